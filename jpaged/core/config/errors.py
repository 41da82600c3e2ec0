"""The config's one error type, whose message is one line."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A bad configuration field.  str(error) is one line:
    `<field>: <what is wrong>; <what is allowed>`."""

    def __init__(self, field: str, problem: str, allowed: str):
        super().__init__(one_line(f"{field}: {problem}; {allowed}"))
        self.field = field


def show(value: Any, limit: int = 160) -> str:
    """repr(value) on one line, cut to `limit` characters."""
    try:
        text = " ".join(repr(value).split())
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the config error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def one_line(text: str) -> str:
    return " ".join(text.split())

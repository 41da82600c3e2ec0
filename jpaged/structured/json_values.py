"""How an error message names an untrusted JSON value: "an object", "a string \"x\"", ..."""

from __future__ import annotations

import json
from typing import Any


def json_type(x: Any) -> str:
    """The value's JSON type, with the value itself for scalars (shortened)."""
    names = {dict: "an object", list: "an array", tuple: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    kind = names.get(type(x), type(x).__name__)
    if kind in ("an object", "an array"):
        return kind
    try:
        text = json.dumps(x, ensure_ascii=True)
    except (TypeError, ValueError):  # not a JSON value (bytes from a Python caller): say what it is
        text = ascii(x)
    return f"{kind} {short(text)}"


def short(x: Any, limit: int = 80) -> str:
    s = str(x)
    return s if len(s) <= limit else s[:limit] + "..."

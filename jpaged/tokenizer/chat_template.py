"""Chat templates: Jinja, compiled in the same sandboxed setup as transformers, so a
template renders here exactly as `transformers`' `apply_chat_template` renders it."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=16)
def compile_template(template: str) -> Any:
    """Compiles a chat template in the same sandboxed Jinja setup as transformers."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
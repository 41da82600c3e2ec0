"""How the server refuses a request: RequestError (an OpenAI-style error body and
a status); request_error, the 400 of a body that failed its pydantic model
(Invalid carries our own checks' messages and params through pydantic); and the
readers of a JSON body that refuse with them.  Host code: no jax, no web
framework.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from pydantic import BaseModel, ValidationError


class RequestError(Exception):
    """A request the server refuses: an OpenAI-style error body and a status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_not_found(name: str) -> str:
    """The message of a 404 for a model (or LoRA adapter) this server does not serve: OpenAI's and vLLM's."""
    return f"The model `{name}` does not exist."


class Invalid(ValueError):
    """A check of ours failing inside model validation.  Pydantic carries it in
    the ValidationError (ctx["error"]); request_error takes back its message and,
    where the error's location does not say it (a check of several fields), its
    param and code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def request_error(e: ValidationError) -> RequestError:
    """The 400 of a body that failed validation: its first error, naming the
    top-level field (`param`) and where inside it ("messages[0].content")."""
    err = e.errors(include_url=False)[0]
    loc = err["loc"]
    path = _path(loc)
    param = str(loc[0]) if loc else None
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, Invalid):
        message = str(cause)
        if path and not message.startswith(path):
            message = f"{path}: {message}"
        return RequestError(message, cause.param or param, code=cause.code)
    if isinstance(cause, Exception):  # a plain ValueError / AssertionError of a validator
        message = f"{path}: {cause}" if path else str(cause)
    elif err["type"] == "missing":
        message = f"{path} is required"
    elif err["type"] in ("model_type", "model_attributes_type", "dict_type"):
        message = f"{path or 'the body'} must be a JSON object, got {json_type(err['input'])}"
    else:
        message = f"{path}: {err['msg']}, got {json_type(err['input'])}"
    return RequestError(message, param)


def _path(loc: tuple[Any, ...]) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parsed(handler: Callable[[Any], Any], value: Any, refusal: str) -> Any:
    """pydantic's parse of `value`, or Invalid("<refusal> <its JSON type>")."""
    try:
        return handler(value)
    except ValidationError:
        raise Invalid(f"{refusal} {json_type(value)}") from None


def json_type(x: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    kind = names.get(type(x), type(x).__name__)
    if kind in ("an object", "an array", "null"):
        return kind
    try:
        text = json.dumps(x, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(x)
    return f"{kind} {text if len(text) <= 80 else text[:80] + '...'}"


def parse_json(body: bytes) -> Any:
    """A request body decoded as JSON, or a 400."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None


def json_body(body: bytes, kind: type[BaseModel], extra: dict[str, Any] | None = None) -> Any:
    """A JSON object body validated as `kind` (fields of `extra` under it), or a 400."""
    raw = parse_json(body) if body.strip() or extra is None else {}
    if not isinstance(raw, dict):
        raise RequestError("the body must be a JSON object")
    try:
        return kind.model_validate({**(extra or {}), **raw})
    except ValidationError as e:
        raise request_error(e) from None

"""Untrusted request JSON in, a prompt and SamplingParams (or one error) out.

Each request is checked on its own, before anything runs: a bad one becomes an
error for that request only, naming its line and field, and never reaches the
device.  Host code: no jax.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Any

from jpaged.core.sequence import SamplingParams

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n",
                   "cache_salt", "ignore_eos", "logprobs", "prompt_logprobs")
PROMPT_FIELDS = ("prompt", "messages")
REQUEST_FIELDS = PROMPT_FIELDS + SAMPLING_FIELDS


@dataclasses.dataclass
class ParsedRequest:
    """One request: `prompt` is what `LLM.generate` takes ({"prompt": text} or
    {"messages": [...]}), or None when `error` says why it cannot run."""

    index: int                      # 0-based line number in the prompts file
    prompt: dict[str, Any] | None
    params: SamplingParams | None
    error: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def text(self) -> str:
        """The request as a person would recognise it (for the terminal)."""
        if self.prompt is None:
            return ""
        return self.prompt.get("prompt") or json.dumps(self.prompt.get("messages"), ensure_ascii=False)


def default_sampling_params(config: Any) -> SamplingParams:
    """The config's sampling defaults (fields of the same names), which each request may override."""
    return SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature,
                          top_p=config.top_p, top_k=config.top_k)


def parse_request(obj: Any, default: SamplingParams, index: int = 0, where: str = "") -> ParsedRequest:
    """Validates one decoded JSON request against `default` sampling settings."""
    where = where or f"request {index}"
    try:
        prompt = _prompt(obj)
        params = _sampling_params(obj, default)
    except ValueError as e:
        return ParsedRequest(index, None, None, error=f"{where}: {e}")
    unknown = [k for k in obj if k not in REQUEST_FIELDS]
    warnings = [f"{where}: unknown field {k!r} ignored{_suggest(k)}" for k in unknown]
    return ParsedRequest(index, prompt, params, warnings=warnings)


def parse_line(raw: bytes, default: SamplingParams, index: int) -> ParsedRequest:
    """One line of a JSONL prompts file (bytes, so that a bad encoding is this line's error)."""
    where = f"line {index + 1}"
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return ParsedRequest(index, None, None, error=f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})")
    except (ValueError, RecursionError) as e:
        return ParsedRequest(index, None, None, error=f"{where}: not valid JSON ({_short(e)})")
    return parse_request(obj, default, index, where)


def read_request_file(path: str | os.PathLike, default: SamplingParams) -> list[ParsedRequest]:
    """Every non-blank line of a JSONL file (UTF-8, with or without a BOM), in order."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    if lines and lines[0].startswith(b"\xef\xbb\xbf"):
        lines[0] = lines[0][3:]
    return [parse_line(line, default, i) for i, line in enumerate(lines) if line.strip()]


def parse_sampling_params(obj: dict[str, Any], default: SamplingParams) -> SamplingParams:
    """The sampling fields of a request object over `default`; ValueError whose
    message starts with the bad field's name."""
    return _sampling_params(obj, default)


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """A chat request's messages, checked as parse_request checks them; ValueError
    whose message starts with "messages"."""
    return _prompt({"messages": messages})["messages"]


def _prompt(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError(f"a request must be a JSON object, got {_json_type(obj)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError('a request needs exactly one of "prompt" (a user message) or "messages"')
    if "prompt" in obj:
        text = obj["prompt"]
        if not isinstance(text, str) or not text:
            raise ValueError(f"prompt must be a non-empty string, got {_json_type(text)}")
        return {"prompt": text}
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list, got {_json_type(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object, got {_json_type(m)}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"messages[{i}].{key} must be a string, got {_json_type(m.get(key))}")
    return {"messages": messages}


def _sampling_params(obj: dict[str, Any], default: SamplingParams) -> SamplingParams:
    overrides = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
    if isinstance(overrides.get("stop_token_ids"), list):
        overrides["stop_token_ids"] = tuple(overrides["stop_token_ids"])
    stop = overrides.get("stop")
    if isinstance(stop, str):  # as OpenAI: one string or a list of them
        overrides["stop"] = (stop,)
    elif isinstance(stop, list):
        overrides["stop"] = tuple(stop)
    elif stop is None and "stop" in overrides:  # JSON null: none
        overrides["stop"] = ()
    params = dataclasses.replace(default, **overrides)
    params.validate()
    return params


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, REQUEST_FIELDS, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(REQUEST_FIELDS)}"


def _json_type(x: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    kind = names.get(type(x), type(x).__name__)
    return f"{kind} {_short(json.dumps(x, ensure_ascii=True))}" if kind not in ("an object", "an array") else kind


def _short(x: Any, limit: int = 80) -> str:
    s = str(x)
    return s if len(s) <= limit else s[:limit] + "..."

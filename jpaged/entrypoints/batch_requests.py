"""The lines of `jpaged batch`'s prompts file: each untrusted JSON line in, a
prompt and SamplingParams (or one error) out.

A line is parsed by the body models of the HTTP server
(jpaged.entrypoints.openai.protocol.BatchRequest, through the same parse_request
as every route): the same checks, the same error messages, prefixed with the
line ("line 4: temperature: ...").  Each line is checked on its own, before
anything runs: a bad one becomes an error for that line only and never reaches
the device; an unknown field is a warning naming the nearest known one.  Host
code: no jax.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Any, Collection

from jpaged.core.sequence import SamplingParams
from jpaged.entrypoints.openai import protocol
from jpaged.entrypoints.openai.errors import RequestError
from jpaged.entrypoints.openai.request_fields import CHAT_ONLY_FIELDS, REQUEST_FIELDS, UNSUPPORTED_FIELDS
from jpaged.structured.json_values import short


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


def parse_request(obj: Any, default: SamplingParams, index: int = 0, where: str = "",
                  base_model: str | None = None, adapters: Collection[str] = ()) -> ParsedRequest:
    """Validates one decoded JSON request over `default` sampling settings.  Its
    "model": absent, null or `base_model` runs the base model, one of `adapters`
    that LoRA adapter (SamplingParams.lora); any other name is its error."""
    where = where or f"request {index}"
    try:
        gen = protocol.parse_request(protocol.BatchRequest, obj, default, base_model, adapters)
    except RequestError as e:
        return ParsedRequest(index, None, None, error=f"{where}: {e.message}")
    known = (*REQUEST_FIELDS, *UNSUPPORTED_FIELDS, *CHAT_ONLY_FIELDS, "best_of")
    warnings = [f"{where}: unknown field {k!r} ignored{_suggest(k)}" for k in obj if k not in known]
    return ParsedRequest(index, gen.prompts[0], gen.params, warnings=warnings)


def parse_line(raw: bytes, default: SamplingParams, index: int, base_model: str | None = None,
               adapters: Collection[str] = ()) -> ParsedRequest:
    """One line of a JSONL prompts file (bytes, so that a bad encoding is this line's error)."""
    where = f"line {index + 1}"
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return ParsedRequest(index, None, None, error=f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})")
    except (ValueError, RecursionError) as e:
        return ParsedRequest(index, None, None, error=f"{where}: not valid JSON ({short(e)})")
    return parse_request(obj, default, index, where, base_model, adapters)


def read_request_file(path: str | os.PathLike, default: SamplingParams, base_model: str | None = None,
                      adapters: Collection[str] = ()) -> list[ParsedRequest]:
    """Every non-blank line of a JSONL file (UTF-8, with or without a BOM), in order."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    if lines and lines[0].startswith(b"\xef\xbb\xbf"):
        lines[0] = lines[0][3:]
    return [parse_line(line, default, i, base_model, adapters) for i, line in enumerate(lines) if line.strip()]


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, REQUEST_FIELDS, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(REQUEST_FIELDS)}"

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

from jpaged.structured.json_values import json_type as _json_type
from jpaged.structured.json_values import short as _short
from jpaged.core.sequence import SamplingParams
from jpaged.structured import schemas
from jpaged.structured import spec as structured_spec

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n",
                   "cache_salt", "ignore_eos", "logprobs", "prompt_logprobs")
# The fields that constrain the output, all mapped to SamplingParams.structured
# (jpaged.structured.spec.from_request): vLLM's `structured_outputs` (and its older
# `guided_decoding` / `guided_*` extras) and OpenAI's `response_format`.
STRUCTURED_FIELDS = ("structured_outputs", "response_format", "guided_decoding",
                     *structured_spec.GUIDED_FIELDS, *structured_spec.NEUTRAL_EXTRAS)
PROMPT_FIELDS = ("prompt", "messages")
# vLLM's disable_additional_properties (also accepted inside structured_outputs): the
# JSON schemas' objects take no keys they do not list (jpaged.structured.schemas).
SCHEMA_FIELDS = ("disable_additional_properties",)
# "model": the base model's name (or absent), or a LoRA adapter's, which the request runs (as vLLM).
REQUEST_FIELDS = PROMPT_FIELDS + SAMPLING_FIELDS + STRUCTURED_FIELDS + SCHEMA_FIELDS + ("model",)

# Request fields of vLLM (SamplingParams, its OpenAI server's extra_body) and of
# OpenAI that would change the answer and that jpaged does not implement, each
# with the values that leave the answer as jpaged computes it.  A request with
# any other value is refused naming the field (the batch CLI: that line's error;
# the HTTP server: a 400), rather than answered as if the field were absent.
# Fields no list here names stay ignored (with a warning in the batch CLI).
# Shared by the batch CLI and jpaged.entrypoints.openai.protocol.  `best_of`
# (accepted only equal to n) is checked beside these (unsupported_field).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    # sampling: penalties, biases, filters
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "min_p": (None, 0),
    "min_tokens": (None, 0),
    "logit_bias": (None, {}),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "logits_processors": (None, []),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    # tool calling (the HTTP chat route implements tools and tool_choice)
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),       # with no tools, nothing to call
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    # the prompt
    "suffix": (None, ""),
    "truncate_prompt_tokens": (None,),
    "prompt_embeds": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "documents": (None, []),
    "reasoning_effort": (None,),
    # the answer's text and logprobs
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "detokenize": (None, True),
    "logprob_token_ids": (None,),
    "prompt_logprob_token_ids": (None,),
    "return_tokens_as_token_ids": (None, False),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "web_search_options": (None,),
}

# Where a request is always a chat (a batch line's "prompt" is a user message),
# special tokens around the rendered chat come from its template alone (as vLLM's
# chat default): add_special_tokens: true would add BOS and the like.
CHAT_ONLY_FIELDS: dict[str, tuple[Any, ...]] = {"add_special_tokens": (None, False)}

# The roles a chat message may have (OpenAI's; "function" is its deprecated
# form of "tool", whose calls jpaged cannot make).  Another role would reach the
# chat template as written: a role "user<|im_end|>" would forge a turn.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


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


def parse_request(obj: Any, default: SamplingParams, index: int = 0, where: str = "",
                  base_model: str | None = None) -> ParsedRequest:
    """Validates one decoded JSON request against `default` sampling settings.  A
    "model" other than `base_model` names a LoRA adapter (SamplingParams.lora);
    whether it is loaded is the engine's to say."""
    where = where or f"request {index}"
    try:
        prompt = _prompt(obj)
        refused = unsupported_field(obj, default.n, CHAT_ONLY_FIELDS)
        if refused is not None:
            raise ValueError(refused[1])
        params = _sampling_params(obj, default)
        lora = _lora(obj, base_model)
        if lora is not None:
            params = dataclasses.replace(params, lora=lora)
    except ValueError as e:
        return ParsedRequest(index, None, None, error=f"{where}: {e}")
    unknown = [k for k in obj if k not in REQUEST_FIELDS and k not in UNSUPPORTED_FIELDS
               and k not in CHAT_ONLY_FIELDS and k != "best_of"]
    warnings = [f"{where}: unknown field {k!r} ignored{_suggest(k)}" for k in unknown]
    return ParsedRequest(index, prompt, params, warnings=warnings)


def parse_line(raw: bytes, default: SamplingParams, index: int, base_model: str | None = None) -> ParsedRequest:
    """One line of a JSONL prompts file (bytes, so that a bad encoding is this line's error)."""
    where = f"line {index + 1}"
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return ParsedRequest(index, None, None, error=f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})")
    except (ValueError, RecursionError) as e:
        return ParsedRequest(index, None, None, error=f"{where}: not valid JSON ({_short(e)})")
    return parse_request(obj, default, index, where, base_model)


def read_request_file(path: str | os.PathLike, default: SamplingParams,
                      base_model: str | None = None) -> list[ParsedRequest]:
    """Every non-blank line of a JSONL file (UTF-8, with or without a BOM), in order."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    if lines and lines[0].startswith(b"\xef\xbb\xbf"):
        lines[0] = lines[0][3:]
    return [parse_line(line, default, i, base_model) for i, line in enumerate(lines) if line.strip()]


def parse_sampling_params(obj: dict[str, Any], default: SamplingParams) -> SamplingParams:
    """The sampling fields of a request object over `default`; ValueError whose
    message starts with the bad field's name."""
    return _sampling_params(obj, default)


def unsupported_field(obj: dict[str, Any], default_n: int = 1,
                      extra: dict[str, tuple[Any, ...]] | None = None) -> tuple[str, str] | None:
    """(field, message) of the first field of `obj` that asks for what jpaged
    does not implement (UNSUPPORTED_FIELDS, and `extra` for a route's own), or
    None.  A neutral value passes only with its own JSON type (false is not 0);
    `best_of` passes only equal to n (`obj`'s, or `default_n`)."""
    table = {**UNSUPPORTED_FIELDS, **(extra or {})}
    for name, value in obj.items():
        if name == "best_of":
            n = obj.get("n")
            n = default_n if n is None else n
            if value is not None and not (_is_number(value) and _is_number(n) and value == n):
                return name, (f"best_of is not supported yet (only best_of == n, here {_short(n)}), "
                              f"got {_json_type(value)}")
        elif name in table and not any(_same_json(value, v) for v in table[name]):
            accepted = ["null" if v is None else json.dumps(v) for v in table[name]]
            accepted = " or ".join(filter(None, [", ".join(accepted[:-1]), accepted[-1]]))
            return name, f"{name} is not supported yet (got {_json_type(value)}; jpaged accepts only {accepted})"
    return None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _same_json(value: Any, neutral: Any) -> bool:
    """`value == neutral` as JSON values: 0 and 0.0 alike, but true is not 1."""
    if _is_number(neutral):
        return _is_number(value) and value == neutral
    if type(value) is not type(neutral):
        return False
    try:
        return bool(value == neutral)
    except Exception:  # noqa: BLE001 - an exotic object from a Python caller
        return False


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
        problem = role_problem(m["role"])
        if problem:
            raise ValueError(f"messages[{i}].role {problem}")
    return {"messages": messages}


def _lora(obj: dict[str, Any], base_model: str | None) -> str | None:
    """The LoRA adapter a request's "model" names: None for the base model (absent, null, or its name)."""
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"model must be a string (the base model's name or a LoRA adapter's), "
                         f"got {_json_type(model)}")
    return None if model is None or model == base_model else model


def role_problem(role: Any) -> str | None:
    """What is wrong with a chat message's role ("must be one of ..."), or None."""
    if isinstance(role, str) and role in CHAT_ROLES:
        return None
    return f"must be one of {', '.join(map(repr, CHAT_ROLES))}, got {_json_type(role)}"


def _sampling_params(obj: dict[str, Any], default: SamplingParams) -> SamplingParams:
    overrides = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
    structured = _structured(obj)
    if structured is not None:
        overrides["structured"] = structured
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


def _structured(obj: dict[str, Any]) -> structured_spec.StructuredOutputs | None:
    """The request's constraint, its JSON schema's objects closed with disable_additional_properties."""
    flag = obj.get("disable_additional_properties")
    if flag is not None and not isinstance(flag, bool):
        raise ValueError(f"disable_additional_properties must be true or false, got {_json_type(flag)}")
    inner, closed = schemas.split_flag(obj.get("structured_outputs"), flag)
    structured = structured_spec.from_request({**obj, "structured_outputs": inner})
    return schemas.closed_constraint(structured) if closed else structured


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, REQUEST_FIELDS, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(REQUEST_FIELDS)}"

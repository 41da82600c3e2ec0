"""OpenAI-style request bodies in, checked requests out; response bodies back.

The sampling fields are checked by jpaged.core.request_parsing (the same checks as
the batch CLI's request lines); this module adds what only the HTTP API has:
the model name, prompt forms, stop strings, stream / echo / stream_options,
the logprobs fields (whose meaning differs between the routes), and the OpenAI
fields jpaged does not implement (a 400 naming the field rather than an answer
that silently ignores it).  Host code: no jax.
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from typing import Any, Callable, Sequence

from jpaged.core.config import is_int
from jpaged.core.request_parsing import REQUEST_FIELDS, SAMPLING_FIELDS, parse_messages, parse_sampling_params
from jpaged.core.sequence import MAX_LOGPROBS, SamplingParams, TokenLogprob

MAX_STOP_STRINGS = 16
LOGPROB_FLOOR = -9999.0  # what -inf (a token of probability 0) becomes: JSON has no infinities (as vLLM)

# Sampling fields whose body form depends on the route: /v1/completions takes
# `logprobs` as a count, /v1/chat/completions as a flag beside `top_logprobs`;
# prompt logprobs come back only through /v1/completions' echo, and /generate.
ROUTE_FIELDS = ("logprobs", "prompt_logprobs")

# OpenAI fields that would change the answer, and the values that leave it as
# jpaged computes it.  Anything else in a body is ignored (clients send `user`,
# `metadata` and the like).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
    "min_tokens": (None, 0),
}


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


@dataclasses.dataclass
class GenerationRequest:
    """A checked request: prompts as LLM.tokenize takes them, and how to answer."""

    prompts: list[Any]          # raw strings, token-id lists, or {"messages": [...]} (chat)
    params: SamplingParams
    stop: list[str]
    stream: bool = False
    echo: bool = False
    include_usage: bool = False
    model: str = ""


# ------------------------------------------------------------------ parsing
def parse_completion(body: Any, default: SamplingParams, model: str) -> GenerationRequest:
    """POST /v1/completions: `prompt` is a string, a token-id list, or a list of
    either; `logprobs`: how many alternatives per token (with `echo`, the
    prompt's tokens get them too)."""
    obj = _object(body)
    _check_model(obj, model)
    _reject_unsupported(obj)
    _reject_prompt_logprobs(obj)
    echo, logprobs = _flag(obj, "echo"), obj.get("logprobs")
    params = _sampling(obj, default, logprobs=logprobs, prompt_logprobs=logprobs if echo else None)
    return GenerationRequest(prompts=_completion_prompts(obj.get("prompt")), params=params,
                             stop=_stop(obj), stream=_flag(obj, "stream"), echo=echo,
                             include_usage=_include_usage(obj), model=model)


def parse_chat(body: Any, default: SamplingParams, model: str) -> GenerationRequest:
    """POST /v1/chat/completions: `messages`, rendered with the model's chat
    template; `logprobs: true` with `top_logprobs` alternatives per token."""
    obj = _object(body)
    _check_model(obj, model)
    _reject_unsupported(obj)
    _reject_prompt_logprobs(obj)
    if obj.get("max_completion_tokens") is not None:  # the newer name of max_tokens
        obj = {**obj, "max_tokens": obj["max_completion_tokens"]}
    messages = _messages(obj.get("messages"))
    return GenerationRequest(prompts=[{"messages": messages}],
                             params=_sampling(obj, default, logprobs=_chat_logprobs(obj)),
                             stop=_stop(obj), stream=_flag(obj, "stream"),
                             include_usage=_include_usage(obj), model=model)


def parse_generate(body: Any, default: SamplingParams, model: str) -> GenerationRequest:
    """POST /generate: {"prompt": text or token ids} or {"messages": [...]}, plus
    sampling fields and `stop`; no streaming."""
    obj = _object(body)
    _reject_unsupported(obj)
    if ("prompt" in obj) == ("messages" in obj):
        raise RequestError('a request needs exactly one of "prompt" or "messages"', "prompt")
    prompt = {"messages": _messages(obj["messages"])} if "messages" in obj else _one_prompt(obj["prompt"], "prompt")
    if _flag(obj, "stream"):
        raise RequestError("/generate does not stream; use /v1/completions with stream: true", "stream")
    # logprobs and prompt_logprobs are counts, as in the batch CLI's request lines.
    params = _sampling(obj, default, **{k: obj.get(k) for k in ROUTE_FIELDS})
    return GenerationRequest(prompts=[prompt], params=params, stop=_stop(obj), model=model)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _check_model(obj: dict[str, Any], model: str) -> None:
    name = obj.get("model")
    if name is not None and name != model:  # omitted: the one model served
        raise RequestError(f"model {name!r} is not served here; this server serves {model!r}",
                           "model", code="model_not_found")


def _reject_unsupported(obj: dict[str, Any]) -> None:
    for name, neutral in UNSUPPORTED_FIELDS.items():
        if name in obj and obj[name] not in neutral:
            raise RequestError(f"{name} is not supported yet (got {obj[name]!r})", name, code="unsupported")
    best_of = obj.get("best_of")
    if best_of is not None and best_of != obj.get("n", 1):
        raise RequestError("best_of is not supported yet (only best_of == n)", "best_of", code="unsupported")


def _reject_prompt_logprobs(obj: dict[str, Any]) -> None:
    if obj.get("prompt_logprobs") is not None:
        raise RequestError("prompt_logprobs is not supported here; /v1/completions returns the prompt's "
                           "logprobs with echo: true and logprobs, /generate with prompt_logprobs",
                           "prompt_logprobs", code="unsupported")


def _chat_logprobs(obj: dict[str, Any]) -> int | None:
    """SamplingParams.logprobs of a chat request: `top_logprobs` (default 0)
    alternatives when `logprobs` is true, none otherwise."""
    top = obj.get("top_logprobs")
    if top is not None and not (is_int(top) and 0 <= top <= MAX_LOGPROBS):
        raise RequestError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}",
                           "top_logprobs")
    if not _flag(obj, "logprobs"):
        if top is not None:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def _sampling(obj: dict[str, Any], default: SamplingParams, **route_fields: Any) -> SamplingParams:
    """The body's sampling fields (null: the default) over `default`; the route
    gives the ROUTE_FIELDS it read in its own way."""
    fields = {k: v for k, v in obj.items()
              if k in SAMPLING_FIELDS and k not in UNSUPPORTED_FIELDS and k not in ROUTE_FIELDS}
    fields.update(route_fields)
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        return parse_sampling_params(fields, default)
    except ValueError as e:
        raise RequestError(str(e), _field_named(str(e))) from None


def _field_named(message: str) -> str | None:
    """The request field a request_parsing message starts with ("top_p must be ...")."""
    m = re.match(r"[a-z_]+", message)
    return m.group(0) if m and m.group(0) in REQUEST_FIELDS else None


def _completion_prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, "prompt")]


def _one_prompt(prompt: Any, where: str) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(f"{where} must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    raise RequestError(f"{where} must be a non-empty string, a non-empty list of token ids, or a list "
                       f"of those; got {type(prompt).__name__}", "prompt")


def _messages(messages: Any) -> list[dict[str, Any]]:
    """Messages with text-part contents ([{"type": "text", "text": ...}]) joined."""
    if isinstance(messages, list):
        messages = [_text_content(m, i) if isinstance(m, dict) else m for i, m in enumerate(messages)]
    try:
        return parse_messages(messages)
    except ValueError as e:
        raise RequestError(str(e), "messages") from None


def _text_content(message: dict[str, Any], i: int) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in content):
        raise RequestError(f"messages[{i}].content: only text parts are supported", "messages")
    return {**message, "content": "".join(p["text"] for p in content)}


def _stop(obj: dict[str, Any]) -> list[str]:
    stop = obj.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    return [s for s in stops if s]


def _flag(obj: dict[str, Any], name: str) -> bool:
    value = obj.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", name)
    return value


def _include_usage(obj: dict[str, Any]) -> bool:
    options = obj.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    if not _flag(obj, "stream"):
        raise RequestError("stream_options is only allowed with stream: true", "stream_options")
    return _flag(options, "include_usage")


# ---------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(request_id: str, obj: str, model: str, choices: list[dict[str, Any]],
             usage_counts: dict[str, int] | None = None, *, with_usage: bool = True) -> dict[str, Any]:
    body = {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
    if with_usage:
        body["usage"] = usage_counts
    return body


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_chunk_choice(index: int, delta: dict[str, Any], finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


# Token strings: each token id decoded alone (as vLLM does), special tokens included.
TokenText = Callable[[int], str]


def finite_logprob(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # (NaN > x is false: the floor too)


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None],
                        token_text: TokenText, text_offset: int = 0) -> dict[str, Any]:
    """/v1/completions' `logprobs` of these tokens; a None entry (the first prompt
    token, which nothing predicts) has null logprob and alternatives.  Offsets
    count the token strings from `text_offset` (the length of those before)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs):
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        values.append(None if lp is None else finite_logprob(lp.logprob))
        tops.append(None if lp is None else _top_by_text(lp, token_text))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _top_by_text(lp: TokenLogprob, token_text: TokenText) -> dict[str, float]:
    """{token string: logprob}, best first; two ids with one string keep the better."""
    top: dict[str, float] = {}
    for token_id, value in lp.top:
        top.setdefault(token_text(token_id), finite_logprob(value))
    return top


def chat_logprobs(logprobs: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """/v1/chat/completions' `logprobs` of these tokens."""
    return {"content": [{**_chat_token(lp.token_id, lp.logprob, token_text),
                         "top_logprobs": [_chat_token(i, v, token_text) for i, v in lp.top]}
                        for lp in logprobs]}


def _chat_token(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode("utf-8"))}


def token_logprob_json(lp: TokenLogprob | None) -> dict[str, Any] | None:
    """/generate's form, the batch CLI's: {"token_id", "logprob", "top": [[id, logprob], ...]}."""
    if lp is None:
        return None
    return {"token_id": lp.token_id, "logprob": finite_logprob(lp.logprob),
            "top": [[i, finite_logprob(v)] for i, v in lp.top]}

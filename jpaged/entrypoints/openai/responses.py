"""The response bodies of the OpenAI routes (and /generate's logprobs): choices,
chunks, usage, and logprobs in each route's shape.  Host code: no jax.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Sequence

import numpy as np

from jpaged.core.sequence import TokenLogprob
from jpaged.structured import tools as structured_tools

LOGPROB_FLOOR = -9999.0  # what -inf (a token of probability 0) becomes: JSON has no infinities (as vLLM)


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


def with_routes(choice: dict[str, Any], routes: np.ndarray | None) -> dict[str, Any]:
    """`choice` with the vLLM-style extension field `routed_experts` (capture_routes):
    the experts [num_tokens - 1][L_moe][k] every token of the choice but its last
    (prompt, then output) went to in each MoE layer.  Absent when not captured."""
    return choice if routes is None else {**choice, "routed_experts": np.asarray(routes).tolist()}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None, routes: np.ndarray | None = None) -> dict[str, Any]:
    return with_routes({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}, routes)


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None,
                tools: structured_tools.DeclaredTools | None = None,
                routes: np.ndarray | None = None) -> dict[str, Any]:
    """A chat choice; with the request's `tools`, the text's `<tool_call>` blocks
    calling them become `message.tool_calls` (finish_reason "tool_calls" for a sample
    that stopped after whole calls; a call cut short keeps "length")."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tools is not None:
        content, calls = structured_tools.parse_tool_calls(text, tools)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
            finish_reason = tool_calls_finish_reason(finish_reason, calls)
    return with_routes({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason},
                       routes)


def tool_calls_finish_reason(finish_reason: str | None, calls: Sequence[structured_tools.ToolCall]) -> str | None:
    """OpenAI's "tool_calls" for a sample that stopped after whole calls; else the sample's own reason."""
    if finish_reason == "stop" and calls and all(c.complete for c in calls):
        return "tool_calls"
    return finish_reason


def chat_chunk_choice(index: int, delta: dict[str, Any], finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None, routes: np.ndarray | None = None) -> dict[str, Any]:
    return with_routes({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason},
                       routes)


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

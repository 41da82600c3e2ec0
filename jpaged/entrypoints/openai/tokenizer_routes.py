"""vLLM's tokenizer routes, serving the engine's tokenizer: POST /tokenize (a
prompt, or messages rendered as /v1/chat/completions renders them), POST
/detokenize, GET /tokenizer_info.  Their work runs in the host thread pool.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from jpaged.entrypoints.openai.errors import RequestError, json_body, model_not_found
from jpaged.entrypoints.openai.guard import check_prompt_bytes, error_response
from jpaged.entrypoints.openai.messages import Messages
from jpaged.entrypoints.openai.state import ServerState
from jpaged.structured import tools as structured_tools


class TokenizeRequest(BaseModel):
    """POST /tokenize, as vLLM: `prompt` (text; `add_special_tokens`, default true)
    or `messages` (the chat template; `add_generation_prompt`, default true:
    the ids /v1/chat/completions would run)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Messages] = None
    tools: Any = None  # with messages: rendered as /v1/chat/completions renders them
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize, as vLLM: {model?, tokens} -> {prompt}."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: Optional[str] = None
    tokens: list[int]


def _tokenizer_request(state: ServerState, body: bytes, kind: type[BaseModel]) -> Any:
    req = json_body(body, kind)
    if req.model is not None and not state.serves(req.model):  # (an adapter shares the base's tokenizer)
        raise RequestError(model_not_found(req.model), "model", code="model_not_found")
    if state.llm.tokenizer is None:
        raise RequestError("this model has no tokenizer")
    return req


def _tokenize(state: ServerState, body: bytes) -> dict[str, Any]:
    req = _tokenizer_request(state, body, TokenizeRequest)
    tokenizer = state.llm.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise RequestError('a request needs exactly one of "prompt" or "messages"', "prompt")
    if req.prompt is not None:
        check_prompt_bytes(state, req.prompt, "prompt")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tokenizer.encode(req.prompt, add_special_tokens=special)
    else:
        messages = [m.as_dict() for m in req.messages]
        check_prompt_bytes(state, {"messages": messages, "tools": req.tools}, "messages")
        try:  # as the chat route renders it
            _, ids = structured_tools.encode_chat_with_tools(tokenizer, messages, req.tools,
                                                             req.add_generation_prompt)
        except ValueError as e:
            raise RequestError(str(e), "tools" if str(e).startswith("tools") else "messages") from None
    return {"count": len(ids), "max_model_len": state.config.max_model_len, "tokens": ids,
            "token_strs": [state.token_text(t) for t in ids] if req.return_token_strs else None}


def _detokenize(state: ServerState, body: bytes) -> dict[str, Any]:
    req = _tokenizer_request(state, body, DetokenizeRequest)
    vocab = state.llm.tokenizer.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:8]}", "tokens")
    return {"prompt": state.llm.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def _tokenizer_info(state: ServerState) -> dict[str, Any]:
    tokenizer = state.llm.tokenizer
    if tokenizer is None:
        raise RequestError("this model has no tokenizer")
    special = tokenizer.special_tokens
    return {"tokenizer_class": type(tokenizer).__name__, "model_max_length": state.config.max_model_len,
            "vocab_size": tokenizer.vocab_size, "bos_token": special.get("bos_token"),
            "eos_token": special.get("eos_token"), "pad_token": special.get("pad_token"),
            "unk_token": special.get("unk_token"), "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "eos_token_ids": tokenizer.eos_token_ids,
            "pad_token_id": tokenizer.pad_token_id, "add_bos_token": tokenizer.add_bos_token,
            "chat_template": tokenizer.chat_template}


async def _host_route(request: Request, state: ServerState, fn: Callable[[ServerState, bytes], dict[str, Any]]
                      ) -> Response:
    try:
        state.ready_engine()
        return JSONResponse(await state.run_host(fn, state, await request.body()))
    except RequestError as e:
        return error_response(e)


def add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _host_route(request, state, _tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _host_route(request, state, _detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        return await _host_route(request, state, lambda state, body: _tokenizer_info(state))

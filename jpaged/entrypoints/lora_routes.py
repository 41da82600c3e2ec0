"""vLLM's LoRA adapter routes: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, registered by create_app (jpaged.entrypoints.server).
A request's "model" then names a loaded adapter (ServerState.adapters)."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from jpaged.engine.async_engine import EngineClosed
from jpaged.entrypoints.openai_protocol import RequestError
from jpaged.entrypoints.server import ServerState, _error_response, _json_body, lora_adapters

log = logging.getLogger(__name__)


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter, as vLLM: a PEFT directory on the server's disk,
    loaded into a free adapter slot (max_loras) under `lora_name`."""

    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter, as vLLM: its requests in flight end ("abort")."""

    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str
    lora_int_id: Optional[int] = None  # vLLM's; names do here


# On the engine thread.  Each sets state.adapters there, as the engine changes
# (a client that leaves before the answer leaves no stale list behind).
def _load_lora(state: ServerState, req: LoadLoraAdapterRequest, llm: Any) -> None:
    """A 400 with the engine's message (naming the file, the name in use, or the slots) if it cannot."""
    try:
        llm.load_lora_adapter(req.lora_name, req.lora_path)
    except ValueError as e:
        raise RequestError(str(e)) from None
    state.adapters = lora_adapters(llm)


def _unload_lora(state: ServerState, req: UnloadLoraAdapterRequest, llm: Any) -> None:
    """A 404 for a name not loaded."""
    from jpaged.engine.lora_manager import UnknownLoraError  # (jax: loaded with the engine)
    try:
        llm.unload_lora_adapter(req.lora_name)
    except UnknownLoraError as e:
        raise RequestError(str(e), "lora_name", code="model_not_found") from None
    except ValueError as e:
        raise RequestError(str(e)) from None
    state.adapters = lora_adapters(llm)


def _lora_request(state: ServerState, body: bytes, kind: type[BaseModel]) -> Any:
    req = _json_body(body, kind)
    if not req.lora_name:
        raise RequestError("lora_name must not be empty", "lora_name")
    if req.lora_name == state.model_name:  # requests naming it would run the base model
        raise RequestError(f"lora_name {req.lora_name!r} is the base model's name", "lora_name")
    return req


async def _lora_route(request: Request, state: ServerState, kind: type[BaseModel],
                      change: Callable[[ServerState, Any, Any], None]) -> Response:
    """Loads or unloads an adapter on the engine thread, between two steps (the
    engine's device state and scheduler are that thread's alone); vLLM's plain
    text on success.  A bad adapter, a name in use or no free slot is a 400 with
    the engine's message; unloading a name not loaded a 404."""
    try:
        engine = state.ready_engine()
        req = await state.run_host(_lora_request, state, await request.body(), kind)
        await engine.call(functools.partial(change, state, req))
    except RequestError as e:
        return _error_response(e)
    except EngineClosed as e:
        return _error_response(RequestError(str(e), status=503, kind="service_unavailable"))
    done = "added" if kind is LoadLoraAdapterRequest else "removed"
    log.info("LoRA adapter %r %s", req.lora_name, done)
    return Response(f"Success: LoRA adapter '{req.lora_name}' {done} successfully.", media_type="text/plain")


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await _lora_route(request, state, LoadLoraAdapterRequest, _load_lora)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await _lora_route(request, state, UnloadLoraAdapterRequest, _unload_lora)

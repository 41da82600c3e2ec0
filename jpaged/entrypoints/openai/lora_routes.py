"""vLLM's LoRA adapter routes: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, registered by create_app (jpaged.entrypoints.openai.app).
A request's "model" then names a loaded adapter (ServerState.adapters).

Every input is checked before the engine sees it: the name by the one rule of
adapter names (jpaged.core.lora_adapters.ADAPTER_NAME_RULE, as lora_modules at start),
the directory's files read with bounds and checked field by field in the host
pool; the engine thread only fits the arrays to the model and writes the slot."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from jpaged.core.config import lora_slots
from jpaged.entrypoints.openai.errors import RequestError, json_body
from jpaged.entrypoints.openai.guard import REFUSALS, refused
from jpaged.entrypoints.openai.state import ServerState, lora_adapters
from jpaged.core.lora_adapters import adapter_name_error
from jpaged.loading.peft import PeftFiles, read_peft_files

if TYPE_CHECKING:
    from jpaged.engine.protocol import Engine

log = logging.getLogger(__name__)


MAX_PATH_CHARS = 4096  # lora_path (PATH_MAX on Linux)


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
def _load_lora(state: ServerState, name: str, files: PeftFiles, llm: Engine) -> None:
    """Fits the adapter read in the host pool to the model and writes its slot: a 400 with
    the engine's message (naming the file, the name in use, or the slots) if it cannot."""
    try:
        llm.load_lora_adapter(name, files)
    except ValueError as e:  # an adapter that does not fit the model names its file
        raise RequestError(str(e), "lora_path" if str(e).startswith(files.path) else None) from None
    state.adapters = lora_adapters(llm)


def _unload_lora(state: ServerState, name: str, llm: Engine) -> None:
    """A 404 for a name not loaded."""
    from jpaged.engine.lora_manager import UnknownLoraError  # (jax: loaded with the engine)
    try:
        llm.unload_lora_adapter(name)
    except UnknownLoraError as e:
        raise RequestError(str(e), "lora_name", code="model_not_found") from None
    except ValueError as e:
        raise RequestError(str(e)) from None
    state.adapters = lora_adapters(llm)


# In the host pool: parsing the body, and reading the adapter's files (bounded:
# jpaged.loading.peft's limits), so that no read stalls the engine's steps.
def _lora_request(state: ServerState, body: bytes, kind: type[BaseModel]) -> Any:
    req = json_body(body, kind)
    error = adapter_name_error(req.lora_name)
    if error:
        raise RequestError(f"lora_name: {error}", "lora_name")
    if req.lora_name == state.model_name:  # requests naming it would run the base model
        raise RequestError(f"lora_name {req.lora_name!r} is the base model's name", "lora_name")
    return req


def _read_adapter(state: ServerState, req: LoadLoraAdapterRequest) -> PeftFiles:
    """The adapter's files, read and checked (a 400 naming the file and the field), once the
    request could be served: adapters on, the name free."""
    if not lora_slots(state.config):
        raise RequestError("LoRA adapters are off: start the server with max_loras > 0 (or lora_modules)")
    if req.lora_name in state.adapters:
        raise RequestError(f"a LoRA adapter named {req.lora_name!r} is already loaded (unload it first)",
                           "lora_name")
    if not req.lora_path or len(req.lora_path) > MAX_PATH_CHARS:
        raise RequestError(f"lora_path must be 1 to {MAX_PATH_CHARS} characters, not {len(req.lora_path):,}",
                           "lora_path")
    try:
        return read_peft_files(req.lora_path)
    except (ValueError, OSError) as e:
        raise RequestError(str(e), "lora_path") from None


async def _lora_route(request: Request, state: ServerState, kind: type[BaseModel]) -> Response:
    """Loads or unloads an adapter: the body parsed and the adapter's files read in the
    host pool, then the slot changed on the engine thread, between two steps (the
    engine's device state and scheduler are that thread's alone); vLLM's plain text
    on success.  A bad name or adapter, a name in use or no free slot is a 400
    naming the field (and the file); unloading a name not loaded a 404."""
    try:
        engine = state.ready_engine()
        req = await state.run_host(_lora_request, state, await request.body(), kind)
        if kind is LoadLoraAdapterRequest:
            files = await state.run_host(_read_adapter, state, req)
            await engine.call(functools.partial(_load_lora, state, req.lora_name, files))
        else:
            await engine.call(functools.partial(_unload_lora, state, req.lora_name))
    except REFUSALS as e:
        return refused(e)
    done = "added" if kind is LoadLoraAdapterRequest else "removed"
    log.info("LoRA adapter %r %s", req.lora_name, done)
    return Response(f"Success: LoRA adapter '{req.lora_name}' {done} successfully.", media_type="text/plain")


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await _lora_route(request, state, LoadLoraAdapterRequest)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await _lora_route(request, state, UnloadLoraAdapterRequest)

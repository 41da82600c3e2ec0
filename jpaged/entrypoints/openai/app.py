"""The OpenAI-compatible HTTP server's app: `create_app(engine)`.

Routes: GET /health, GET /v1/models (and /v1/models/{id}), POST
/v1/completions, POST /v1/chat/completions, POST /generate
(jpaged.entrypoints.openai.serving), POST /tokenize, POST /detokenize, GET
/tokenizer_info (tokenizer_routes), GET /metrics (Prometheus, vLLM's names:
metrics), and vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(lora_routes); with ServerOptions.enable_rl_routes, the rollout routes of RL
frameworks (admin); any other path is a 404 in OpenAI's error shape.  A
request's "model" names the base model (its served name) or a loaded LoRA
adapter, which it then runs (as vLLM); /v1/models lists both.

The engine is one LLM or a data-parallel router (jpaged.engine.protocol.Engine),
read only through that protocol.  Bad input is a 400 with an OpenAI-style error
body; a full queue is a 429 with Retry-After; what refuses a request before the
routes see it (the API key, body limits, connection limits, the drain at
shutdown) is jpaged.entrypoints.openai.guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jpaged.entrypoints.openai.admin import add_admin_routes
from jpaged.entrypoints.openai.answers import ChatAnswer, CompletionAnswer, GenerateAnswer
from jpaged.entrypoints.openai.errors import RequestError, error_body, model_not_found
from jpaged.entrypoints.openai.guard import RequestGuard, error_response
from jpaged.entrypoints.openai.lora_routes import add_lora_routes
from jpaged.entrypoints.openai.metrics import CONTENT_TYPE
from jpaged.entrypoints.openai.protocol import parse_chat, parse_completion, parse_generate
from jpaged.entrypoints.openai.serving import handle_generation
from jpaged.entrypoints.openai.state import ServerOptions, ServerState
from jpaged.entrypoints.openai.tokenizer_routes import add_tokenizer_routes

if TYPE_CHECKING:  # the engine (and jax) load when the server builds it, not on import
    from jpaged.engine.protocol import Engine

log = logging.getLogger(__name__)


def create_app(engine: Union["Engine", Callable[[], "Engine"]], config: Any = None, *,
               model_name: str | None = None,
               on_load_failure: Callable[[BaseException], None] | None = None,
               options: ServerOptions | None = None) -> FastAPI:
    """The FastAPI app serving `engine`: an Engine (an LLM or a DataParallelLLM),
    or a callable that builds one (built in the background once the server runs,
    so that /health answers 503 while it loads; `config` is then required).
    `on_load_failure` is called if building fails (scripts/serve.py stops the server).
    `options`: the API key and the request limits (ServerOptions); serve the app
    with `uvicorn_config(app, ...)` for the connection limits too."""
    config = config if config is not None else engine.config
    state = ServerState(engine, config, model_name or config.model, options)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=state.load, args=(on_load_failure,), name="jpaged-load", daemon=True).start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.close)

    app = FastAPI(title="jpaged", lifespan=lifespan)
    app.state.jpaged = state
    app.add_middleware(RequestGuard, state=state)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        """Unknown routes (404) and methods (405) in OpenAI's error shape."""
        message = (f"Invalid URL ({request.method} {request.url.path})" if e.status_code == 404
                   else f"{e.detail} ({request.method} {request.url.path})")
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("request failed: %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "internal_server_error"),
                            status_code=500)

    @app.get("/health")
    async def health() -> Response:
        ok = state.status == "ready"
        return JSONResponse({"status": state.status}, status_code=200 if ok else 503)

    def model_card(model_id: str) -> dict[str, Any]:
        """vLLM's card: an adapter's `root` is its directory, its `parent` the base model."""
        adapter = model_id != state.model_name
        return {"id": model_id, "object": "model", "created": state.created, "owned_by": "jpaged",
                "root": state.adapters[model_id] if adapter else config.model,
                "parent": state.model_name if adapter else None, "max_model_len": config.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(m) for m in (state.model_name, *state.adapters)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if not state.serves(model_id):
            return error_response(RequestError(model_not_found(model_id), "model", code="model_not_found"))
        return JSONResponse(model_card(model_id))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle_generation(request, state, parse_completion, CompletionAnswer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle_generation(request, state, parse_chat, ChatAnswer)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await handle_generation(request, state, parse_generate, GenerateAnswer)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    add_tokenizer_routes(app, state)
    add_lora_routes(app, state)
    if state.options.enable_rl_routes:
        add_admin_routes(app, state)
    return app

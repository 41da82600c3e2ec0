"""What RL frameworks (verl, slime, OpenRLHF) call on a rollout server (vLLM's
and SGLang's names), only with ServerOptions.enable_rl_routes (else 404s):
POST /pause {"mode": "abort"|"keep"|"wait"} (default "keep"; returns at once,
"wait" lets the requests in flight finish meanwhile), POST /resume, POST
/sleep {"level": 1|2}, POST /wake_up, POST /update_weights {"path" (or
"model_path"), "in_flight": "abort"|"keep"|"recompute"} (an orbax, HF or
.gguf checkpoint of the same model, read on the engine thread: no step runs
meanwhile), POST /reset_prefix_cache; GET /is_paused, GET /is_sleeping.  Each
runs on the engine thread between two steps (LLM.pause, .sleep, ...); the
fields may also come as query parameters (vLLM's /sleep?level=1), the JSON
body winning.  A bad field, or the engine refusing (ValueError, RuntimeError,
OSError: sleep with requests unfinished, wake_up after sleep(2) without new
weights, a bad checkpoint, reset_prefix_cache while busy) is a 400 with the
message.  While paused, generation requests queue until /resume; while
asleep they are 503s.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from jpaged.engine.async_engine import EngineClosed
from jpaged.entrypoints.openai_protocol import RequestError
from jpaged.entrypoints.server import ServerState, _error_response, _json_body

log = logging.getLogger(__name__)


class RLRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PauseRequest(RLRequest):
    mode: Literal["abort", "keep", "wait"] = "keep"


class SleepRequest(RLRequest):
    level: Literal[1, 2] = 1


class UpdateWeightsRequest(RLRequest):
    path: str = Field(validation_alias=AliasChoices("path", "model_path"))
    in_flight: Literal["abort", "keep", "recompute"] = "abort"


def _rl_request(body: bytes, query: dict[str, str], kind: type[RLRequest]) -> RLRequest:
    return _json_body(body, kind, {k: int(v) if v.isdigit() else v for k, v in query.items()})


def _rl_change(state: ServerState, change: Callable[[Any, Any], Any], req: RLRequest, llm: Any) -> Any:
    """On the engine thread: change(llm, req); the engine's refusals become 400s."""
    try:
        return change(llm, req)
    except AttributeError as e:
        raise RequestError(f"this engine does not support it: {e}") from None  # (a data-parallel router)
    except (ValueError, RuntimeError, OSError) as e:
        raise RequestError(str(e)) from None
    finally:
        state.asleep = bool(getattr(llm, "is_sleeping", False))


async def _rl_route(request: Request, state: ServerState, kind: type[RLRequest],
                    change: Callable[[Any, Any], Any], sleeps: bool = False) -> Response:
    try:
        engine = state.ready_engine()
        req = await state.run_host(_rl_request, await request.body(), dict(request.query_params), kind)
        if sleeps:
            state.asleep = True  # before the call is queued: no request submitted after it meets the sleep
        await engine.call(functools.partial(_rl_change, state, change, req))
    except RequestError as e:
        return _error_response(e)
    except EngineClosed as e:
        return _error_response(RequestError(str(e), status=503, kind="service_unavailable"))
    log.info("%s %s", request.url.path, req.model_dump())
    return JSONResponse({"status": "ok"})


def add_rl_routes(app: FastAPI, state: ServerState) -> None:
    def post(path: str, change: Callable[[Any, Any], Any], kind: type[RLRequest] = RLRequest,
             sleeps: bool = False) -> None:
        async def route(request: Request) -> Response:
            return await _rl_route(request, state, kind, change, sleeps)
        app.add_api_route(path, route, methods=["POST"], name=path.strip("/"))

    def get(path: str, attribute: str) -> None:
        async def route() -> Response:
            try:
                state.ready_engine()
            except RequestError as e:
                return _error_response(e)
            return JSONResponse({attribute: bool(getattr(state.llm, attribute, False))})
        app.add_api_route(path, route, methods=["GET"], name=path.strip("/"))

    post("/pause", lambda llm, req: llm.pause(req.mode), PauseRequest)
    post("/resume", lambda llm, req: llm.resume())
    post("/sleep", lambda llm, req: llm.sleep(req.level), SleepRequest, sleeps=True)
    post("/wake_up", lambda llm, req: llm.wake_up())
    post("/update_weights", lambda llm, req: llm.update_params(req.path, in_flight=req.in_flight),
         UpdateWeightsRequest)
    post("/reset_prefix_cache", lambda llm, req: llm.reset_prefix_cache())
    get("/is_paused", "is_paused")
    get("/is_sleeping", "is_sleeping")

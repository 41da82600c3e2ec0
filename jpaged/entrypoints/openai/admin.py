"""The admin routes: what RL frameworks (verl, slime, OpenRLHF) call on a rollout
server (vLLM's and SGLang's names), only with ServerOptions.enable_rl_routes (else 404s):
POST /pause {"mode": "abort"|"keep"|"wait"} (default "keep"; returns at once,
"wait" lets the requests in flight finish meanwhile), POST /resume, POST
/sleep {"level": 1|2}, POST /wake_up, POST /update_weights {"path" (or
"model_path"), "in_flight": "abort"|"keep"|"recompute"} (an orbax, HF or
.gguf checkpoint of the same model, read on the engine thread: no step runs
meanwhile), POST /reset_prefix_cache; GET /is_paused, GET /is_sleeping.  Each
runs on the engine thread between two steps (LLM.pause, .sleep, ...); the
fields may also come as query parameters (vLLM's /sleep?level=1: each given
once, an integer spelt exactly), the JSON body winning.  A bad, unknown or
repeated field, or the engine refusing (ValueError, RuntimeError,
OSError: sleep with requests unfinished, wake_up after sleep(2) without new
weights, a bad checkpoint, reset_prefix_cache while busy) is a 400 with the
message.  While paused, generation requests queue until /resume; while
asleep they are 503s.
"""

from __future__ import annotations

import functools
import logging
import pathlib
import typing
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field

from jpaged.core.config import EMBEDDED_MODEL, auto_load_format
from jpaged.entrypoints.openai.errors import RequestError, json_body
from jpaged.entrypoints.openai.guard import REFUSALS, error_response, refused
from jpaged.entrypoints.openai.state import ServerState

if TYPE_CHECKING:
    from jpaged.engine.protocol import Engine

log = logging.getLogger(__name__)

MAX_PATH_CHARS = 4096  # /update_weights' path (PATH_MAX on Linux)


def _exact_int(value: Any) -> Any:
    """An integer field takes JSON integers only (pydantic's Literal[1, 2] takes true and 1.0)."""
    if type(value) is not int:
        raise ValueError(f"must be an integer, got {value!r}")
    return value


class RLRequest(BaseModel):
    # Unknown fields are 400s naming them: a misspelt field must not pass as a default.
    model_config = ConfigDict(extra="forbid", strict=True)


class PauseRequest(RLRequest):
    mode: Literal["abort", "keep", "wait"] = "keep"


class SleepRequest(RLRequest):
    level: Annotated[Literal[1, 2], BeforeValidator(_exact_int)] = 1


class WakeUpRequest(RLRequest):
    # vLLM's /wake_up?tags=weights&tags=kv_cache wakes part of a sleeping engine; jpaged
    # always wakes all of it (a superset of any subset asked for), so the tags are checked only.
    tags: list[Literal["weights", "kv_cache"]] | None = None


class UpdateWeightsRequest(RLRequest):
    path: str = Field(validation_alias=AliasChoices("path", "model_path"))
    in_flight: Literal["abort", "keep", "recompute"] = "abort"


# What a route does to the engine, on the engine thread (a verb of the Engine protocol).
Change = Callable[["Engine", Any], None]


def _query_fields(items: list[tuple[str, str]], kind: type[RLRequest]) -> dict[str, Any]:
    """The query parameters as fields: each given once (a list field's values repeated);
    an integer field's value one of its values' exact ASCII spelling ("1", not "01",
    " 1" or "²")."""
    fields: dict[str, Any] = {}
    for key, value in items:
        field = kind.model_fields.get(key)
        if field is not None and _is_list(field.annotation):
            fields.setdefault(key, []).append(value)  # a list field: ?tags=a&tags=b
            continue
        if key in fields:
            raise RequestError(f"query parameter {key!r} is given more than once", key)
        fields[key] = value
        choices = typing.get_args(field.annotation) if field and typing.get_origin(field.annotation) is Literal else ()
        if choices and all(type(c) is int for c in choices):
            spelled = {str(c): c for c in choices}
            if value not in spelled:
                raise RequestError(f"{key} must be {' or '.join(spelled)}, got {value!r}", key)
            fields[key] = spelled[value]
    return fields


def _is_list(annotation: Any) -> bool:
    """list[...] or list[...] | None."""
    return typing.get_origin(annotation) is list or any(typing.get_origin(a) is list for a in typing.get_args(annotation))


def _rl_request(body: bytes, query: list[tuple[str, str]], kind: type[RLRequest]) -> RLRequest:
    req = json_body(body, kind, _query_fields(query, kind))
    if isinstance(req, UpdateWeightsRequest):
        _check_checkpoint(req.path)
    return req


def _check_checkpoint(path: str) -> None:
    """A 400 (field "path") unless `path` names what update_params reads: an orbax
    checkpoint, a HF checkpoint directory or a .gguf file (or the embedded model).
    One message for a missing path and any other: the server's disk is not told."""
    if path == EMBEDDED_MODEL:
        return
    ok = False
    if 0 < len(path) <= MAX_PATH_CHARS and "\0" not in path:
        try:
            p = pathlib.Path(path).expanduser()
            ok = (p.is_dir() and any((p / f).is_file() for f in ("_CHECKPOINT_METADATA", "_METADATA"))
                  or auto_load_format(p) is not None)
        except (OSError, ValueError):
            ok = False
    if not ok:
        shown = repr(path) if len(path) <= 256 else f"{path[:256]!r}..."
        raise RequestError(f"path {shown} is not a readable orbax, HF (a directory with config.json) or .gguf "
                           f"checkpoint", "path")


def _rl_change(state: ServerState, change: Change, field: str | None, req: RLRequest, llm: Engine) -> None:
    """On the engine thread: change(llm, req); the engine's refusals become 400s (naming
    `field` when the route's input is what was refused)."""
    try:
        change(llm, req)
    except (ValueError, RuntimeError, OSError) as e:
        raise RequestError(str(e), field) from None
    finally:
        state.asleep = bool(llm.is_sleeping)


async def _rl_route(request: Request, state: ServerState, kind: type[RLRequest], change: Change,
                    field: str | None, sleeps: bool = False) -> Response:
    try:
        engine = state.ready_engine()
        req = await state.run_host(_rl_request, await request.body(), request.query_params.multi_items(), kind)
        if sleeps:
            state.asleep = True  # before the call is queued: no request submitted after it meets the sleep
        await engine.call(functools.partial(_rl_change, state, change, field, req))
    except REFUSALS as e:
        return refused(e)
    log.info("%s %s", request.url.path, req.model_dump())
    return JSONResponse({"status": "ok"})


def add_admin_routes(app: FastAPI, state: ServerState) -> None:
    def post(path: str, change: Change, kind: type[RLRequest] = RLRequest, field: str | None = None,
             sleeps: bool = False) -> None:
        async def route(request: Request) -> Response:
            return await _rl_route(request, state, kind, change, field, sleeps)
        app.add_api_route(path, route, methods=["POST"], name=path.strip("/"))

    def get(path: str, attribute: str, read: Callable[[Engine], bool]) -> None:
        async def route(request: Request) -> Response:
            try:
                if request.query_params:  # (these take no input)
                    raise RequestError(f"{path} takes no query parameters, got "
                                       f"{sorted(request.query_params)[:4]}", sorted(request.query_params)[0])
                state.ready_engine()
            except RequestError as e:
                return error_response(e)
            return JSONResponse({attribute: bool(read(state.llm))})
        app.add_api_route(path, route, methods=["GET"], name=path.strip("/"))

    post("/pause", lambda llm, req: llm.pause(req.mode), PauseRequest)
    post("/resume", lambda llm, req: llm.resume())
    post("/sleep", lambda llm, req: llm.sleep(req.level), SleepRequest, sleeps=True)
    post("/wake_up", lambda llm, req: llm.wake_up(), WakeUpRequest)
    post("/update_weights", lambda llm, req: llm.update_params(req.path, in_flight=req.in_flight),
         UpdateWeightsRequest, field="path")
    post("/reset_prefix_cache", lambda llm, req: llm.reset_prefix_cache())
    get("/is_paused", "is_paused", lambda llm: llm.is_paused)
    get("/is_sleeping", "is_sleeping", lambda llm: llm.is_sleeping)

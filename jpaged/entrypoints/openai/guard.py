"""Admission: what refuses a request before, or instead of, an answer.

RequestGuard (pure ASGI, in front of the routes) checks the API key, refuses a
body larger than max_request_body_bytes (413, from Content-Length or while
reading a chunked body), Transfer-Encoding together with Content-Length (400),
and a body not read within body_timeout_seconds (408); check_prompt_bytes caps
each prompt's bytes (max_prompt_bytes, 400) before it is tokenized; `refused`
turns a refusal into its response (a full queue: 429 with Retry-After).
`uvicorn_config` adds the connection limits (concurrency, backlog, header size
and header timeout, keep-alive timeout), and DrainingServer refuses new
requests (503) while those in flight finish at shutdown.  A client that goes
away is noticed by wait_for_disconnect (ClientGone).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from types import FrameType
from typing import Any, Awaitable, Callable

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from jpaged.engine.async_engine import EngineClosed, QueueFull
from jpaged.entrypoints.openai.errors import RequestError, error_body
from jpaged.entrypoints.openai.state import RETRY_AFTER_SECONDS, ServerOptions, ServerState

log = logging.getLogger(__name__)

FLUSH_SECONDS = 2.0             # after the grace period: time for cut streams to send their last chunks


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has closed the connection (the body is read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def json_bytes(obj: Any) -> bytes:
    """As JSONResponse encodes."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def _utf8_len(text: str, cap: int) -> int:
    """len(text in UTF-8), or a number above `cap` without encoding a text that
    has more characters than `cap` (a character is at least one byte)."""
    return len(text) if len(text) > cap else len(text.encode("utf-8", "surrogatepass"))


def check_prompt_bytes(state: ServerState, prompt: Any, param: str) -> None:
    """A 400 for a text prompt (or a chat's messages) over max_prompt_bytes: checked
    before anything tokenizes it.  (Token-id prompts are counted in tokens.)"""
    cap = state.options.max_prompt_bytes
    if isinstance(prompt, str):
        size = _utf8_len(prompt, cap)
    elif isinstance(prompt, dict):  # the messages, and the tools the template writes beside them
        size = _utf8_len(json.dumps([prompt.get("messages"), prompt.get("tools")], ensure_ascii=False), cap)
    else:
        return
    if size > cap:
        raise RequestError(f"the {param} is {size} bytes; this server takes at most {cap} bytes of text per "
                           "prompt (max_prompt_bytes)", param, code="prompt_too_large")


def error_response(e: RequestError) -> JSONResponse:
    status = 404 if e.code == "model_not_found" else e.status  # as OpenAI and vLLM
    return JSONResponse(e.body(), status_code=status, headers=e.headers)


# What the routes catch: a request refused, or one the engine could not take.
REFUSALS = (RequestError, QueueFull, EngineClosed)


def refused(e: Exception) -> JSONResponse:
    """The response to a refusal (one of REFUSALS): a RequestError as it says; a full
    queue a 429 with Retry-After (the client may retry); a closed engine a 503."""
    if isinstance(e, QueueFull):
        e = RequestError(str(e), status=429, kind="rate_limit_error", code="queue_full",
                         headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    elif isinstance(e, EngineClosed):
        e = RequestError(str(e), status=503, kind="service_unavailable")
    assert isinstance(e, RequestError), type(e)
    return error_response(e)


class RequestGuard:
    """Pure ASGI, in front of the routes: the API key, then the body's framing
    and size, then the whole body read within body_timeout_seconds and handed to
    the app (which never reads a partial or oversized body).  Refusals close the
    connection (an unread body is not worth reading)."""

    def __init__(self, app: Any, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        options = self.state.options
        refusal = self._check_headers(scope, options)
        body: bytes | None = b""
        if refusal is None:
            try:
                body = await asyncio.wait_for(_read_body(receive, options.max_request_body_bytes),
                                              options.body_timeout_seconds)
            except RequestError as e:
                refusal = e
            except asyncio.TimeoutError:
                refusal = RequestError(f"the request body did not arrive within {options.body_timeout_seconds:g} "
                                       "s (body_timeout_seconds)", status=408, code="body_timeout")
        if refusal is not None:
            headers = {**refusal.headers, "Connection": "close"}
            return await _send_json(send, refusal.status, refusal.body(), headers)
        if body is None:
            return  # the client left while sending
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay() -> dict[str, Any]:
            return pending.pop() if pending else await receive()
        await self.app(scope, replay, send)

    def _check_headers(self, scope: dict[str, Any], options: ServerOptions) -> RequestError | None:
        headers: dict[bytes, list[bytes]] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.lower(), []).append(value)
        if options.api_key is not None and _needs_key(scope["path"], options):
            scheme, _, token = (headers.get(b"authorization") or [b""])[0].partition(b" ")
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), options.api_key.encode())
            if not ok:
                return RequestError("Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                                    status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if b"transfer-encoding" in headers and b"content-length" in headers:
            return RequestError("a request must not have both Transfer-Encoding and Content-Length headers")
        cap = options.max_request_body_bytes
        lengths = headers.get(b"content-length", [])
        if lengths and lengths[0].strip().isdigit() and int(lengths[0]) > cap:
            return _too_large(int(lengths[0]), cap)
        return None


def _needs_key(path: str, options: ServerOptions) -> bool:
    return path != "/health" and (path != "/metrics" or options.metrics_require_key)


def _too_large(size: int, cap: int) -> RequestError:
    return RequestError(f"the request body is {size} bytes or more; this server takes at most {cap} bytes "
                        "(max_request_body_bytes)", status=413, code="body_too_large")


async def _read_body(receive: Callable[[], Awaitable[dict[str, Any]]], cap: int) -> bytes | None:
    """The whole body (None if the client left first); a 413 once it passes `cap`."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        part = message.get("body", b"")
        size += len(part)
        if size > cap:
            raise _too_large(size, cap)
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _send_json(send: Callable[[dict[str, Any]], Awaitable[None]], status: int, body: dict[str, Any],
                     headers: dict[str, str]) -> None:
    data = json_bytes(body)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


# ---------------------------------------------------------- connections
class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a header timeout: a connection whose request
    line and headers have not all arrived `header_timeout` seconds after it
    opened (or after its previous response) is closed.  uvicorn has none of its
    own (its keep-alive timer restarts on every byte), so a client trickling
    header bytes would hold a connection for ever.  uvicorn_config sets the value."""

    header_timeout = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        self._arm_header_timer()  # before a pipelined request may start a new cycle
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_handler, self.cycle)

    def send_400_response(self, msg: str) -> None:
        """A request head h11 cannot take (malformed, or over max_header_bytes):
        the 400 in OpenAI's error shape, like every other refusal."""
        body = json.dumps(error_body(f"invalid HTTP request: {msg}", "invalid_request_error")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _header_timeout_handler(self, cycle: Any) -> None:
        if self.cycle is cycle and not self.transport.is_closing():  # no request has begun since
            log.debug("closing a connection without a whole request head after %g s", self.header_timeout)
            self.transport.close()


def uvicorn_config(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for `app` with its ServerOptions' connection limits: at most
    limit_concurrency connections and tasks (then 503s), a listen backlog, request
    line + headers of at most max_header_bytes arriving within
    header_timeout_seconds, idle keep-alive connections closed after
    timeout_keep_alive.  `kwargs` go to uvicorn.Config as they are."""
    options: ServerOptions = app.state.jpaged.options
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": options.header_timeout_seconds})
    settings = dict(host=host, port=port, http=protocol, lifespan="on", limit_concurrency=options.limit_concurrency,
                    backlog=options.backlog, timeout_keep_alive=options.timeout_keep_alive,
                    h11_max_incomplete_event_size=options.max_header_bytes)
    return uvicorn.Config(app, **{**settings, **kwargs})


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain before its shutdown.  uvicorn alone stops listening on
    SIGTERM, so a load balancer's health check gets "connection refused" and new
    requests fail while in-flight ones finish.  Here the first SIGTERM or SIGINT
    drains instead: the server keeps listening, answers /health and new requests
    with 503, and lets the requests in flight finish.  Once none is left it shuts
    down; if some are still running when the grace period is over, they are cut:
    aborted in the engine, so that each stream ends with a chunk whose
    finish_reason is "abort" and `data: [DONE]` (a whole answer with that
    reason), one log line says how many, and the server shuts down once they are
    sent (at most FLUSH_SECONDS later).  A second signal ends the grace period at
    once; a third stops without waiting."""

    def __init__(self, config: uvicorn.Config, app_state: ServerState, grace_seconds: float):
        super().__init__(config)
        self.app_state = app_state
        self.grace_seconds = grace_seconds
        self._drain_deadline: float | None = None
        self._cut_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # (a signal handler: only sets state; on_tick does the rest)
        if self._drain_deadline is None and not self.should_exit:
            self._drain_deadline = time.monotonic() + self.grace_seconds
            self.app_state.drain()
        elif self._cut_at is None and not self.should_exit:
            self._drain_deadline = time.monotonic()
        else:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """Called by uvicorn's main loop every 0.1 s; True stops the server."""
        if self._drain_deadline is not None and not self.should_exit:
            now, busy = time.monotonic(), self.app_state.num_in_flight
            if busy == 0:
                log.info("drain over: no request in flight; shutting down")
                self.should_exit = True
            elif self._cut_at is None and now >= self._drain_deadline:
                self._cut_at = now
                self.app_state.cut_runs()
                log.warning("shutdown grace period over (%g s): %d requests still in flight cut with "
                            "finish_reason abort", self.grace_seconds, busy)
            elif self._cut_at is not None and now - self._cut_at > FLUSH_SECONDS:
                self.should_exit = True
            if self.should_exit:
                self.config.timeout_graceful_shutdown = FLUSH_SECONDS  # for answers still being sent
        return await super().on_tick(counter)

"""An OpenAI-compatible HTTP server over the engine: `create_app(engine)`.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST
/v1/chat/completions, POST /generate and GET /metrics (Prometheus, vLLM's
names).  Streaming responses are server-sent events, `data: {json}` per chunk
and `data: [DONE]` at the end.

The engine runs in one background thread (jpaged.engine.async_engine); each HTTP
request turns into engine requests, reads their per-step deltas, detokenizes
them (jpaged.tokenizer.detokenizer, which also holds back the start of a stop
string) and answers.  The engine is one LLM or a data-parallel router
(jpaged.engine.protocol.Engine).  Stop strings travel in SamplingParams.stop:
the engine ends a sample in the step its text hits one; a client that goes
away, mid-stream or while waiting for a whole answer, has its requests
aborted; both free their KV blocks.  Bad input is a 400 with an
OpenAI-style error body; a full queue is a 429 with Retry-After; a request that
fails inside the engine fails alone.  Logprobs travel with the text: each
streamed chunk carries those of the tokens consumed since the previous one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jpaged.engine.async_engine import AsyncEngine, Delta, EngineClosed, QueueFull, Submission
from jpaged.tokenizer.detokenizer import SampleText
from jpaged.entrypoints.openai_protocol import (GenerationRequest, RequestError, chat_choice, chat_chunk_choice,
                                    chat_logprobs, completion_choice, completion_logprobs, envelope,
                                    error_body, new_id, parse_chat, parse_completion, parse_generate,
                                    token_logprob_json, usage)
from jpaged.core.request_parsing import default_sampling_params
from jpaged.core.sequence import TokenLogprob
from jpaged.entrypoints.server_metrics import CONTENT_TYPE, ServerMetrics

if TYPE_CHECKING:  # the engine (and jax) load when the server builds it, not on import
    from jpaged.engine.protocol import Engine

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20     # a request body beyond this is refused (413) before parsing
RETRY_AFTER_SECONDS = 1         # the hint sent with a 429
ENGINE_JOIN_SECONDS = 60.0      # at shutdown, wait this long for the step in progress


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


# ------------------------------------------------------------------ state
class ServerState:
    """The engine (once loaded), its status and the metrics registry of one app."""

    def __init__(self, source: Any, config: Any, model_name: str):
        self.source = source  # an Engine, or a callable that builds one
        self.config = config
        self.model_name = model_name
        self.defaults = default_sampling_params(config)
        self.metrics = ServerMetrics(model_name, config.block_size,
                                     enable_prefix_caching=config.enable_prefix_caching,
                                     num_replicas=config.data_parallel_size)
        self.llm: Any = None
        self.engine: AsyncEngine | None = None
        self.status = "loading"  # loading | ready | failed: <why> | shutting down
        self.load_error: str | None = None
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}

    def load(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Builds (if given a factory) and starts the engine; /health turns 200."""
        try:
            llm = self.source() if _is_factory(self.source) else self.source
            engine = AsyncEngine(llm, max_queued_requests=self.config.max_queued_requests,
                                 metrics=self.metrics)
            self.llm = llm
            if self.status == "shutting down":
                return
            engine.start()
            self.engine, self.status = engine, "ready"
            log.info("engine ready: %s, %d KV blocks of %d tokens", self.model_name, llm.num_blocks,
                     self.config.block_size)
        except Exception as e:  # noqa: BLE001 - reported on /health and to the caller
            log.exception("the engine failed to load")
            self.load_error = f"{type(e).__name__}: {e}"
            self.status = f"failed: {self.load_error}"
            if on_failure is not None:
                on_failure(e)

    def drain(self) -> None:
        """Takes no new requests (503, /health too) while those in flight go on."""
        self.status = "shutting down"

    @property
    def num_in_flight(self) -> int:
        return self.engine.num_unfinished if self.engine is not None else 0

    def close(self) -> None:
        self.drain()
        if self.engine is not None:
            self.engine.close(ENGINE_JOIN_SECONDS)

    def ready_engine(self) -> AsyncEngine:
        if self.status != "ready" or self.engine is None:
            raise RequestError(f"the server is not ready ({self.status})", status=503,
                               kind="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        return self.engine

    def decode(self, token_ids: list[int]) -> str:
        tokenizer = self.llm.tokenizer
        return tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else ""

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens shown (logprobs name their tokens
        so); cached: a logprobs answer decodes up to 21 tokens per token."""
        text = self._token_texts.get(token_id)
        if text is None:
            tokenizer = self.llm.tokenizer
            text = tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else ""
            self._token_texts[token_id] = text
        return text


def _is_factory(source: Any) -> bool:
    return callable(source) and not hasattr(source, "step")


# --------------------------------------------------------------- a request
@dataclasses.dataclass
class ChoiceUpdate:
    index: int                  # choice index: prompt index * n + sample index
    text: str                   # new text ("" with a finish)
    finish_reason: str | None   # set once, on the choice's last update
    # The logprobs of the tokens consumed since the choice's last update (when asked for).
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)


class GenerationRun:
    """One HTTP request in flight: its engine requests' deltas in, its choices'
    text (and logprobs) out.  Ends (and aborts what is left in the engine) when
    every choice has finished, a request failed, or the client went away."""

    def __init__(self, state: ServerState, engine: AsyncEngine, submission: Submission,
                 gen: GenerationRequest, request: Request):
        self.engine, self.submission, self.gen = engine, submission, gen
        self.n = gen.params.n
        self.samples = [SampleText(state.decode, gen.stop) for _ in range(len(submission.requests) * self.n)]
        self.finish_reasons: list[str | None] = [None] * len(self.samples)
        # Per choice, of the tokens its text consumed (SamplingParams.logprobs); per prompt, its own.
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in self.samples]
        self.prompt_logprobs: list[list[TokenLogprob | None] | None] = [None] * len(submission.requests)
        self._logprobs_sent = [0] * len(self.samples)
        self.error: str | None = None
        self._disconnect = asyncio.ensure_future(_wait_for_disconnect(request))

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.submission.requests)

    @property
    def completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, self.completion_tokens)

    async def updates(self) -> AsyncIterator[list[ChoiceUpdate]]:
        """The choices' new text after each engine step, until all finished or an
        error (then `error` is set).  Raises ClientGone if the client leaves."""
        try:
            while self.error is None and None in self.finish_reasons:
                updates = self._apply(await self._next_delta())
                if updates:
                    yield updates
        finally:
            self._disconnect.cancel()
            self.engine.abort(r for r in self.submission.requests if not r.finished)

    async def run_to_end(self) -> None:
        async for _ in self.updates():
            pass

    async def _next_delta(self) -> Delta:
        get = asyncio.ensure_future(self.submission.queue.get())
        await asyncio.wait({get, self._disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            raise ClientGone()
        return get.result()

    def _apply(self, delta: Delta) -> list[ChoiceUpdate]:
        if "error" in delta.finish_reasons:
            self.error = delta.error or "internal error"
            return []
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[delta.index] = delta.prompt_logprobs
        updates = []
        for j in range(self.n):
            c = delta.index * self.n + j
            if self.finish_reasons[c] is not None:
                continue  # finished (the engine ends a sample in the step its text hits a stop string)
            logprobs = delta.new_logprobs[j] if delta.new_logprobs else []
            update = self._advance_sample(c, delta.new_token_ids[j], logprobs, delta.finish_reasons[j])
            if update is not None:
                updates.append(update)
        return updates

    def _advance_sample(self, c: int, token_ids: list[int], logprobs: list[TokenLogprob],
                        engine_reason: str | None) -> ChoiceUpdate | None:
        """The choice's update for these new tokens, or None while it has no new
        text and goes on (its tokens' logprobs then wait for the next update)."""
        sample = self.samples[c]
        consumed = sample.num_tokens
        text = sample.push(token_ids)
        self.logprobs[c] += logprobs[:sample.num_tokens - consumed]  # none past a stop string
        reason = "stop" if sample.stopped else engine_reason
        if reason is not None and not sample.stopped:
            text += sample.finish()
            reason = "stop" if sample.stopped else reason
        self.finish_reasons[c] = reason
        if not text and reason is None:
            return None
        new_logprobs = self.logprobs[c][self._logprobs_sent[c]:]
        self._logprobs_sent[c] = len(self.logprobs[c])
        return ChoiceUpdate(c, text, reason, new_logprobs)


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client has closed the connection (the body is read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ----------------------------------------------------------- answer shapes
class Answer:
    """How one route shapes a GenerationRun into a response body or SSE chunks."""

    prefix = "cmpl"

    def __init__(self, run: GenerationRun, state: ServerState, prompt_texts: list[str]):
        self.run, self.state, self.prompt_texts = run, state, prompt_texts
        self.id = new_id(self.prefix)

    def body(self) -> dict[str, Any]:
        raise NotImplementedError

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, update: ChoiceUpdate) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self) -> dict[str, Any]:
        raise NotImplementedError


class CompletionAnswer(Answer):
    """/v1/completions.  With echo the prompt leads each choice, in the body and in
    the choice's first chunk (which waits for the prompt's logprobs)."""

    def __init__(self, run: GenerationRun, state: ServerState, prompt_texts: list[str]):
        super().__init__(run, state, prompt_texts)
        self._started = [False] * len(run.samples)  # streaming: the choice had a chunk
        self._offsets = [0] * len(run.samples)      # streaming: its token strings' length so far

    def _echo(self, c: int) -> str:
        return self.prompt_texts[c // self.run.n] if self.run.gen.echo else ""

    def _logprobs(self, c: int, logprobs: list[TokenLogprob], echo: bool, offset: int) -> dict[str, Any] | None:
        """The choice's `logprobs` of these tokens, led by the prompt's with echo."""
        if self.run.gen.params.logprobs is None:
            return None
        ids, entries = [lp.token_id for lp in logprobs], list(logprobs)
        if echo:
            request = self.run.submission.requests[c // self.run.n]
            prompt = self.run.prompt_logprobs[c // self.run.n] or [None] * len(request.prompt_token_ids)
            ids, entries = request.prompt_token_ids + ids, prompt + entries
        return completion_logprobs(ids, entries, self.state.token_text, offset)

    def body(self) -> dict[str, Any]:
        run = self.run
        choices = [completion_choice(c, self._echo(c) + s.text, run.finish_reasons[c],
                                     self._logprobs(c, run.logprobs[c], run.gen.echo, 0))
                   for c, s in enumerate(run.samples)]
        return envelope(self.id, "text_completion", run.gen.model, choices, run.usage())

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return envelope(self.id, "text_completion", self.run.gen.model, choices, None,
                        with_usage=self.run.gen.include_usage)

    def chunk(self, update: ChoiceUpdate) -> dict[str, Any]:
        c = update.index
        echo, self._started[c] = self.run.gen.echo and not self._started[c], True
        logprobs = self._logprobs(c, update.logprobs, echo, self._offsets[c])
        if logprobs is not None:
            self._offsets[c] += sum(map(len, logprobs["tokens"]))
        text = (self._echo(c) if echo else "") + update.text
        return self._chunk([completion_choice(c, text, update.finish_reason, logprobs)])

    def usage_chunk(self) -> dict[str, Any]:
        return envelope(self.id, "text_completion", self.run.gen.model, [], self.run.usage())


class ChatAnswer(Answer):
    prefix = "chatcmpl"

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        return None if self.run.gen.params.logprobs is None else chat_logprobs(logprobs, self.state.token_text)

    def body(self) -> dict[str, Any]:
        run = self.run
        choices = [chat_choice(c, s.text, run.finish_reasons[c], self._logprobs(run.logprobs[c]))
                   for c, s in enumerate(run.samples)]
        return envelope(self.id, "chat.completion", run.gen.model, choices, run.usage())

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return envelope(self.id, "chat.completion.chunk", self.run.gen.model, choices, None,
                        with_usage=self.run.gen.include_usage)

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk([chat_chunk_choice(c, {"role": "assistant", "content": ""}, None)])
                for c in range(len(self.run.samples))]

    def chunk(self, update: ChoiceUpdate) -> dict[str, Any]:
        delta = {"content": update.text} if update.text else {}
        return self._chunk([chat_chunk_choice(update.index, delta, update.finish_reason,
                                              self._logprobs(update.logprobs))])

    def usage_chunk(self) -> dict[str, Any]:
        return envelope(self.id, "chat.completion.chunk", self.run.gen.model, [], self.run.usage())


class GenerateAnswer(Answer):
    """/generate: the shape of the batch CLI's output lines."""

    def body(self) -> dict[str, Any]:
        run, params = self.run, self.run.gen.params
        samples = [dict(text=s.text, token_ids=list(s.token_ids), finish_reason=run.finish_reasons[c])
                   for c, s in enumerate(run.samples)]
        if params.logprobs is not None:
            for sample, logprobs in zip(samples, run.logprobs):
                sample["logprobs"] = [token_logprob_json(lp) for lp in logprobs]
        body = {**samples[0], "samples": samples, "usage": run.usage()}
        if params.prompt_logprobs is not None:
            body["prompt_logprobs"] = [token_logprob_json(lp) for lp in run.prompt_logprobs[0] or []]
        return body


async def _respond(answer: Answer) -> Response:
    """A whole (non-streamed) answer; aborted if the client leaves first."""
    run = answer.run
    try:
        await run.run_to_end()
    except ClientGone:
        return Response(status_code=499)  # nobody reads it: the connection is closed
    if run.error is not None:
        return JSONResponse(error_body(run.error, "internal_server_error"), status_code=500)
    return JSONResponse(answer.body())


async def _stream(answer: Answer) -> AsyncIterator[str]:
    """The SSE body: chunks as text is released, the usage chunk if asked, [DONE]."""
    run = answer.run
    try:
        for chunk in answer.first_chunks():
            yield _sse(chunk)
        async for updates in run.updates():
            for update in updates:
                yield _sse(answer.chunk(update))
        if run.error is not None:
            yield _sse(error_body(run.error, "internal_server_error"))
        elif run.gen.include_usage:
            yield _sse(answer.usage_chunk())
        yield "data: [DONE]\n\n"
    except ClientGone:
        return
    except Exception as e:  # noqa: BLE001 - the headers are sent: report in the stream
        log.exception("streaming failed")
        yield _sse(error_body(f"internal error: {type(e).__name__}: {e}", "internal_server_error"))
        yield "data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# --------------------------------------------------------------- handlers
async def _json_body(request: Request) -> Any:
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise RequestError(f"the body is larger than {MAX_BODY_BYTES} bytes", status=413)
    try:
        return json.loads(bytes(body))
    except (ValueError, RecursionError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None


def _tokenized(state: ServerState, prompt: Any, gen: GenerationRequest) -> tuple[list[int], str]:
    """(token ids, prompt text for echo), or a 400 naming what the engine would refuse."""
    param = "messages" if isinstance(prompt, dict) else "prompt"
    try:
        ids = state.llm.tokenize(prompt)
    except ValueError as e:
        raise RequestError(str(e), param) from None
    problem = state.llm.check_request(ids, gen.params)
    if problem:
        raise RequestError(problem, "n" if problem.startswith("n=") else param)
    return ids, prompt if isinstance(prompt, str) else state.decode(ids)


def _error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _handle(request: Request, state: ServerState, parse: Callable[..., GenerationRequest],
                  answer_type: type[Answer]) -> Response:
    try:
        engine = state.ready_engine()
        gen = parse(await _json_body(request), state.defaults, state.model_name)
        prompts = [_tokenized(state, p, gen) for p in gen.prompts]
        submission = engine.submit([(ids, gen.params, text if isinstance(p, str) else None)
                                    for p, (ids, text) in zip(gen.prompts, prompts)])
    except RequestError as e:
        return _error_response(e)
    except QueueFull as e:
        return _error_response(RequestError(str(e), status=429, kind="rate_limit_error", code="queue_full",
                                            headers={"Retry-After": str(RETRY_AFTER_SECONDS)}))
    except EngineClosed as e:
        return _error_response(RequestError(str(e), status=503, kind="service_unavailable"))
    answer = answer_type(GenerationRun(state, engine, submission, gen, request), state, [t for _, t in prompts])
    if gen.stream:
        return StreamingResponse(_stream(answer), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _respond(answer)


# -------------------------------------------------------------------- app
def create_app(engine: Union["Engine", Callable[[], "Engine"]], config: Any = None, *,
               model_name: str | None = None,
               on_load_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The FastAPI app serving `engine`: an Engine (an LLM or a DataParallelLLM),
    or a callable that builds one (built in the background once the server runs,
    so that /health answers 503 while it loads; `config` is then required).
    `on_load_failure` is called if building fails (scripts/serve.py stops the server)."""
    config = config if config is not None else engine.config
    state = ServerState(engine, config, model_name or config.model)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=state.load, args=(on_load_failure,), name="jpaged-load", daemon=True).start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.close)

    app = FastAPI(title="jpaged", lifespan=lifespan)
    app.state.jpaged = state

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("request failed: %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "internal_server_error"),
                            status_code=500)

    @app.get("/health")
    async def health() -> Response:
        ok = state.status == "ready"
        return JSONResponse({"status": state.status}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "jpaged", "max_model_len": config.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(request, state, parse_completion, CompletionAnswer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle(request, state, parse_chat, ChatAnswer)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await _handle(request, state, parse_generate, GenerateAnswer)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app


# ------------------------------------------------------------------ server
class DrainingServer(uvicorn.Server):
    """uvicorn with a drain before its shutdown.  uvicorn alone stops listening on
    SIGTERM, so a load balancer's health check gets "connection refused" and new
    requests fail while in-flight ones finish.  Here the first SIGTERM or SIGINT
    drains instead: the server keeps listening, answers /health and new requests
    with 503, and lets the requests in flight finish; once none is left, or the
    grace period is over, uvicorn shuts down as usual within what is left of the
    period (requests still running then are cancelled, which aborts them).  A
    second signal ends the drain at once."""

    def __init__(self, config: uvicorn.Config, app_state: ServerState, grace_seconds: float):
        super().__init__(config)
        self.app_state = app_state
        self.grace_seconds = grace_seconds
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_deadline is None and not self.should_exit:
            self._drain_deadline = time.monotonic() + self.grace_seconds
            self.app_state.drain()  # (a signal handler: only sets state; on_tick does the rest)
        else:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """Called by uvicorn's main loop every 0.1 s; True stops the server."""
        if self._drain_deadline is not None:
            left = self._drain_deadline - time.monotonic()
            if left <= 0 or self.app_state.num_in_flight == 0:
                if not self.should_exit:
                    log.info("drain over (%d requests in flight): shutting down", self.app_state.num_in_flight)
                self.should_exit = True
            if self.should_exit:
                self.config.timeout_graceful_shutdown = max(left, 0.0)
        return await super().on_tick(counter)

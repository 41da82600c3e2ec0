"""An OpenAI-compatible HTTP server over the engine: `create_app(engine)`.

Routes: GET /health, GET /v1/models (and /v1/models/{id}), POST
/v1/completions, POST /v1/chat/completions, POST /generate, POST /tokenize,
POST /detokenize, GET /tokenizer_info, GET /metrics (Prometheus, vLLM's
names), and vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter;
with ServerOptions.enable_rl_routes, the rollout routes of RL frameworks (see
"RL routes" below); any other path is a 404 in OpenAI's error shape.  A request's "model" names
the base model (its served name) or a loaded LoRA adapter, which it then runs
(as vLLM); /v1/models lists both.  Streaming responses are server-sent events, `data: {json}` per chunk
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

Hardening (ServerOptions): the event loop never runs the model's host work
(JSON parsing, chat templating, tokenizing, echo's detokenizing, building a
whole answer's body): that runs in a small thread pool.  Before any of it, a
pure-ASGI guard (RequestGuard) checks the API key, refuses a body larger than
max_request_body_bytes (413, from Content-Length or while reading a chunked
body), Transfer-Encoding together with Content-Length (400), and a body not
read within body_timeout_seconds (408); each prompt's bytes are capped by
max_prompt_bytes (400) before it is tokenized.  `uvicorn_config` adds the
connection limits (concurrency, backlog, header size and header timeout,
keep-alive timeout).  The vLLM tokenizer routes (/tokenize, /detokenize,
/tokenizer_info) serve the same tokenizer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar, Union

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from jpaged.engine.async_engine import AsyncEngine, Delta, EngineClosed, QueueFull, Submission
from jpaged.structured import tools as structured_tools
from jpaged.structured.tool_parser import ToolCallStreamParser
from jpaged.tokenizer.detokenizer import SampleText
from jpaged.entrypoints.openai_protocol import (GenerationRequest, RequestError, chat_choice, chat_chunk_choice,
                                    chat_logprobs, completion_choice, completion_logprobs, envelope,
                                    Messages, error_body, model_not_found, new_id, parse_chat,
                                    parse_completion, parse_generate,
                                    request_error, token_logprob_json, tool_calls_finish_reason, usage)
from jpaged.core.config import lora_slots
from jpaged.core.request_parsing import default_sampling_params
from jpaged.core.sequence import TokenLogprob
from jpaged.entrypoints.server_metrics import CONTENT_TYPE, LoraRequestsInfo, ServerMetrics

if TYPE_CHECKING:  # the engine (and jax) load when the server builds it, not on import
    from jpaged.engine.protocol import Engine

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1         # the hint sent with a 429
ENGINE_JOIN_SECONDS = 60.0      # at shutdown, wait this long for the step in progress
FLUSH_SECONDS = 2.0             # after the grace period: time for cut streams to send their last chunks
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """What the HTTP layer allows (`jpaged serve` flags of the same names).
    A None size is derived from the config (see `resolved`)."""

    api_key: str | None = None              # clients send "Authorization: Bearer <key>"; None: no check
    metrics_require_key: bool = False       # /metrics behind the key too (/health never is)
    max_request_body_bytes: int | None = None  # None: max(16 MiB, 4 * max_prompt_bytes)
    max_prompt_bytes: int | None = None     # per prompt (text, or a chat's contents); None: see resolved
    body_timeout_seconds: float = 30.0      # the whole body must arrive within this (else 408)
    header_timeout_seconds: float = 10.0    # the request line and headers must arrive within this
    timeout_keep_alive: float = 5.0         # an idle keep-alive connection is closed after this
    max_header_bytes: int = 16 * 1024       # request line + headers (h11_max_incomplete_event_size)
    limit_concurrency: int | None = None    # connections + tasks before uvicorn's 503; None: see resolved
    backlog: int = 2048                     # the listening socket's accept queue
    host_threads: int = 4                   # threads for tokenizing / templating / detokenizing
    enable_rl_routes: bool = False          # /pause, /sleep, /update_weights, ...: else they are 404s
    # A request's disable_additional_properties when it does not set one (vLLM's option).
    disable_additional_properties: bool = False

    def resolved(self, config: Any) -> "ServerOptions":
        """These options with every None size derived from the config: prompts of
        64 bytes per token of max_model_len (at least 64 KiB: far more than any
        tokenizer's text per token), bodies of four such prompts (at least 16
        MiB), and room for every queued and running request twice over plus 64."""
        prompt = self.max_prompt_bytes or max(64 * 1024, 64 * config.max_model_len)
        body = self.max_request_body_bytes or max(16 * 2**20, 4 * prompt)
        running = config.max_num_seqs * config.data_parallel_size
        concurrency = self.limit_concurrency or 2 * (config.max_queued_requests + running) + 64
        return dataclasses.replace(self, max_prompt_bytes=prompt, max_request_body_bytes=body,
                                   limit_concurrency=concurrency)


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


# ------------------------------------------------------------------ state
class ServerState:
    """The engine (once loaded), its status and the metrics registry of one app."""

    def __init__(self, source: Any, config: Any, model_name: str, options: ServerOptions | None = None):
        self.source = source  # an Engine, or a callable that builds one
        self.config = config
        self.model_name = model_name
        self.options = (options or ServerOptions()).resolved(config)
        # The model's host work (tokenizing, chat templates, detokenizing big inputs) runs here, never
        # on the event loop.  (A tokenizer that holds the GIL still delays the loop: max_prompt_bytes
        # bounds how long.)
        self.host_pool = concurrent.futures.ThreadPoolExecutor(self.options.host_threads,
                                                               thread_name_prefix="jpaged-host")
        self.runs: set["GenerationRun"] = set()  # in flight: the drain ends them at its deadline
        self.defaults = default_sampling_params(config)
        self.metrics = ServerMetrics(model_name, config.block_size,
                                     enable_prefix_caching=config.enable_prefix_caching,
                                     num_replicas=config.data_parallel_size)
        self.llm: Any = None
        self.engine: AsyncEngine | None = None
        self.status = "loading"  # loading | ready | failed: <why> | shutting down
        self.load_error: str | None = None
        self.created = int(time.time())
        # The loaded LoRA adapters (name -> path), as the engine thread last reported
        # them: replaced whole, never changed in place (host threads read it).
        self.adapters: dict[str, str] = {}
        # Set (on the event loop) before a /sleep reaches the engine thread, cleared there once
        # awake: a generation request submitted after it would meet a sleeping engine (a 503).
        self.asleep = False
        if lora_slots(config):
            self.metrics.registry.register(LoraRequestsInfo(lambda: self.runs, lora_slots(config)))
        self._token_texts: dict[int, str] = {}

    def load(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Builds (if given a factory) and starts the engine; /health turns 200."""
        try:
            llm = self.source() if _is_factory(self.source) else self.source
            engine = AsyncEngine(llm, max_queued_requests=self.config.max_queued_requests,
                                 metrics=self.metrics)
            self.llm = llm
            self.adapters = lora_adapters(llm)
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
        """Requests the engine has not finished, or whose answer is still being sent."""
        return max(self.engine.num_unfinished if self.engine is not None else 0, len(self.runs))

    def cut_runs(self) -> int:
        """Aborts every request in flight: each choice left ends with finish_reason
        "abort" (streams send that chunk and [DONE]).  Returns how many were cut."""
        runs = list(self.runs)
        for run in runs:
            run.engine.abort(run.submission.requests)
        return len(runs)

    def close(self) -> None:
        self.drain()
        if self.engine is not None:
            self.engine.close(ENGINE_JOIN_SECONDS)
        self.host_pool.shutdown(wait=False, cancel_futures=True)

    async def run_host(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in the host thread pool: the event loop goes on meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.host_pool, functools.partial(fn, *args))

    def ready_engine(self) -> AsyncEngine:
        if self.status != "ready" or self.engine is None:
            raise RequestError(f"the server is not ready ({self.status})", status=503,
                               kind="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        return self.engine

    def serves(self, model: str) -> bool:
        """Whether `model` names the base model or a loaded LoRA adapter."""
        return model == self.model_name or model in self.adapters

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


def lora_adapters(llm: Any) -> dict[str, str]:
    """The engine's loaded LoRA adapters, name -> path (a copy: read off the engine thread)."""
    return dict(llm.lora_adapters)


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
        self._runs = state.runs
        self._runs.add(self)

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
            self._runs.discard(self)
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

    def chunks(self, update: ChoiceUpdate) -> list[dict[str, Any]]:
        """The SSE chunks of one choice's update (one, unless tool calls split it)."""
        return [self.chunk(update)]

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
        if self.run.gen.params.logprobs == 0:  # as vLLM: the token's own entry, no alternatives
            entries = [lp if lp is None or lp.top else dataclasses.replace(lp, top=((lp.token_id, lp.logprob),))
                       for lp in entries]
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

    def __init__(self, run: GenerationRun, state: ServerState, prompt_texts: list[str]):
        super().__init__(run, state, prompt_texts)
        # Streaming with tools: each choice's text goes through a tool-call parser; the
        # logprobs of tokens it holds back wait for the choice's next chunk.
        tools = run.gen.declared_tools
        self._tool_parsers = [ToolCallStreamParser(tools) for _ in run.samples] if tools is not None else None
        self._held_logprobs: list[list[TokenLogprob]] = [[] for _ in run.samples]

    def body(self) -> dict[str, Any]:
        run = self.run
        choices = [chat_choice(c, s.text, run.finish_reasons[c], self._logprobs(run.logprobs[c]),
                               run.gen.declared_tools)
                   for c, s in enumerate(run.samples)]
        return envelope(self.id, "chat.completion", run.gen.model, choices, run.usage())

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return envelope(self.id, "chat.completion.chunk", self.run.gen.model, choices, None,
                        with_usage=self.run.gen.include_usage)

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk([chat_chunk_choice(c, {"role": "assistant", "content": ""}, None)])
                for c in range(len(self.run.samples))]

    def chunks(self, update: ChoiceUpdate) -> list[dict[str, Any]]:
        if self._tool_parsers is None:
            delta = {"content": update.text} if update.text else {}
            return [self._chunk([chat_chunk_choice(update.index, delta, update.finish_reason,
                                                   self._logprobs(update.logprobs))])]
        parser = self._tool_parsers[update.index]
        deltas = parser.feed(update.text) + (parser.finish() if update.finish_reason else [])
        reason = tool_calls_finish_reason(update.finish_reason, parser.calls)
        held = self._held_logprobs[update.index]
        held += update.logprobs
        if reason is None and not deltas:  # nothing to show yet: no empty chunk per token
            return []
        if reason is not None:  # the finish in a chunk of its own
            deltas.append({})
        logprobs, held[:] = self._logprobs(list(held)), []
        return [self._chunk([chat_chunk_choice(update.index, delta, reason if i == len(deltas) - 1 else None,
                                               logprobs if i == 0 else None)])
                for i, delta in enumerate(deltas)]

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
    """A whole (non-streamed) answer; aborted if the client leaves first.  Its
    body (logprobs of a long echoed prompt: many token strings) is built and
    encoded in the host pool."""
    run = answer.run
    try:
        await run.run_to_end()
    except ClientGone:
        return Response(status_code=499)  # nobody reads it: the connection is closed
    if run.error is not None:
        return JSONResponse(error_body(run.error, "internal_server_error"), status_code=500)
    return Response(await answer.state.run_host(lambda: _json_bytes(answer.body())), media_type="application/json")


def _json_bytes(obj: Any) -> bytes:
    """As JSONResponse encodes."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


async def _stream(answer: Answer) -> AsyncIterator[str]:
    """The SSE body: chunks as text is released, the usage chunk if asked, [DONE]."""
    run = answer.run
    try:
        for chunk in answer.first_chunks():
            yield _sse(chunk)
        async for updates in run.updates():
            for update in updates:
                for chunk in answer.chunks(update):
                    yield _sse(chunk)
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
def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None


def _utf8_len(text: str, cap: int) -> int:
    """len(text in UTF-8), or a number above `cap` without encoding a text that
    has more characters than `cap` (a character is at least one byte)."""
    return len(text) if len(text) > cap else len(text.encode("utf-8", "surrogatepass"))


def _check_prompt_bytes(state: ServerState, prompt: Any, param: str) -> None:
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


def _tokenized(state: ServerState, prompt: Any, gen: GenerationRequest,
               explicit_max_tokens: str | None) -> tuple[list[int], str]:
    """(token ids, prompt text for echo), or a 400 naming what the engine would
    refuse, or a prompt plus an explicit max_tokens (named `explicit_max_tokens`)
    beyond max_model_len.  Runs in the host pool."""
    param = "messages" if isinstance(prompt, dict) else "prompt"
    _check_prompt_bytes(state, prompt, param)
    try:
        ids = state.llm.tokenize(prompt)
    except ValueError as e:
        raise RequestError(str(e), param) from None
    problem = state.llm.check_request(ids, gen.params)
    if problem:
        if (gen.params.structured is not None and gen.constraint_field is not None
                and state.llm.check_request(ids, dataclasses.replace(gen.params, structured=None)) is None):
            # The constraint's own problem (a bad schema or regex, one no output satisfies): its field's.
            raise RequestError(f"{gen.constraint_field}: {problem}", gen.constraint_field)
        raise RequestError(problem, "n" if problem.startswith("n=") else param)
    limit, asked = state.config.max_model_len, gen.params.max_tokens
    if explicit_max_tokens is not None and len(ids) + asked > limit:
        where = "messages" if param == "messages" else "prompt"
        raise RequestError(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{len(ids) + asked} tokens ({len(ids)} in the {where}, {asked} in the completion). "
                           f"Please reduce the length of the {where} or the completion.", explicit_max_tokens,
                           code="context_length_exceeded")
    if isinstance(prompt, list) and state.llm.tokenizer is not None:
        # Token ids: their text with special tokens, as the echoed logprobs' tokens show them.
        return ids, state.llm.tokenizer.decode(ids, skip_special_tokens=False)
    return ids, prompt if isinstance(prompt, str) else state.decode(ids)


def _explicit_max_tokens(raw: Any, chat: bool) -> str | None:
    """The body's field that set max_tokens, or None (then the config's default
    applies, cut at max_model_len as the generation goes)."""
    if not isinstance(raw, dict):
        return None
    if chat and raw.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens" if raw.get("max_tokens") is not None else None


def _prepare(state: ServerState, parse: Callable[..., GenerationRequest],
             body: bytes) -> tuple[GenerationRequest, list[tuple[list[int], str]]]:
    """A body checked and its prompts tokenized (in the host pool, off the event loop)."""
    gen, explicit = _parsed(state, parse, body)
    return gen, _tokenized_prompts(state, gen, explicit)


def _parsed(state: ServerState, parse: Callable[..., GenerationRequest],
            body: bytes) -> tuple[GenerationRequest, str | None]:
    """A body checked: (the request, the field that set max_tokens or None)."""
    raw = _parse_json(body)
    if state.options.disable_additional_properties and isinstance(raw, dict) \
            and raw.get("disable_additional_properties") is None:
        raw["disable_additional_properties"] = True  # the server's default (a request's own false wins)
    gen = parse(raw, state.defaults, state.model_name, tuple(state.adapters))
    bound = state.config.max_queued_requests
    if len(gen.prompts) > bound:  # a 429 would invite retrying a request that can never be queued
        raise RequestError(f"this request has {len(gen.prompts)} prompts; the server queues at most {bound} "
                           "requests (max_queued_requests), so it can never take them all at once: send at "
                           f"most {bound} prompts per request", "prompt", code="too_many_prompts")
    return gen, _explicit_max_tokens(raw, parse is parse_chat)


def _tokenized_prompts(state: ServerState, gen: GenerationRequest,
                       explicit: str | None) -> list[tuple[list[int], str]]:
    return [_tokenized(state, p, gen, explicit) for p in gen.prompts]


async def _constraint_compiled(state: ServerState, gen: GenerationRequest) -> None:
    """The request's constraint compiled, or refused (a 400 naming its field), on the
    grammar compiler's own bounded threads: a slow compile holds no host-pool thread."""
    grammars = state.llm.grammars
    if gen.params.structured is None or grammars is None:
        return
    problem = await asyncio.wrap_future(grammars.check_async(gen.params.structured))
    if problem:
        field = gen.constraint_field
        raise RequestError(f"{field}: {problem}" if field else problem, field)


def _error_response(e: RequestError) -> JSONResponse:
    status = 404 if e.code == "model_not_found" else e.status  # as OpenAI and vLLM
    return JSONResponse(e.body(), status_code=status, headers=e.headers)


async def _handle(request: Request, state: ServerState, parse: Callable[..., GenerationRequest],
                  answer_type: type[Answer]) -> Response:
    try:
        engine = state.ready_engine()
        gen, explicit = await state.run_host(_parsed, state, parse, await request.body())
        await _constraint_compiled(state, gen)
        prompts = await state.run_host(_tokenized_prompts, state, gen, explicit)
        if state.asleep or getattr(state.llm, "is_sleeping", False):  # (no await from here to submit)
            raise RequestError("the engine is asleep: POST /wake_up first", status=503,
                               kind="service_unavailable")
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


# ------------------------------------------------------- tokenizer routes
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


def _json_body(body: bytes, kind: type[BaseModel], extra: dict[str, Any] | None = None) -> Any:
    """A JSON object body validated as `kind` (fields of `extra` under it), or a 400."""
    raw = _parse_json(body) if body.strip() or extra is None else {}
    if not isinstance(raw, dict):
        raise RequestError("the body must be a JSON object")
    try:
        return kind.model_validate({**(extra or {}), **raw})
    except ValidationError as e:
        raise request_error(e) from None


def _tokenizer_request(state: ServerState, body: bytes, kind: type[BaseModel]) -> Any:
    req = _json_body(body, kind)
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
        _check_prompt_bytes(state, req.prompt, "prompt")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tokenizer.encode(req.prompt, add_special_tokens=special)
    else:
        messages = [m.as_dict() for m in req.messages]
        _check_prompt_bytes(state, {"messages": messages, "tools": req.tools}, "messages")
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
        return _error_response(e)


# ------------------------------------------------------------ the guard
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
    data = _json_bytes(body)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


# -------------------------------------------------------------------- app
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
            return _error_response(RequestError(model_not_found(model_id), "model", code="model_not_found"))
        return JSONResponse(model_card(model_id))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(request, state, parse_completion, CompletionAnswer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle(request, state, parse_chat, ChatAnswer)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await _handle(request, state, parse_generate, GenerateAnswer)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _host_route(request, state, _tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _host_route(request, state, _detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        return await _host_route(request, state, lambda state, body: _tokenizer_info(state))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    # (imported here: those modules use this one's state and helpers)
    from jpaged.entrypoints.lora_routes import add_lora_routes
    from jpaged.entrypoints.rl_routes import add_rl_routes
    add_lora_routes(app, state)
    if state.options.enable_rl_routes:
        add_rl_routes(app, state)
    return app


# ------------------------------------------------------------------ server
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

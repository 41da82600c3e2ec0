"""The generation routes' work (/v1/completions, /v1/chat/completions,
/generate): a body parsed and checked, its prompts tokenized, submitted to the
engine, and the engine's per-step deltas (each choice's new text and logprobs)
gathered into choices, answered whole or streamed as server-sent events (`data: {json}` per
chunk, `data: [DONE]` at the end).  How each route shapes its answer (an
Answer): jpaged.entrypoints.openai.answers.

The engine runs in one background thread (jpaged.engine.async_engine); the
model's host work (JSON parsing, chat templating, tokenizing, building a whole
answer's body) runs in the state's host thread pool, never on the event loop.
The text is the engine's (its output processor detokenizes, holds back the
start of a stop string and ends a sample in the step its text hits one), so a
streamed answer's text equals the library's by construction.
A client that goes away, mid-stream or while waiting for a whole answer, has
its requests aborted; a request that fails inside the engine fails alone.
Logprobs travel with the text: each streamed chunk carries those of the tokens
consumed since the previous one.  Captured routes (capture_routes, a MoE model)
come whole, in each choice's last chunk: see GenerationRun._with_routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any, AsyncIterator, Callable

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jpaged.core.sequence import TokenLogprob
from jpaged.engine.async_engine import AsyncEngine, Submission, Update
from jpaged.entrypoints.openai.errors import RequestError, error_body, parse_json
from jpaged.entrypoints.openai.guard import (REFUSALS, ClientGone, check_prompt_bytes, json_bytes, refused,
                                             wait_for_disconnect)
from jpaged.entrypoints.openai.protocol import GenerationRequest, parse_chat
from jpaged.entrypoints.openai.responses import new_id, usage
from jpaged.entrypoints.openai.state import ServerState

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ChoiceText:
    """One choice's text so far, and the tokens it took."""
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass
class ChoiceUpdate:
    index: int                  # choice index: prompt index * n + sample index
    text: str                   # new text ("" with a finish)
    finish_reason: str | None   # set once, on the choice's last update
    # The logprobs of the tokens consumed since the choice's last update (when asked for).
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    # capture_routes: the choice's routed experts [num_tokens - 1, L_moe, k], on its last update.
    routes: np.ndarray | None = None


class GenerationRun:
    """One HTTP request in flight: its engine requests' deltas in, its choices'
    text (and logprobs) out.  Ends (and aborts what is left in the engine) when
    every choice has finished, a request failed, or the client went away."""

    def __init__(self, state: ServerState, engine: AsyncEngine, submission: Submission,
                 gen: GenerationRequest, request: Request):
        self.engine, self.submission, self.gen = engine, submission, gen
        self.n = gen.params.n
        self.samples = [ChoiceText() for _ in range(len(submission.requests) * self.n)]
        self.finish_reasons: list[str | None] = [None] * len(self.samples)
        # Per choice, of the tokens its text consumed (SamplingParams.logprobs); per prompt, its own.
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in self.samples]
        self.prompt_logprobs: list[list[TokenLogprob | None] | None] = [None] * len(submission.requests)
        self._logprobs_sent = [0] * len(self.samples)
        # capture_routes: each choice's routed experts (its request's output's), and the
        # last updates that wait for them (_with_routes).
        self.routes: list[np.ndarray | None] = [None] * len(self.samples)
        self._waiting: list[ChoiceUpdate] = []
        self.error: str | None = None
        self._disconnect = asyncio.ensure_future(wait_for_disconnect(request))
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

    async def _next_delta(self) -> Update:
        get = asyncio.ensure_future(self.submission.queue.get())
        await asyncio.wait({get, self._disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            raise ClientGone()
        return get.result()

    def _apply(self, update: Update) -> list[ChoiceUpdate]:
        index, delta = update
        if any(s.finish_reason == "error" for s in delta.samples):
            self.error = delta.error or "internal error"
            return []
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[index] = delta.prompt_logprobs
        if delta.output is not None and self.gen.params.capture_routes:
            for j, sample in enumerate(delta.output.samples):
                self.routes[index * self.n + j] = sample.get("routed_experts")
        updates = []
        for j, sample in enumerate(delta.samples):
            c = index * self.n + j
            if self.finish_reasons[c] is not None:
                continue  # finished (the engine ends a sample in the step its text hits a stop string)
            choice = self._advance_sample(c, sample.token_ids, sample.text, sample.logprobs, sample.finish_reason)
            if choice is not None:
                updates.append(choice)
        return self._with_routes(updates)

    def _with_routes(self, updates: list[ChoiceUpdate]) -> list[ChoiceUpdate]:
        """Capturing routes, each choice's last update carries them whole: an RL rollout
        replays the routes of its whole sequence (prompt included) in the trainer, so
        routes per chunk would only have to be joined again, and the prompt's match no
        chunk's text.  They come with the request's output, once all its n samples
        have ended: a sample that ends before its siblings has its last update wait."""
        if not self.gen.params.capture_routes:
            return updates
        pending, self._waiting = self._waiting + updates, []
        all_ended = None not in self.finish_reasons  # (an output without routes: release all)
        ready = []
        for u in pending:
            if u.finish_reason is None or all_ended or self.routes[u.index] is not None:
                ready.append(dataclasses.replace(u, routes=self.routes[u.index]) if u.finish_reason else u)
            else:
                self._waiting.append(u)
        return ready

    def _advance_sample(self, c: int, token_ids: list[int], text: str, logprobs: list[TokenLogprob],
                        reason: str | None) -> ChoiceUpdate | None:
        """The choice's update for these new tokens, or None while it has no new
        text and goes on (its tokens' logprobs then wait for the next update)."""
        sample = self.samples[c]
        sample.text += text
        sample.token_ids += token_ids
        self.logprobs[c] += logprobs
        self.finish_reasons[c] = reason
        if not text and reason is None:
            return None
        new_logprobs = self.logprobs[c][self._logprobs_sent[c]:]
        self._logprobs_sent[c] = len(self.logprobs[c])
        return ChoiceUpdate(c, text, reason, new_logprobs)


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
    return Response(await answer.state.run_host(lambda: json_bytes(answer.body())), media_type="application/json")


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


def _tokenized(state: ServerState, prompt: Any, gen: GenerationRequest,
               explicit_max_tokens: str | None) -> tuple[list[int], str]:
    """(token ids, prompt text for echo), or a 400 naming what the engine would
    refuse, or a prompt plus an explicit max_tokens (named `explicit_max_tokens`)
    beyond max_model_len.  Runs in the host pool."""
    param = "messages" if isinstance(prompt, dict) else "prompt"
    check_prompt_bytes(state, prompt, param)
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
        raise RequestError(problem, _problem_field(problem, param))
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


def _problem_field(problem: str, param: str) -> str:
    """The body field a check_request problem is about: `param` (the prompt's) unless it names another."""
    if problem.startswith("n="):
        return "n"
    return "capture_routes" if problem.startswith("capture_routes") else param


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
    raw = parse_json(body)
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


async def handle_generation(request: Request, state: ServerState, parse: Callable[..., GenerationRequest],
                            answer_type: type[Answer]) -> Response:
    """A generation route: the body parsed, its constraint compiled and its prompts
    tokenized off the event loop, submitted to the engine, answered whole or streamed."""
    try:
        engine = state.ready_engine()
        gen, explicit = await state.run_host(_parsed, state, parse, await request.body())
        await _constraint_compiled(state, gen)
        prompts = await state.run_host(_tokenized_prompts, state, gen, explicit)
        if state.asleep or state.llm.is_sleeping:  # (no await from here to submit)
            raise RequestError("the engine is asleep: POST /wake_up first", status=503,
                               kind="service_unavailable")
        submission = engine.submit([(ids, gen.params, text if isinstance(p, str) else None)
                                    for p, (ids, text) in zip(gen.prompts, prompts)])
    except REFUSALS as e:
        return refused(e)
    answer = answer_type(GenerationRun(state, engine, submission, gen, request), state, [t for _, t in prompts])
    if gen.stream:
        return StreamingResponse(_stream(answer), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _respond(answer)

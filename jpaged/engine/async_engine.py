"""The engine beside an asyncio server.

`LLM.step()` is synchronous and not thread-safe, so one background thread owns
the engine.  The server's coroutines never touch it: they put requests and
aborts into a thread-safe inbox, which the thread drains at the top of each
step, and read per-step deltas (the tokens, text and logprobs each sample
appended, and how it finished: the engine's own `RequestDelta`s, its requests
being submitted with output_kind "delta") from an asyncio queue per HTTP
request, fed with `loop.call_soon_threadsafe`.  When nothing is queued or running the thread
blocks on the inbox's condition variable: an idle server uses no CPU.  Other
calls that change the engine (loading a LoRA adapter) go through the same
inbox (`AsyncEngine.call`): they run on the thread, between two steps and in
order with the requests submitted before them.

The engine is any `jpaged.engine.protocol.Engine` (one LLM, or a data-parallel
router): this uses only that interface.  Host code: the engine object comes in
from outside; this module imports no jax.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterable, TypeVar

from jpaged.core.sequence import SamplingParams
from jpaged.core.stats import EngineSnapshot
from jpaged.engine.protocol import Engine
from jpaged.engine.request_output import RequestDelta, SampleDelta

log = logging.getLogger(__name__)

T = TypeVar("T")


class QueueFull(Exception):
    """More requests wait than max_queued_requests allows."""


class EngineClosed(Exception):
    """The engine is shutting down: no new requests."""


# What a Submission's queue carries: (the request's position in its Submission, the
# engine's delta for it).  The engine's RequestDelta as it is: tokens, text and
# logprobs per sample, each sample's finish reason once it has ended.
Update = tuple[int, RequestDelta]


def ended(delta: RequestDelta) -> bool:
    """Every sample has ended: the request's last update."""
    return all(s.finish_reason is not None for s in delta.samples)


def ended_delta(request_id: int, n: int, reason: str, error: str | None) -> RequestDelta:
    """The last update of a request the engine did not run to its end itself (one it
    could not take, or one an engine-loop error ended)."""
    return RequestDelta(request_id, [SampleDelta([], "", [], reason) for _ in range(n)], started=False, error=error)


class EngineRequest:
    """One prompt submitted to the engine (with all its samples)."""

    def __init__(self, submission: "Submission", index: int, prompt_token_ids: list[int],
                 params: SamplingParams, prompt: str | None):
        self.submission = submission
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.prompt = prompt
        self.arrival_time = time.perf_counter()
        # Owned by the engine thread from here on.
        self.engine_id: int | None = None
        self.last_token_time: list[float | None] = []  # per sample
        self.first_token_time: float | None = None    # the engine's, of its first token
        self.queued = True     # counts against max_queued_requests until a sample starts
        self.finished = False


class Submission:
    """The engine requests of one HTTP request, sharing one asyncio queue of deltas."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.requests: list[EngineRequest] = []



def deliver_all(outbox: list[tuple[Submission, Update]]) -> None:
    """From the engine thread: a step's deltas to the coroutines waiting on their
    queues, with one wake-up per event loop (not one per request: each wake-up
    is a write to the loop's self-pipe and a turn of the loop)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Update], Update]]] = {}
    for submission, update in outbox:
        by_loop.setdefault(submission.loop, []).append((submission.queue, update))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass


def _put_all(batch: list[tuple[asyncio.Queue[Update], Update]]) -> None:
    for queue, update in batch:
        queue.put_nowait(update)


class EngineCall:
    """A function to run on the engine thread (AsyncEngine.call), and the future
    its caller awaits."""

    def __init__(self, fn: Callable[[Engine], Any], loop: asyncio.AbstractEventLoop):
        self.fn, self.loop = fn, loop
        self.future: asyncio.Future[Any] = loop.create_future()

    def run(self, llm: Engine) -> None:
        """From the engine thread: fn(llm), its result or exception to the caller."""
        try:
            result, error = self.fn(llm), None
        except Exception as e:  # noqa: BLE001 - the caller's to handle, never the loop's
            result, error = None, e
        try:
            self.loop.call_soon_threadsafe(self._settle, result, error)
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass

    def _settle(self, result: Any, error: BaseException | None) -> None:
        if self.future.done():  # the caller went away (cancelled)
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


class EngineMetrics:
    """What the engine thread reports as it goes (jpaged.entrypoints.openai.metrics implements it)."""

    def on_admitted(self, request: EngineRequest) -> None: ...
    def on_tokens(self, request: EngineRequest, num_tokens: int, gap: float | None, first: bool) -> None: ...
    def on_finished(self, request: EngineRequest, reasons: list[str | None], now: float) -> None: ...
    def on_snapshot(self, snapshot: EngineSnapshot) -> None: ...


class AsyncEngine:
    """Runs an engine in one background thread for asyncio callers."""

    def __init__(self, llm: Engine, *, max_queued_requests: int, metrics: EngineMetrics | None = None):
        self.llm = llm
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics or EngineMetrics()
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []  # (add | abort, EngineRequest) or (call, EngineCall)
        self._num_queued = 0      # requests not started yet (guarded by _cond)
        self._num_unfinished = 0  # requests submitted and not finished (guarded by _cond)
        self._closing = False
        self._tracked: dict[int, EngineRequest] = {}  # engine thread only: by engine request id
        self._outbox: list[tuple[Submission, Update]] = []  # engine thread only: deltas not yet handed over
        self._thread = threading.Thread(target=self._run, name="jpaged-engine", daemon=True)

    # ------------------------------------------------------------ event-loop side
    def start(self) -> None:
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_queued(self) -> int:
        return self._num_queued

    @property
    def num_unfinished(self) -> int:
        """Requests submitted whose last delta has not been delivered yet (a
        draining server waits for 0)."""
        return self._num_unfinished

    def submit(self, prompts: list[tuple[list[int], SamplingParams, str | None]]) -> Submission:
        """Queues every prompt of one HTTP request, or none of them: QueueFull when
        they do not all fit under max_queued_requests, EngineClosed after close()."""
        submission = Submission(asyncio.get_running_loop())
        submission.requests = [EngineRequest(submission, i, ids, params, text)
                               for i, (ids, params, text) in enumerate(prompts)]
        with self._cond:
            if self._closing:
                raise EngineClosed("the server is shutting down")
            if self._num_queued + len(prompts) > self.max_queued_requests:
                raise QueueFull(f"{self._num_queued} requests are queued; the bound is "
                                f"{self.max_queued_requests} (max_queued_requests)")
            self._num_queued += len(prompts)
            self._num_unfinished += len(prompts)
            self._inbox.extend(("add", r) for r in submission.requests)
            self._cond.notify()
        return submission

    def abort(self, requests: Iterable[EngineRequest]) -> None:
        """Ends these requests (those not finished yet) and frees their blocks."""
        work = [("abort", r) for r in requests if not r.finished]
        with self._cond:
            self._inbox.extend(work)
            self._cond.notify()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """fn(engine) on the engine thread, between two steps (the engine is not
        thread-safe: whatever changes it must run there), after the requests
        submitted before it; returns its result or raises its exception.
        EngineClosed after close()."""
        work = EngineCall(fn, asyncio.get_running_loop())
        with self._cond:
            if self._closing:
                raise EngineClosed("the server is shutting down")
            self._inbox.append(("call", work))
            self._cond.notify()
        return await work.future

    def close(self, timeout: float | None = None) -> None:
        """Stops taking requests, aborts what is left and joins the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------- engine thread
    def _run(self) -> None:
        self.metrics.on_snapshot(self._snapshot())  # the pool's size before any request
        while True:
            work, closing = self._wait_for_work()
            try:
                self._apply(work)
                if closing:
                    self._abort_all()
                    return
                if self.llm.has_unfinished_requests():
                    self._step()
                self._publish()
            except Exception as e:  # noqa: BLE001 - the loop must outlive any request
                log.exception("engine loop error")
                self._fail_all(f"internal error: {type(e).__name__}: {e}")
            finally:
                self._flush()

    def _wait_for_work(self) -> tuple[list[tuple[str, Any]], bool]:
        """Blocks while there is nothing to do; then takes the whole inbox."""
        with self._cond:
            while not self._inbox and not self._closing and not self.llm.has_unfinished_requests():
                self._cond.wait()
            work, self._inbox = self._inbox, []
            return work, self._closing

    def _apply(self, work: list[tuple[str, Any]]) -> None:
        for kind, request in work:  # in arrival order: an abort follows its add
            if kind == "add":
                self._add(request)
            elif kind == "call":
                # A step left in flight after the last request ended would make the
                # engine look busy to a call that needs it idle (/reset_prefix_cache).
                self.llm.drain()
                request.run(self.llm)
            elif request.engine_id in self._tracked:  # else finished already
                self.llm.abort([request.engine_id])

    def _add(self, request: EngineRequest) -> None:
        params = dataclasses.replace(request.params, output_kind="delta")
        try:
            rid = self.llm.add_request(request.prompt_token_ids, params, prompt=request.prompt)
        except Exception as e:  # noqa: BLE001 - a request the engine cannot take fails alone
            log.exception("add_request failed")
            self._finish_unstarted(request, "error", f"internal error: {type(e).__name__}: {e}")
            return
        request.engine_id = rid
        request.last_token_time = [None] * params.n
        self._tracked[rid] = request
        self.metrics.on_admitted(request)

    def _step(self) -> None:
        """One engine step; its deltas go to their requests."""
        try:
            deltas = self.llm.step()
        except Exception as e:  # noqa: BLE001 - e.g. EngineStalled: the engine failed the requests
            log.error("engine step failed: %s: %s", type(e).__name__, e)
            return
        now = time.perf_counter()
        for engine_delta in deltas:
            request = self._tracked.get(engine_delta.request_id)
            if request is not None:
                self._deliver(request, engine_delta, now)

    def _deliver(self, request: EngineRequest, engine_delta: RequestDelta, now: float) -> None:
        """Hands one engine delta to its HTTP request (and the metrics)."""
        samples = engine_delta.samples
        request.first_token_time = engine_delta.first_token_time
        for i, sample in enumerate(samples):
            if sample.token_ids:
                last = request.last_token_time[i]
                self.metrics.on_tokens(request, len(sample.token_ids), None if last is None else now - last,
                                       first=last is None and i == 0)
                request.last_token_time[i] = now
        if engine_delta.started:
            self._dequeue(request)
        if ended(engine_delta):
            del self._tracked[request.engine_id]
            self._mark_finished(request, engine_delta, now)
        elif any(s.token_ids or s.text for s in samples):
            self._outbox.append((request.submission, (request.index, engine_delta)))

    def _publish(self) -> None:
        """The engine's gauges, after each step, to the metrics."""
        self.metrics.on_snapshot(self._snapshot())

    def _dequeue(self, request: EngineRequest) -> None:
        if request.queued:
            request.queued = False
            with self._cond:
                self._num_queued -= 1

    def _mark_finished(self, request: EngineRequest, delta: RequestDelta, now: float) -> None:
        self._dequeue(request)
        request.finished = True
        with self._cond:
            self._num_unfinished -= 1
        self.metrics.on_finished(request, [s.finish_reason for s in delta.samples], now)
        self._outbox.append((request.submission, (request.index, delta)))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        deliver_all(outbox)

    def _finish_unstarted(self, request: EngineRequest, reason: str, error: str | None) -> None:
        # request_id -1: the engine never took it (it has no id there)
        self._mark_finished(request, ended_delta(-1, request.params.n, reason, error), time.perf_counter())

    def _abort_all(self) -> None:
        """At close: every request still tracked finishes with "abort"."""
        self.llm.abort(list(self._tracked))
        while self.llm.has_unfinished_requests():  # a step still on the device brings their last tokens
            self._step()
        self._publish()

    def _fail_all(self, error: str) -> None:
        """After an error outside any one request: end every request, keep serving."""
        try:
            self.llm.abort(list(self._tracked))
        except Exception:  # noqa: BLE001
            log.exception("abort after an engine loop error failed")
        now = time.perf_counter()
        for rid, request in list(self._tracked.items()):
            del self._tracked[rid]
            self._mark_finished(request, ended_delta(rid, len(request.last_token_time), "error", error), now)

    def _snapshot(self) -> EngineSnapshot:
        """The engine's snapshot, with the requests still in the inbox as waiting."""
        snap = self.llm.snapshot()
        with self._cond:
            snap.waiting += sum(kind == "add" for kind, _ in self._inbox)
        return snap

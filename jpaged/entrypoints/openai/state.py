"""What one app serves, shared by its routes: ServerOptions (what the HTTP layer
allows) and ServerState (the engine once loaded, its status, the host thread
pool, the metrics registry, and the loaded LoRA adapters as the engine thread
last reported them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from jpaged.core.config import lora_slots
from jpaged.core.sequence import default_sampling_params
from jpaged.engine.async_engine import AsyncEngine, Submission
from jpaged.entrypoints.openai.errors import RequestError
from jpaged.entrypoints.openai.metrics import LoraRequestsInfo, ServerMetrics

if TYPE_CHECKING:  # the engine (and jax) load when the server builds it, not on import
    from jpaged.engine.protocol import Engine

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1         # the hint sent with a 429 (or a 503 while loading)
ENGINE_JOIN_SECONDS = 60.0      # at shutdown, wait this long for the step in progress

T = TypeVar("T")


class Run(Protocol):
    """A request in flight (jpaged.entrypoints.openai.serving.GenerationRun): what
    the drain and the LoRA metrics read of it."""

    engine: AsyncEngine
    submission: Submission
    gen: Any  # the GenerationRequest (gen.params.lora)


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


class ServerState:
    """The engine (once loaded), its status and the metrics registry of one app."""

    def __init__(self, source: Engine | Callable[[], Engine], config: Any, model_name: str,
                 options: ServerOptions | None = None):
        self.source = source  # an Engine, or a callable that builds one
        self.config = config
        self.model_name = model_name
        self.options = (options or ServerOptions()).resolved(config)
        # The model's host work (tokenizing, chat templates, detokenizing big inputs) runs here, never
        # on the event loop.  (A tokenizer that holds the GIL still delays the loop: max_prompt_bytes
        # bounds how long.)
        self.host_pool = concurrent.futures.ThreadPoolExecutor(self.options.host_threads,
                                                               thread_name_prefix="jpaged-host")
        self.runs: set[Run] = set()  # in flight: the drain ends them at its deadline
        self.defaults = default_sampling_params(config)
        self.metrics = ServerMetrics(model_name, config.block_size,
                                     enable_prefix_caching=config.enable_prefix_caching,
                                     num_replicas=config.data_parallel_size)
        self.llm: Engine | None = None  # (the routes read only Engine's members off it)
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
    """Whether create_app was handed a callable that builds the engine (an engine has step())."""
    return callable(source) and not hasattr(source, "step")


def lora_adapters(llm: Engine) -> dict[str, str]:
    """The engine's loaded LoRA adapters, name -> path (a copy: read off the engine thread)."""
    return dict(llm.lora_adapters)

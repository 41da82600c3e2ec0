"""What every engine offers: `Engine`, the interface that `LLM` (one replica) and
`DataParallelLLM` (a router over several) both implement, and the batch loop
they share (`generate_iter`, `generate`).

Callers (the HTTP server's AsyncEngine, the batch CLI, the run summary) take
an `Engine` and use nothing else: request ids are the engine's own (a router
hands out global ones), `step()` returns `RequestDelta`s
(jpaged.engine.request_output) whose `request_id` is the id `add_request`
returned, and each request's last delta carries its `RequestOutput` (every
request once, whether it ran to the end, failed, or was aborted: `abort` ends
a request now and the next `step()` returns it with finish_reason "abort"),
and `snapshot()` is the one look at gauges and counters.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol, runtime_checkable

import tqdm

from jpaged.core.sequence import SamplingParams, Sequence
from jpaged.core.stats import EngineSnapshot, EngineStats

if TYPE_CHECKING:  # the engine's modules import jax; this one stays light
    from jpaged.engine.request_output import RequestDelta, RequestOutput
    from jpaged.loading.peft import PeftFiles

Prompts = Iterable[Any]
PerPrompt = SamplingParams | list[SamplingParams] | None


@runtime_checkable
class Engine(Protocol):
    """The engine interface (see the module docstring): everything the entry points
    (jpaged.entrypoints: serve, the server package openai/ and its routes, batch,
    metrics) and the AsyncEngine read off an engine: the server never probes for
    a member (getattr / hasattr), so every verb its routes call is here.
    tests/entrypoints/test_server_data_parallel.py checks that both engines have every
    member and that the entry points read no other."""

    config: Any
    tokenizer: Any
    model_config: Any     # jpaged.core.model_config.ModelConfig
    loaded: Any           # jpaged.loading.weights.LoadedWeights: where the weights came from
    kv_dtype: Any         # the KV pool's dtype (a jnp.dtype)
    attention_impl: str   # the attention kernel that runs
    attention_note: str | None  # why it is not the one the config asked for, or None
    grammars: Any         # jpaged.structured.grammar.GrammarCompiler, or None (no tokenizer)

    # Requests: ids are the engine's; a finished request's id is not reused.
    def default_sampling_params(self) -> SamplingParams: ...
    def prepare_prompt(self, prompt: Any, params: SamplingParams
                       ) -> tuple[list[int] | None, SamplingParams, str | None, str | None]: ...
    def tokenize(self, prompt: Any) -> list[int]: ...
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> str | None: ...
    def add_request(self, prompt_token_ids: list[int] | None, params: SamplingParams,
                    prompt: str | None = None, error: str | None = None) -> int: ...
    def get_sequence(self, request_id: int) -> Sequence | None: ...
    def abort(self, request_ids: Iterable[int]) -> None: ...
    def finish_sample(self, request_id: int, index: int, reason: str = "stop") -> None: ...

    # Steps
    def step(self) -> list[RequestDelta]: ...
    def has_unfinished_requests(self) -> bool: ...
    def precompile(self, max_num_tokens: int | None = None, *, background: bool = False) -> int: ...
    def drain(self) -> None: ...  # completes the step left in flight (asynchronous scheduling)
    def follow(self) -> None: ...  # processes other than 0 of a multi-process run
    def close(self) -> None: ...

    # Between generate() calls (the RL and LoRA routes): the engine is idle when generate() returns.
    # Refusals are ValueError / RuntimeError / OSError with a message for the client.
    def reset_prefix_cache(self) -> None: ...
    # `path`: a PEFT directory, or its PeftFiles read beforehand off the engine thread (the server).
    def load_lora_adapter(self, name: str, path: str | os.PathLike | PeftFiles) -> None: ...
    def unload_lora_adapter(self, name: str) -> None: ...  # UnknownLoraError (a KeyError) for a name not loaded
    def pause(self, mode: str = "keep") -> None: ...
    def resume(self) -> None: ...
    @property
    def is_paused(self) -> bool: ...
    def sleep(self, level: int = 1) -> None: ...
    def wake_up(self) -> None: ...
    @property
    def is_sleeping(self) -> bool: ...
    def update_params(self, params: Any, **kwargs: Any) -> None: ...

    # Batch API (both delegate to this module's functions)
    def generate(self, prompts: Prompts, sampling_params: PerPrompt = None, *,
                 use_tqdm: bool = False) -> list[RequestOutput]: ...
    def generate_iter(self, prompts: Prompts, sampling_params: PerPrompt = None, *, use_tqdm: bool = False,
                      stop: threading.Event | None = None) -> Iterator[RequestOutput]: ...

    # Reporting
    def begin_generate(self) -> None: ...
    def snapshot(self) -> EngineSnapshot: ...
    @property
    def stats(self) -> EngineStats: ...
    @property
    def totals(self) -> EngineStats: ...
    @property
    def lora_adapters(self) -> dict[str, str]: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def kv_pool_bytes(self) -> int: ...
    @property
    def num_compilations(self) -> int: ...
    @property
    def compile_seconds(self) -> float: ...
    @property
    def program_build(self) -> dict[str, float]: ...
    @property
    def token_buckets(self) -> tuple[int, ...]: ...
    def memory_per_device(self) -> dict[str, tuple[int, int]]: ...
    def replica_summary(self) -> list[dict[str, Any]]: ...


def sampling_per_prompt(prompts: list, sampling_params: PerPrompt, default: SamplingParams) -> list[SamplingParams]:
    """generate()'s sampling argument as one SamplingParams per prompt."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or default] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError("one SamplingParams per prompt, or a single one for all")
    return list(sampling_params)


def generate(engine: Engine, prompts: Prompts, sampling_params: PerPrompt = None, *,
             use_tqdm: bool = False) -> list[RequestOutput]:
    """Runs every prompt to completion; outputs come back in prompt order."""
    outputs = list(generate_iter(engine, prompts, sampling_params, use_tqdm=use_tqdm))
    return sorted(outputs, key=lambda o: o.index)


def generate_iter(engine: Engine, prompts: Prompts, sampling_params: PerPrompt = None, *,
                  use_tqdm: bool = False, stop: threading.Event | None = None) -> Iterator[RequestOutput]:
    """generate(), yielding each request's output as soon as it (every sample)
    finishes; `output.index` is its position in `prompts`.  Closing the
    iterator early, or setting `stop` (checked before every step, so a
    signal handler may set it), aborts the requests that have not finished."""
    prompts = list(prompts)
    sampling_params = sampling_per_prompt(prompts, sampling_params, engine.default_sampling_params())
    engine.begin_generate()
    index = {engine.add_request(*engine.prepare_prompt(p, sp)): i
             for i, (p, sp) in enumerate(zip(prompts, sampling_params))}
    pending = set(index)
    try:
        with tqdm.tqdm(total=len(index), desc="requests", disable=not use_tqdm) as bar:
            while pending and not (stop is not None and stop.is_set()):
                for delta in engine.step():
                    # (a request added through add_request by someone else is not ours)
                    if delta.finished and delta.request_id in pending:
                        pending.discard(delta.request_id)
                        bar.update(1)
                        yield dataclasses.replace(delta.output, index=index[delta.request_id])
    finally:
        # Closed early, or an exception: nothing stays queued.  The aborted requests
        # are returned by the engine's next step() (any later loop skips them).
        engine.abort(pending)
        # Asynchronous scheduling leaves the step launched after a request's last
        # token on the device (it stopped on EOS or a stop string): completed here,
        # so that the calls made between generate() calls find the engine idle.
        engine.drain()

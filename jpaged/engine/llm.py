"""The offline engine: `LLM(config).generate(prompts)`, like vLLM's LLM class.

`LLM` is the façade over `jpaged.engine.core.EngineCore` (requests, the step
loop, weights, pause, sleep, adapters): what users call to run batches
(generate, generate_iter), prepare prompts, and read the engine's statistics
and memory.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Iterator

import jax

from jpaged.core.block_manager import BlockAllocator
from jpaged.core.config import PREEMPTION_MODES
from jpaged.core.sequence import SamplingParams, Sequence, Status, default_sampling_params
from jpaged.core.stats import EngineSnapshot, EngineStats
from jpaged.engine import protocol
from jpaged.engine.components import swap_capacity
from jpaged.engine.core import EngineCore
from jpaged.engine.output_processor import RequestOutput
from jpaged.runtime.kv_pool import bytes_per_block
from jpaged.layers.sharding import bytes_per_device

__all__ = ["LLM", "RequestOutput"]


class LLM(EngineCore):
    """Loads a model, sizes the KV pool and serves batches of requests."""

    def follow(self) -> None:
        """Processes other than 0 of a multi-process run (jpaged.runtime.distributed): run
        the steps process 0 schedules until it calls close()."""
        if jax.process_index() == 0:
            raise RuntimeError("process 0 schedules; follow() is for the other processes")
        self.runner.follow()

    def close(self) -> None:
        """Process 0 of a multi-process run: releases the processes in follow()."""
        self.runner.stop_followers()

    # ------------------------------------------------------------- the pool
    @property
    def allocator(self) -> BlockAllocator:
        return self.block_manager.allocator

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one pool block (a page of the KV layout's layers)."""
        return bytes_per_block(self.model_config, self.config.block_size, self.kv_dtype,
                               self.kv_layout.layers_per_page)

    def memory_per_device(self) -> dict[str, tuple[int, int]]:
        """(weight bytes, KV pool bytes) held on each of this engine's devices."""
        weights, pool = bytes_per_device(self.params), bytes_per_device(self.runner.kv_pool)
        return {d: (weights.get(d, 0), pool.get(d, 0)) for d in sorted({*weights, *pool})}

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (only between generate() calls)."""
        if self.scheduler.has_work or self._in_flight is not None:
            raise RuntimeError("reset_prefix_cache() needs an idle engine")
        self.block_manager.reset()

    def install_pool(self, num_blocks: int, preemption_mode: str) -> None:
        """Experiments: an empty pool of num_blocks blocks (at most the device pool's,
        whose arrays stay) and preemption_mode, with a fresh host swap space sized by
        swap_space_gb in swap mode.  Only on an idle engine."""
        if self.scheduler.has_work or self._in_flight is not None:
            raise RuntimeError("install_pool() needs an idle engine")
        if not 2 <= num_blocks <= self.num_blocks:
            raise ValueError(f"num_blocks={num_blocks} must be in [2, {self.num_blocks}]")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        self.config.preemption_mode = self.scheduler.preemption_mode = preemption_mode
        self.block_manager.reset(num_blocks)
        self.swap_space.reset(swap_capacity(self.config, self.block_bytes, preemption_mode))

    # ------------------------------------------------------------- requests
    def default_sampling_params(self) -> SamplingParams:
        return default_sampling_params(self.config)

    def prepare_prompt(self, prompt: Any, params: SamplingParams
                       ) -> tuple[list[int] | None, SamplingParams, str | None, str | None]:
        """The arguments of add_request() for a prompt as generate() takes it:
        (token ids, params, prompt text, error)."""
        prepared = self.inputs.prepare(prompt, params)
        return prepared.token_ids, prepared.params, prepared.text, prepared.error

    def tokenize(self, prompt: Any) -> list[int]:
        """Prompt token ids exactly as generate() builds them (chat template for a
        {"prompt"} / {"messages"} dict); ValueError for a prompt generate() would fail."""
        return self.inputs.tokenize(prompt)

    def cached_prefix_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Prompt tokens a new request would find in the prefix cache now (a router's
        question: changes nothing)."""
        if self._lora_error(params):
            return 0
        slot, key = self.lora.binding(params.lora)
        probe = Sequence(-1, list(prompt_token_ids), params, weights_version=self.weights_version,
                         lora_slot=slot, lora_key=key)
        return self.block_manager.find_hit(probe).num_blocks * self.config.block_size

    def precompile(self, max_num_tokens: int | None = None, *, background: bool = False) -> int:
        """Builds, before a workload arrives, the greedy step of the power-of-two
        buckets of the step-size ladder up to max_num_tokens tokens, and the
        bucket of max_num_tokens (default: up to max_num_batched_tokens); a step
        in a bucket between them runs padded to the next one while its own is
        built in the background.  Sampling steps build on first use.  Returns the
        number of programs built (loaded ones included), or with `background`
        the number queued on the builder thread, returning at once.  With
        speculative decoding, the greedy draft-verifying step too, in the
        buckets up to the most tokens a drafting step can hold."""
        return self.runner.precompile(max_num_tokens, background=background,
                                      max_speculative_tokens=self.speculator.max_step_tokens(
                                          self.config.max_num_seqs, self.config.max_num_batched_tokens))

    # ----------------------------------------------------------- statistics
    def begin_generate(self) -> None:
        """Starts the window that `stats` reports (generate() calls it)."""
        self.step_stats.begin_window()

    @property
    def stats(self) -> EngineStats:
        """What the last (or the running) generate() call did; `totals` holds
        everything since the engine started."""
        return self.step_stats.window

    def snapshot(self) -> EngineSnapshot:
        """Gauges now (requests by state, KV blocks) and counters since start."""
        snap = EngineSnapshot(used_blocks=self.block_manager.num_used_blocks, num_blocks=self.num_blocks,
                              outstanding_tokens=self.outstanding_tokens(), totals=self.totals.snapshot())
        for seq in self._active.values():
            if seq.group[0] is not seq or all(s.is_done for s in seq.group):
                continue
            statuses = {s.status for s in seq.group}
            if statuses & {Status.PREFILLING, Status.DECODING}:
                snap.running += 1
            elif Status.SWAPPED in statuses:
                snap.swapped += 1
            else:
                snap.waiting += 1
        return snap

    def outstanding_tokens(self) -> int:
        """Tokens this engine still owes its unfinished requests: prompt tokens not
        computed yet plus the most each sequence may still generate."""
        return sum(max(0, s.num_tokens - s.num_computed_tokens)
                   + max(0, s.params.max_tokens - len(s.output_token_ids))
                   for s in self._active.values() if not s.is_done)

    def replica_summary(self) -> list[dict[str, Any]]:
        """Per data-parallel replica, what it was sent and did: none for one engine."""
        return []

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    @property
    def compile_seconds(self) -> float:
        """Seconds spent getting step programs ready since the engine started
        (tracing, lowering, compiling, loading from disk; in any thread)."""
        return self.runner.compile_seconds

    @property
    def program_build(self) -> dict[str, float]:
        """compile_seconds split, and the programs compiled here vs loaded from disk."""
        b = self.runner.build_stats
        return {"trace_lower_s": b.trace_lower_seconds, "xla_compile_s": b.compile_seconds,
                "load_s": b.load_seconds, "programs_compiled": b.compiled, "programs_loaded": b.loaded}

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """The step-size ladder: each bucket is one compiled program."""
        return self.runner.token_buckets

    # ------------------------------------------------------------ batch API
    def generate(self, prompts: Iterable[Any], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order.

        A prompt is a raw string, a list of token ids, or a chat request
        {"messages": [...]} / {"prompt": "a user message"} (rendered with the
        model's chat template).  A request that cannot run (bad input, or a step
        that failed under it) comes back with finish_reason "error".
        """
        return protocol.generate(self, prompts, sampling_params, use_tqdm=use_tqdm)

    def generate_iter(self, prompts: Iterable[Any],
                      sampling_params: SamplingParams | list[SamplingParams] | None = None,
                      *, use_tqdm: bool = False, stop: threading.Event | None = None
                      ) -> Iterator[RequestOutput]:
        """generate(), yielding each output as its request finishes (protocol.generate_iter)."""
        return protocol.generate_iter(self, prompts, sampling_params, use_tqdm=use_tqdm, stop=stop)

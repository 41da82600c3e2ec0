"""The engine's statistics: one object that every layer writes into.

The engine owns one `EngineStats` (`LLM.totals`) and hands it to its block
manager and scheduler, which count prefix-cache and preemption events in it
directly; the engine adds step timing and KV occupancy.  Counters accumulate
from the engine's start (what a metrics endpoint exports); `since(base)` gives
the part after a snapshot (what one generate() call reports, `LLM.stats`).
No jax here: host code counts too.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# High-water marks, not sums: `since()` keeps them as they are, and
# `reset_peaks()` starts a new window (the engine does at each generate()).
PEAK_FIELDS = ("peak_blocks_used", "shared_blocks_peak", "swap_blocks_peak")


@dataclasses.dataclass
class EngineStats:
    # Steps (engine)
    steps: int = 0
    prefill_steps: int = 0           # steps that computed prompt tokens
    device_seconds: float = 0.0
    host_seconds: float = 0.0
    compile_seconds: float = 0.0     # compiling step programs the first time a bucket ran
    tokens_scheduled: int = 0        # real tokens computed
    token_slots: int = 0             # token slots computed (step buckets): >= tokens_scheduled
    # KV occupancy (engine), summed over steps
    slots_allocated: int = 0
    slots_filled: int = 0
    # Prefix cache (block manager)
    prompt_tokens: int = 0           # tokens to prefill at admissions (resumes included)
    cached_prompt_tokens: int = 0    # of those, found in the cache (not recomputed)
    cache_hit_blocks: int = 0        # cached blocks reused at admissions
    evictions: int = 0
    cow_copies: int = 0
    # Preemption (scheduler; bytes and seconds: engine)
    preemptions: int = 0
    recompute_preemptions: int = 0
    swap_preemptions: int = 0
    swap_fallbacks: int = 0          # swap victims recomputed because the host pool was full
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    swap_seconds: float = 0.0        # device<->host copies (part of device_seconds)
    # Speculative decoding (engine): rows that verified drafts, their draft
    # tokens, and the drafts accepted (vLLM's spec_decode_num_* counters)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # Peaks since reset_peaks()
    peak_blocks_used: int = 0
    shared_blocks_peak: int = 0      # most blocks with refcount > 1 at once
    swap_blocks_peak: int = 0        # most host blocks in use at once
    # Mixture of experts (engine): tokens routed to each expert [L_moe, E] (int64),
    # row i the model's i-th MoE layer, padding not counted; None for a dense model.
    expert_load: np.ndarray | None = None

    def since(self, base: EngineStats) -> EngineStats:
        """Counters accumulated after `base` was copied; peaks as they stand."""
        return EngineStats(**{f.name: getattr(self, f.name) if f.name in PEAK_FIELDS
                              else _minus(getattr(self, f.name), getattr(base, f.name))
                              for f in dataclasses.fields(self)})

    def snapshot(self) -> EngineStats:
        copy = dataclasses.replace(self)
        copy.expert_load = None if self.expert_load is None else self.expert_load.copy()
        return copy

    @staticmethod
    def sum(parts: list[EngineStats]) -> EngineStats:
        """Several engines' stats added field by field (one pool each: peaks add up too)."""
        return EngineStats(**{f.name: _total([getattr(p, f.name) for p in parts])
                              for f in dataclasses.fields(EngineStats)})

    def add_expert_load(self, load: np.ndarray) -> None:
        """Adds one step's expert load [L_moe, E] (a MoE model's StepResult.expert_load)."""
        load = np.asarray(load, np.int64)
        self.expert_load = load.copy() if self.expert_load is None else self.expert_load + load

    def reset_peaks(self) -> None:
        for name in PEAK_FIELDS:
            setattr(self, name, 0)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def padding_ratio(self) -> float:
        """Token slots computed / real tokens (1.0: no padding)."""
        return self.token_slots / self.tokens_scheduled if self.tokens_scheduled else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens verified (0 without drafts)."""
        return self.spec_decode_num_accepted_tokens / max(1, self.spec_decode_num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a row with drafts emitted on average: its accepted drafts plus one."""
        return 1 + self.spec_decode_num_accepted_tokens / max(1, self.spec_decode_num_drafts)

    @property
    def kv_waste(self) -> float:
        return 1.0 - self.slots_filled / self.slots_allocated if self.slots_allocated else 0.0


def _minus(value, base):
    """value - base for a counter; an expert load (array) that `base` did not have yet stays whole."""
    return value if base is None else value - base


def _total(values: list):
    """The sum of one counter over several engines, leaving out the expert loads they lack."""
    present = [v for v in values if v is not None]
    return sum(present[1:], present[0]) if present else None


@dataclasses.dataclass
class EngineSnapshot:
    """One look at an engine: gauges as they stand and counters since it started.
    `LLM.snapshot()` takes it; the CLI summary, /metrics and the data-parallel
    router all read it (a router's is the sum of its replicas')."""

    running: int = 0             # requests with a sample prefilling or decoding
    waiting: int = 0             # requests not started yet, or preempted by recompute
    swapped: int = 0             # requests preempted to host memory
    used_blocks: int = 0         # KV blocks held now
    num_blocks: int = 0          # KV blocks in the pool (block 0, the null block, included)
    outstanding_tokens: int = 0  # prompt tokens still to compute + the most still to generate
    totals: EngineStats = dataclasses.field(default_factory=EngineStats)

    @staticmethod
    def combine(parts: list[EngineSnapshot]) -> EngineSnapshot:
        """The sum of several engines' snapshots (one pool per engine: peaks add up too)."""
        gauges = {f.name: sum(getattr(p, f.name) for p in parts)
                  for f in dataclasses.fields(EngineSnapshot) if f.name != "totals"}
        return EngineSnapshot(**gauges, totals=EngineStats.sum([p.totals for p in parts]))

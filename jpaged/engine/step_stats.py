"""Counts each engine step into the engine's `EngineStats`: step time split
into device, compile and host seconds, padding, swap traffic, KV occupancy and
a MoE model's expert load.

The block manager and scheduler count their own events (prefix-cache hits,
preemptions) into the same object; this adds what only the step loop sees.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jpaged.core.block_manager import BlockManager
from jpaged.core.scheduler import SchedulerOutput
from jpaged.core.sequence import Sequence
from jpaged.core.stats import EngineStats
from jpaged.core.swap_space import HostSwapSpace


class StepStats:
    """`totals` since the engine started, and the window one generate() reports."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.totals = EngineStats()
        self._window_start = EngineStats()
        self._last_completed = 0.0  # perf_counter when the last step completed

    def begin_window(self) -> None:
        """Starts the window that `window` reports (generate() calls it)."""
        self.totals.reset_peaks()
        self._window_start = self.totals.snapshot()

    @property
    def window(self) -> EngineStats:
        return self.totals.since(self._window_start)

    def record(self, out: SchedulerOutput, *, prefill: bool, started_at: float, timing: Any,
               token_slots: int, block_manager: BlockManager, running: list[Sequence],
               swap_space: HostSwapSpace, expert_load: np.ndarray | None = None) -> None:
        """One step, completed now: `timing` is the runner's StepTiming of it,
        `token_slots` the bucket it ran in (0 when it computed nothing),
        `expert_load` a MoE model's tokens per expert [L_moe, E] in it.  Its wall:
        since it began (`started_at`), or (a step launched while the one before
        ran) since that one completed, so overlapped steps are not counted twice."""
        now = time.perf_counter()
        step_seconds, self._last_completed = now - max(started_at, self._last_completed), now
        s = self.totals
        s.steps += bool(out.scheduled)
        s.prefill_steps += prefill
        device_seconds = timing.swap + timing.copy + timing.forward
        s.device_seconds += device_seconds
        s.compile_seconds += timing.compile
        # (asynchronously, a step may wait for its program while the step before runs:
        # that wait lies in the earlier step's wall, so this one's remainder may be < 0)
        s.host_seconds += max(0.0, step_seconds - device_seconds - timing.compile)
        s.swap_seconds += timing.swap
        s.swapped_out_bytes += sum(len(r.block_ids) for r in out.swap_out) * swap_space.block_bytes
        s.swapped_in_bytes += sum(len(r.block_ids) for r in out.swap_in) * swap_space.block_bytes
        s.tokens_scheduled += out.num_tokens
        s.token_slots += token_slots
        used, bs = block_manager.num_used_blocks, self.block_size
        s.peak_blocks_used = max(s.peak_blocks_used, used)
        s.slots_allocated += used * bs
        # Shared blocks hold tokens of several sequences: cap at the slots held.  Every
        # layer group's table counts (a sliding group's, from its first block held).
        s.slots_filled += min(used * bs, sum(min(q.num_computed_tokens, len(t.block_ids) * bs) - t.start * bs
                                             for q in running for t in block_manager.tables(q)))
        s.swap_blocks_peak = max(s.swap_blocks_peak, swap_space.num_used_blocks)
        if expert_load is not None:
            s.add_expert_load(expert_load)

"""Stall detection: an engine that can schedule nothing while requests wait
fails them and says why, rather than spin.  Host code: no jax."""

from __future__ import annotations

from jpaged.core.block_manager import BlockManager
from jpaged.core.scheduler import Scheduler, SchedulerOutput
from jpaged.core.sequence import Sequence


class EngineStalled(RuntimeError):
    """A step could schedule nothing while requests waited (they were failed)."""


class ProgressCheck:
    """Watches the steps' outcomes; raises EngineStalled after two steps in a row
    that scheduled nothing, finished nothing and left the scheduler's state
    unchanged: schedule() is deterministic, so every later step would do the
    same.  An empty step may still move state (a preemption, a fork): not
    stalled then."""

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager):
        self.scheduler = scheduler
        self.block_manager = block_manager
        self._idle_state: tuple | None = None  # scheduler state after the last step that ran nothing

    def after_step(self, out: SchedulerOutput, finished: list[Sequence]) -> None:
        sched = self.scheduler
        if finished or out.scheduled or out.swap_out or out.swap_in or not sched.has_work:
            self._idle_state = None
            return
        state = (self.block_manager.num_free_blocks,
                 *((id(s), s.status, s.num_computed_tokens, len(s.block_table.block_ids), len(s.forks))
                   for q in (sched.waiting, sched.running, sched.swapped) for s in q))
        if state != self._idle_state:
            self._idle_state = state
            return
        described = (f"{len(sched.waiting)} waiting, {len(sched.running)} running, {len(sched.swapped)} "
                     f"swapped; {self.block_manager.num_free_blocks} free blocks, max_num_batched_tokens "
                     f"{sched.max_num_batched_tokens}, max_num_seqs {sched.max_num_seqs}")
        message = f"engine stalled: a step could schedule nothing ({described})"
        for seq in [*sched.waiting, *sched.running, *sched.swapped]:
            sched.fail(seq, message)
        raise EngineStalled(message)

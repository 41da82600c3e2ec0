"""What a step that raised leaves behind: its sequences fail alone, the engine
goes on.  The exception may strike after the donated KV pool was consumed;
then the pool is rebuilt empty, the prefix cache is dropped and the other
running sequences recompute their K/V (as after a recompute preemption)."""

from __future__ import annotations

import logging

from jpaged.core.block_manager import BlockManager
from jpaged.core.scheduler import Scheduler, SchedulerOutput
from jpaged.runtime.model_runner import ModelRunner, PendingStep

log = logging.getLogger(__name__)


def fail_step(scheduler: Scheduler, runner: ModelRunner, block_manager: BlockManager, out: SchedulerOutput,
              error: Exception, pending: PendingStep | None = None) -> None:
    """Fails every sequence the step `out` involved and frees their blocks."""
    message = f"step failed: {type(error).__name__}: {error}"
    log.error("%s (failing %d sequences)", message, len(out.scheduled))
    for s in out.scheduled:
        scheduler.drop_unknown(s)
    involved = [s.seq for s in out.scheduled] + [r.seq for r in (*out.swap_out, *out.swap_in)]
    for seq in dict.fromkeys(involved):
        if not seq.is_done:
            scheduler.fail(seq, message)
    if runner.restore_pool(pending):
        log.error("the KV pool was lost with the failed step: recomputing %d running sequences",
                  len(scheduler.running))
        scheduler.requeue_running()
        block_manager.reset()

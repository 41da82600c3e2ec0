"""A step between `EngineCore.start_step()` and `finish_step()`: with asynchronous
scheduling it stays on the device while the host schedules the next one."""

from __future__ import annotations

import dataclasses

from jpaged.core.scheduler import SchedulerOutput
from jpaged.core.sequence import Sequence
from jpaged.runtime.model_runner import PendingStep

# EngineCore.pause's modes (see there).
PAUSE_MODES = ("abort", "keep", "wait")


@dataclasses.dataclass
class StartedStep:
    """A step between EngineCore.start_step() and finish_step()."""
    out: SchedulerOutput
    pending: PendingStep | None
    error: Exception | None
    start: float
    prefill: bool = False  # a prompt chunk ran in it (the step's statuses change when it launches)
    # What finished in the step before it, completed first because a constrained
    # sample's next mask needed its token (finish_step returns them too).
    finished: list[Sequence] = dataclasses.field(default_factory=list)
    paused: bool = False  # the engine is paused: nothing was scheduled (EngineCore.pause)

"""One step's plan, as the scheduler hands it to the runner (vLLM V1's
`SchedulerOutput`): which sequences run with how many tokens, and the block
moves (swap-out, swap-in, copy-on-write) that come before the forward."""

from __future__ import annotations

import dataclasses

from jpaged.core.sequence import Sequence, Status


@dataclasses.dataclass
class ScheduledSeq:
    """num_new tokens of seq from position `start` (its num_computed_tokens when
    scheduled): a prefill chunk, or 1 to decode, plus `drafts` (speculative
    decoding: draft tokens after the decode token, verified by the step; num_new
    counts them).  `output_index`: where the token this row samples goes in
    seq's output (set when the step is launched; None for a prefill chunk that
    does not reach the end of the sequence)."""
    seq: Sequence
    num_new: int
    start: int = -1
    output_index: int | None = None
    drafts: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.start < 0:
            self.start = self.seq.num_computed_tokens


@dataclasses.dataclass
class SwapOut:
    """Device blocks of a preempted sequence to copy into host slots."""
    seq: Sequence
    block_ids: list[int]
    slots: list[int]


@dataclasses.dataclass
class SwapIn:
    """Host slots of a resumed sequence to copy into its new device blocks."""
    seq: Sequence
    slots: list[int]
    block_ids: list[int]
    status: Status


@dataclasses.dataclass
class SchedulerOutput:
    """One step's work, in the order the runner applies it: swap-outs (device ->
    host), swap-ins (host -> device), block copies (copy-on-write), then one
    forward over the scheduled tokens."""

    scheduled: list[ScheduledSeq]
    block_copies: list[tuple[int, int]]
    swap_out: list[SwapOut]
    swap_in: list[SwapIn]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)

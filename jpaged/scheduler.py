"""Host-side scheduler: which sequences run in the next step, and with how many tokens.

Policies:
  continuous  a finished sequence's slot is refilled at the next step; waiting
              prompts are prefilled (chunked to max_num_batched_tokens) before
              running sequences decode.
  static      the baseline: a batch of up to max_num_seqs is admitted only
              when the previous batch is over, and runs padded until its
              longest member finishes (finished members stay as padding rows).
"""

from __future__ import annotations

import collections
import time

from jpaged.kv_cache import BlockAllocator
from jpaged.model_runner import Row
from jpaged.sequence import Sequence, Status


class Scheduler:
    def __init__(self, allocator: BlockAllocator, *, policy: str, max_num_seqs: int,
                 max_num_batched_tokens: int):
        if policy not in ("continuous", "static"):
            raise ValueError(f"scheduler must be 'continuous' or 'static', got {policy!r}")
        self.allocator = allocator
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Row], bool]:
        """Rows of the next step and whether it is a prefill step."""
        if self.policy == "static" and self.running and all(s.is_done for s in self.running):
            self._end_static_batch()
        rows = self._schedule_prefill()
        if rows:
            return rows, True
        rows = self._schedule_decode()
        return (rows, False) if any(r.num_new for r in rows) else ([], False)

    def _schedule_prefill(self) -> list[Row]:
        budget = self.max_num_batched_tokens
        rows = []
        for seq in list(self.running):  # chunked prefills in flight first
            if seq.status is Status.PREFILLING and budget > 0:
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if self._grow_or_preempt(seq, seq.num_computed_tokens + n):
                    rows.append(Row(seq, n))
                    budget -= n
        rows = [r for r in rows if r.seq.status is Status.PREFILLING]
        may_admit = self.policy == "continuous" or not self.running
        while may_admit and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._try_grow(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            seq.status = Status.PREFILLING
            self.running.append(seq)
            rows.append(Row(seq, n))
            budget -= n
        return rows

    def _schedule_decode(self) -> list[Row]:
        rows = []
        for seq in list(self.running):
            if seq.is_done:
                if self.policy == "static":
                    rows.append(Row(seq, 0))  # padding: the static batch keeps its shape
                continue
            if seq.status is not Status.DECODING:
                continue  # preempted by an earlier row of this loop
            if self._grow_or_preempt(seq, seq.num_tokens):
                rows.append(Row(seq, 1))
        # A row appended before its sequence was preempted must not run.
        return [r for r in rows if r.num_new == 0 or r.seq.status is Status.DECODING]

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int) -> bool:
        """Makes room for num_tokens of seq, preempting later arrivals if needed;
        a sequence that cannot fit even alone ends with an error."""
        while not self._try_grow(seq, num_tokens):
            if self._preempt_latest(exclude=seq) is None:
                seq.block_table.release(self.allocator)
                self.running.remove(seq)
                seq.finish("error", f"sequence of {seq.num_tokens} tokens needs more KV blocks "
                                    f"than the whole pool has ({self.allocator.num_blocks - 1})")
                return False
        return True

    def _try_grow(self, seq: Sequence, num_tokens: int) -> bool:
        if seq.block_table.blocks_needed(num_tokens) > self.allocator.num_free_blocks:
            return False
        seq.block_table.grow(num_tokens, self.allocator)
        return True

    def _preempt_latest(self, exclude: Sequence) -> Sequence | None:
        """Recompute preemption: drop the latest-arrived running sequence's blocks
        and requeue it first; on resume it prefills prompt + generated tokens."""
        candidates = [s for s in self.running if s is not exclude and not s.is_done]
        if not candidates:
            return None
        victim = max(candidates, key=lambda s: s.arrival_time)
        self.running.remove(victim)
        victim.block_table.release(self.allocator)
        victim.num_computed_tokens = 0
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    def finish(self, seq: Sequence) -> None:
        """Called once seq is DONE: continuous frees its slot and blocks now; a
        static batch holds them until its last member is done."""
        if self.policy == "continuous":
            self.running.remove(seq)
            seq.block_table.release(self.allocator)

    def _end_static_batch(self) -> None:
        # Static batching hands back the whole batch at once: that is when its
        # members' requests complete.
        now = time.perf_counter()
        for seq in self.running:
            seq.block_table.release(self.allocator)
            seq.finish_time = now
        self.running.clear()

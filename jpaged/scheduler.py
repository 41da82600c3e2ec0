"""Host-side scheduler: which sequences run in the next step, and with how many tokens.

Policies:
  continuous  a finished sequence's slot is refilled at the next step; waiting
              prompts are prefilled (chunked to max_num_batched_tokens) before
              running sequences decode.
  static      the baseline: a batch of up to max_num_seqs is admitted only
              when the previous batch is over, and runs padded until its
              longest member finishes (finished members stay as padding rows).

Blocks go through the BlockManager (reference counts, prefix cache, CoW): an
admitted sequence first reuses the longest cached run of its full blocks and
prefills the rest, always recomputing at least its last token; before a row
writes positions [computed, computed + n) every block they fall in is made
private (copy-on-write).  A request with n > 1 samples prefills its prompt but
the last token once, then forks: the samples share every prompt block and each
computes the last prompt token (and so samples its own first token) itself.
"""

from __future__ import annotations

import collections
import time

from jpaged.block_manager import BlockManager
from jpaged.kv_cache import BlockAllocator
from jpaged.model_runner import Row
from jpaged.sequence import Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager | BlockAllocator, *, policy: str, max_num_seqs: int,
                 max_num_batched_tokens: int, block_size: int = 16):
        if policy not in ("continuous", "static"):
            raise ValueError(f"scheduler must be 'continuous' or 'static', got {policy!r}")
        if isinstance(block_manager, BlockAllocator):  # a bare allocator: no prefix caching
            block_manager = BlockManager(block_manager.num_blocks, block_size,
                                         enable_prefix_caching=False, allocator=block_manager)
        self.block_manager = block_manager
        self.allocator = block_manager.allocator
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
        """Rows of the next step and whether it is a prefill step.  Block copies
        the rows depend on are left in block_manager.take_copies()."""
        if self.policy == "static" and self.running and all(s.is_done for s in self.running):
            self._end_static_batch()
        rows = self._schedule_prefill()
        if rows:
            return rows, True
        rows = self._schedule_decode()
        return (rows, False) if any(r.num_new for r in rows) else ([], False)

    def _schedule_prefill(self) -> list[Row]:
        for seq in list(self.running):
            if seq.forks and seq.status is Status.PREFILLING and seq.num_computed_tokens >= seq.prefill_target:
                self._fork(seq)
        budget = self.max_num_batched_tokens
        rows = []
        for seq in list(self.running):  # chunked prefills in flight first
            if seq.status is Status.PREFILLING and budget > 0:
                n = min(seq.prefill_target - seq.num_computed_tokens, budget)
                if n > 0 and self._grow_or_preempt(seq, seq.num_computed_tokens + n):
                    rows.append(Row(seq, n))
                    budget -= n
        rows = [r for r in rows if r.seq.status is Status.PREFILLING]
        may_admit = self.policy == "continuous" or not self.running
        while (may_admit and self.waiting and budget > 0
               and len(self.running) + self.waiting[0].num_seats <= self.max_num_seqs):
            seq = self.waiting[0]
            n = self._try_admit(seq, budget)
            if n is None:
                break
            self.waiting.popleft()
            seq.status = Status.PREFILLING
            self.running.append(seq)
            if n:
                rows.append(Row(seq, n))
                budget -= n
        return rows

    def _try_admit(self, seq: Sequence, budget: int) -> int | None:
        """Reuses seq's longest cached prefix and makes room for its first chunk;
        returns the chunk's token count (0: a fork leader that is fully cached),
        or None, changing nothing, when the pool cannot hold it."""
        bm = self.block_manager
        handles, blocks = bm.match(seq)
        bs = seq.block_table.block_size
        # Always recompute the last token (its logits give the next one).
        computed = min(len(blocks) * bs, seq.num_tokens - 1)
        n = min(seq.prefill_target - computed, budget)
        end = computed + n
        revived = sum(bm.refcount[b] == 0 for b in blocks)
        fresh = max(0, -(-end // bs) - len(blocks))
        # Writing into the last reused block (a fully cached prompt) copies it.
        cow = int(n > 0 and computed < len(blocks) * bs)
        if revived + fresh + cow > bm.num_free_blocks:
            return None
        for b in blocks:
            bm.share(b)
        seq.block_table.block_ids = list(blocks)
        seq.block_keys = list(handles)
        seq.num_computed_tokens = computed
        bm.record_admission(seq.num_tokens, computed, len(blocks))
        if not seq.output_token_ids:
            seq.num_cached_tokens = computed
        if n:
            ok = self._prepare_write(seq, end)
            assert ok, "admission accounting is off"
        return n

    def _fork(self, leader: Sequence) -> None:
        """Parallel sampling: the samples share every block of the prefilled prompt."""
        bm = self.block_manager
        at = self.running.index(leader) + 1
        for child in leader.forks:
            for b in leader.block_table.block_ids:
                bm.share(b)
            child.block_table.block_ids = list(leader.block_table.block_ids)
            child.block_keys = list(leader.block_keys)
            child.num_computed_tokens = leader.num_computed_tokens
            child.status = Status.PREFILLING
        self.running[at:at] = leader.forks
        leader.forks = []

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
        while not self._prepare_write(seq, num_tokens):
            if self._preempt_latest(exclude=seq) is None:
                self._release(seq)
                self.running.remove(seq)
                seq.finish("error", f"sequence of {seq.num_tokens} tokens needs more KV blocks "
                                    f"than the whole pool has ({self.allocator.num_blocks - 1})")
                return False
        return True

    def _prepare_write(self, seq: Sequence, num_tokens: int) -> bool:
        """Makes positions [num_computed_tokens, num_tokens) of seq writable: grows
        its table and copies-on-write the shared or cached blocks they fall in.
        False, changing nothing, when the pool cannot provide the blocks."""
        bm, table = self.block_manager, seq.block_table
        bs = table.block_size
        first = seq.num_computed_tokens // bs
        last = min(-(-num_tokens // bs), len(table.block_ids))
        cows = [i for i in range(first, last) if bm.needs_cow(table.block_ids[i])]
        if table.blocks_needed(num_tokens) + len(cows) > bm.num_free_blocks:
            return False
        for i in cows:
            table.block_ids[i] = bm.cow(table.block_ids[i])
        table.grow(num_tokens, bm)
        return True

    def _release(self, seq: Sequence) -> None:
        seq.block_table.release(self.block_manager)  # last block first: deepest evicted first
        seq.block_keys = []

    def _preempt_latest(self, exclude: Sequence) -> Sequence | None:
        """Recompute preemption: drop the latest-arrived running sequence's blocks
        (they stay cached) and requeue it first; on resume it prefills prompt +
        generated tokens, reusing what is still cached."""
        candidates = [s for s in self.running if s is not exclude and not s.is_done]
        if not candidates:
            return None
        victim = max(candidates, key=lambda s: s.arrival_time)
        self.running.remove(victim)
        self._release(victim)
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
            self._release(seq)

    def _end_static_batch(self) -> None:
        # Static batching hands back the whole batch at once: that is when its
        # members' requests complete.
        now = time.perf_counter()
        for seq in self.running:
            self._release(seq)
            seq.finish_time = now
        self.running.clear()

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

Oversubscription and preemption: a sequence is admitted while the pool has
blocks for its first chunk (nothing is reserved for its future tokens).  When a
running sequence needs a block and none is free even after evicting unused
cached blocks, the latest-arrived running sequence is preempted (the requester
itself when it is the latest), by recompute or by swap (preemption_mode; see
_preempt).  Swapped sequences resume, in arrival order, before any new
admission, and nothing is admitted or resumed in a step that preempted.  The
earliest arrival is never a victim while others run, so the system always makes
progress; a sequence that cannot fit even in an empty pool ends with an error.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import time

from jpaged.block_manager import BlockManager
from jpaged.kv_cache import BlockAllocator, HostSwapSpace
from jpaged.model_runner import Row
from jpaged.sequence import Sequence, Status


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
class PreemptionCounters:
    """Cumulative (the engine reports per-generate deltas)."""

    preemptions: int = 0
    recompute_preemptions: int = 0
    swap_preemptions: int = 0
    swap_fallbacks: int = 0        # swap victims recomputed: the host pool was full
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0

    def minus(self, base: "PreemptionCounters") -> "PreemptionCounters":
        return PreemptionCounters(**{f.name: getattr(self, f.name) - getattr(base, f.name)
                                     for f in dataclasses.fields(self)})


class Scheduler:
    def __init__(self, block_manager: BlockManager | BlockAllocator, *, policy: str, max_num_seqs: int,
                 max_num_batched_tokens: int, block_size: int = 16, preemption_mode: str = "recompute",
                 swap_space: HostSwapSpace | None = None):
        if policy not in ("continuous", "static"):
            raise ValueError(f"scheduler must be 'continuous' or 'static', got {policy!r}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
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
        self.swapped: list[Sequence] = []  # arrival order
        self.preemption_mode = preemption_mode
        self.swap_space = swap_space
        self.counters = PreemptionCounters()
        self._swap_out: list[SwapOut] = []
        self._swap_in: list[SwapIn] = []
        self._preempted_now = False

    @property
    def num_preemptions(self) -> int:
        return self.counters.preemptions

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> tuple[list[Row], bool]:
        """Rows of the next step and whether it is a prefill step.  Block copies
        the rows depend on are left in block_manager.take_copies(), swaps in take_swaps()."""
        self._preempted_now = False
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
        if self._preempted_now or not self._schedule_swap_in():
            return rows
        may_admit = self.policy == "continuous" or not self.running
        while (may_admit and self.waiting and budget > 0
               and len(self.running) + self.waiting[0].num_seats <= self.max_num_seqs):
            seq = self.waiting[0]
            n = self._try_admit(seq, budget)
            if n is None:
                if not self.running:  # not even an empty pool holds its first chunk
                    self.waiting.popleft()
                    self._fail(seq, f"request of {seq.num_tokens} tokens cannot fit in the KV pool "
                                    f"({self.allocator.num_blocks - 1} blocks)")
                    continue
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
        """Makes room for num_tokens of seq, preempting the latest-arrived running
        sequence while the pool is short (seq itself when it is the latest: False).
        A sequence that needs more blocks than the whole pool ends with an error."""
        bs = seq.block_table.block_size
        if -(-num_tokens // bs) > self.allocator.num_blocks - 1:
            self._fail(seq, f"sequence of {num_tokens} tokens needs more KV blocks than the "
                            f"whole pool has ({self.allocator.num_blocks - 1})")
            return False
        while not self._prepare_write(seq, num_tokens):
            others = [s for s in self.running if s is not seq and not s.is_done]
            if not others and not any(s.is_done for s in self.running):
                # Alone in the pool and still short (copy-on-write needs a spare block).
                self._fail(seq, f"sequence of {num_tokens} tokens cannot fit in the KV pool "
                                f"({self.allocator.num_blocks - 1} blocks) even alone")
                return False
            # Finished static-batch members hold blocks until their batch ends:
            # then seq waits for them (preempting itself) instead of failing.
            victim = max(others + [seq], key=lambda s: s.arrival_time)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _prepare_write(self, seq: Sequence, num_tokens: int) -> bool:
        """Makes positions [num_computed_tokens, num_tokens) of seq writable (see
        BlockManager.prepare_write)."""
        return self.block_manager.prepare_write(seq.block_table, seq.num_computed_tokens, num_tokens)

    def _release(self, seq: Sequence) -> None:
        seq.block_table.release(self.block_manager)  # last block first: deepest evicted first
        seq.block_keys = []

    def _preempt(self, victim: Sequence) -> None:
        """Takes victim off the running list.  recompute: its blocks are dropped
        (cached ones stay cached) and it is requeued first; on resume it prefills
        prompt + generated tokens in one pass, reusing what is still cached.
        swap: its computed blocks are queued for a device->host copy (run by the
        engine before anything writes the pool again) and it waits in `swapped`
        until there is room; recompute when the host pool is full."""
        self.running.remove(victim)
        victim.num_preemptions += 1
        self.counters.preemptions += 1
        self._preempted_now = True
        pending = next((r for r in self._swap_in if r.seq is victim), None)
        if pending is not None:  # swapped in by this very schedule(): nothing was written yet
            self._swap_in.remove(pending)
            self._release(victim)
            self._park(victim, pending.slots, pending.status)
            self.counters.swap_preemptions += 1
            return
        if self.preemption_mode == "swap":
            n = -(-victim.num_computed_tokens // victim.block_table.block_size)
            slots = self.swap_space.allocate(n) if n and self.swap_space is not None else None
            if slots is not None:
                self._swap_out.append(SwapOut(victim, victim.block_table.block_ids[:n], slots))
                status = victim.status
                self._release(victim)
                self._park(victim, slots, status)
                self.counters.swap_preemptions += 1
                return
            if n:
                self.counters.swap_fallbacks += 1  # no room in host memory
        self._release(victim)
        victim.num_computed_tokens = 0
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        self.counters.recompute_preemptions += 1

    def _park(self, seq: Sequence, slots: list[int], status: Status) -> None:
        seq.swap_slots, seq.swap_status = slots, status
        seq.status = Status.SWAPPED
        bisect.insort(self.swapped, seq, key=lambda s: s.arrival_time)

    def _schedule_swap_in(self) -> bool:
        """Resumes swapped sequences, earliest arrival first, into whatever blocks
        are free now (the engine copies their host blocks in before the step).
        True when none is left waiting in host memory."""
        bm = self.block_manager
        while self.swapped:
            seq = self.swapped[0]
            if len(self.running) + seq.num_seats > self.max_num_seqs:
                return False
            n = len(seq.swap_slots)
            # Room for the restored blocks and for its next token.
            need = max(n, -(-(seq.num_computed_tokens + 1) // seq.block_table.block_size))
            if need > bm.num_free_blocks:
                if not self.running:  # an empty pool cannot hold it: it never will
                    self.swapped.pop(0)
                    self._fail(seq, f"swapped-out sequence of {seq.num_tokens} tokens cannot fit "
                                    f"in the KV pool ({self.allocator.num_blocks - 1} blocks)")
                    continue
                return False
            self.swapped.pop(0)
            blocks = [bm.allocate() for _ in range(n)]  # private: the host copy is the content
            seq.block_table.block_ids = blocks
            seq.block_keys = []
            self._swap_in.append(SwapIn(seq, seq.swap_slots, list(blocks), seq.swap_status))
            seq.status, seq.swap_slots, seq.swap_status = seq.swap_status, [], None
            self.running.append(seq)
        return True

    def take_swaps(self) -> tuple[list["SwapOut"], list["SwapIn"]]:
        """This step's block moves, for the engine to run before the step's copies
        and forward: swap-outs first (device -> host: the victims' blocks may be
        rewritten by this step), then swap-ins (host -> device).  The swap-ins'
        host slots are freed here; their data stays until the next schedule()."""
        outs, ins = self._swap_out, self._swap_in
        self._swap_out, self._swap_in = [], []
        for r in ins:
            self.swap_space.free(r.slots)
        self.counters.swapped_out_blocks += sum(len(r.block_ids) for r in outs)
        self.counters.swapped_in_blocks += sum(len(r.block_ids) for r in ins)
        return outs, ins

    def _fail(self, seq: Sequence, error: str) -> None:
        """Ends seq (and samples it has not forked yet) with an error, freeing what it holds."""
        if seq in self.running:
            self.running.remove(seq)
        pending = next((r for r in self._swap_in if r.seq is seq), None)
        if pending is not None:
            self._swap_in.remove(pending)
            self.swap_space.free(pending.slots)
        if seq.swap_slots:
            self.swap_space.free(seq.swap_slots)
            seq.swap_slots = []
        self._release(seq)
        for s in [seq] + seq.forks:
            s.finish("error", error)
        seq.forks = []

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

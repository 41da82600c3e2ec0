"""Host-side scheduler: which sequences run in the next step, and with how many tokens.

A step is one flat ragged batch of at most max_num_batched_tokens tokens (as in
vLLM V1): every running sequence's decode token first, then the next chunks of
prompts being prefilled, then swapped-out sequences resume and waiting ones are
admitted into what is left of the budget.  Chunked prefill thus piggybacks on
decode: a long prompt never stalls the running sequences' next tokens.

Policies:
  continuous  a finished sequence's seat is refilled at the next step.
  static      the baseline: a batch of up to max_num_seqs is admitted only
              when the previous batch is over; finished members keep their
              blocks until the batch's longest member finishes.

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
import logging
import time

from jpaged.core.block_manager import BlockManager, PrefixHit
from jpaged.core.config import SchedulerConfig
from jpaged.core.scheduler_output import ScheduledSeq, SchedulerOutput, SwapIn, SwapOut
from jpaged.core.sequence import PLACEHOLDER, Sequence, Status
from jpaged.core.stats import EngineStats
from jpaged.core.step_output import StepOutput, StopConditions
from jpaged.core.swap_space import HostSwapSpace

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, block_manager: BlockManager, config: SchedulerConfig, *,
                 swap_space: HostSwapSpace | None = None, token_buckets: tuple[int, ...] = (),
                 stats: EngineStats | None = None, stops: StopConditions | None = None):
        """`stops`: when a sample ends (the engine's output processor), for on_launched / update_from_output."""
        self.block_manager = block_manager
        self.policy = config.scheduler
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.token_buckets = tuple(token_buckets)  # the runner's step sizes (see _fit_bucket)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # arrival order
        self.preemption_mode = config.preemption_mode  # LLM.install_pool may change it
        self.swap_space = swap_space
        self.stats = stats if stats is not None else EngineStats()  # shared with the engine
        self.stops = stops
        self._swap_out: list[SwapOut] = []
        self._swap_in: list[SwapIn] = []
        self._preempted_now = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self, drafts: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """The next step: running decodes first, then in-flight prefill chunks, then
        swapped sequences and new admissions, within max_num_batched_tokens.
        `drafts` (speculative decoding): draft tokens by seq_id for decoding
        sequences, verified in their rows when budget and free blocks allow (a
        draft never preempts anything: without room a row decodes one token)."""
        drafts = drafts or {}
        self._preempted_now = False
        if self.policy == "static" and self.running and all(s.is_done for s in self.running):
            self._end_static_batch()
        for seq in list(self.running):
            # (prompt logprobs of a prefill still on the device are not in yet: the forks copy them)
            if (seq.forks and seq.status is Status.PREFILLING and seq.num_computed_tokens >= seq.prefill_target
                    and not seq.needs_prompt_logprobs and not seq.owes_routes):
                self._fork(seq)
        budget = self.max_num_batched_tokens
        scheduled = []
        for status in (Status.DECODING, Status.PREFILLING):
            for seq in list(self.running):
                if seq.status is not status or budget <= 0 or seq.awaits_last_token:
                    continue  # (also skips what an earlier grow preempted)
                if status is Status.DECODING:
                    row = self._draft_row(seq, drafts.get(seq.seq_id, ()), budget)
                    if row is not None:
                        scheduled.append(row)
                        budget -= row.num_new
                        continue
                n = 1 if status is Status.DECODING else min(seq.prefill_target - seq.num_computed_tokens, budget)
                if n > 0 and self._grow_or_preempt(seq, seq.num_computed_tokens + n):
                    scheduled.append(ScheduledSeq(seq, n))
                    budget -= n
        # A sequence scheduled before a later one preempted it must not run.
        scheduled = [s for s in scheduled if s.seq.status in (Status.DECODING, Status.PREFILLING)]
        budget = self.max_num_batched_tokens - sum(s.num_new for s in scheduled)
        if not self._preempted_now and self._schedule_swap_in():
            scheduled += self._admit(budget)
        self._fit_bucket(scheduled)
        swap_out, swap_in = self._take_swaps()
        return SchedulerOutput(scheduled, self.block_manager.take_copies(), swap_out, swap_in)

    # ------------------------------------------------- a step's output applied
    def on_launched(self, out: SchedulerOutput) -> None:
        """A dispatched step's effect on its sequences, known before its tokens are:
        its tokens count as computed, and each sequence it completes gets a
        PLACEHOLDER for the token it samples (the next schedule() sees the state
        after this step before its tokens are known)."""
        for row, s in enumerate(out.scheduled):
            seq = s.seq
            # (a draft's K/V counts once it is accepted: _apply_row)
            seq.num_computed_tokens = s.start + s.num_new - len(s.drafts)
            if seq.num_computed_tokens >= seq.num_tokens:  # else a prefill chunk: its sample is not a token
                s.output_index = len(seq.output_token_ids)
                seq.output_token_ids.append(PLACEHOLDER)
                seq.sample_row = row
                seq.status = Status.DECODING
                seq.awaits_last_token = self.stops.reached_length(seq, len(seq.output_token_ids))
            self.block_manager.cache_full_blocks(seq)  # blocks whose tokens are all known

    def update_from_output(self, out: SchedulerOutput, output: StepOutput) -> list[Sequence]:
        """Puts a completed step's tokens (and logprobs) into its sequences, applies
        the stop conditions they trigger and frees what ended; returns the
        sequences that ended here.  A row that fails fails only its sequence."""
        finished, offset = [], 0  # offset: the row's first token in the step's flat batch
        for row, s in enumerate(out.scheduled[:len(output.tokens)]):
            try:
                tokens = output.row_tokens(row, bool(s.drafts))
                if s.drafts:  # vLLM's counters
                    self.stats.spec_decode_num_drafts += 1
                    self.stats.spec_decode_num_draft_tokens += len(s.drafts)
                    self.stats.spec_decode_num_accepted_tokens += len(tokens) - 1
                if self._apply_row(s, tokens, output, row, offset):
                    finished.append(s.seq)
            except Exception as e:  # noqa: BLE001 - pinned to this sequence
                log.exception("request %d failed after its step", s.seq.seq_id)
                self.drop_unknown(s)
                self.fail(s.seq, f"internal error: {type(e).__name__}: {e}")
            offset += s.num_new
        return finished

    @staticmethod
    def drop_unknown(s: ScheduledSeq) -> None:
        """A failed row's sequence keeps only the tokens the host knows."""
        if s.output_index is not None:
            del s.seq.output_token_ids[s.output_index:]

    def _apply_row(self, s: ScheduledSeq, tokens: list[int], output: StepOutput, row: int, offset: int) -> bool:
        """One row: prompt logprobs, the sampled tokens in their places (one, or
        accepted drafts and one) and the stop conditions; True when seq ended here."""
        seq = s.seq
        if s.output_index is not None and s.output_index >= len(seq.output_token_ids):
            return False  # the sequence stopped at an earlier token: this row ran past its end
        output.record_logprobs(s, tokens[0], row, offset)
        output.record_routes(s, offset)
        if s.output_index is None:
            return False  # a prefill chunk
        seq.output_token_ids[s.output_index] = tokens[0]
        if seq.is_done:
            return False  # aborted while the step ran: the token is kept, nothing else changes
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        for i, token in enumerate(tokens):
            if i:  # an accepted draft came before this token: its K/V is in the pool
                seq.output_token_ids.insert(s.output_index + i, token)
                seq.num_computed_tokens += 1
            if self._stops(seq, token, s.output_index + i) or seq.is_done:
                return True
        if s.drafts:  # the rejected drafts' blocks
            self.block_manager.truncate(seq, seq.num_tokens)
        self.block_manager.cache_full_blocks(seq)
        return False

    def _stops(self, seq: Sequence, token: int, index: int) -> bool:
        """Applies the stop conditions to seq's output token `index`; True when seq ends there."""
        reason = self.stops.finish_reason(seq, token, num_output=index + 1)
        if seq.grammar is not None and reason in (None, "length"):  # a structure complete at the limit: "stop"
            reason = self._advance_grammar(seq, token) or reason
            if seq.is_done:
                return True
        if reason is None:
            return False
        del seq.output_token_ids[index + 1:]  # a later step's placeholder
        self.block_manager.cache_full_blocks(seq)
        seq.finish(reason)
        if seq in self.running:
            self.finish(seq)
        else:  # preempted while its last step ran
            self.fail(seq, None, reason=reason)
        return True

    def _advance_grammar(self, seq: Sequence, token: int) -> str | None:
        """Moves a constrained sample's matcher past its new token: "stop" when the
        constraint is complete.  A token the constraint refuses (only a NaN row
        can sample one) fails the sample with an error."""
        if seq.grammar.accept(token):
            return "stop" if seq.grammar.is_finished else None
        self.fail(seq, f"token {token} broke the {seq.grammar.spec.kind} constraint: "
                       f"{seq.grammar.error or 'not allowed'}")
        return None

    def _draft_row(self, seq: Sequence, drafts, budget: int) -> ScheduledSeq | None:
        """A decode row with as many of `drafts` as the budget and the free blocks
        allow without preempting anything; None for a plain decode row."""
        drafts = list(drafts)[:budget - 1]
        if not drafts or not self._prepare_write(seq, seq.num_computed_tokens + 1 + len(drafts)):
            return None
        return ScheduledSeq(seq, 1 + len(drafts), drafts=drafts)

    def _admit(self, budget: int) -> list[ScheduledSeq]:
        """Admits waiting sequences in arrival order while seats, tokens and blocks
        last.  A request whose next uncached full block another admitted prompt is
        about to compute waits for it (then hits the cache) instead of computing
        the same prefix twice."""
        scheduled = []
        if self.policy == "static" and self.running:
            return scheduled
        deferred = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self._seats_taken() + seq.num_seats > self.max_num_seqs:
                break
            hit = self.block_manager.find_hit(seq)
            if self._prefix_in_flight(seq, hit.num_blocks):
                deferred.append(self.waiting.popleft())
                continue
            n = self._try_admit(seq, budget, hit)
            if n is None:
                if not self.running:  # not even an empty pool holds its first chunk
                    self.waiting.popleft()
                    self._fail(seq, f"request of {seq.num_tokens} tokens cannot fit in the KV pool "
                                    f"({self.block_manager.num_blocks - 1} blocks)")
                    continue
                break
            self.waiting.popleft()
            seq.status = Status.PREFILLING
            self.running.append(seq)
            if n:
                scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        self.waiting.extendleft(reversed(deferred))
        return scheduled

    def _seats_taken(self) -> int:
        """Seats of the running sequences, the samples their leaders will fork included."""
        return sum(s.num_seats for s in self.running)

    def _prefix_in_flight(self, seq: Sequence, num_cached_blocks: int) -> bool:
        """Whether a prefilling sequence will cache the first full block of seq that
        the prefix cache does not hold yet (same tokens up to it, same extra keys)."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return False
        end = (num_cached_blocks + 1) * bm.block_size  # through the first uncached block
        if end > seq.num_tokens - 1:
            return False  # no uncached full block before its last token
        prefix = seq.token_slice(0, end)
        return any(other.status is Status.PREFILLING and other.prefill_target >= end
                   and other.num_computed_tokens < end and other.extra_keys == seq.extra_keys
                   and other.token_slice(0, end) == prefix
                   for other in self.running)

    def _fit_bucket(self, scheduled: list[ScheduledSeq]) -> None:
        """Trims the step's last prefill chunk so that the step's token count lands on
        a bucket of the runner's ladder when the next bucket up would pad it by more
        than an eighth; the trimmed tokens run in the next step.  Steps under 32
        tokens are left alone: they cost about the same whatever their size (the
        weights' memory traffic dominates), so splitting them would only add steps."""
        if not self.token_buckets or not scheduled:
            return
        last, n = scheduled[-1], sum(s.num_new for s in scheduled)
        up = min((b for b in self.token_buckets if b >= n), default=n)
        down = max((b for b in self.token_buckets if b <= n), default=0)
        if up - n > n // 8 and down >= 32 and last.num_new > n - down and not last.drafts:
            last.num_new -= n - down

    def _try_admit(self, seq: Sequence, budget: int, hit: PrefixHit) -> int | None:
        """Reuses seq's longest usable cached prefix (`hit`: BlockManager.find_hit)
        and makes room for its first chunk; returns the chunk's token count (0: a
        fork leader that is fully cached), or None, changing nothing, when the
        pool cannot hold it.  Writing into the last reused block (a fully cached
        prompt) copies it."""
        bm = self.block_manager
        # Always recompute the last token (its logits give the next one).
        computed = min(hit.num_blocks * bm.block_size, seq.num_tokens - 1)
        n = min(seq.prefill_target - computed, budget)
        if not bm.admit(seq, hit, computed, computed + n):
            return None
        seq.num_computed_tokens = computed
        bm.record_admission(seq.num_tokens, computed, hit.num_blocks)
        if not seq.output_token_ids:
            seq.num_cached_tokens = computed
        return n

    def _fork(self, leader: Sequence) -> None:
        """Parallel sampling: the samples share every block of the prefilled prompt."""
        at = self.running.index(leader) + 1
        for child in leader.forks:
            self.block_manager.fork(leader, child)
            child.prompt_logprobs = list(leader.prompt_logprobs)  # the prompt's, computed once
            child.routes = list(leader.routes)
            child.num_computed_tokens = leader.num_computed_tokens
            child.status = Status.PREFILLING
        self.running[at:at] = leader.forks
        leader.forks = []

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int) -> bool:
        """Makes room for num_tokens of seq, preempting the latest-arrived running
        sequence while the pool is short (seq itself when it is the latest: False).
        A sequence that needs more blocks than the whole pool ends with an error."""
        if self.block_manager.pages_to_hold(seq.num_computed_tokens, num_tokens) > self.block_manager.num_blocks - 1:
            self._fail(seq, f"sequence of {num_tokens} tokens needs more KV blocks than the "
                            f"whole pool has ({self.block_manager.num_blocks - 1})")
            return False
        while not self._prepare_write(seq, num_tokens):
            others = [s for s in self.running if s is not seq and not s.is_done]
            if not others and not any(s.is_done for s in self.running):
                # Alone in the pool and still short (copy-on-write needs a spare block).
                self._fail(seq, f"sequence of {num_tokens} tokens cannot fit in the KV pool "
                                f"({self.block_manager.num_blocks - 1} blocks) even alone")
                return False
            # Asynchronous scheduling: a sequence whose last token is on the device
            # frees its blocks when that step completes; it is no victim, and when
            # seq would be its own, seq waits a step for those blocks instead.
            finishing = [s for s in others if s.awaits_last_token]
            others = [s for s in others if not s.awaits_last_token]
            if finishing and max(others + [seq], key=lambda s: s.arrival_time) is seq:
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
        return self.block_manager.prepare_seq_write(seq, seq.num_computed_tokens, num_tokens)

    def _preempt(self, victim: Sequence) -> None:
        """Takes victim off the running list.  recompute: its blocks are dropped
        (cached ones stay cached) and it is requeued first; on resume it prefills
        prompt + generated tokens in one pass, reusing what is still cached.
        swap: its computed blocks are queued for a device->host copy (run by the
        runner before anything writes the pool again) and it waits in `swapped`
        until there is room; recompute when the host pool is full."""
        self.running.remove(victim)
        self.stats.preemptions += 1
        self._preempted_now = True
        pending = next((r for r in self._swap_in if r.seq is victim), None)
        if pending is not None:  # swapped in by this very schedule(): nothing was written yet
            self._swap_in.remove(pending)
            self.block_manager.release(victim)
            self._park(victim, pending.slots, pending.status)
            self.stats.swap_preemptions += 1
            return
        if self.preemption_mode == "swap":
            blocks = self.block_manager.swap_out(victim)
            n = len(blocks)
            slots = self.swap_space.allocate(n) if n and self.swap_space is not None else None
            if slots is not None:
                self._swap_out.append(SwapOut(victim, blocks, slots))
                status = victim.status
                self.block_manager.release(victim)
                self._park(victim, slots, status)
                self.stats.swap_preemptions += 1
                return
            if n:
                self.stats.swap_fallbacks += 1  # no room in host memory
        self.block_manager.release(victim)
        self._requeue(victim)
        self.stats.recompute_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        """Back to the front of the waiting queue with no K/V: it prefills its prompt and output again."""
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _park(self, seq: Sequence, slots: list[int], status: Status) -> None:
        seq.swap_slots, seq.swap_status = slots, status
        seq.status = Status.SWAPPED
        bisect.insort(self.swapped, seq, key=lambda s: s.arrival_time)

    def _schedule_swap_in(self) -> bool:
        """Resumes swapped sequences, earliest arrival first, into whatever blocks
        are free now (the runner copies their host blocks in before the step).
        True when none is left waiting in host memory."""
        bm = self.block_manager
        while self.swapped:
            seq = self.swapped[0]
            if self._seats_taken() + seq.num_seats > self.max_num_seqs:
                return False
            # Room for the restored blocks and for its next token.
            if bm.swap_in_need(seq) > bm.num_free_blocks:
                if not self.running:  # an empty pool cannot hold it: it never will
                    self.swapped.pop(0)
                    self._fail(seq, f"swapped-out sequence of {seq.num_tokens} tokens cannot fit "
                                    f"in the KV pool ({self.block_manager.num_blocks - 1} blocks)")
                    continue
                return False
            self.swapped.pop(0)
            blocks = bm.swap_in(seq)  # private: the host copy is the content
            self._swap_in.append(SwapIn(seq, seq.swap_slots, list(blocks), seq.swap_status))
            seq.status, seq.swap_slots, seq.swap_status = seq.swap_status, [], None
            self.running.append(seq)
        return True

    def _take_swaps(self) -> tuple[list[SwapOut], list[SwapIn]]:
        """This step's block moves, for the runner to apply before the step's copies
        and forward: swap-outs first (device -> host: the victims' blocks may be
        rewritten by this step), then swap-ins (host -> device).  The swap-ins'
        host slots are freed here; their data stays until the next schedule()."""
        outs, ins = self._swap_out, self._swap_in
        self._swap_out, self._swap_in = [], []
        for r in ins:
            self.swap_space.free(r.slots)
        self.stats.swapped_out_blocks += sum(len(r.block_ids) for r in outs)
        self.stats.swapped_in_blocks += sum(len(r.block_ids) for r in ins)
        return outs, ins

    def fail(self, seq: Sequence, error: str | None, reason: str = "error") -> None:
        """Ends seq wherever it is (waiting, running or swapped) with `reason` and
        `error` (None for an early but normal end), freeing its blocks and host swap slots."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.swapped:
            self.swapped.remove(seq)
        self._fail(seq, error, reason)

    def requeue_running(self) -> None:
        """Sends every running sequence back to the waiting queue with no K/V (the
        pool's contents were lost): it prefills prompt + output again on resume."""
        for seq in reversed(self.running):
            self.block_manager.release(seq)
            self._requeue(seq)
        self.running.clear()

    def requeue_all(self) -> None:
        """requeue_running, and the swapped-out sequences too, their host copies
        dropped: every unfinished sequence prefills its tokens again (new weights)."""
        self.requeue_running()
        for seq in reversed(self.swapped):
            self.swap_space.free(seq.swap_slots)
            seq.swap_slots, seq.swap_status = [], None
            self._requeue(seq)
        self.swapped.clear()

    def _fail(self, seq: Sequence, error: str | None, reason: str = "error") -> None:
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
        self.block_manager.release(seq)
        for s in [seq] + seq.forks:
            if not s.is_done:  # (a finished member of a static batch keeps its result)
                s.finish(reason, error)
        seq.forks = []

    def finish(self, seq: Sequence) -> None:
        """Called once seq is DONE: continuous frees its slot and blocks now; a
        static batch holds them until its last member is done."""
        if self.policy == "continuous":
            self.running.remove(seq)
            self.block_manager.release(seq)

    def _end_static_batch(self) -> None:
        # Static batching hands back the whole batch at once: that is when its
        # members' requests complete.
        now = time.perf_counter()
        for seq in self.running:
            self.block_manager.release(seq)
            seq.finish_time = now
        self.running.clear()

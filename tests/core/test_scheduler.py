"""The scheduler and the block manager on their own: no model, no jax.

A fake engine drives them: each step it applies the step's block moves to a
fake pool (one token id per slot, so a slot's "K/V" is the token written
there), checks what every scheduled sequence would read, writes its new tokens,
and advances it as LLM.step does (a fake sampled token once its prefill
completes, finishing at max_tokens).  Hypothesis draws the workloads: pool and
block sizes, budgets, seats, prompts sharing prefixes, n > 1, requests arriving
mid-run, under continuous / static batching, recompute / swap preemption, with
prefix caching on and off.  Every step: the token budget holds, at most
max_num_seqs seats are taken, every block is referenced by exactly as many
block tables as its refcount says, and no scheduled write lands in a shared or
cached block.  At the end every request has finished with all its tokens and
every block and host swap slot is back.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.core.block_manager import NULL_BLOCK, BlockManager
from jpaged.core.config import SchedulerConfig
from jpaged.core.kv_layout import KVLayout
from jpaged.core.rounding import cdiv
from jpaged.core.scheduler import Scheduler, SchedulerOutput
from jpaged.core.sequence import SamplingParams, Sequence, Status
from jpaged.core.swap_space import HostSwapSpace

EMPTY = -1  # a fake pool slot no token was written to
MAX_STEPS = 20_000


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    arrival_step: int
    salt: str | None = None


@dataclasses.dataclass(frozen=True)
class Workload:
    policy: str
    preemption_mode: str
    prefix_caching: bool
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    swap_blocks: int
    token_buckets: tuple[int, ...]
    requests: tuple[Request, ...]
    window: int | None = None  # a hybrid layout: a global group and a sliding group of this window


def fake_token(seq: Sequence) -> int:
    """A deterministic "sample": samples of one prompt (different seeds) diverge."""
    return 3 + (seq.seed * 7919 + len(seq.output_token_ids) * 104729) % 11


class FakeEngine:
    """LLM.step without a model: the scheduler's decisions applied to a fake pool."""

    def __init__(self, w: Workload):
        self.w = w
        self.layout = KVLayout(1, ((1,), (0,)), (None, w.window)) if w.window else None
        self.bm = BlockManager(w.num_blocks, w.block_size, enable_prefix_caching=w.prefix_caching,
                               layout=self.layout)
        self.swap = HostSwapSpace(w.swap_blocks, (w.block_size,), np.int64)
        config = SchedulerConfig(scheduler=w.policy, max_num_seqs=w.max_num_seqs,
                                 max_num_batched_tokens=w.max_num_batched_tokens, preemption_mode=w.preemption_mode)
        self.sched = Scheduler(self.bm, config, swap_space=self.swap, token_buckets=w.token_buckets)
        self.pool = np.full((w.num_blocks, w.block_size), EMPTY, np.int64)
        self.requests: dict[int, Sequence] = {}  # by index in w.requests

    def add(self, i: int, r: Request) -> None:
        """As LLM.add_request: samples 1..n-1 are forks with seeds seed + i."""
        params = SamplingParams(max_tokens=r.max_tokens, n=r.n, ignore_eos=True, cache_salt=r.salt)
        seq = Sequence(i, list(r.prompt), params, seed=1000 * i)
        for k in range(1, r.n):
            child = Sequence(-(1000 * i + k), seq.prompt_token_ids, params, seed=seq.seed + k)
            child.group = seq.group
            seq.group.append(child)
            seq.forks.append(child)
        self.requests[i] = seq
        self.sched.add(seq)

    def run(self) -> None:
        pending = sorted(enumerate(self.w.requests), key=lambda x: x[1].arrival_step)
        for step in range(MAX_STEPS):
            while pending and pending[0][1].arrival_step <= step:
                self.add(*pending.pop(0))
            if not pending and not self.sched.has_work:
                return
            out = self.sched.schedule()
            self.check_step(out)
            self.execute(out)
            for s in out.scheduled:
                self.advance(s.seq, s.num_new)
        raise AssertionError(f"not done after {MAX_STEPS} steps: the scheduler stopped making progress")

    def execute(self, out: SchedulerOutput) -> None:
        """The runner's order: swap-outs, swap-ins, copies, then the step's writes."""
        if out.swap_out:
            ids = [b for r in out.swap_out for b in r.block_ids]
            self.swap.store([x for r in out.swap_out for x in r.slots], self.pool[ids])
        if out.swap_in:
            ids = [b for r in out.swap_in for b in r.block_ids]
            self.pool[ids] = self.swap.load([x for r in out.swap_in for x in r.slots])
        if out.block_copies:
            src, dst = zip(*out.block_copies)
            self.pool[list(dst)] = self.pool[list(src)]  # every source read before any write
        bs = self.w.block_size
        for s in out.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            for g, table in enumerate(self.bm.tables(seq)):
                table = table.block_ids
                window = None if g == 0 else self.w.window
                # The context this step's attention reads: a sliding group's, from the
                # window of the step's first token on.
                for pos in range(0 if window is None else max(0, start - window + 1), start):
                    assert self.pool[table[pos // bs], pos % bs] == seq.token_ids[pos], (seq.seq_id, g, pos)
                for pos in range(start, start + s.num_new):
                    self.pool[table[pos // bs], pos % bs] = seq.token_ids[pos]

    def advance(self, seq: Sequence, num_new: int) -> None:
        """LLM._advance with a fake sample."""
        seq.num_computed_tokens += num_new
        self.bm.cache_full_blocks(seq)
        if seq.num_computed_tokens < seq.num_tokens:
            return  # a prefill chunk
        seq.output_token_ids.append(fake_token(seq))
        seq.status = Status.DECODING
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            seq.finish("length")
            self.sched.finish(seq)

    def check_step(self, out: SchedulerOutput) -> None:
        w, sched, bm = self.w, self.sched, self.bm
        assert out.num_tokens <= w.max_num_batched_tokens
        assert len(out.scheduled) <= w.max_num_seqs
        assert sum(s.num_seats for s in sched.running) <= w.max_num_seqs
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            seq = s.seq
            assert seq.status in (Status.PREFILLING, Status.DECODING) and s.num_new >= 1
            assert s.num_new == 1 if seq.status is Status.DECODING else \
                seq.num_computed_tokens + s.num_new <= seq.prefill_target
            end = seq.num_computed_tokens + s.num_new
            for table in bm.tables(seq):
                table = table.block_ids
                assert len(table) >= bm.blocks_for(end)
                for b in table[seq.num_computed_tokens // w.block_size:bm.blocks_for(end)]:
                    # Spelled out rather than bm.needs_cow(b), which is what this checks.
                    assert b != NULL_BLOCK and bm.refcount[b] == 1 and b not in bm._handle, \
                        f"seq {seq.seq_id} writes shared or cached block {b}"
            if w.window:  # a sliding group holds nothing wholly before its window
                sliding = bm.tables(seq)[1].block_ids
                first = max(0, seq.num_computed_tokens - w.window + 1) // w.block_size
                assert all(b == NULL_BLOCK for b in sliding[:first])
        self.check_holders()

    def check_holders(self) -> None:
        """Each block is in exactly refcount block tables (of running sequences only),
        each swapped-out sequence holds its host slots and nothing else does."""
        sched, bm = self.sched, self.bm
        held = collections.Counter(b for s in sched.running for t in bm.tables(s) for b in t.block_ids
                                   if b != NULL_BLOCK)
        assert all(held[b] == bm.refcount[b] for b in range(1, bm.num_blocks)), "a block held twice"
        assert all(not t.block_ids for s in (*sched.waiting, *sched.swapped) for t in bm.tables(s))
        slots = [x for s in sched.swapped for x in s.swap_slots]
        assert len(set(slots)) == len(slots) == self.swap.num_used_blocks
        bm.check_invariants()

    def check_done(self) -> None:
        sched, bm = self.sched, self.bm
        assert not (sched.waiting or sched.running or sched.swapped)
        assert len(self.requests) == len(self.w.requests)
        for i, r in enumerate(self.w.requests):
            seq = self.requests[i]
            assert len(seq.group) == r.n and not seq.forks
            for s in seq.group:
                assert s.finish_reason == "length", (s.seq_id, s.finish_reason, s.error)
                assert len(s.output_token_ids) == r.max_tokens
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks - 1
        assert bm.num_shared_blocks == 0 and self.swap.num_used_blocks == 0
        self.check_holders()


def run_workload(w: Workload) -> FakeEngine:
    engine = FakeEngine(w)
    engine.run()
    engine.check_done()
    return engine


# ----------------------------------------------------------------- workloads
@st.composite
def workloads(draw, policy: str, preemption_mode: str, prefix_caching: bool) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    window = draw(st.sampled_from([None, None, 1, 3, 5, 9]))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 40))
    tokens = st.integers(3, 8)  # few distinct tokens: prompts share blocks often
    prefixes = draw(st.lists(st.lists(tokens, max_size=20), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(tokens, max_size=12))
        requests.append(Request(
            prompt=tuple(prompt or [3]), max_tokens=draw(st.integers(1, 12)),
            n=draw(st.integers(1, min(3, max_num_seqs))), arrival_step=draw(st.integers(0, 12)),
            salt=draw(st.sampled_from([None, None, "a"]))))
    # Room for the longest request alone (+1 for a copy-on-write), and a little more:
    # the pool is small, so sequences get preempted.
    need = max(cdiv(len(r.prompt) + r.max_tokens, block_size) for r in requests) + 1
    if window:  # the sliding group's blocks too: the window and a chunk of up to `budget` tokens
        need += min(need, cdiv(window - 1 + budget, block_size) + 2)
    num_blocks = 1 + need + draw(st.integers(0, 12))
    ladder = tuple(sorted({min(1 << i, budget) for i in range(budget.bit_length() + 1)}))
    return Workload(policy=policy, preemption_mode=preemption_mode, prefix_caching=prefix_caching,
                    block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=budget, swap_blocks=draw(st.integers(0, 3 * need)),
                    token_buckets=draw(st.sampled_from([(), ladder])), requests=tuple(requests),
                    window=window)


MODES = [(policy, mode, caching) for policy in ("continuous", "static")
         for mode in ("recompute", "swap") for caching in (False, True)]


@pytest.mark.parametrize("policy,preemption_mode,prefix_caching", MODES)
def test_invariants_hold_and_every_request_finishes(policy, preemption_mode, prefix_caching):
    @settings(max_examples=60, deadline=None)
    @given(workloads(policy, preemption_mode, prefix_caching))
    def check(w: Workload) -> None:
        run_workload(w)
    check()


@pytest.mark.parametrize("window", [None, 5])
def test_small_pool_preempts_and_recovers(window):
    """A fixed workload that must preempt: 6 requests of up to 6 blocks in a pool of 8
    (with a sliding group of window 5 beside: 4 more blocks)."""
    for policy, mode, caching in MODES:
        requests = tuple(Request(prompt=tuple([3 + i % 2] * 10 + [5, 6]), max_tokens=10, n=1 + i % 2,
                                 arrival_step=i) for i in range(6))
        engine = run_workload(Workload(policy, mode, caching, block_size=4, num_blocks=13 if window else 9,
                                       max_num_seqs=4, max_num_batched_tokens=16, swap_blocks=12,
                                       token_buckets=(), requests=requests, window=window))
        assert engine.sched.stats.preemptions > 0, (policy, mode, caching)
        if mode == "swap":
            assert engine.sched.stats.swap_preemptions > 0, (policy, caching)


def test_runs_without_jax():
    """The scheduler core needs no device stack: run the fixed workload in a fresh
    interpreter (pytest's has long since imported jax) and check jax never loaded."""
    root = pathlib.Path(__file__).resolve().parents[2]
    code = ("import sys\nsys.path.insert(0, 'tests/core')\nimport test_scheduler\n"
            "test_scheduler.test_small_pool_preempts_and_recovers(5)\n"
            "loaded = {m.split('.')[0] for m in sys.modules} & {'jax', 'flax', 'pallas_kernels'}\n"
            "assert sys.modules['jpaged'].__file__.startswith(sys.argv[1]), sys.modules['jpaged'].__file__\n"
            "assert not loaded, loaded\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code, str(root)], cwd=root, env=env, check=True)

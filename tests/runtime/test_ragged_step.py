"""The ragged step: token-budget scheduling, bucket fitting, in-batch prefix sharing,
and mixed decode + prefill steps giving the same tokens as each request alone."""

from __future__ import annotations

from helpers import random_prompts

from jpaged.core.block_manager import BlockManager
from jpaged.core.config import SchedulerConfig
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import SamplingParams, Sequence, Status


def make_scheduler(num_blocks=64, block_size=4, budget=16, max_num_seqs=8, caching=False, buckets=()):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    config = SchedulerConfig(scheduler="continuous", max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(bm, config, token_buckets=buckets)


def run_step(sched, out):
    """What the engine does after a forward: advance every scheduled sequence."""
    for s in out.scheduled:
        seq = s.seq
        seq.num_computed_tokens += s.num_new
        sched.block_manager.cache_full_blocks(seq)
        if seq.num_computed_tokens >= seq.num_tokens:
            seq.output_token_ids.append(7)
            seq.status = Status.DECODING


def test_decodes_first_then_chunks_within_the_budget():
    sched = make_scheduler(budget=16)
    a = Sequence(0, list(range(3, 9)), SamplingParams(max_tokens=50))     # 6 tokens
    sched.add(a)
    run_step(sched, sched.schedule())
    assert a.status is Status.DECODING
    b = Sequence(1, list(range(3, 43)), SamplingParams(max_tokens=50))    # 40 tokens
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new) for s in out.scheduled] == [(0, 1), (1, 15)]
    run_step(sched, out)
    out = sched.schedule()  # the decode again, then b's next chunk
    assert [(s.seq.seq_id, s.num_new) for s in out.scheduled] == [(0, 1), (1, 15)]
    assert out.num_tokens <= 16


def test_last_chunk_trimmed_onto_a_bucket():
    """2 decodes + a 40-token prompt = 42 tokens would pad to 64; the chunk is cut
    to 30 so that the step is exactly the 32 bucket."""
    sched = make_scheduler(budget=64, buckets=(8, 16, 32, 64))
    for i in range(2):
        sched.add(Sequence(i, [5, 6, 7], SamplingParams(max_tokens=50)))
    run_step(sched, sched.schedule())
    sched.add(Sequence(2, list(range(3, 43)), SamplingParams(max_tokens=50)))
    out = sched.schedule()
    assert [s.num_new for s in out.scheduled] == [1, 1, 30] and out.num_tokens == 32
    run_step(sched, out)
    out = sched.schedule()  # the rest: 2 decodes + 10 prompt tokens = 12 -> bucket 16 (no trim)
    assert [s.num_new for s in out.scheduled] == [1, 1, 10]


def test_shared_prefix_in_flight_is_computed_once():
    """Three requests share 3 full blocks that are not cached yet: only the first is
    admitted; the others wait one step and then reuse its blocks."""
    sched = make_scheduler(budget=64, caching=True)
    prefix = list(range(10, 22))  # 3 blocks of 4
    seqs = [Sequence(i, prefix + [30 + i, 40 + i], SamplingParams(max_tokens=5)) for i in range(3)]
    other = Sequence(3, list(range(50, 60)), SamplingParams(max_tokens=5))
    for s in seqs + [other]:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 3]  # 1 and 2 wait; 3 shares nothing
    run_step(sched, out)
    out = sched.schedule()
    admitted = {s.seq.seq_id: s.num_new for s in out.scheduled if s.seq.seq_id in (1, 2)}
    assert admitted == {1: 2, 2: 2}  # only their own last tokens: the prefix hit the cache
    assert seqs[1].num_cached_tokens == seqs[2].num_cached_tokens == 12


def test_mixed_steps_equal_each_request_alone(make_tiny_llm):
    """Prompts of many lengths arriving while others decode, chunked by a small
    budget: every request's greedy tokens equal those it gets alone."""
    prompts = random_prompts([5, 40, 17, 3, 64, 9, 33], seed=11)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm = make_tiny_llm(max_num_batched_tokens=24, max_num_seqs=4, build_padded_buckets=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone
    # (the first run pads more: a step whose bucket is still being built runs in a larger one)
    llm.runner.wait_for_programs()
    assert [o.token_ids for o in llm.generate(prompts, params)] == together
    assert llm.stats.padding_ratio < 1.5


def test_shared_prefix_engine_hits_and_matches(make_tiny_llm, tiny_llm):
    """In the engine: requests admitted together that share an uncached prefix
    compute it once (the later ones hit the cache) and give the same tokens."""
    prefix = random_prompts([48], seed=4)[0]
    prompts = [prefix + tail for tail in random_prompts([5, 7, 3], seed=5)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm = make_tiny_llm(enable_prefix_caching=True)
    outs = llm.generate(prompts, params)
    assert llm.stats.cached_prompt_tokens >= 2 * 48
    plain = tiny_llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]

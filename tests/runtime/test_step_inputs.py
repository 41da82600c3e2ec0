"""The step-input seam: build_step_inputs packs the scheduled sequences into one
StepInputs pytree (host numpy only) whose structure names the compiled variant,
and which pickles for the multi-process broadcast."""

from __future__ import annotations

import pickle

import jax
import numpy as np

from jpaged.core.block_manager import BlockManager
from jpaged.core.config import SchedulerConfig
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import SamplingParams, Sequence, Status
from jpaged.runtime.step_inputs import StepInputs, build_step_inputs, padding_step_inputs

BLOCK, WIDTH = 4, 8


def schedule(*params: SamplingParams):
    """One step: a 6-token prompt already prefilled (a decode of 1 token) and a
    10-token prompt prefilling, with the given params (one per sequence)."""
    sched = Scheduler(BlockManager(64, BLOCK, enable_prefix_caching=False),
                      SchedulerConfig(scheduler="continuous", max_num_seqs=8, max_num_batched_tokens=32))
    a = Sequence(0, list(range(3, 9)), params[0], seed=5)
    sched.add(a)
    sched.schedule()
    a.num_computed_tokens += 6
    a.output_token_ids.append(77)
    a.status = Status.DECODING
    sched.add(Sequence(1, list(range(20, 30)), params[1], seed=2**40 + 9))
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new) for s in out.scheduled] == [(0, 1), (1, 10)]
    return out.scheduled


def build(scheduled, T=16, S=4):
    return build_step_inputs(scheduled, num_tokens=T, num_seqs=S, block_size=BLOCK, table_width=WIDTH,
                             vocab_size=64)


def test_tokens_and_metadata():
    scheduled = schedule(SamplingParams(), SamplingParams())
    x = build(scheduled)
    a, b = (s.seq for s in scheduled)
    assert x.num_tokens == 16 and x.num_seqs == 4
    np.testing.assert_array_equal(x.tokens[:11], [77] + list(range(20, 30)))
    np.testing.assert_array_equal(x.tokens[11:], 0)
    np.testing.assert_array_equal(x.meta.positions[:11], [6] + list(range(10)))
    np.testing.assert_array_equal(x.meta.kv_lens, [7, 10, 0, 0])
    np.testing.assert_array_equal(x.meta.cu_q_lens, [0, 1, 11, 11, 11])
    np.testing.assert_array_equal(x.meta.logits_indices, [0, 10, 0, 0])
    for i, seq in enumerate((a, b)):
        ids = seq.block_table.block_ids
        np.testing.assert_array_equal(x.meta.block_tables[i, :len(ids)], ids)
    # token 0 is a's position 6: its block 1, offset 2; b's tokens fill its blocks in order
    assert (x.meta.write_blocks[0], x.meta.write_offsets[0]) == (a.block_table.block_ids[1], 2)
    np.testing.assert_array_equal(x.meta.write_blocks[1:11], np.repeat(b.block_table.block_ids, BLOCK)[:10])
    np.testing.assert_array_equal(x.meta.write_offsets[1:11], np.arange(10) % BLOCK)
    for leaf in jax.tree.leaves(x):
        assert isinstance(leaf, np.ndarray)  # host numpy only


def test_greedy_step_is_the_padding_structure():
    """All greedy, no logprobs: the structure precompile compiles (sampling=None)."""
    x = build(schedule(SamplingParams(), SamplingParams()))
    assert x.sampling is None and x.prompt_targets is None and not x.logprobs
    assert jax.tree.structure(x) == jax.tree.structure(padding_step_inputs(16, 4, WIDTH))


def test_sampling_columns():
    x = build(schedule(SamplingParams(temperature=0.5), SamplingParams()))
    s = x.sampling
    assert s.top_k is None and s.top_p is None  # no row filters: no threshold search
    np.testing.assert_array_equal(s.temperature, np.array([0.5, 0, 0, 0], np.float32))
    np.testing.assert_array_equal(s.seed, np.array([5, 9, 0, 0], np.uint32))  # low 32 bits
    np.testing.assert_array_equal(s.step, [1, 0, 0, 0])
    assert s.seed.dtype == np.uint32 and s.temperature.dtype == np.float32
    y = build(schedule(SamplingParams(temperature=0.5), SamplingParams(top_k=3, top_p=0.9,
                                                                       temperature=1.0)))
    np.testing.assert_array_equal(y.sampling.top_k, [0, 3, 0, 0])
    np.testing.assert_allclose(y.sampling.top_p, [1, 0.9, 0, 0])


def test_prompt_targets():
    """Each flat token's successor in its sequence; 0 past a sequence's known tokens."""
    x = build(schedule(SamplingParams(logprobs=2), SamplingParams(prompt_logprobs=1)))
    assert x.logprobs
    np.testing.assert_array_equal(x.prompt_targets[:11], [0] + list(range(21, 30)) + [0])
    y = build(schedule(SamplingParams(logprobs=2), SamplingParams()))  # nobody owes prompt logprobs
    assert y.logprobs and y.prompt_targets is None


def test_each_variant_is_its_own_structure():
    variants = [(SamplingParams(), SamplingParams()),
                (SamplingParams(temperature=1.0), SamplingParams()),
                (SamplingParams(temperature=1.0, top_k=5), SamplingParams()),
                (SamplingParams(logprobs=1), SamplingParams()),
                (SamplingParams(), SamplingParams(prompt_logprobs=0)),
                (SamplingParams(temperature=1.0, logprobs=0), SamplingParams(prompt_logprobs=0))]
    structures = {jax.tree.structure(build(schedule(*p))) for p in variants}
    assert len(structures) == len(variants)


def test_pickles_for_the_broadcast():
    x = build(schedule(SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(prompt_logprobs=3)))
    y = pickle.loads(pickle.dumps(("step", [(1, 2)], x)))[2]
    assert isinstance(y, StepInputs) and jax.tree.structure(y) == jax.tree.structure(x)
    for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
        np.testing.assert_array_equal(u, v)
        assert u.dtype == v.dtype

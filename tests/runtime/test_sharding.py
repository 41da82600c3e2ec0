"""Tensor and data parallelism on four simulated CPU devices (set in conftest.py).

On the CPU these check correctness, not speed: the sharded engine must give the
one-device engine's tokens and (within fp32 all-reduce rounding) its logprobs,
with the weights, the pool and the step's collectives where the design puts them.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import SMOLLM_ENGINE, TINY_ENGINE, random_prompts
from jpaged.core.config import ConfigError
from jpaged.engine.llm import LLM
from jpaged.engine.protocol import Engine
from jpaged.engine.router import DataParallelLLM, create_engine
from jpaged.core.sequence import SamplingParams
from jpaged.layers.sharding import POOL_SPEC, collectives, weight_spec

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5)
PROMPTS = random_prompts([5, 17, 40, 3, 29], seed=11)
# fp32 logprobs after row-parallel all-reduces sum in another order than one device's matmul.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def one_device(tiny_llm):
    return tiny_llm


@pytest.fixture(scope="module")
def expected(one_device):
    return one_device.generate(PROMPTS, GREEDY)


def assert_same(outputs, expected) -> None:
    for got, want in zip(outputs, expected):
        assert got.token_ids == want.token_ids
        got_lp = [t.logprob for t in got.logprobs]
        want_lp = [t.logprob for t in want.logprobs]
        np.testing.assert_allclose(got_lp, want_lp, atol=LOGPROB_ATOL)
        assert [t.top[0][0] for t in got.logprobs] == [t.top[0][0] for t in want.logprobs]


def leaf_name(path) -> str:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return next(n for n in reversed(names) if isinstance(n, str) and n != "value")


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_tp2_matches_one_device(make_tiny_llm, expected, impl):
    llm = make_tiny_llm(tensor_parallel_size=2, attention_impl=impl)
    assert_same(llm.generate(PROMPTS, GREEDY), expected)
    pool = llm.runner.kv_pool
    assert pool.sharding.spec == POOL_SPEC and len(pool.sharding.device_set) == 2
    for path, leaf in jax.tree_util.tree_flatten_with_path(llm.params)[0]:
        assert leaf.sharding.spec == weight_spec(leaf_name(path), leaf.ndim), path
    # Each device holds half of the pool and about half of the weights (norms are replicated).
    memory = llm.memory_per_device()
    assert len(memory) == 2
    full_weights = sum(x.nbytes for x in jax.tree.leaves(llm.params))
    for weights, pool_bytes in memory.values():
        assert pool_bytes == pool.nbytes // 2
        assert full_weights / 2 <= weights < 0.55 * full_weights
    llm.runner.wait_for_programs()  # the buckets the first run queued in the background
    compiled = llm.num_compilations
    assert_same(llm.generate(PROMPTS, GREEDY), expected)
    assert llm.num_compilations == compiled


def test_tp_decode_step_gathers_no_pool_or_weight(make_tiny_llm):
    llm = make_tiny_llm(tensor_parallel_size=2, attention_impl="cpu")
    llm.precompile(8)  # the decode bucket
    (exe,) = llm.runner.executables()
    ops = collectives(exe.as_text())
    reduce_bytes = [b for op, _, b in ops if op == "all-reduce"]
    # One all-reduce of the [8, hidden] activations after the embedding and after
    # each row-parallel matmul (o and down) of each layer, and one of the [8] NaN
    # flags (StepResult.nan_rows: a row's logits are split over the vocabulary).
    activations = 8 * llm.model_config.hidden_size * 4
    assert sorted(reduce_bytes) == [8] + [activations] * (1 + 2 * llm.model_config.num_layers)
    smallest_weight = min(x.nbytes for x in jax.tree.leaves(llm.params) if x.ndim == 2)
    gathers = [(shape, b) for op, shape, b in ops if op == "all-gather"]
    assert all(b < smallest_weight // 8 for _, b in gathers), gathers  # only the argmax's [8, tp] candidates


def test_fewer_kv_heads_than_devices_are_replicated(make_tiny_llm, expected):
    llm = make_tiny_llm(tensor_parallel_size=4)  # the tiny Llama has 2 KV heads
    assert llm.model_config.num_kv_heads == 4
    assert llm.runner.kv_pool.sharding.shard_shape(llm.runner.kv_pool.shape)[3] == 1
    assert_same(llm.generate(PROMPTS, GREEDY), expected)


def test_heads_that_do_not_divide_fail_at_start(make_tiny_llm):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 3 does not divide .* 4 query heads"):
        make_tiny_llm(tensor_parallel_size=3)
    with pytest.raises(ValueError, match="needs 8 devices; 4 are visible"):
        make_tiny_llm(tensor_parallel_size=8)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_tp(make_tiny_llm, expected, mode):
    # 12 blocks of 16 tokens for 5 sequences growing to 56+ tokens: they must preempt.
    # Preemption leaves the tokens as they are (tests/engine/test_preemption.py): one device's
    # unpreempted run is the reference.
    settings = dict(num_blocks=12, preemption_mode=mode, swap_space_gb=0.01)
    llm = make_tiny_llm(tensor_parallel_size=2, **settings)
    assert_same(llm.generate(PROMPTS, GREEDY), expected)
    assert llm.stats.preemptions > 0
    assert llm.runner.kv_pool.sharding.spec == POOL_SPEC


def test_prefix_cache_under_tp(make_tiny_llm):
    shared = random_prompts([48], seed=3)[0]
    prompts = [shared + p for p in random_prompts([4, 9, 1], seed=4)]
    one = make_tiny_llm(enable_prefix_caching=True)
    tp = make_tiny_llm(enable_prefix_caching=True, tensor_parallel_size=2)
    for llm in (one, tp):
        llm.generate(prompts[:1], GREEDY)  # caches the shared blocks
    want = one.generate(prompts[1:], GREEDY)
    assert_same(tp.generate(prompts[1:], GREEDY), want)
    assert tp.stats.cached_prompt_tokens == one.stats.cached_prompt_tokens == 2 * 48


def test_data_parallel_replicas(tiny_llama_dir, expected):
    dp = create_engine(model=tiny_llama_dir, **{**TINY_ENGINE, "enable_prefix_caching": True},
                       data_parallel_size=2, tensor_parallel_size=2)  # a 2 x 2 mesh
    assert isinstance(dp, DataParallelLLM)
    assert [len(r.memory_per_device()) for r in dp.replicas] == [2, 2]
    devices = [set(r.memory_per_device()) for r in dp.replicas]
    assert not devices[0] & devices[1]
    assert_same(dp.generate(PROMPTS, GREEDY), expected)
    loads = dp.replica_summary()
    assert all(r["requests"] >= 2 for r in loads)  # the batch was spread
    bad, good = dp.generate([[], PROMPTS[0]], GREEDY)  # a bad request fails alone
    assert bad.finish_reason == "error" and "empty prompt" in bad.error
    assert good.token_ids == expected[0].token_ids
    # A request sharing a cached prefix goes where the prefix is, whatever the order.
    shared = random_prompts([40], seed=5)[0]
    dp.generate([shared + [7]], GREEDY)
    home = next(r["replica"] for r in dp.replica_summary() if r["requests"])
    dp.generate([shared + [9, 10]], GREEDY)
    (hit,) = [r for r in dp.replica_summary() if r["requests"]]
    assert hit["replica"] == home and hit["cached_prompt_tokens"] == 32


def test_data_parallel_engine_speaks_global_request_ids(tiny_llama_dir, one_device, expected):
    """DataParallelLLM is an Engine like LLM: one id space over its replicas for
    add_request / step / get_sequence / abort / finish_sample, and a snapshot that
    combines the replicas'."""
    dp = create_engine(model=tiny_llama_dir, **TINY_ENGINE, data_parallel_size=2)
    assert isinstance(dp, Engine) and isinstance(one_device, Engine)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ids = [dp.add_request(p, long) for p in PROMPTS]
    assert ids == list(range(len(PROMPTS)))
    assert {dp.get_sequence(i).seq_id for i in ids} == set(ids)
    homes = {i: next(j for j, r in enumerate(dp.replicas) if r.get_sequence(i) is not None) for i in ids}
    assert len(set(homes.values())) == 2  # spread over both replicas
    dp.step()
    dp.step()  # (asynchronous scheduling: a step counts once it completes, at the next one)
    snap = dp.snapshot()
    assert snap.running == len(PROMPTS) and snap.used_blocks > 0
    assert snap.num_blocks == dp.num_blocks and snap.totals.steps == 2  # one step of each replica
    assert snap.outstanding_tokens == sum(r.snapshot().outstanding_tokens for r in dp.replicas)
    dp.abort([ids[0]])
    assert dp.get_sequence(ids[0]).finish_reason == "abort"  # until step() returns it
    dp.finish_sample(ids[1], 0)
    finished = {}
    while dp.has_unfinished_requests():
        finished.update({d.request_id: d.output for d in dp.step() if d.finished})
    assert set(finished) == set(ids) and finished[ids[0]].finish_reason == "abort"
    assert dp.get_sequence(ids[0]) is None and dp.replicas[homes[ids[0]]].get_sequence(ids[0]) is None
    assert finished[ids[1]].finish_reason == "stop" and len(finished[ids[1]].token_ids) <= 2
    for i in ids[2:]:
        assert finished[i].token_ids[:16] == expected[i].token_ids
    assert not dp._requests and dp.snapshot().used_blocks == 0
    outputs = dp.generate(PROMPTS, GREEDY)  # ids go on from where add_request left them
    assert sorted(o.request_id for o in outputs) == list(range(len(PROMPTS), 2 * len(PROMPTS)))


def test_smollm2_tp3_matches_one_device(smollm_llm):
    """SmolLM2-135M has 9 query and 3 KV heads: TP = 3 gives each device 3 and 1;
    TP = 2 fails at start-up with the sizes that work.  The sharded engine scans its
    30 layers (one layer compiled, not 30: the split of the heads is the same, and
    the unrolled loop under TP is the tiny engines' above)."""
    prompts = [{"prompt": p} for p in ("What is a paged KV cache?", "Name three primary colors.",
                                       "Write a haiku about JAX.")]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = smollm_llm.generate(prompts, params)
    tp = LLM(**{**SMOLLM_ENGINE, "tensor_parallel_size": 3, "layer_loop": "scan"})
    got = tp.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 2 does not divide .*9 query heads.*\[1, 3\]"):
        LLM(**{**SMOLLM_ENGINE, "tensor_parallel_size": 2})


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_pallas_kernels_under_shard_map(make_tiny_llm, expected, impl):
    """The Pallas kernels (interpret mode on this CPU) run per device under shard_map at TP = 2."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    llm = make_tiny_llm(tensor_parallel_size=2, attention_impl=impl, max_num_batched_tokens=64)
    got = llm.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in got] == [o.token_ids[:4] for o in expected[:2]]

"""Quantized KV pools (kv_cache_dtype int8 and fp8_e4m3): the row format, the
rotation in front of it, what a block costs, and the engine on it.

The kernels' own checks against the reference on quantized pools are in
tests/kernels (the shared case table's int8 / fp8 cases); the accuracy against
an fp32 pool on the embedded model is measured in benchmarks/bench_kv_quant.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_all_blocks_free, random_prompts
from jpaged.core.sequence import SamplingParams
from jpaged.models.base import kv_rotation
from jpaged.runtime import kv_pool as kv_pool_mod
from jpaged.core.config import ConfigError
from jpaged.runtime.kv_pool import (bytes_per_block, copy_blocks, gather_blocks, num_blocks_for,
                                    scatter_blocks)
from pallas_kernels.reference import (SCALE_CODE_MAX, check_page_layout, dequantize_rows, is_quantized,
                                      pool_block_size, pool_head_dim, quantize_pages, quantize_rows,
                                      read_pages, row_scale, write_kv_reference)

INT8, FP8 = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)
PROMPTS = random_prompts([5, 16, 21, 40], seed=23)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


# ------------------------------------------------------------- the row format
@pytest.mark.parametrize("dtype,qmax,steps,rel", [(INT8, 127, 4, None), (FP8, 448, 1, 1 / 8)])
def test_rows_round_trip_within_the_dtype_precision(dtype, qmax, steps, rel):
    """int8 scales are quarter-powers of two (codes c, scale 2**(c/4)), fp8's powers of two."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 64)) * np.exp(rng.uniform(-8, 8, (200, 1)))   # magnitudes 1e-4..3e3
    q_values, q_codes = quantize_rows(jnp.asarray(x, jnp.float32), dtype)
    values, code = np.asarray(q_values, np.float32), np.asarray(q_codes, np.float32)
    cmax = SCALE_CODE_MAX[dtype]
    assert values.shape == (200, 64) and code.shape == (200,) and (code == np.round(code)).all()
    # The code is the smallest that fits the row's largest value in the dtype's range.
    amax = np.abs(x).max(-1)
    np.testing.assert_array_equal(code, np.clip(np.ceil(steps * np.log2(amax / qmax)), -cmax, cmax))
    unclamped = code > -cmax      # rows of tiny values keep the smallest code
    assert unclamped.sum() > 150 and (np.abs(values).max(-1) <= qmax).all()
    # A row's largest value lands in the top step of the range (int8: (127 / 2**0.25, 127]).
    assert (np.abs(values).max(-1)[unclamped] > qmax * 2.0 ** (-1 / steps) - 1).all()
    back = np.asarray(dequantize_rows(q_values, q_codes))
    scale = np.asarray(row_scale(jnp.asarray(code), dtype), np.float64)[:, None]
    np.testing.assert_allclose(scale[:, 0], 2.0 ** (code / steps), rtol=1e-7)
    # int8: half a step of the row's scale; fp8: half an ulp of each value (3 mantissa
    # bits), or of the smallest subnormal.
    err = np.abs(back - x)
    bound = scale / 2 if dtype == INT8 else np.maximum(np.abs(x) * rel / 2, scale * 2.0 ** -10)
    assert (scale[unclamped, 0] < 2.0 ** (1 / steps) * amax[unclamped] / qmax * (1 + 1e-6)).all()
    assert (err <= bound * (1 + 1e-6)).all()


def test_rows_edge_cases():
    # An all-zero row, a row that saturates at the largest code, int8's ties to even.
    x = np.zeros((3, 4), np.float32)
    x[1] = [1e9, -1e9, 3.0, 0.0]
    x[2] = [127.0, 0.5, 1.5, -2.5]
    rows, codes = map(np.asarray, quantize_rows(jnp.asarray(x), INT8))
    assert (rows[0] == [0, 0, 0, 0]).all() and codes[0] == -64
    assert codes[1] == 64 and rows[1, 0] == 127 and rows[1, 1] == -127
    assert (rows[2] == [127, 0, 2, -2]).all() and codes[2] == 0
    fp8 = quantize_rows(jnp.asarray(x), FP8)
    assert np.asarray(fp8[1].astype(jnp.float32))[0] == -16
    assert np.isfinite(np.asarray(dequantize_rows(*fp8))).all()   # saturates, never NaN
    # Negative int8 codes: floor division and a non-negative remainder (2**(-5/4) = 2**-2 * 2**0.75).
    assert float(row_scale(jnp.float32(-5), INT8)) == np.float32(0.25) * np.float32(2 ** 0.75)


def test_layout_helpers():
    pool = jnp.zeros((2, 1, 2, 1, 5, 16), jnp.int8)
    assert is_quantized(INT8) and is_quantized(FP8) and not is_quantized(jnp.bfloat16)
    assert pool_head_dim(pool) == 16 and pool_head_dim(pool.astype(jnp.float32)) == 16
    assert pool_block_size(pool) == 4 and pool_block_size(pool.astype(jnp.float32)) == 5


# ------------------------------------------------------------- the page layout
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_pages_hold_values_then_one_row_of_codes(dtype):
    """A quantized page [BS + 1, D]: rows 0..BS-1 are the values, bit for bit those of
    quantize_rows, and row BS the BS rows' codes, then zeros; read_pages dequantizes."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 2, 8, 16)) * np.exp(rng.uniform(-4, 4, (3, 2, 8, 1))),
                    jnp.float32)
    pages = np.asarray(quantize_pages(x, dtype).astype(jnp.float32))
    values, codes = (np.asarray(a.astype(jnp.float32)) for a in quantize_rows(x, dtype))
    assert pages.shape == (3, 2, 9, 16)
    np.testing.assert_array_equal(pages[..., :8, :], values)
    np.testing.assert_array_equal(pages[..., 8, :8], codes)
    assert (pages[..., 8, 8:] == 0).all()
    np.testing.assert_array_equal(np.asarray(read_pages(quantize_pages(x, dtype))),
                                  np.asarray(dequantize_rows(*quantize_rows(x, dtype))))


def test_pages_need_block_size_at_most_head_dim(tiny_llm):
    check_page_layout(16, 16, INT8)
    check_page_layout(32, 16, jnp.bfloat16)          # unquantized pages have no code row
    with pytest.raises(ValueError, match="block_size must be <= head_dim"):
        check_page_layout(32, 16, FP8)
    with pytest.raises(ValueError, match="block_size must be <= head_dim"):
        quantize_pages(jnp.zeros((32, 16)), INT8)
    cfg = tiny_llm.model_config
    with pytest.raises(ConfigError, match="^block_size: "):
        num_blocks_for(cfg, block_size=2 * cfg.head_dim, dtype=INT8, num_blocks=4,
                       kv_memory_fraction=0.5, weight_bytes=0, max_num_seqs=1, max_model_len=64)


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_write_puts_the_code_in_the_code_row(dtype):
    """write_kv_reference: token t's values go to row offsets[t] of its page, its code to
    element offsets[t] of row BS; nothing else of the pool changes, and an offset
    past the page is dropped (it never reaches the code row)."""
    NB, L, KVH, BS, D = 4, 2, 2, 8, 16
    rng = np.random.default_rng(4)
    pool = jnp.asarray(rng.integers(-3, 4, (NB, L, 2, KVH, BS + 1, D)), jnp.float32).astype(dtype)
    k = jnp.asarray(rng.standard_normal((3, KVH, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, KVH, D)) * 100, jnp.float32)
    blocks, offsets = jnp.asarray([2, 3, 1], jnp.int32), jnp.asarray([5, 0, BS], jnp.int32)
    out = np.asarray(write_kv_reference(pool, 1, k, v, blocks, offsets).astype(jnp.float32))
    want = np.asarray(pool.astype(jnp.float32)).copy()
    for t in range(2):                               # token 2's offset is out of range
        for kv, x in enumerate((k, v)):
            values, codes = (np.asarray(a.astype(jnp.float32)) for a in quantize_rows(x[t], dtype))
            want[blocks[t], 1, kv, :, offsets[t]] = values
            want[blocks[t], 1, kv, :, BS, offsets[t]] = codes
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("d", [16, 64, 20])
def test_rotation_is_orthonormal_and_spreads_outliers(d):
    r = kv_rotation(d)
    np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-5)
    outlier = np.zeros(d, np.float32)
    outlier[3] = 1.0
    assert np.abs(outlier @ r).max() < 0.6     # one hot channel becomes many small ones


# ------------------------------------------------------------- capacity
def test_bytes_and_blocks_for_the_same_budget(tiny_llm, monkeypatch):
    """A block of a quantized pool costs head_dim bytes per row and one more row of
    codes per page, so the same budget holds 4 * BS / (BS + 1) times the fp32 blocks
    (block_size 16: 3.76x)."""
    cfg = tiny_llm.model_config
    assert bytes_per_block(cfg, 16, INT8) * 4 * 16 == bytes_per_block(cfg, 16, jnp.float32) * (16 + 1)
    assert bytes_per_block(cfg, 8, INT8) * 4 * 8 == bytes_per_block(cfg, 8, jnp.float32) * (8 + 1)
    assert bytes_per_block(cfg, 16, FP8) == bytes_per_block(cfg, 16, INT8)
    monkeypatch.setattr(kv_pool_mod, "free_device_memory", lambda *a, **k: 64 * 2**20)
    blocks = {dt: num_blocks_for(cfg, block_size=16, dtype=dt, num_blocks=0, kv_memory_fraction=0.5,
                                 weight_bytes=0, max_num_seqs=10**6, max_model_len=2048)
              for dt in (jnp.float32, jnp.bfloat16, INT8)}
    assert blocks[INT8] / blocks[jnp.float32] == pytest.approx(4 * 16 / (16 + 1), rel=1e-3)
    assert blocks[jnp.bfloat16] == 2 * blocks[jnp.float32]


# ------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def int8_llm(make_tiny_llm):
    return make_tiny_llm(kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def int8_tokens(int8_llm):
    return [o.token_ids for o in int8_llm.generate(PROMPTS, GREEDY)]


def test_engine_pool_is_quantized(int8_llm, tiny_llm):
    pool = int8_llm.runner.kv_pool
    cfg = int8_llm.model_config
    bs = int8_llm.config.block_size
    assert pool.dtype == INT8 and pool.shape[-2:] == (bs + 1, cfg.head_dim)
    assert int8_llm.kv_pool_bytes * 4 * bs == tiny_llm.kv_pool_bytes * (bs + 1)


@pytest.fixture(scope="module")
def fp8_llm(make_tiny_llm):
    return make_tiny_llm(kv_cache_dtype="fp8_e4m3")


def _prompt_logprob_drift(llm, baseline) -> np.ndarray:
    """|logprob difference| of every prompt token (teacher-forced) against `baseline`."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    want, got = baseline.generate(PROMPTS, params), llm.generate(PROMPTS, params)
    diffs = [abs(a.logprob - b.logprob) for w, g in zip(want, got)
             for a, b in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:])]
    assert len(diffs) == sum(len(p) - 1 for p in PROMPTS)
    return np.asarray(diffs)


def test_int8_logprobs_drift_less_than_fp8(tiny_llm, int8_llm, fp8_llm):
    """Teacher-forced prompt logprobs against the fp32 pool: int8 (7 bits per row's
    scale) drifts well under fp8 e4m3 (3 mantissa bits), and neither is exact.
    (Tiny random model, head_dim 16: mean drifts ~0.03 and ~0.1 nats.)"""
    int8, fp8 = _prompt_logprob_drift(int8_llm, tiny_llm), _prompt_logprob_drift(fp8_llm, tiny_llm)
    assert 0 < int8.mean() < fp8.mean() / 2, (int8.mean(), fp8.mean())
    assert int8.max() < 0.25 and fp8.max() < 1.0, (int8.max(), fp8.max())


def test_cpu_kernel_gives_the_reference_tokens_on_an_int8_pool(make_tiny_llm, int8_tokens):
    """(The Pallas kernels' int8 / fp8 reads are checked against the reference in
    tests/kernels, case by case; through the engine in interpret mode they cost ~30 s.)"""
    llm = make_tiny_llm(kv_cache_dtype="int8", attention_impl="cpu")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == int8_tokens


def test_fp8_pool_through_the_cpu_kernel(make_tiny_llm, fp8_llm):
    cpu = make_tiny_llm(kv_cache_dtype="fp8_e4m3", attention_impl="cpu")
    assert fp8_llm.runner.kv_pool.dtype == FP8
    assert [o.token_ids for o in cpu.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in fp8_llm.generate(PROMPTS, GREEDY)]


def test_swap_moves_quantized_blocks_bit_for_bit(int8_llm):
    pool = int8_llm.runner.kv_pool
    rng = np.random.default_rng(1)
    blocks = rng.integers(-128, 128, (3, *pool.shape[1:])).astype(np.int8)
    pool = scatter_blocks(pool, [5, 9, 2], blocks)
    np.testing.assert_array_equal(gather_blocks(pool, [9, 2, 5]), blocks[[1, 2, 0]])
    int8_llm.runner.kv_pool = pool


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_copy_on_write_copies_a_quantized_block_with_its_codes(dtype):
    """copy_blocks moves whole pages, code rows included: the copy reads back as the
    source's dequantized K/V, and the source and the other blocks are unchanged."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((5, 2, 2, 2, 8, 16)) * 30, jnp.float32)
    pool = quantize_pages(x, dtype)
    before = np.asarray(read_pages(pool))
    after = np.asarray(read_pages(copy_blocks(pool, [(3, 1), (2, 4)])))
    np.testing.assert_array_equal(after[[1, 4]], before[[3, 2]])
    np.testing.assert_array_equal(after[[0, 2, 3]], before[[0, 2, 3]])
    assert not np.array_equal(before[1], before[3])   # the copy really changed block 1


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_and_prefix_cache_on_an_int8_pool(make_tiny_llm, int8_llm, mode):
    """An oversubscribed int8 pool with shared prefixes: every request completes with
    the tokens of a pool large enough never to preempt (the module's int8 engine,
    whose programs are built already: swap moves the bytes; recompute rewrites the
    same rows), and the pool is empty at the end."""
    system = random_prompts([16], seed=99)[0]
    prompts = [(system + p)[:48] for p in random_prompts([3, 9, 20, 30, 12, 25], seed=5)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = int8_llm.generate(prompts, params)
    assert int8_llm.stats.preemptions == 0
    small = make_tiny_llm(kv_cache_dtype="int8", block_size=8, max_num_seqs=6, max_num_batched_tokens=64,
                          enable_prefix_caching=True, num_blocks=13, preemption_mode=mode, swap_space_gb=0.01)
    got = small.generate(prompts, params)
    assert small.stats.preemptions > 0 and small.totals.cache_hit_blocks > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert_all_blocks_free(small)


def test_tensor_parallel_splits_the_scales_with_the_heads(make_tiny_llm, int8_tokens):
    llm = make_tiny_llm(kv_cache_dtype="int8", tensor_parallel_size=2)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == int8_tokens
    shards = llm.runner.kv_pool.addressable_shards
    assert len(shards) == 2 and shards[0].data.shape[3] == llm.model_config.num_kv_heads // 2
    assert shards[0].data.shape[-2:] == (llm.config.block_size + 1, llm.model_config.head_dim)

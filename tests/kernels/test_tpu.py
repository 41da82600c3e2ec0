"""The Pallas Mosaic-TPU ragged paged-attention kernel vs the jnp reference, on CPU.

Every kernel run is in TPU interpret mode (CPU simulation of HBM, VMEM, SMEM,
DMAs and semaphores) with the race detector on, and asserts that it found no
race.  Interpret mode is slow (each distinct shape is a ~5 s compile), so the
cases (`cases.CASES`, those listing "pallas_tpu", plus the tests below) are a
covering selection, not a product:

* decode-only batches with long contexts (many K/V steps), whole prompts,
  chunked prefill over a cached prefix, mixed batches, padding tokens and
  padding sequences, sequences longer than one query tile;
* head_dim 64 / 128, GQA 1 / 3 / 4 / 8, block size 8 / 16 / 32, fp32 / bf16,
  both the decode (block_q_small) and the prefill (block_q) code paths;
* NaN in everything a sequence may not read (block 0, unowned blocks, the
  tail of its last block, every other layer; `tests/kernels/cases.py`),
  layer 1 and 2 of 3, a traced layer inside `lax.scan`;
* sliding windows of 5 (< block, tiles starting mid compute block) and 40
  (> block) and past every context (the scan test), soft caps deciding the
  softmax, fp32 and bf16; NaN in every key before a sequence's window and the
  null block in its table entries before it;
* quantized pools (rows of head_dim values and a scale code): int8 with
  fp32 q (a window and a soft cap; decode), fp8 with bf16 q and with fp32 q
  (one KV head per grid step), held to the fp32 / bf16 tolerances; rows a
  sequence may not read hold int8 random bytes with scale code 127 (up to ~6e11
  once dequantized) or fp8 NaN;
* fixed shapes with several draws (no padding at all, padding only);
* 2 simulated TensorCores (head blocks split over cores), eager DMAs;
* every run checks the exact number of DMAs the kernel issued: q, the pages
  from the one holding each tile's first window start (page 0 without a
  window) up to its causal bound and the output of each tile, nothing for
  empty tiles or unused table entries (so the cost does not scale with W,
  nor with kv_len under a window);
* a racy kernel is reported (the detector is live), and the kernel lowers to
  a Mosaic `tpu_custom_call` for a v5e target (fp32, bf16, int8 and fp8 pools).

Tolerances: `cases.TOL` (fp32 2e-5 abs + 1e-5 rel, 3x for the soft-capped scores of
+-60..90 of `cases.BIG_LOGITS`; bf16 2e-2).
Inputs are fresh random draws each run; the seed is in every failure message.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu as ktpu
from pallas_kernels.reference import is_quantized, pool_block_size
from kernels.cases import (TOL, attention_per_layer, cases_for, check_ragged, fresh_seed,
                           make_ragged_case, mixed_seqs)

try:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _interp
except ImportError:  # pragma: no cover - moved in another jax version
    _interp = None

RACE = pltpu.InterpretParams(detect_races=True)


def assert_no_race():
    if _interp is None:
        pytest.skip("jax has no TPU interpret race state here")
    assert _interp.races is not None and not _interp.races.races_found, "race detected"


def expected_dmas(args, block_q=None, head_blocks=1, sliding_window=None, **_):
    """DMAs the kernel must issue, no more: per tile that attends, its q, each
    page from the one holding its first token's window start (page 0 without a
    window) up to the one holding the last key its last token sees, and its
    output; per tile of padding tokens, its output (zeros); nothing for empty
    tiles.  Independent of the table width W.  A quantized pool's page is two DMAs:
    its value rows and its code row."""
    q, pool, _, bt, kv, cu = args
    T, BS = q.shape[0], pool_block_size(pool)
    per_page = 1 + is_quantized(pool.dtype)
    bq = ktpu.block_sizes(T, q.shape[1] // pool.shape[3], BS, bt.shape[1], pool.dtype,
                          block_q)[0]
    seq, start, n = map(np.asarray, ktpu.tile_layout(cu, kv, T, bq))
    kv, cu = np.asarray(kv), np.asarray(cu)
    count = 0
    for s, first_tok, n_tok in zip(seq, start, n):
        count += n_tok > 0                                       # output copy
        if s >= 0:
            first_pos = kv[s] - (cu[s + 1] - cu[s]) + (first_tok - cu[s])
            last_key = first_pos + n_tok - 1
            first_page = 0 if sliding_window is None else \
                max(0, first_pos - sliding_window + 1) // BS
            count += 1 + (last_key // BS + 1 - first_page) * per_page   # q copy + pages
    return count * head_blocks


def run_tpu(args, interpret=RACE, head_blocks=1, **kw):
    """The kernel in interpret mode; asserts no race and exactly the expected DMAs."""
    out = jax.block_until_ready(ktpu.paged_attention_tpu(*args, interpret=interpret, **kw))
    assert_no_race()
    dmas = _interp.dma_id_counter.value - 100     # the interpreter numbers DMAs from 100
    assert dmas == expected_dmas(args, head_blocks=head_blocks, **kw), "DMA count"
    return out


# --------------------------------------------------------------------------
# Tile layout (pure jnp, no kernel): every token in exactly one tile, tiles
# never straddle sequences, the static bound cdiv(T, block_q) + S holds.

def test_tile_layout_covers_tokens_once():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    S, T = 6, 64
    layout = jax.jit(ktpu.tile_layout, static_argnums=(2, 3))
    for draw in range(60):
        bq = [1, 5, 16][draw % 3]
        q_lens = rng.integers(0, 11, S) * (rng.random(S) < 0.8)   # sum <= 60 < T
        kv_lens = q_lens + rng.integers(0, 50, S) * (q_lens > 0)
        if draw % 10 == 0:
            q_lens[:] = kv_lens[:] = 0                  # nothing but padding
        if draw % 10 == 1:
            q_lens[0] += T - q_lens.sum()               # no padding
            kv_lens[0] = max(kv_lens[0], q_lens[0])
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        seq, start, n = map(np.asarray, layout(jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32),
                                               T, bq))
        what = f"seed={seed} draw={draw} T={T} bq={bq} cu={cu} kv={kv_lens}"
        assert seq.shape == (-(-T // bq) + S,), what
        owner = np.full(T, -2)
        for t in range(len(n)):
            assert 0 <= n[t] <= bq, what
            if n[t] == 0:
                continue
            toks = np.arange(start[t], start[t] + n[t])
            assert (owner[toks] == -2).all(), f"token in two tiles: {what}"
            owner[toks] = seq[t]
            if seq[t] >= 0:
                assert cu[seq[t]] <= toks[0] and toks[-1] < cu[seq[t] + 1], f"straddles: {what}"
        assert (owner != -2).all(), f"token in no tile: {what}"
        assert (owner[cu[-1]:] == -1).all(), what
        # a tile of sequence s that sees keys has seq == s; all here do (kv >= q)
        tok_seq = np.searchsorted(cu, np.arange(cu[-1]), side="right") - 1
        assert (owner[:cu[-1]] == tok_seq).all(), what
        # work tiles first, then zero tiles, then empty tiles
        kinds = np.where(seq >= 0, 0, np.where(n > 0, 1, 2))
        assert (np.diff(kinds) >= 0).all(), what


# --------------------------------------------------------------------------
# The shared cases: decode-only batches with long contexts (many K/V steps,
# cross-tile prefetch), mixed batches (decodes, whole prompts, chunked prefill
# over a cached prefix, prompts longer than one query tile, padding), windows
# and soft caps.

@pytest.mark.parametrize("case", cases_for("pallas_tpu"), ids=lambda c: c.id)
def test_matches_reference(case):
    seed = fresh_seed()
    seqs, args = case.make(seed)
    out = run_tpu(args, **case.options, **case.tuning.get("pallas_tpu", {}))
    case.check(out, args, seed, seqs, "pallas_tpu")


# --------------------------------------------------------------------------
# Fixed shapes, several draws (one compile): layer 2 of 3, wide tables.
FIX = dict(G=2, KVH=2, D=64, BS=16, layer=2)
FIX_T, FIX_S, FIX_W, FIX_MAX = 48, 6, 16, 200
FIX_NB = 1 + FIX_S * -(-FIX_MAX // FIX["BS"])


def fixed_case(seed, seqs):
    n_tok = sum(q for _, q in seqs)
    return make_ragged_case(seed, seqs, **FIX, pad_tokens=FIX_T - n_tok,
                            pad_seqs=FIX_S - len(seqs), width=FIX_W, num_blocks=FIX_NB)


def run_fixed(args):
    return run_tpu(args, block_q=16, pages_per_compute_block=4)


def test_fixed_shape_draws():
    """Random mixed draw, a batch with no padding token, a batch of padding only."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    draws = [mixed_seqs(rng, 5, FIX["BS"], FIX_MAX, 16),
             [(FIX_MAX, 30), (17, 17), (64, 1)],                   # 48 tokens: no padding
             []]                                                   # padding only
    for i, seqs in enumerate(draws):
        if sum(q for _, q in seqs) > FIX_T:
            seqs = seqs[:3]
        args = fixed_case(seed + i, seqs)
        check_ragged(run_fixed(args), args, seed + i, f"tpu fixed {seqs}")  # padding: zeros


def test_nan_isolation_and_layer():
    """Everything the batch may not read is NaN: block 0, spare blocks, tails of
    last blocks, unused table entries (W > needed), layers 0 and 1 (layer 2 is read)."""
    seed = fresh_seed()
    seqs = [(33, 33), (16, 5), (5, 1), (130, 9)]
    args = fixed_case(seed, seqs)
    pool, bt = np.asarray(args[1]), np.asarray(args[3])
    assert np.isnan(pool[0]).all() and np.isnan(pool[:, :2]).all() and (bt[:, -2:] == 0).all()
    check_ragged(run_fixed(args), args, seed, f"tpu nan {seqs}")


# --------------------------------------------------------------------------
# Quantized pools beyond the shared cases (window5-cap-int8, decode-int8-split: int8
# with fp32 q; mixed-fp8-bf16-gpu: fp8 with bf16 q): fp8 with fp32 q, so the fp8
# values and scales are held to fp32 tolerance, one KV head per grid step (page DMAs
# of a head slice of the value rows and of the code rows); NaN in every row and code
# the batch may not read.

def test_fp8_pool_fp32_q_head_blocks():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    seqs = mixed_seqs(rng, 3, 16, 48, 12)
    args = make_ragged_case(seed, seqs, G=2, KVH=2, D=64, BS=16, kv_dtype=jnp.float8_e4m3fn)
    null = np.asarray(args[1][0], np.float32)                    # [L, 2, KVH, BS + 1, D]
    assert np.isnan(null[..., :16, :]).all() and np.isnan(null[..., 16, :16]).all()
    out = run_tpu(args, head_blocks=2, kv_heads_per_block=1)
    check_ragged(out, args, seed, f"tpu fp8 fp32-q heads-per-block 1 {seqs}")


# --------------------------------------------------------------------------
# Two simulated TensorCores: the "parallel" head-block axis is split over them.

def test_two_cores_no_race():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    seqs = mixed_seqs(rng, 3, 16, 48, 12)
    args = make_ragged_case(seed, seqs, G=2, KVH=2, D=64, BS=16)
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2,
                                   dma_execution_mode="eager")
    out = run_tpu(args, interpret=params, head_blocks=2, kv_heads_per_block=1, block_q=8,
                  pages_per_compute_block=1)
    check_ragged(out, args, seed, f"tpu 2 cores {seqs}")


def test_race_detector_is_live():
    """Negative control: reading a DMA destination before waiting is reported,
    so 'no race' above means something."""
    if _interp is None:
        pytest.skip("jax has no TPU interpret race state here")

    def kernel(x_hbm, o_ref, buf, sem):
        c = pltpu.make_async_copy(x_hbm, buf, sem)
        c.start()
        o_ref[...] = buf[...]          # read while the DMA may still be writing
        c.wait()

    f = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        interpret=pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"))
    jax.block_until_ready(f(jnp.ones((8, 128), jnp.float32)))
    assert _interp.races.races_found


# --------------------------------------------------------------------------
# Traced layer inside lax.scan, through the public entry point.

def test_traced_layer_in_scan(monkeypatch):
    """Through the public entry point, with Gemma 2's options passed through: a
    window past every context (the global result) and a soft cap that decides."""
    monkeypatch.setattr(ktpu, "default_interpret", lambda: RACE)
    ktpu.paged_attention_tpu.clear_cache()      # no trace made with another default
    seed = fresh_seed()
    q, pool, _, bt, kv_lens, cu = make_ragged_case(seed, [(20, 4), (7, 1), (9, 9)], G=2, KVH=1,
                                                   D=64, BS=16, nan=False)
    opts = dict(sm_scale=1.0, sliding_window=4096, soft_cap=4.0)

    def run(impl, **kw):
        return np.asarray(attention_per_layer(impl, q, pool, bt, kv_lens, cu, **kw))

    out = run("pallas_tpu", **opts)
    assert_no_race()
    ref = run("reference", **opts)
    np.testing.assert_allclose(out, ref, **TOL[np.dtype(np.float32)], err_msg=f"seed={seed}")
    assert np.abs(run("reference", sm_scale=1.0) - ref).max() > 0.1    # the cap did matter


# --------------------------------------------------------------------------
# Lowering to Mosaic for a TPU v5e target (no TPU needed; the final libtpu
# compile, which checks layouts, is not run here).
GEMMA_OPTIONS = dict(sliding_window=4096, soft_cap=50.0)
# Quantized pools (kv_dtype int8 / fp8: pages of BS + 1 rows of D bytes, the scale
# codes last): value and code-row DMAs, 8-bit to fp32 / bf16 converts.
LOWER_CASES = [  # (D, G, KVH, BS, dtype, kv_dtype (None: dtype), kv_heads_per_block, options)
    (128, 4, 8, 16, jnp.bfloat16, None, None, {}),
    (128, 4, 8, 16, jnp.bfloat16, None, 4, {}),
    (128, 8, 2, 32, jnp.bfloat16, None, None, {}),
    (64, 1, 2, 8, np.float32, None, None, {}),
    (128, 3, 2, 16, np.float32, None, None, {}),
    (256, 2, 4, 16, jnp.bfloat16, None, None, GEMMA_OPTIONS),   # Gemma 2 9B's attention shape
    (128, 4, 8, 32, jnp.bfloat16, np.int8, 4, {}),
    (64, 3, 2, 32, np.float32, np.int8, None, {}),
    (128, 4, 2, 32, jnp.bfloat16, jnp.float8_e4m3fn, None, GEMMA_OPTIONS),
    (64, 2, 2, 32, np.float32, jnp.float8_e4m3fn, None, {}),
]


@pytest.mark.parametrize("D,G,KVH,BS,dtype,kv_dtype,hb,options", LOWER_CASES)
def test_lowers_to_mosaic(monkeypatch, D, G, KVH, BS, dtype, kv_dtype, hb, options):
    from jax._src.pallas.mosaic import tpu_info
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    T, S, W, NB = 256, 16, 64, 600
    kv_dtype = kv_dtype or dtype
    q = jax.ShapeDtypeStruct((T, KVH * G, D), dtype)
    pool = jax.ShapeDtypeStruct((NB, 2, 2, KVH, BS + is_quantized(kv_dtype), D), kv_dtype)
    bt = jax.ShapeDtypeStruct((S, W), jnp.int32)
    kv_lens = jax.ShapeDtypeStruct((S,), jnp.int32)
    cu = jax.ShapeDtypeStruct((S + 1,), jnp.int32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    fn = jax.jit(lambda *a: ktpu.paged_attention_tpu(*a, interpret=False, kv_heads_per_block=hb,
                                                     **options))
    text = fn.trace(q, pool, layer, bt, kv_lens, cu).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text and "jpaged_ragged_attention_tpu" in text

"""GPU (Pallas Triton) ragged paged attention vs the jnp reference, on CPU.

The kernels run with `interpret=True` (automatic off a GPU).  Interpret mode
is slow, so the cases (`cases.CASES`, those listing "pallas_gpu") are a covering
selection, not the product:

* head_dim {64, 128} x GQA {1, 3, 4, 8} x block size {8, 16, 32, 128} x
  dtype {fp32, bf16}: every value appears in the decode cases and again in
  the mixed cases; key tiles of several pages (block_k > BS), one page and
  part of a page (block_k < BS) all occur, and the no-dot path (block_k 8).
* decode-only batches of 1..33 sequences, contexts up to ~1100 with exact
  block boundaries (k*BS), k*BS+1 and 1 (`cases.lens_profile`);
  whole prompts (q_len == kv_len), chunked prefill over a cached prefix,
  speculative-decode-sized q_lens, mixed batches, padding tokens after the
  real ones and padding sequences (q_len 0, kv_len 0), a q_len-0 sequence
  with cached K/V in the middle of a batch, an all-padding batch.
* both paths of the split: short sequences through the split-KV decode
  kernel + the merge in the ragged kernel (default), and every sequence
  through the ragged kernel (decode_rows=0).
* sliding windows of 5 (< block, several query tiles per chunk), 16 (== block,
  split-KV partitions over the window, key tiles of half a page), 40 (> block,
  key tiles of 4 pages) and past every context; soft caps deciding the softmax
  with and without a window (fp32 and bf16); NaN in every key before a
  sequence's window and the null block in its table entries before it.
* every case fills all pool memory a sequence may not read with NaN (block 0,
  unowned blocks, the tail of each last block, every layer but the one read;
  layer > 0 throughout).
* quantized pools (int8, float8_e4m3fn pages: value rows, then a row of scale codes):
  the table's cases (split-KV decode, page-vector gather-loads, slices of
  128-token pages, one page per tile with a window and a soft cap; fp32 and
  bf16 queries) and `test_quantized_tilings` (fp8 with fp32 queries on the
  no-dot 8-key path, int8 through the ragged kernel alone).  Unowned rows
  hold NaN (fp8) or random bytes with scale code 127 (int8: up to ~6e11).

Tolerances (`cases.TOL`): fp32 atol 2e-5 / rtol 1e-5 (3x for the soft-capped
scores of +-60..90: `cases.BIG_LOGITS`), bf16 2e-2.
Inputs are fresh random draws each run; the seed is in every failure message.
Compile time dominates (the interpreted kernels are XLA CPU programs), so
they are compiled at XLA's backend optimisation level 0 (half the compile
time; the kernels run for milliseconds either way).
The lowering tests at the end take the kernels to Triton IR (no GPU needed);
test_triton_sm90.py compiles that IR for sm_90.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernels.cases import (FAST_COMPILE, FP8, INT8, NUM_LAYERS, TOL, attention_per_layer,
                           cases_for, check_ragged, fresh_seed, make_ragged_case, mixed_seqs)

import pallas_kernels
from pallas_kernels import gpu as kgpu
from pallas_kernels import triton_aot

BF16 = jnp.bfloat16
F32 = np.float32


def fast_jit(fn, **kw):
    return jax.jit(functools.partial(fn, **kw), compiler_options=FAST_COMPILE)


@pytest.mark.parametrize("case", cases_for("pallas_gpu"), ids=lambda c: c.id)
def test_matches_reference(case):
    seed = fresh_seed()
    seqs, args = case.make(seed)
    out = fast_jit(kgpu.paged_attention_gpu, **case.options, **case.tuning.get("pallas_gpu", {}))(*args)
    case.check(out, args, seed, seqs, f"pallas_gpu {case.tuning.get('pallas_gpu', {})}")


def test_fuzz_fixed_shapes():
    """Random ragged batches at one static shape (one compile): decodes, whole
    prompts, chunks, varying padding tokens and sequences; the first draw is
    all padding (every row written as exactly zero, poisoned q included)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    S, T, BS, max_len, W = 6, 48, 16, 200, 13
    fn = fast_jit(kgpu.paged_attention_gpu)
    for draw in range(5):
        seqs = mixed_seqs(rng, int(rng.integers(1, S + 1)), BS, max_len, 16) if draw else []
        while sum(q for _, q in seqs) > T:
            seqs.pop()
        args = make_ragged_case(seed + draw, seqs, G=2, KVH=2, D=64, BS=BS, width=W,
                                pad_tokens=T - sum(q for _, q in seqs), pad_seqs=S - len(seqs),
                                num_blocks=1 + S * W)
        assert args[0].shape[0] == T and args[3].shape == (S, W)
        if not seqs:
            args = (args[0].at[0].set(jnp.nan),) + args[1:]
        check_ragged(fn(*args), args, seed, f"fuzz draw {draw} {seqs}")


@pytest.mark.parametrize("kv_dtype,dtype,tuning", [
    (FP8, F32, dict(block_k=8, num_partitions=2)),       # no-dot path, slices of 16-key pages
    (INT8, BF16, dict(decode_rows=0, block_k=64)),       # ragged kernel only, 4-page gathers
], ids=["fp8-f32-tiny-tiles", "int8-bf16-no-split"])
def test_quantized_tilings(kv_dtype, dtype, tuning):
    """Quantized pools on the tilings the shared cases leave out."""
    seed = fresh_seed()
    seqs = [(70, 1), (33, 33), (100, 12), (17, 1), (0, 0), (48, 3)]
    args = make_ragged_case(seed, seqs, G=3, KVH=2, D=64, BS=16, dtype=dtype, kv_dtype=kv_dtype)
    out = fast_jit(kgpu.paged_attention_gpu, **tuning)(*args)
    check_ragged(out, args, seed, f"{np.dtype(kv_dtype).name} {tuning} {seqs}")


# --------------------------------------------------------------------------
# NaN isolation, layer selection, the public entry, scan over layers.

def test_nan_isolation_and_layer():
    """Every byte a sequence does not own is NaN (block 0, spare blocks, the
    tail of its last block, all other layers); layer 2 of 3 is read; decode and
    prefill rows, through the public entry point."""
    seed = fresh_seed()
    seqs = [(33, 1), (16, 6), (5, 5), (40, 1), (70, 20)]
    args = make_ragged_case(seed, seqs, G=2, KVH=2, D=64, BS=16, layer=2, width=8)
    pool = np.asarray(args[1])
    assert np.isnan(pool[0]).all() and np.isnan(pool[:, 0]).all() and np.isnan(pool[:, 1]).all()
    out = fast_jit(pallas_kernels.paged_attention, impl="pallas_gpu")(*args)
    check_ragged(out, args, seed, "nan")


def test_traced_layer_in_scan():
    """Traced layer index inside lax.scan, through the public entry point (the
    options passed through)."""
    seed = fresh_seed()
    q, pool, _, bt, kv_lens, cu = make_ragged_case(seed, [(20, 1), (7, 7), (30, 4)], G=2, KVH=1,
                                                   D=64, BS=16, nan=False)
    opts = dict(sm_scale=1.0, sliding_window=9, soft_cap=4.0)

    def run_impl(impl):
        return attention_per_layer(impl, q, pool, bt, kv_lens, cu, compiler_options=FAST_COMPILE,
                                   **opts)

    out = run_impl("pallas_gpu")
    with jax.default_matmul_precision("highest"):    # exact fp32 oracle (see check_ragged)
        ref = run_impl("reference")
    assert out.shape == (NUM_LAYERS,) + q.shape
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL[np.dtype(F32)])
    plain = attention_per_layer("reference", q, pool, bt, kv_lens, cu, sm_scale=1.0)
    assert np.abs(np.asarray(plain) - np.asarray(ref)).max() > 0.1    # the options did matter


# --------------------------------------------------------------------------
# Static tiling.

def test_partition_heuristic():
    # one sequence, long context: enough programs for ~2 waves of 132 SMs
    p = kgpu.num_partitions_heuristic(1, 8, 32768 // 16, 16)
    assert 1 * 8 * p >= 2 * 132
    assert kgpu.num_partitions_heuristic(256, 8, 2048, 16) == 1     # many sequences: no split
    assert kgpu.num_partitions_heuristic(1, 8, 4, 16) == 1          # short tables: no split


def test_tile_numbering_covers_every_sequence():
    """key(s) = cu[s] * G // block_m + s numbers every sequence's tiles (and the
    padding pseudo-sequence's) inside the static grid, without overlaps."""
    rng = np.random.default_rng(fresh_seed())
    for _ in range(200):
        S, G, bm = int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(2 ** rng.integers(4, 7))
        q_lens = rng.integers(0, 40, S) * (rng.random(S) < 0.8)
        T = int(q_lens.sum() + rng.integers(0, 10)) or 1
        cu = np.concatenate([[0], np.cumsum(q_lens), [T]])          # + padding pseudo-sequence
        n_tiles = kgpu.plan_tiling(T, G, 64, 16, S, 4, 2, 4, block_m=bm).num_q_tiles
        owned = []
        for s in range(S + 1):
            key = cu[s] * G // bm + s
            owned += [key + j for j in range(-(-(cu[s + 1] - cu[s]) * G // bm))]
        assert len(owned) == len(set(owned)) and max(owned, default=0) < n_tiles


def test_plan_tiling_defaults_and_checks():
    t = kgpu.plan_tiling(T=64, G=4, D=128, BS=16, S=64, W=128, KVH=8, itemsize=2)
    assert (t.block_k, t.block_m, t.decode_rows, t.num_partitions) == (64, 64, 16, 1)
    t = kgpu.plan_tiling(T=1, G=4, D=128, BS=16, S=1, W=2048, KVH=8, itemsize=4)
    assert (t.block_k, t.block_m, t.num_partitions) == (16, 16, 33)   # fp32 x 128: small tiles
    # quantized pools: tiles sized by q's dtype (the dots'): <= 64 keys and 8 KiB of it
    assert kgpu.tile_itemsize(INT8, BF16) == 2 and kgpu.tile_itemsize(FP8, F32) == 4
    assert kgpu.tile_itemsize(BF16, F32) == 2
    for D, itemsize, block_k in [(64, 2, 64), (128, 2, 32), (64, 4, 32), (128, 4, 16)]:
        t = kgpu.plan_tiling(T=64, G=4, D=D, BS=16, S=64, W=128, KVH=8, itemsize=itemsize,
                             quantized=True)
        assert t.block_k == block_k and t.block_m == (16 if D * itemsize > 256 else 64)
    assert kgpu.plan_tiling(4, 4, 64, 16, 2, 10, 2, 4, decode_rows=0).num_partitions == 1
    with pytest.raises(ValueError):
        kgpu.plan_tiling(4, 4, 64, 16, 2, 10, 2, 4, decode_rows=8)    # < 16 rows / not >= G
    with pytest.raises(ValueError):
        kgpu.plan_tiling(4, 4, 64, 16, 2, 10, 2, 4, block_m=24)
    q, pool, layer, bt, kv_lens, cu = make_ragged_case(0, [(5, 5)], G=1, KVH=1, D=48, BS=8)
    with pytest.raises(ValueError):
        kgpu.paged_attention_gpu(q, pool, layer, bt, kv_lens, cu)    # head_dim 48


# --------------------------------------------------------------------------
# The kernels must lower through the Pallas Triton backend (no GPU needed:
# lowering to Triton IR runs on CPU; test_triton_sm90.py compiles it).
# dtype: q's and the pool's, or (q's, the pool's) for quantized pools.
LOWER_CASES = [  # (D, G, BS, dtype, T, tuning)
    (128, 4, 16, BF16, 3, {}),
    (64, 3, 8, F32, 40, {}),
    (128, 8, 128, BF16, 64, dict(num_partitions=2)),
    (128, 1, 128, BF16, 64, dict(decode_rows=0)),
    (64, 4, 16, F32, 16, dict(block_k=8)),
    (128, 4, 16, BF16, 40, dict(sliding_window=64, soft_cap=50.0)),   # Gemma 2's options
    # quantized pools: page-vector gathers, one page, slices of a page, the no-dot path
    (64, 3, 16, (F32, INT8), 40, {}),
    (64, 3, 16, (BF16, FP8), 40, {}),
    (128, 4, 32, (BF16, INT8), 40, dict(block_k=32, sliding_window=64, soft_cap=50.0)),
    (128, 8, 128, (BF16, FP8), 64, dict(num_partitions=2)),
    (64, 4, 16, (F32, FP8), 16, dict(block_k=8)),
]


def _lower(D, G, BS, dtype, T, num_warps=4, **kw):
    S, KVH, W, NB = 3, 2, 8, 30
    q_dtype, kv_dtype = dtype if isinstance(dtype, tuple) else (dtype, dtype)
    quantized = kv_dtype in (INT8, FP8)
    args = (jax.ShapeDtypeStruct((T, KVH * G, D), q_dtype),
            jax.ShapeDtypeStruct((NB, 2, 2, KVH, BS + quantized, D), kv_dtype), 1,
            jax.ShapeDtypeStruct((S, W), jnp.int32), jax.ShapeDtypeStruct((S,), jnp.int32),
            jax.ShapeDtypeStruct((S + 1,), jnp.int32))
    return triton_aot.capture_ttir(kgpu.paged_attention_gpu, *args, interpret=False,
                                   num_warps=num_warps, **kw)


@pytest.mark.parametrize("D,G,BS,dtype,T,kw", LOWER_CASES)
def test_lowers_to_triton(D, G, BS, dtype, T, kw):
    irs = _lower(D, G, BS, dtype, T, **kw)
    names = ["jpaged_ragged_gpu"] if kw.get("decode_rows") == 0 else ["jpaged_decode_gpu",
                                                                      "jpaged_ragged_gpu"]
    assert [ir.name for ir in irs] == names
    for ir in irs:
        assert "tt.func public @" in ir.ttir and (ir.num_warps, ir.num_stages) == (4, 2)
        assert ("tanh" in ir.ttir) == ("soft_cap" in kw), ir.name     # the cap reaches the IR
    if isinstance(dtype, tuple):                  # the pool is read as 1-byte values
        pool_ty = {INT8: "i8", FP8: "f8E4M3FN"}[dtype[1]]
        for ir in irs:
            assert f"!tt.ptr<{pool_ty}>" in ir.ttir, ir.name
            assert (dtype[1] == FP8) == ("tt.fp_to_fp" in ir.ttir), ir.name


def test_capture_on_newer_jaxlib(monkeypatch):
    """jaxlib > 0.10.2 compiles the Triton IR while lowering (through a GPU
    plugin a CPU install lacks): the capture still gets the first kernel's IR
    and launch config, and `single_kernel` reaches the second one alone."""
    from jax._src.pallas.triton import pallas_call_registration as registration
    if not hasattr(registration, "jaxlib_version") or not hasattr(registration, "triton"):
        pytest.skip("simulates jax 0.10.2's lowering rule on a later jaxlib; this jax has another rule")
    monkeypatch.setattr(registration, "jaxlib_version", (0, 11, 2))
    (ir,) = _lower(128, 4, 16, BF16, 3, num_warps=8)
    assert ir.name == "jpaged_decode_gpu" and "tt.func public @" in ir.ttir
    assert (ir.num_warps, ir.num_stages) == (8, 2)
    S, KVH, D = 3, 2, 64
    args = (jax.ShapeDtypeStruct((16, KVH * 4, D), BF16),
            jax.ShapeDtypeStruct((30, 2, 2, KVH, 16, D), BF16), 1,
            jax.ShapeDtypeStruct((S, 8), jnp.int32), jax.ShapeDtypeStruct((S,), jnp.int32),
            jax.ShapeDtypeStruct((S + 1,), jnp.int32))
    (ir,) = triton_aot.capture_ttir(kgpu.single_kernel("ragged"), *args, num_stages=3)
    assert ir.name == "jpaged_ragged_gpu" and (ir.num_warps, ir.num_stages) == (4, 3)

"""Pallas paged-attention kernels vs the jnp reference, on CPU (interpret mode).

GPU (Triton) kernels run with `interpret=True`, the TPU (Mosaic) kernel in TPU
interpret mode with the race detector on.  Interpret mode is slow, so the
parameter grid is a covering selection, not the full product:

* decode (gpu): every head_dim {64, 128} x GQA {1, 3, 4, 8} x block size
  {8, 16, 32, 128} x dtype {fp32, bf16} value appears, every (G, BS) pair
  is hit by gpu decode, and the other pairs at least once across kernels.
* batch 1..33, lengths 0..>1000 including exact block boundaries (k*BS),
  k*BS+1, 1, 0 and the table maximum W*BS; padded table entries are 0.
* every case fills all pool memory a sequence may not read with NaN: block 0,
  unowned blocks, the tail of each sequence's last block, and every layer
  other than the one read (layer > 0 is used throughout).

Tolerances (max abs error vs reference, outputs are O(1)):
  fp32 K/V: atol 2e-5, rtol 1e-5; bf16: atol 2e-2, rtol 2e-2.
Inputs are fresh random draws each run; the seed is printed on failure.

TPU alignment: interpret mode accepts any shape; on real TPUs block_size must
be a multiple of 8 (fp32) / 16 (bf16) — the bf16 TPU cases here use >= 16.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels
from pallas_kernels import gpu as kgpu
from pallas_kernels import tpu as ktpu
from pallas_kernels import triton_aot
from pallas_kernels.reference import paged_attention_reference

try:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _tpu_interp
except ImportError:  # pragma: no cover
    _tpu_interp = None

TOL = {np.float32: dict(atol=2e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
NUM_LAYERS = 3
RACE_PARAMS = pltpu.InterpretParams(detect_races=True)
_reference = jax.jit(paged_attention_reference, static_argnames=("sm_scale",))


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def make_case(seed, *, B, G, KVH, D, BS, kv_lens, q_lens=None, Q=1, extra_w=1,
              dtype=np.float32, layer=1, nan=True, width=None, num_blocks=None):
    """Random pool/tables; everything a sequence must not read is NaN."""
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(kv_lens, np.int32)
    assert kv_lens.shape == (B,)
    if q_lens is None:
        q_lens = np.where(kv_lens > 0, 1, 0)
    q_lens = np.asarray(q_lens, np.int32)
    n_blk = -(-kv_lens // BS)
    W = width or max(1, int(n_blk.max())) + extra_w         # padded table entries
    NB = num_blocks or 1 + int(n_blk.sum()) + 3             # + null block + spares
    assert W >= n_blk.max() and NB >= 1 + n_blk.sum()
    pool = rng.standard_normal((NB, NUM_LAYERS, 2, KVH, BS, D)).astype(np.float32)
    if nan:
        mask = np.ones((NB, NUM_LAYERS, 2, KVH, BS, D), bool)   # True = poison
    bt = np.zeros((B, W), np.int32)
    phys = rng.permutation(np.arange(1, NB))
    k = 0
    for b in range(B):
        ids = phys[k:k + n_blk[b]]
        k += n_blk[b]
        bt[b, :n_blk[b]] = ids
        if nan:
            for j, blk in enumerate(ids):
                valid = min(BS, kv_lens[b] - j * BS)
                mask[blk, layer, :, :, :valid] = False
    if nan:
        pool[mask] = np.nan
    pool = jnp.asarray(pool, dtype)
    q = jnp.asarray(rng.standard_normal((B, Q, G * KVH, D)), dtype)
    return q, pool, layer, jnp.asarray(bt), jnp.asarray(kv_lens), jnp.asarray(q_lens)


def check(out, args, dtype, seed, what):
    q = args[0]
    ref = _reference(*args)
    assert out.shape == q.shape and out.dtype == q.dtype, what
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), f"{what}: non-finite output (seed={seed})"
    np.testing.assert_allclose(out, ref, **TOL[dtype], err_msg=f"{what} seed={seed}")
    # rows with q_lens == 0 / kv_lens == 0 and padding beyond q_lens are exactly zero
    q_lens = np.asarray(args[5])
    kv_lens = np.asarray(args[4])
    for b in range(out.shape[0]):
        n = q_lens[b] if kv_lens[b] > 0 else 0
        assert (out[b, n:] == 0).all(), f"{what}: row {b} not zero past q_len (seed={seed})"


def run_tpu(args, **kw):
    out = ktpu.paged_attention_tpu(*args, interpret=RACE_PARAMS, **kw)
    out = jax.block_until_ready(out)
    if _tpu_interp is not None:
        assert _tpu_interp.races is not None and not _tpu_interp.races.races_found, "race detected"
    return out


def lens_profile(rng, B, BS, max_len):
    """Lengths mixing 0, 1, exact block boundaries, boundary+1, max, random."""
    special = [0, 1, BS, BS + 1, 2 * BS, max_len, max_len - 1, (max_len // BS) * BS]
    out = [special[i % len(special)] if i < len(special) else int(rng.integers(0, max_len + 1))
           for i in range(B)]
    rng.shuffle(out)
    return [max(0, min(max_len, x)) for x in out]


# --------------------------------------------------------------------------
# GPU decode (flash-decoding), covering selection.
# (D, G, BS, B, max_len, dtype, num_partitions, block_k); key tiles of several
# pages (block_k > BS), one page, and parts of a page (block_k < BS) all occur.
DECODE_CASES = [
    (64, 1, 8, 1, 1037, np.float32, None, None),    # long single sequence, many partitions
    (128, 3, 16, 5, 300, jnp.bfloat16, 3, None),
    (64, 4, 32, 33, 256, np.float32, None, 64),     # batch 33, exact boundaries
    (128, 8, 128, 2, 1100, jnp.bfloat16, None, None),
    (128, 1, 32, 3, 96, jnp.bfloat16, 1, 32),
    (64, 8, 16, 7, 160, np.float32, 4, 16),
    (64, 3, 128, 4, 384, np.float32, 2, None),
    (128, 4, 8, 9, 64, jnp.bfloat16, None, 8),      # [16, 8] tiles: no-dot fallback path
    (128, 4, 128, 3, 600, np.float32, 3, 16),       # 8 tiles per page, partitions mid-page
]


@pytest.mark.parametrize("D,G,BS,B,max_len,dtype,P,block_k", DECODE_CASES)
def test_gpu_decode(D, G, BS, B, max_len, dtype, P, block_k):
    seed = _seed()
    rng = np.random.default_rng(seed)
    kv_lens = lens_profile(rng, B, BS, max_len)
    if B == 1:
        kv_lens = [max_len]
    args = make_case(seed, B=B, G=G, KVH=2, D=D, BS=BS, kv_lens=kv_lens, dtype=dtype)
    out = kgpu.paged_decode_gpu(*args, num_partitions=P, block_k=block_k)
    check(out, args, dtype, seed, f"gpu decode P={P} block_k={block_k}")


def test_gpu_partition_heuristic():
    # small batch, long context: enough programs for ~2 waves of 132 SMs
    p = kgpu.num_partitions_heuristic(batch=1, num_kv_heads=8, max_blocks=32768 // 16, block_size=16)
    assert 1 * 8 * p >= 2 * 132
    # big batch: no split
    assert kgpu.num_partitions_heuristic(256, 8, 2048, 16) == 1
    # short context: never below 256 tokens per partition
    assert kgpu.num_partitions_heuristic(1, 8, 4, 16) == 1


def test_gpu_decode_all_partitions_empty_and_q0():
    """kv_lens > 0 but q_lens == 0 must give zeros; all-zero batch too."""
    seed = _seed()
    args = make_case(seed, B=3, G=4, KVH=1, D=64, BS=16, kv_lens=[40, 0, 17], q_lens=[0, 0, 1])
    out = kgpu.paged_decode_gpu(*args, num_partitions=2)
    check(out, args, np.float32, seed, "gpu decode q0")
    zero = (args[0], args[1], args[2], args[3], jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32))
    assert (np.asarray(kgpu.paged_decode_gpu(*zero, num_partitions=2)) == 0).all()


# --------------------------------------------------------------------------
# Ragged prefill / mixed batches.
# (D, G, BS, dtype, Q, [(kv_len, q_len), ...])
RAGGED_CASES = [
    # decode rows + pure prefill (q == kv) + chunked prefill over a cache + padding rows
    (64, 4, 16, np.float32, 24, [(1, 1), (24, 24), (70, 24), (33, 1), (0, 0), (50, 7), (16, 16)]),
    (128, 3, 8, jnp.bfloat16, 20, [(20, 20), (57, 13), (9, 1), (40, 0)]),
    (64, 1, 32, np.float32, 40, [(40, 40), (1030, 40), (64, 1), (96, 32)]),
    (128, 8, 128, jnp.bfloat16, 9, [(9, 9), (256, 9), (129, 1)]),
]


@pytest.mark.parametrize("D,G,BS,dtype,Q,rows", RAGGED_CASES)
def test_gpu_ragged(D, G, BS, dtype, Q, rows):
    seed = _seed()
    kv_lens, q_lens = zip(*rows)
    args = make_case(seed, B=len(rows), G=G, KVH=2, D=D, BS=BS, kv_lens=kv_lens, q_lens=q_lens,
                     Q=Q, dtype=dtype)
    out = kgpu.paged_ragged_gpu(*args)
    check(out, args, dtype, seed, "gpu ragged")


def test_ragged_fuzz_fixed_shapes():
    """Random ragged (kv_len, q_len) draws at fixed shapes (one compile per
    kernel): decode rows, pure prefill, chunked prefill, padding rows."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    B, Q, BS, max_len = 6, 16, 16, 200
    W = -(-max_len // BS)
    for draw in range(3):
        kv = rng.integers(0, max_len + 1, B)
        kv[0] = int(rng.integers(1, max_len // BS + 1)) * BS     # exact block boundary
        kv[1] = int(rng.integers(1, Q + 1))                      # pure prefill row below
        ql = np.minimum(kv, rng.integers(1, Q + 1, B))           # chunked prefill rows
        ql[1] = kv[1]
        ql[2] = 1                                                # a decode row
        ql = np.where(kv > 0, np.maximum(ql, 1), 0)              # kv == 0 -> padding row
        rng.shuffle(perm := np.arange(B))
        kv, ql = kv[perm], ql[perm]
        args = make_case(seed + draw, B=B, G=2, KVH=2, D=64, BS=BS, kv_lens=kv, q_lens=ql, Q=Q,
                         width=W, num_blocks=1 + B * W)
        check(kgpu.paged_ragged_gpu(*args), args, np.float32, seed, f"gpu fuzz {kv} {ql}")
        check(run_tpu(args, pages_per_compute_block=4, block_m=32), args, np.float32, seed,
              f"tpu fuzz {kv} {ql}")


def test_gpu_ragged_small_block_m():
    """block_m smaller than Q*G: several row tiles, some fully masked / skipped."""
    seed = _seed()
    rows = [(30, 30), (45, 5), (3, 1), (0, 0)]
    kv_lens, q_lens = zip(*rows)
    args = make_case(seed, B=4, G=3, KVH=2, D=64, BS=16, kv_lens=kv_lens, q_lens=q_lens, Q=30)
    out = kgpu.paged_ragged_gpu(*args, block_m=16, block_k=16)
    check(out, args, np.float32, seed, "gpu ragged block_m=16 block_k=16")


# --------------------------------------------------------------------------
# TPU (Mosaic, interpret mode + race detector): decode and ragged.
# (D, G, KVH, BS, B, max_len, dtype, pages_per_compute_block)
TPU_DECODE_CASES = [
    (128, 4, 1, 32, 2, 1040, jnp.bfloat16, 8),   # long: many double-buffered steps
    (64, 3, 2, 8, 5, 100, np.float32, 3),
    (64, 8, 2, 32, 4, 128, np.float32, 1),
    (128, 1, 2, 128, 2, 300, jnp.bfloat16, None),
]


@pytest.mark.parametrize("D,G,KVH,BS,B,max_len,dtype,ppcb", TPU_DECODE_CASES)
def test_tpu_decode(D, G, KVH, BS, B, max_len, dtype, ppcb):
    seed = _seed()
    rng = np.random.default_rng(seed)
    kv_lens = lens_profile(rng, B, BS, max_len)
    kv_lens[0] = max_len
    args = make_case(seed, B=B, G=G, KVH=KVH, D=D, BS=BS, kv_lens=kv_lens, dtype=dtype)
    out = run_tpu(args, pages_per_compute_block=ppcb)
    check(out, args, dtype, seed, f"tpu decode ppcb={ppcb}")


TPU_RAGGED_CASES = [
    (64, 4, 16, np.float32, 12, [(12, 12), (40, 12), (17, 1), (0, 0), (30, 5)], 2, 16),
    (128, 3, 16, jnp.bfloat16, 8, [(8, 8), (70, 3), (1, 1)], 2, None),
]


@pytest.mark.parametrize("D,G,BS,dtype,Q,rows,ppcb,block_m", TPU_RAGGED_CASES)
def test_tpu_ragged(D, G, BS, dtype, Q, rows, ppcb, block_m):
    seed = _seed()
    kv_lens, q_lens = zip(*rows)
    args = make_case(seed, B=len(rows), G=G, KVH=2, D=D, BS=BS, kv_lens=kv_lens, q_lens=q_lens,
                     Q=Q, dtype=dtype)
    out = run_tpu(args, pages_per_compute_block=ppcb, block_m=block_m)
    check(out, args, dtype, seed, "tpu ragged")


def test_tpu_two_cores_no_race():
    """Parallel grid axes split over 2 simulated TensorCores (megacore-like)."""
    seed = _seed()
    rows = [(40, 1), (0, 0), (33, 9)]
    kv_lens, q_lens = zip(*rows)
    args = make_case(seed, B=3, G=2, KVH=2, D=64, BS=16, kv_lens=kv_lens, q_lens=q_lens, Q=9)
    out = ktpu.paged_attention_tpu(*args, pages_per_compute_block=1, interpret=pltpu.InterpretParams(
        detect_races=True, num_cores_or_threads=2))
    out = jax.block_until_ready(out)
    assert not _tpu_interp.races.races_found
    check(out, args, np.float32, seed, "tpu 2 cores")


def test_tpu_race_detector_is_live():
    """Negative control: a kernel that reads a DMA destination before waiting
    must be reported, so 'no race' above means something."""
    if _tpu_interp is None:
        pytest.skip("no interpret module")
    from jax.experimental import pallas as pl

    def kernel(x_hbm, o_ref, buf, sem):
        c = pltpu.make_async_copy(x_hbm, buf, sem)
        c.start()
        o_ref[...] = buf[...]          # read while the DMA may still be writing
        c.wait()

    x = jnp.ones((8, 128), jnp.float32)
    f = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        interpret=pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"))
    jax.block_until_ready(f(x))
    assert _tpu_interp.races.races_found


# --------------------------------------------------------------------------
# NaN isolation, layer selection, dispatch, scan over layers.

@pytest.mark.parametrize("impl", ["gpu", "tpu"])
@pytest.mark.parametrize("Q", [1, 6])
def test_nan_isolation_and_layer(impl, Q):
    """Every byte a sequence does not own is NaN (block 0, spare blocks, the
    tail of its last block, all other layers); layer 2 of 3 is read."""
    seed = _seed()
    rows = [(33, min(Q, 33)), (16, min(Q, 16)), (0, 0), (5, min(Q, 5))]
    kv_lens, q_lens = zip(*rows)
    args = make_case(seed, B=4, G=2, KVH=2, D=64, BS=16, kv_lens=kv_lens, q_lens=q_lens, Q=Q,
                     layer=2, extra_w=3)
    pool = np.asarray(args[1])
    assert np.isnan(pool[0]).all() and np.isnan(pool[:, 0]).all()
    if impl == "tpu":
        out = run_tpu(args, pages_per_compute_block=2)
    else:
        out = pallas_kernels.paged_attention(*args, impl=impl)
    check(out, args, np.float32, seed, f"{impl} nan Q={Q}")


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_dispatch_in_layer_scan(impl):
    """Traced layer index inside lax.scan, through the public entry point."""
    seed = _seed()
    q, pool, _, bt, kv_lens, q_lens = make_case(seed, B=2, G=2, KVH=1, D=64, BS=16,
                                                kv_lens=[20, 7], nan=False)

    def run(which):
        def body(c, layer):
            return c, pallas_kernels.paged_attention(q, pool, layer, bt, kv_lens, q_lens,
                                                     impl=which, sm_scale=0.3)
        return jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(NUM_LAYERS))[1])()

    out, ref = run(impl), run("reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL[np.float32])


def test_impls_and_default():
    assert set(pallas_kernels.IMPLS) == {"reference", "cpu", "gpu", "tpu"}
    assert pallas_kernels.default_impl() in pallas_kernels.IMPLS
    with pytest.raises(ValueError):
        pallas_kernels.paged_attention(*make_case(0, B=1, G=1, KVH=1, D=64, BS=8, kv_lens=[3]),
                                       impl="nope")


# --------------------------------------------------------------------------
# The GPU kernels must lower through the Pallas Triton backend (no GPU needed:
# lowering to Triton IR runs on CPU; tests/test_triton_sm90.py compiles it).
LOWER_CASES = [  # (kernel, D, G, BS, dtype, Q)
    ("decode", 128, 4, 16, jnp.bfloat16, 1),
    ("decode", 64, 3, 8, np.float32, 1),
    ("decode", 128, 8, 128, jnp.bfloat16, 1),
    ("ragged", 128, 4, 16, jnp.bfloat16, 16),
    ("ragged", 64, 3, 8, np.float32, 7),
    ("ragged", 128, 1, 128, jnp.bfloat16, 64),
]


def _lower_gpu(kernel, D, G, BS, dtype, Q, num_warps=4):
    B, KVH, W, NB = 3, 2, 8, 30
    q = jax.ShapeDtypeStruct((B, Q, KVH * G, D), dtype)
    pool = jax.ShapeDtypeStruct((NB, 2, 2, KVH, BS, D), dtype)
    ints = jax.ShapeDtypeStruct((B,), jnp.int32)
    bt = jax.ShapeDtypeStruct((B, W), jnp.int32)
    fn = kgpu.paged_decode_gpu if kernel == "decode" else kgpu.paged_ragged_gpu
    kw = dict(num_partitions=2) if kernel == "decode" else {}
    return triton_aot.capture_ttir(fn, q, pool, 1, bt, ints, ints, interpret=False,
                                   num_warps=num_warps, **kw)


@pytest.mark.parametrize("kernel,D,G,BS,dtype,Q", LOWER_CASES)
def test_gpu_lowers_to_triton(kernel, D, G, BS, dtype, Q):
    (ir,) = _lower_gpu(kernel, D, G, BS, dtype, Q)
    assert ir.name == f"jpaged_{kernel}_gpu" and "tt.func public @" in ir.ttir
    assert (ir.num_warps, ir.num_stages) == (4, 2)


def test_gpu_capture_on_newer_jaxlib(monkeypatch):
    """jaxlib > 0.10.2 compiles the Triton IR while lowering (through a GPU
    plugin a CPU install lacks): the capture still gets the IR and launch."""
    from jax._src.pallas.triton import pallas_call_registration as registration
    monkeypatch.setattr(registration, "jaxlib_version", (0, 11, 2), raising=False)
    (ir,) = _lower_gpu("decode", 128, 4, 16, jnp.bfloat16, 1, num_warps=8)
    assert ir.name == "jpaged_decode_gpu" and "tt.func public @" in ir.ttir
    assert (ir.num_warps, ir.num_stages) == (8, 2)


TPU_LOWER_CASES = [  # (D, G, BS, dtype, Q)
    (128, 4, 16, jnp.bfloat16, 1),
    (128, 8, 32, jnp.bfloat16, 1),
    (128, 4, 16, jnp.bfloat16, 16),
    (64, 1, 8, np.float32, 1),
]


@pytest.mark.parametrize("D,G,BS,dtype,Q", TPU_LOWER_CASES)
def test_tpu_lowers_to_mosaic(monkeypatch, D, G, BS, dtype, Q):
    """jax-side Mosaic lowering for a TPU v5e target (no TPU needed; the final
    libtpu compile, which checks layouts, is not run here)."""
    from jax._src.pallas.mosaic import tpu_info
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    B, KVH, W, NB = 3, 2, 16, 60
    q = jax.ShapeDtypeStruct((B, Q, KVH * G, D), dtype)
    pool = jax.ShapeDtypeStruct((NB, 2, 2, KVH, BS, D), dtype)
    ints = jax.ShapeDtypeStruct((B,), jnp.int32)
    bt = jax.ShapeDtypeStruct((B, W), jnp.int32)
    text = jax.jit(lambda *a: ktpu.paged_attention_tpu(*a, interpret=False)).trace(
        q, pool, 1, bt, ints, ints).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text

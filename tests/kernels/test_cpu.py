"""The CPU ragged paged-attention kernel and K/V write (pallas_kernels.cpu, C++ XLA FFI calls).

Attention vs the jnp reference over the shared case table (`cases.CASES`,
the cases listing "cpu"):

* head_dim {64, 128} (and 20, the scalar paths for a head_dim that is not a
  multiple of 8) x GQA {1, 3, 4, 8} x block size {1, 8, 16, 32} x dtype
  {fp32, bf16} for queries and {fp32, bf16, int8, fp8 e4m3} for the pool
  (quantized pages [BS + 1, D]: value rows, then a row of scale codes c: 2**(c/4) for int8,
  2**c for fp8), every
  q / pool pairing included.  Every int8 / fp8 byte value under every scale
  code reads exactly (value * the reference's fp32 scale).
* decode-only batches (contexts up to ~1100 with exact block boundaries,
  boundary + 1 and 1: `cases.lens_profile`), whole prompts, chunked
  prefill over a cached prefix, mixed batches (`cases.mixed_seqs`);
  prompts longer than a work item's token tile and a key chunk; padding tokens
  after the real ones, padding sequences (q_len 0, kv_len 0), a q_len-0
  sequence with cached K/V mid-batch, an all-padding batch.
* every case fills all pool memory a sequence may not read with NaN (block 0,
  unowned blocks, the tail of each last block, every layer but the one read;
  layer > 0 unless stated; int8 pools: random bytes with scale code 127, up to
  ~6e11 once dequantized); a traced layer inside jit and lax.scan.
* sliding windows smaller than, equal to and larger than the block size,
  window 1 and a window past every context, soft caps that decide the
  softmax (scores ~ +-100 under a cap of 50); with a window every key before
  the window of a sequence's first new token is NaN and its table entries of
  blocks wholly before it point at the null block: the kernel never loads
  them (it starts each item's key loop at its first token's window start),
  and 0 * NaN would reach the output if it did.
* a hypothesis test draws random ragged batches at fixed shapes.

K/V write vs `write_kv_reference` (all dtype pairs, padding tokens to the null
block, out-of-range writes dropped), in place when the pool is donated;
quantized pools byte for byte (codes clamped at both ends, saturation).
The cpu backend uses the kernels for quantized pools (never the reference).
Fallbacks: the reference when the kernel is unavailable or a dtype unsupported,
with the options passed through.

Tolerances (`cases.TOL`): fp32 atol 2e-5 / rtol 1e-5 (3x for the soft-capped
scores of +-60..90: `cases.BIG_LOGITS`), bf16 2e-2.
Inputs are fresh random draws each run; the seed is in every failure message.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels.cases import (FP8, INT8, NUM_LAYERS, OPTIONS, TOL, cases_for, check_ragged,
                           fresh_seed, make_ragged_case, mixed_seqs, oracle, reference)

import pallas_kernels
from pallas_kernels import cpu
from pallas_kernels.reference import (SCALE_CODE_MAX, is_quantized, quantize_pages, row_scale,
                                      write_kv_reference)

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason=f"CPU kernel unavailable: {cpu.unavailable_reason()}")

BF16 = jnp.bfloat16
F32 = np.float32
kernel = jax.jit(cpu.paged_attention_cpu, static_argnames=OPTIONS + ("max_threads",))


def assert_poisoned(rows):
    """Pool pages a sequence may not read hold NaN, or (int8: no NaN) random bytes with
    scale code 127, which dequantize to up to ~6e11 (a quantized page's codes: the
    first BS elements of its last row)."""
    quantized = is_quantized(rows.dtype)
    int8 = rows.dtype == jnp.int8
    rows = np.asarray(rows.astype(jnp.float32))
    if not quantized:
        assert np.isnan(rows).all()
        return
    BS = rows.shape[-2] - 1
    codes = rows[..., BS, :BS]
    if int8:
        assert (codes == 127).all()
    else:
        assert np.isnan(rows[..., :BS, :]).all() and np.isnan(codes).all()


def run(args, seed, what, **kw):
    out = kernel(*args, **kw)
    check_ragged(out, args, seed, what)
    return out


@pytest.mark.parametrize("case", cases_for("cpu"), ids=lambda c: c.id)
def test_matches_reference(case):
    seed = fresh_seed()
    seqs, args = case.make(seed)
    assert_poisoned(args[1][0])                                   # the null block
    case.check(kernel(*args, **case.options), args, seed, seqs, "cpu")


@pytest.mark.parametrize("q_dtype,pool_dtype", [(F32, BF16), (BF16, F32), (F32, INT8),
                                                  (BF16, INT8), (F32, FP8), (BF16, FP8)])
def test_mixed_dtypes(q_dtype, pool_dtype):
    """q of either float dtype over any pool dtype.  A quantized pool is read exactly
    (dequantized in fp32): fp32 queries get the fp32 tolerance."""
    seed = fresh_seed()
    seqs = mixed_seqs(np.random.default_rng(seed), 7, 16, 200, 40)
    args = make_ragged_case(seed, seqs, G=3, KVH=2, D=64, BS=16, dtype=q_dtype,
                            kv_dtype=pool_dtype)
    assert args[1].dtype == jnp.dtype(pool_dtype)
    assert args[1].shape[-2:] == (16 + is_quantized(pool_dtype), 64)    # + the row of codes
    out = kernel(*args)
    assert out.dtype == jnp.dtype(q_dtype)
    ref = oracle(args)
    tol = TOL[np.dtype(BF16 if BF16 in (q_dtype, pool_dtype) else F32)]
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, **tol, err_msg=f"seed={seed}")


@pytest.mark.parametrize("D", [64, 20])
@pytest.mark.parametrize("pool_dtype", [INT8, FP8])
def test_quantized_values_exact(pool_dtype, D):
    """Every byte value (fp8: subnormals, +-0, +-448 and NaN included) under every scale
    code (int8: [-64, 64], scale 2**(c/4); fp8: [-16, 16], scale 2**c) reads as exactly
    value * scale, the reference's fp32 scale: one key per sequence, so each output row
    is its V row (softmax weight exactly 1).  D = 20: the scalar tail too."""
    all_bytes = np.arange(256, dtype=np.uint8).view(np.dtype(pool_dtype))
    values = np.resize(all_bytes, -(-256 // D) * D).reshape(-1, D)   # every byte at least once
    cmax = SCALE_CODE_MAX[jnp.dtype(pool_dtype)]
    rows = [(v, e) for e in range(-cmax, cmax + 1) for v in values]    # one sequence each
    S, KVH, BS = len(rows), 1, 4
    pool = np.zeros((S + 1, NUM_LAYERS, 2, KVH, BS + 1, D), np.dtype(pool_dtype))
    for s, (v, e) in enumerate(rows):
        pool[s + 1, 1, 0, 0, 0] = np.ones(D, np.float32).astype(pool_dtype)  # K: finite
        pool[s + 1, 1, 1, 0, 0] = v
        pool[s + 1, 1, :, 0, BS, 0] = np.float32(e).astype(pool_dtype)   # row 0's code
    q = jnp.asarray(np.random.default_rng(fresh_seed()).standard_normal((S, 2, D)), F32)
    bt = jnp.arange(1, S + 1, dtype=jnp.int32)[:, None]
    out = np.asarray(kernel(q, jnp.asarray(pool), 1, bt, jnp.ones(S, jnp.int32),
                            jnp.arange(S + 1, dtype=jnp.int32)))
    scales = np.asarray(row_scale(jnp.asarray([e for _, e in rows], jnp.float32), pool_dtype), np.float64)
    want = np.stack([v.astype(np.float64) * s for (v, _), s in zip(rows, scales)])  # exact in fp64
    for g in range(2):
        np.testing.assert_array_equal(out[:, g], want.astype(np.float32))


def test_padding():
    seed = fresh_seed()
    # A q_len-0 sequence with cached K/V mid-batch, padding sequences, padding tokens.
    seqs = [(30, 3), (50, 0), (20, 20), (0, 0), (9, 1)]
    q, pool, layer, bt, kv_lens, cu = make_ragged_case(seed, seqs, G=2, KVH=2, D=64, BS=8,
                                                       pad_tokens=7, pad_seqs=2)
    run((q, pool, layer, bt, kv_lens, cu), seed, "padding")
    # All padding: every output exactly zero.
    out = kernel(q, pool, layer, bt, jnp.zeros_like(kv_lens), jnp.zeros_like(cu))
    assert (np.asarray(out) == 0).all()
    # No tokens at all.
    assert kernel(q[:0], pool, layer, bt, kv_lens, jnp.zeros_like(cu)).shape == (0, *q.shape[1:])


def test_out_of_contract_lengths_match_reference():
    """kv_len past the block table's capacity and q_len > kv_len (tokens at negative
    positions see nothing): no out-of-bounds reads, the reference's output."""
    seed = fresh_seed()
    q, pool, layer, bt, _, cu = make_ragged_case(seed, [(40, 4), (24, 6), (16, 2)], G=3, KVH=1,
                                                 D=64, BS=8, nan=False, pad_seqs=0, width=5)
    kv_lens = jnp.asarray([60, 3, 16], jnp.int32)                # 60 > 5 * 8; 6 > 3
    out = np.asarray(kernel(q, pool, layer, bt, kv_lens, cu))
    ref = np.asarray(reference(q, pool, layer, bt, kv_lens, cu))
    np.testing.assert_allclose(out, ref, **TOL[np.dtype(F32)], err_msg=f"seed={seed}")
    assert np.isfinite(out).all()


@pytest.mark.parametrize("options", [{}, dict(sliding_window=30, soft_cap=5.0)])
def test_threads_deterministic(options):
    """Each (sequence, kv head, token tile) is computed by one thread: any thread count
    gives the same bits."""
    seed = fresh_seed()
    args = make_ragged_case(seed, mixed_seqs(np.random.default_rng(seed), 9, 16, 300, 100),
                            G=3, KVH=3, D=64, BS=16, sliding_window=options.get("sliding_window"))
    np.testing.assert_array_equal(np.asarray(kernel(*args, **options)),
                                  np.asarray(kernel(*args, max_threads=1, **options)))


def test_traced_layer_in_scan_and_vmap():
    seed = fresh_seed()
    seqs = [(70, 70), (33, 1), (100, 20)]
    q, pool, _, bt, kv_lens, cu = make_ragged_case(seed, seqs, G=3, KVH=3, D=64, BS=16, nan=False)

    @jax.jit
    def all_layers(q, pool):  # layer traced inside the scan, as with layer_loop=scan
        def body(carry, layer):
            out = pallas_kernels.paged_attention(q, pool, layer, bt, kv_lens, cu, impl="cpu")
            return carry, out
        return jax.lax.scan(body, 0, jnp.arange(NUM_LAYERS, dtype=jnp.int32))[1]

    outs = all_layers(q, pool)
    for layer in range(NUM_LAYERS):
        np.testing.assert_allclose(np.asarray(outs[layer]),
                                   oracle((q, pool, layer, bt, kv_lens, cu)),
                                   **TOL[np.dtype(F32)], err_msg=f"layer {layer} seed={seed}")
    qs = jnp.stack([q, 2 * q])
    vmapped = jax.vmap(lambda q: cpu.paged_attention_cpu(q, pool, 2, bt, kv_lens, cu))(qs)
    for i in range(2):
        np.testing.assert_allclose(np.asarray(vmapped[i]),
                                   np.asarray(kernel(qs[i], pool, 2, bt, kv_lens, cu)), rtol=1e-6)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_random_ragged_batches(data):
    """Random mixes of decodes, prompts and chunks at fixed shapes (one compile per config)."""
    G, KVH, D, BS, dtype, kv_dtype = data.draw(st.sampled_from(
        [(3, 3, 64, 16, F32, None), (4, 2, 128, 8, BF16, None), (3, 3, 64, 16, F32, INT8),
         (4, 2, 128, 8, BF16, FP8)]))
    T, S, max_len = 96, 6, 150
    budget, seqs = T - 1, []
    for _ in range(data.draw(st.integers(1, S - 1), label="n_seqs")):
        kv = data.draw(st.integers(1, max_len), label="kv_len")
        q = data.draw(st.sampled_from([1, kv, None]), label="q_kind")
        q = data.draw(st.integers(1, kv), label="q_len") if q is None else q
        q = min(q, budget, kv)
        if q == 0:
            break
        budget -= q
        seqs.append((kv, q))
    layer = data.draw(st.integers(0, NUM_LAYERS - 1), label="layer")
    seed = fresh_seed()
    n_blk = -(-max_len // BS)
    args = make_ragged_case(seed, seqs, G=G, KVH=KVH, D=D, BS=BS, dtype=dtype, layer=layer,
                            kv_dtype=kv_dtype,
                            pad_tokens=T - sum(q for _, q in seqs), pad_seqs=S - len(seqs),
                            width=n_blk + 1, num_blocks=1 + (S - 1) * n_blk + 3)
    run(args, seed, f"hypothesis seqs={seqs} layer={layer} pool {args[1].dtype}")


# ---------------------------------------------------------------------------
# K/V write

def _write_case(rng, *, pool_dtype, kv_dtype, T=21, NB=9, KVH=2, BS=8, D=64):
    pool = rng.standard_normal((NB, NUM_LAYERS, 2, KVH, BS, D))
    if is_quantized(pool_dtype):
        pool = quantize_pages(jnp.asarray(pool), pool_dtype)
    pool = jnp.asarray(pool, pool_dtype)
    # Rows of magnitudes 2**-30 .. 2**30 (scale codes clamped at both ends: fp8 at +-16,
    # int8 at +-64, where values saturate), one all-zero row.
    mag = 2.0 ** rng.uniform(-30, 30, (2, T, KVH, 1))
    mag[0, 0, 0], mag[1, 0, 0], mag[0, 2, 0] = 2.0 ** 30, 2.0 ** -30, 0   # token 0: a real write
    k = jnp.asarray(rng.standard_normal((T, KVH, D)) * mag[0], kv_dtype)
    v = jnp.asarray(rng.standard_normal((T, KVH, D)) * mag[1], kv_dtype)
    slots = rng.permutation((NB - 1) * BS)[:T] + BS                # distinct rows past block 0
    blocks, offsets = (slots // BS).astype(np.int32), (slots % BS).astype(np.int32)
    blocks[-3:], offsets[-3:] = 0, [0, 1, 1]                       # padding tokens: null block
    blocks[5], offsets[9] = NB + 2, BS                             # out of range: dropped
    return pool, k, v, jnp.asarray(blocks), jnp.asarray(offsets)


@pytest.mark.parametrize("pool_dtype,kv_dtype",
                         [(F32, F32), (BF16, F32), (BF16, BF16), (F32, BF16)])
def test_write_kv_matches_reference_in_place(pool_dtype, kv_dtype):
    rng = np.random.default_rng(fresh_seed())
    pool, k, v, blocks, offsets = _write_case(rng, pool_dtype=pool_dtype, kv_dtype=kv_dtype)
    want = np.asarray(write_kv_reference(pool, 1, k, v, blocks, offsets), np.float32)
    write = jax.jit(cpu.write_kv_cpu, donate_argnums=0)
    ptr = pool.unsafe_buffer_pointer()
    got = write(pool, jnp.int32(1), k, v, blocks, offsets)
    assert got.unsafe_buffer_pointer() == ptr                       # the donated pool, in place
    assert pool.is_deleted()
    got = np.asarray(got, np.float32)
    np.testing.assert_array_equal(got[1:], want[1:])               # block 0 is scratch
    np.testing.assert_array_equal(got[0, [0, 2]], want[0, [0, 2]])  # other layers untouched


@pytest.mark.parametrize("kv_dtype", [F32, BF16])
@pytest.mark.parametrize("pool_dtype", [INT8, FP8])
def test_write_kv_quantized_bit_identical_in_place(pool_dtype, kv_dtype):
    """A quantized pool gets quantize_rows of k and v, byte for byte the reference's
    (clamped exponents and saturated values included), written in place."""
    rng = np.random.default_rng(fresh_seed())
    pool, k, v, blocks, offsets = _write_case(rng, pool_dtype=pool_dtype, kv_dtype=kv_dtype)
    want = np.asarray(write_kv_reference(pool, 1, k, v, blocks, offsets)).view(np.uint8)
    exps = np.asarray(want[1:, 1, ..., -1, :8].view(pool_dtype), np.float32)   # the code rows
    cmax = SCALE_CODE_MAX[jnp.dtype(pool_dtype)]
    assert exps.min() == -cmax and exps.max() == cmax               # both clamps reached
    write = jax.jit(cpu.write_kv_or_reference, donate_argnums=0)
    ptr = pool.unsafe_buffer_pointer()
    got = write(pool, jnp.int32(1), k, v, blocks, offsets)
    assert got.unsafe_buffer_pointer() == ptr                       # the donated pool, in place
    assert pool.is_deleted() and got.dtype == jnp.dtype(pool_dtype)
    got = np.asarray(got).view(np.uint8)
    np.testing.assert_array_equal(got[1:], want[1:])               # block 0 is scratch
    np.testing.assert_array_equal(got[0, [0, 2]], want[0, [0, 2]])  # other layers untouched


@pytest.mark.parametrize("pool_dtype", [F32, INT8])
def test_write_kv_traced_layer_in_scan(pool_dtype):
    """The engine's pattern: write then read each layer inside a scan over layers."""
    rng = np.random.default_rng(fresh_seed())
    pool, k, v, blocks, offsets = _write_case(rng, pool_dtype=pool_dtype, kv_dtype=F32)

    def step(write):
        def body(pool, layer):
            return write(pool, layer, k * (layer + 1), v - layer, blocks, offsets), None
        return jax.jit(lambda pool: jax.lax.scan(body, pool, jnp.arange(NUM_LAYERS))[0],
                       donate_argnums=0)

    want = np.asarray(step(write_kv_reference)(jnp.array(pool)))
    got = np.asarray(step(cpu.write_kv_cpu)(jnp.array(pool)))
    np.testing.assert_array_equal(got[1:], want[1:])
    # Out-of-range layer: dropped, like the reference's scatter.
    same = cpu.write_kv_cpu(jnp.array(pool), NUM_LAYERS + 1, k, v, blocks, offsets)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(pool))


# ---------------------------------------------------------------------------
# Dispatch and fallbacks

def test_backend_dispatch():
    backend = pallas_kernels.get_backend("cpu")
    assert backend.attention is cpu.paged_attention_or_reference
    assert backend.write_kv is cpu.write_kv_or_reference
    if jax.default_backend() == "cpu":
        assert pallas_kernels.default_impl() == "cpu"
    seed = fresh_seed()
    args = make_ragged_case(seed, [(20, 20), (9, 1)], G=2, KVH=2, D=64, BS=8)
    np.testing.assert_array_equal(
        np.asarray(pallas_kernels.paged_attention(*args, impl="cpu")), np.asarray(kernel(*args)))
    # The options reach the kernel.
    opts = dict(sm_scale=2.0, sliding_window=6, soft_cap=3.0)
    np.testing.assert_array_equal(
        np.asarray(pallas_kernels.paged_attention(*args, impl="cpu", **opts)),
        np.asarray(kernel(*args, **opts)))


@pytest.mark.parametrize("pool_dtype", [INT8, FP8])
def test_backend_dispatch_quantized_uses_kernels(monkeypatch, pool_dtype):
    """The cpu backend reads and writes quantized pools with the kernels: with the
    reference's attention and write made to fail, both entry points still work."""
    seed = fresh_seed()
    args = make_ragged_case(seed, [(20, 20), (90, 1), (33, 5)], G=3, KVH=2, D=64, BS=8,
                            kv_dtype=pool_dtype)
    pool, k, v, blocks, offsets = _write_case(np.random.default_rng(seed), pool_dtype=pool_dtype,
                                              kv_dtype=BF16)
    want_pool = np.asarray(write_kv_reference(pool, 1, k, v, blocks, offsets)).view(np.uint8)
    want = {dt: np.asarray(kernel(args[0].astype(dt), *args[1:])) for dt in (F32, BF16)}

    def no_reference(*a, **kw):
        raise AssertionError("the cpu backend fell back to the reference")
    monkeypatch.setattr(cpu, "paged_attention_reference", no_reference)
    monkeypatch.setattr(cpu, "write_kv_reference", no_reference)
    backend = pallas_kernels.get_backend("cpu")
    for dt in (F32, BF16):
        q = args[0].astype(dt)
        assert cpu.supports(q, args[1])
        np.testing.assert_array_equal(np.asarray(jax.jit(backend.attention)(q, *args[1:])),
                                      want[dt])
        np.testing.assert_array_equal(
            np.asarray(pallas_kernels.paged_attention(q, *args[1:], impl="cpu")), want[dt])
    got = jax.jit(backend.write_kv)(pool, 1, k, v, blocks, offsets)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8)[1:], want_pool[1:])


def test_fallback_to_reference(monkeypatch):
    seed = fresh_seed()
    args = make_ragged_case(seed, [(20, 20), (9, 1)], G=2, KVH=2, D=64, BS=8, nan=False)
    pool, k, v, blocks, offsets = _write_case(np.random.default_rng(seed), pool_dtype=F32,
                                              kv_dtype=F32)
    want = np.asarray(kernel(*args))
    opts = dict(sm_scale=2.0, sliding_window=6, soft_cap=3.0)
    want_opts = np.asarray(kernel(*args, **opts))
    assert np.abs(want_opts - want).max() > 0.1
    want_pool = np.asarray(jax.jit(write_kv_reference)(pool, 1, k, v, blocks, offsets))
    # Unsupported dtype: not the kernel's (the reference takes it).
    q16 = args[0].astype(jnp.float16)
    assert not cpu.supports(q16, args[1])
    with pytest.raises(TypeError, match="float16"):
        cpu.paged_attention_cpu(q16, *args[1:])
    # Kernel unavailable (e.g. no compiler): both entry points fall back.
    monkeypatch.setattr(cpu, "_state", {"ok": False, "reason": "RuntimeError: no g++ (test)"})
    assert not cpu.available() and "no g++" in cpu.unavailable_reason()
    assert not cpu.supports(*args[:2])
    out = jax.jit(cpu.paged_attention_or_reference)(*args)    # cannot be the kernel now
    np.testing.assert_allclose(np.asarray(out), want, **TOL[np.dtype(F32)], err_msg=f"seed={seed}")
    out = jax.jit(cpu.paged_attention_or_reference, static_argnames=OPTIONS)(*args, **opts)
    np.testing.assert_allclose(np.asarray(out), want_opts, **TOL[np.dtype(F32)],
                               err_msg=f"seed={seed}")                # the options passed through
    np.testing.assert_array_equal(
        np.asarray(jax.jit(cpu.write_kv_or_reference)(pool, 1, k, v, blocks, offsets)), want_pool)
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu.paged_attention_cpu(*args)

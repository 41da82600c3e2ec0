"""The CPU decode kernel (pallas_kernels.cpu, a C++ XLA FFI custom call) vs the jnp reference."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import cpu
from pallas_kernels.reference import paged_attention_reference

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason=f"CPU kernel unavailable: {cpu.unavailable_reason()}")

NUM_LAYERS = 3
_ref = jax.jit(paged_attention_reference, static_argnames=("sm_scale",))


def _lengths(rng, B, BS, max_len):
    """Mix of edge lengths (0, 1, block boundaries +-1, the maximum) and random ones."""
    edges = [0, 1, BS - 1, BS, BS + 1, 2 * BS, 2 * BS + 1, max_len, max_len - 1]
    edges = [x for x in edges if 0 <= x <= max_len]
    lens = [edges[i % len(edges)] if i < len(edges) else int(rng.integers(0, max_len + 1))
            for i in range(B)]
    return np.asarray(rng.permutation(lens), np.int32)


def make_case(seed, *, B, KVH, G, D, BS, max_len, dtype=jnp.float32, poison=False):
    """Random pool, permuted block table with padded entries -> block 0, lengths.

    With poison, every pool element a sequence must not read (block 0, other
    layers, unowned blocks, the tail of each last block) is NaN; the clean pool
    has random values there instead.  Returns (q, clean_pool, pool, layer, bt, kv_lens, q_lens).
    """
    rng = np.random.default_rng(seed)
    W = math.ceil(max_len / BS)
    kv_lens = _lengths(rng, B, BS, max_len)
    q_lens = (kv_lens > 0).astype(np.int32)
    q_lens[rng.random(B) < 0.15] = 0                      # some padding rows with a stale kv_len
    nb = 1 + B * W + 3
    perm = rng.permutation(np.arange(1, nb))
    bt = np.zeros((B, W), np.int32)
    owned = np.zeros((nb, BS), bool)                       # (block, offset) read by someone at `layer`
    layer = int(rng.integers(1, NUM_LAYERS))
    i = 0
    for b in range(B):
        n = math.ceil(kv_lens[b] / BS)
        bt[b, :n] = perm[i:i + n]
        i += n
        for j in range(n):
            owned[bt[b, j], :min(BS, kv_lens[b] - j * BS)] = True
    clean = rng.standard_normal((nb, NUM_LAYERS, 2, KVH, BS, D)).astype(np.float32)
    pool = clean
    if poison:
        mask = np.zeros(clean.shape, bool)
        mask[:, layer] = owned[:, None, None, :, None]
        pool = np.where(mask, clean, np.nan).astype(np.float32)
    q = rng.standard_normal((B, 1, KVH * G, D)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(clean, dtype), jnp.asarray(pool, dtype), layer,
            jnp.asarray(bt), jnp.asarray(kv_lens), jnp.asarray(q_lens))


def _check_padding_zero(out, q_lens, kv_lens):
    pad = (np.asarray(q_lens) == 0) | (np.asarray(kv_lens) == 0)
    assert np.all(np.asarray(out, np.float32)[pad] == 0)


CASES = [  # (D, KVH, G, BS, B, max_len)
    (64, 2, 1, 16, 7, 600),
    (64, 3, 3, 16, 33, 150),
    (128, 2, 4, 8, 17, 333),
    (128, 1, 3, 64, 9, 600),
    (64, 2, 4, 1, 5, 70),
    (64, 1, 1, 64, 1, 64),
    (128, 4, 1, 8, 12, 97),
]


@pytest.mark.parametrize("D,KVH,G,BS,B,max_len", CASES)
def test_matches_reference(D, KVH, G, BS, B, max_len):
    q, clean, _, layer, bt, kv_lens, q_lens = make_case(D * 1000 + BS + G, B=B, KVH=KVH, G=G, D=D,
                                                        BS=BS, max_len=max_len)
    out = cpu.paged_decode_cpu(q, clean, layer, bt, kv_lens, q_lens)
    ref = _ref(q, clean, layer, bt, kv_lens, q_lens)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
    _check_padding_zero(out, q_lens, kv_lens)


@pytest.mark.parametrize("D,KVH,G,BS,B,max_len", [CASES[1], CASES[2], CASES[4]])
def test_nan_isolation(D, KVH, G, BS, B, max_len):
    q, clean, poisoned, layer, bt, kv_lens, q_lens = make_case(7 + BS, B=B, KVH=KVH, G=G, D=D, BS=BS,
                                                               max_len=max_len, poison=True)
    assert np.isnan(np.asarray(poisoned[0])).all()                    # the null block is all NaN
    out = np.asarray(cpu.paged_decode_cpu(q, poisoned, layer, bt, kv_lens, q_lens))
    assert np.isfinite(out).all()
    ref = _ref(q, clean, layer, bt, kv_lens, q_lens)
    np.testing.assert_allclose(out, np.asarray(ref), atol=1e-5, rtol=1e-5)
    _check_padding_zero(out, q_lens, kv_lens)


def test_sm_scale_and_padding_rows():
    q, clean, _, layer, bt, kv_lens, _ = make_case(3, B=6, KVH=2, G=3, D=64, BS=16, max_len=100)
    q_lens = jnp.asarray([1, 0, 1, 0, 1, 1], jnp.int32)
    out = cpu.paged_decode_cpu(q, clean, layer, bt, kv_lens, q_lens, sm_scale=0.3)
    ref = _ref(q, clean, layer, bt, kv_lens, q_lens, sm_scale=0.3)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(out)[[1, 3]] == 0)
    # All-padding batch.
    zeros = cpu.paged_decode_cpu(q, clean, layer, bt, jnp.zeros_like(kv_lens), jnp.zeros_like(q_lens))
    assert np.all(np.asarray(zeros) == 0)


def test_jit_traced_layer_scan_and_donation():
    q, clean, _, _, bt, kv_lens, q_lens = make_case(11, B=9, KVH=3, G=3, D=64, BS=16, max_len=160)

    @jax.jit
    def all_layers(q, pool):  # layer is traced inside the scan, like the engine's layer loop
        def body(carry, layer):
            return carry, pallas_kernels.paged_attention(q, pool, layer, bt, kv_lens, q_lens, impl="cpu")
        return jax.lax.scan(body, 0, jnp.arange(NUM_LAYERS, dtype=jnp.int32))[1]

    outs = all_layers(q, clean)
    for layer in range(NUM_LAYERS):
        np.testing.assert_allclose(np.asarray(outs[layer]), np.asarray(_ref(q, clean, layer, bt, kv_lens, q_lens)),
                                   atol=1e-5, rtol=1e-5)

    # Donated pool updated in place after the read: attention sees the old contents.
    expected = np.asarray(_ref(q, clean, 1, bt, kv_lens, q_lens))
    step = jax.jit(lambda q, pool, layer: (cpu.paged_decode_cpu(q, pool, layer, bt, kv_lens, q_lens),
                                           pool.at[:, layer].set(0.0)), donate_argnums=1)
    out, new_pool = step(q, jnp.array(clean), jnp.int32(1))
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(new_pool[:, 1]) == 0)


def test_dispatch_and_fallbacks():
    assert "cpu" in pallas_kernels.IMPLS
    if jax.default_backend() == "cpu":
        assert pallas_kernels.default_impl() == "cpu"
    # Q > 1 (prefill) falls back to the reference.
    rng = np.random.default_rng(5)
    _, clean, _, layer, bt, kv_lens, q_lens = make_case(5, B=4, KVH=2, G=2, D=64, BS=8, max_len=40)
    q = jnp.asarray(rng.standard_normal((4, 3, 4, 64)), jnp.float32)
    q_lens = jnp.minimum(kv_lens, 3)
    out = jax.jit(pallas_kernels.paged_attention, static_argnames=("impl",))(
        q, clean, layer, bt, kv_lens, q_lens, impl="cpu")
    np.testing.assert_allclose(np.asarray(out), np.asarray(_ref(q, clean, layer, bt, kv_lens, q_lens)),
                               atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="decode-only"):
        cpu.paged_decode_cpu(q, clean, layer, bt, kv_lens, q_lens)


def test_vmap_sequential():
    q, clean, _, layer, bt, kv_lens, q_lens = make_case(13, B=4, KVH=2, G=2, D=64, BS=16, max_len=60)
    qs = jnp.stack([q, 2 * q])
    out = jax.vmap(lambda q: cpu.paged_decode_cpu(q, clean, layer, bt, kv_lens, q_lens))(qs)
    for i in range(2):
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(_ref(qs[i], clean, layer, bt, kv_lens, q_lens)),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
def test_bf16_pool(q_dtype):
    q, clean, poisoned, layer, bt, kv_lens, q_lens = make_case(17, B=10, KVH=2, G=3, D=128, BS=16,
                                                               max_len=300, dtype=jnp.bfloat16, poison=True)
    q = q.astype(q_dtype)
    out = cpu.paged_decode_cpu(q, poisoned, layer, bt, kv_lens, q_lens)
    assert out.dtype == q_dtype
    ref = _ref(q, clean, layer, bt, kv_lens, q_lens)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)
    _check_padding_zero(out, q_lens, kv_lens)
    via_dispatch = pallas_kernels.paged_attention(q, poisoned, layer, bt, kv_lens, q_lens, impl="cpu")
    np.testing.assert_array_equal(np.asarray(via_dispatch, np.float32), out)


@pytest.mark.parametrize("pool_dtype,kv_dtype", [(jnp.bfloat16, jnp.float32),
                                                 (jnp.bfloat16, jnp.bfloat16),
                                                 (jnp.float32, jnp.float32)])
def test_write_kv_matches_xla_scatter(pool_dtype, kv_dtype):
    """The C++ K/V write equals XLA's scatter (bf16 rounding included), drops
    out-of-range slots, leaves everything else alone, and updates the donated
    pool in place."""
    rng = np.random.default_rng(7)
    NB, L, KVH, BS, D, T, layer = 9, NUM_LAYERS, 2, 8, 64, 21, 1
    pool = jnp.asarray(rng.standard_normal((NB, L, 2, KVH, BS, D)), pool_dtype)
    new_kv = jnp.asarray(rng.standard_normal((T, 2, KVH, D)), kv_dtype)
    slots = rng.permutation(NB * BS)[:T].astype(np.int32)
    slots[3], slots[11] = -1, NB * BS + 5                       # dropped
    ok = (slots >= 0) & (slots < NB * BS)
    want = pool.at[slots[ok] // BS, layer, :, :, slots[ok] % BS].set(
        new_kv[ok].astype(pool_dtype))
    write = jax.jit(cpu.write_kv_cpu, donate_argnums=0)
    ptr = pool.unsafe_buffer_pointer()
    got = write(pool, layer, new_kv, jnp.asarray(slots))
    assert got.unsafe_buffer_pointer() == ptr
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

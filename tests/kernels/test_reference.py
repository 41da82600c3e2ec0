"""The oracle itself and the backend registry.

`paged_attention_reference` is what every kernel is tested against, so it is
checked here against a plain numpy loop (one softmax per token and head), and
the registry is checked to route each impl to its attention and K/V write.
Kernel tests: test_cpu.py, test_gpu.py, test_tpu.py (this directory).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from kernels.cases import attention_per_layer, check_ragged, fresh_seed, make_ragged_case, mixed_seqs

import pallas_kernels
from pallas_kernels.reference import write_kv_reference


def numpy_attention(q, pool, layer, block_tables, kv_lens, cu_q_lens):
    q, pool, bt, kv_lens, cu = map(np.asarray, (q, pool, block_tables, kv_lens, cu_q_lens))
    q, pool = q.astype(np.float64), pool.astype(np.float64)
    T, H, D = q.shape
    KVH, BS = pool.shape[3], pool.shape[4]
    out = np.zeros((T, H, D))
    for s in range(len(kv_lens)):
        q_len = cu[s + 1] - cu[s]
        for i in range(q_len):
            t, pos = cu[s] + i, kv_lens[s] - q_len + i
            rows = [(bt[s, j // BS], j % BS) for j in range(pos + 1)]
            for h in range(H):
                kvh = h // (H // KVH)
                k = np.stack([pool[b, layer, 0, kvh, o] for b, o in rows])
                v = np.stack([pool[b, layer, 1, kvh, o] for b, o in rows])
                w = np.exp((k @ q[t, h]) * D ** -0.5 - np.max((k @ q[t, h]) * D ** -0.5))
                out[t, h] = (w / w.sum()) @ v
    return out


@pytest.mark.parametrize("G,KVH,BS", [(1, 2, 8), (3, 1, 4), (2, 2, 16)])
def test_reference_matches_a_numpy_loop(G, KVH, BS):
    seed = fresh_seed()
    seqs = mixed_seqs(np.random.default_rng(seed), 4, BS, 2 * BS + 5, 6) + [(BS, BS)]
    args = make_ragged_case(seed, seqs, G=G, KVH=KVH, D=16, BS=BS, layer=2)
    got = np.asarray(pallas_kernels.paged_attention(*args, impl="reference"))
    want = numpy_attention(*args)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"seed={seed}")
    check_ragged(jnp.asarray(got), args, seed, "reference")  # NaN-free, zero padding


def test_write_kv_reference_writes_each_token_once():
    pool = jnp.zeros((4, 2, 2, 1, 4, 2))
    k = jnp.arange(6.0).reshape(3, 1, 2)
    v = -k
    out = np.asarray(write_kv_reference(pool, 1, k, v, jnp.array([2, 3, 0]), jnp.array([1, 0, 0])))
    np.testing.assert_array_equal(out[2, 1, 0, 0, 1], [0, 1])
    np.testing.assert_array_equal(out[3, 1, 1, 0, 0], [-2, -3])
    assert not out[:, 0].any() and not out[1].any()  # other layers and blocks untouched


def test_registry_routes_every_impl():
    assert set(pallas_kernels.IMPLS) == {"reference", "cpu", "gpu", "tpu"}
    assert pallas_kernels.default_impl() in pallas_kernels.IMPLS
    for impl in pallas_kernels.IMPLS:
        backend = pallas_kernels.get_backend(impl)
        assert backend.name == impl and callable(backend.attention) and callable(backend.write_kv)
    with pytest.raises(ValueError, match="unknown attention impl"):
        pallas_kernels.get_backend("nope")


def test_reference_rejects_mismatched_shapes():
    q, pool, layer, bt, kv_lens, cu = make_ragged_case(0, [(5, 5)], G=1, KVH=1, D=16, BS=4)
    with pytest.raises(ValueError, match="cu_q_lens"):
        pallas_kernels.paged_attention(q, pool, layer, bt, kv_lens, cu[:-1])
    with pytest.raises(ValueError, match="num_tokens"):
        pallas_kernels.paged_attention(q[None], pool, layer, bt, kv_lens, cu)


def test_reference_in_a_layer_scan_under_jit():
    seed = fresh_seed()
    args = make_ragged_case(seed, [(20, 3), (7, 7), (9, 1)], G=2, KVH=1, D=16, BS=4, nan=False)
    q, pool, _, bt, kv_lens, cu = args
    out = attention_per_layer("reference", q, pool, bt, kv_lens, cu, sm_scale=None)
    for layer in range(3):
        want = numpy_attention(q, pool, layer, bt, kv_lens, cu)
        np.testing.assert_allclose(np.asarray(out[layer]), want, atol=2e-5, rtol=1e-5)

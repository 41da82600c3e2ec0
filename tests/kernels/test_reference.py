"""The oracle itself, the contract's options and the backend registry.

`paged_attention_reference` is what every kernel is tested against, so it is
checked here against a dense numpy implementation written from the contract
(per sequence: gather its keys, scale, soft-cap, mask causally and to the
sliding window, softmax in float64) over the cases of the shared table
(`cases.CASES`) that list "reference": every sliding-window and soft-cap case
(windows smaller than, equal to and larger than the block size, window 1,
sequences many windows long, prefill chunks and decodes in one batch, GQA)
and plain ones; the registry is checked to route each impl to its attention
and K/V write, and every impl to reject invalid options.
Kernel tests: test_cpu.py, test_gpu.py, test_tpu.py (this directory).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from kernels.cases import (attention_per_layer, cases_for, fresh_seed, make_ragged_case, oracle,
                           reference)

import pallas_kernels
from pallas_kernels.reference import CODES_PER_OCTAVE, is_quantized, write_kv_reference


def dense_attention(q, pool, layer, block_tables, kv_lens, cu_q_lens, *, sm_scale=None,
                    sliding_window=None, soft_cap=None):
    """The contract in numpy, float64, one sequence at a time: token i of sequence s
    at position p = kv_len - q_len + i sees keys k with p - sliding_window < k <= p."""
    if is_quantized(pool.dtype):  # pages: BS rows of head_dim values, then a row of their codes
        steps = CODES_PER_OCTAVE[jnp.dtype(pool.dtype)]
        pool = np.asarray(pool, np.float64)
        BS = pool.shape[-2] - 1
        pool = pool[..., :BS, :] * np.exp2(pool[..., BS, :BS, None] / steps)
    q, pool, bt, kv_lens, cu = map(np.asarray, (q, pool, block_tables, kv_lens, cu_q_lens))
    q, pool = q.astype(np.float64), pool.astype(np.float64)
    T, H, D = q.shape
    KVH, BS = pool.shape[3], pool.shape[4]
    G = H // KVH
    scale = D ** -0.5 if sm_scale is None else sm_scale
    out = np.zeros((T, H, D))
    for s in range(len(kv_lens)):
        q_len, kv_len = cu[s + 1] - cu[s], kv_lens[s]
        if q_len == 0:
            continue
        key = np.arange(kv_len)
        pos = kv_len - q_len + np.arange(q_len)
        visible = key[None, :] <= pos[:, None]                            # [q_len, kv_len]
        if sliding_window is not None:
            visible &= key[None, :] > pos[:, None] - sliding_window
        seen = visible.any(axis=0)       # keys no token sees may be freed / NaN: never read
        k = pool[bt[s, key[seen] // BS], layer, 0, :, key[seen] % BS]     # [n, KVH, D]
        v = pool[bt[s, key[seen] // BS], layer, 1, :, key[seen] % BS]
        qs = q[cu[s]:cu[s + 1]].reshape(q_len, KVH, G, D)
        scores = np.einsum("tkgd,nkd->tkgn", qs, k) * scale
        if soft_cap is not None:
            scores = soft_cap * np.tanh(scores / soft_cap)
        scores = np.where(visible[:, seen][:, None, None, :], scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[cu[s]:cu[s + 1]] = np.einsum("tkgn,nkd->tkgd", p / p.sum(-1, keepdims=True),
                                         v).reshape(q_len, H, D)
    return out


@pytest.mark.parametrize("case", cases_for("reference"), ids=lambda c: c.id)
def test_reference_matches_dense_numpy(case):
    seed = fresh_seed()
    seqs, args = case.make(seed)
    got = oracle(args, **case.options)
    want = dense_attention(*args, **case.options)
    if case.dtype == np.float32:
        tol = dict(atol=2e-5 * case.fp32_tol, rtol=1e-5 * case.fp32_tol)
    else:  # bf16 inputs are exact in fp32 and float64; the outputs are rounded to bf16
        want = np.asarray(jnp.asarray(want, case.dtype), np.float32)
        tol = dict(atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(got, want, **tol, err_msg=f"{case.id} seed={seed} seqs={seqs}")
    assert (got[np.asarray(args[5])[-1]:] == 0).all(), f"{case.id}: padding tokens not zero"
    if case.soft_cap is not None:  # the case tests what it says: the cap changes the result
        uncapped = dense_attention(*args, **{**case.options, "soft_cap": None})
        assert np.abs(uncapped - dense_attention(*args, **case.options)).max() > 0.1, case.id


def test_window_and_cap_change_the_result():
    """On a finite pool: a window shorter than the context and a cap below the logits
    each change the dense result, and a window past every context changes nothing."""
    seed = fresh_seed()
    args = make_ragged_case(seed, [(60, 20), (33, 1)], G=2, KVH=1, D=16, BS=8, nan=False)
    plain = dense_attention(*args, sm_scale=3.0)
    assert np.abs(dense_attention(*args, sm_scale=3.0, sliding_window=10) - plain).max() > 0.1
    assert np.abs(dense_attention(*args, sm_scale=3.0, soft_cap=2.0) - plain).max() > 0.1
    np.testing.assert_array_equal(dense_attention(*args, sm_scale=3.0, sliding_window=61), plain)
    got = np.asarray(reference(*args, sm_scale=3.0, sliding_window=10, soft_cap=2.0))
    np.testing.assert_allclose(got, dense_attention(*args, sm_scale=3.0, sliding_window=10,
                                                    soft_cap=2.0), atol=2e-5, rtol=1e-5)


BAD_OPTIONS = [dict(sliding_window=0), dict(sliding_window=-4), dict(sliding_window=8.0),
               dict(sliding_window=True), dict(sliding_window="8"), dict(soft_cap=0.0),
               dict(soft_cap=-30.0), dict(soft_cap=float("inf")), dict(soft_cap=float("nan")),
               dict(soft_cap=True), dict(soft_cap="50")]


def test_every_impl_rejects_invalid_options():
    args = make_ragged_case(0, [(9, 3)], G=2, KVH=1, D=16, BS=8, nan=False)
    for impl in pallas_kernels.IMPLS:
        for bad in BAD_OPTIONS:
            (name, value), = bad.items()
            with pytest.raises(ValueError, match=name):
                pallas_kernels.paged_attention(*args, impl=impl, **bad)
                pytest.fail(f"impl={impl} accepted {bad}")
    # numpy scalars are fine
    got = reference(*args, sliding_window=np.int64(4), soft_cap=np.float32(5.0))
    assert np.isfinite(np.asarray(got)).all()


def test_write_kv_reference_writes_each_token_once():
    pool = jnp.zeros((4, 2, 2, 1, 4, 2))
    k = jnp.arange(6.0).reshape(3, 1, 2)
    v = -k
    out = np.asarray(write_kv_reference(pool, 1, k, v, jnp.array([2, 3, 0]), jnp.array([1, 0, 0])))
    np.testing.assert_array_equal(out[2, 1, 0, 0, 1], [0, 1])
    np.testing.assert_array_equal(out[3, 1, 1, 0, 0], [-2, -3])
    assert not out[:, 0].any() and not out[1].any()  # other layers and blocks untouched


def test_registry_routes_every_impl():
    assert pallas_kernels.IMPLS == ("reference", "cpu", "pallas_gpu", "pallas_tpu")
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
    for options in [{}, dict(sliding_window=6, soft_cap=4.0)]:
        out = attention_per_layer("reference", q, pool, bt, kv_lens, cu, sm_scale=None, **options)
        for layer in range(3):
            want = dense_attention(q, pool, layer, bt, kv_lens, cu, **options)
            np.testing.assert_allclose(np.asarray(out[layer]), want, atol=2e-5, rtol=1e-5,
                                       err_msg=f"{options} layer {layer} seed={seed}")

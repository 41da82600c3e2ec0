"""Random ragged paged-attention cases shared by the kernel tests.

A case is a list of sequences (kv_len, q_len): q_len new tokens at the end of
kv_len tokens in the pool (q_len == kv_len: a prompt's first chunk; 1: decode;
0 with kv_len 0: a padding sequence).  Everything a sequence may not read is
NaN: block 0, blocks it does not own, the tail of its last block, and every
layer other than the one read.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import paged_attention_reference

TOL = {np.dtype(np.float32): dict(atol=2e-5, rtol=1e-5),
       np.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2)}
NUM_LAYERS = 3
reference = jax.jit(paged_attention_reference, static_argnames=("sm_scale",))


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def make_ragged_case(seed: int, seqs: list[tuple[int, int]], *, G: int, KVH: int, D: int, BS: int,
                     dtype=np.float32, layer: int = 1, nan: bool = True, pad_tokens: int = 3,
                     pad_seqs: int = 1, width: int | None = None, num_blocks: int | None = None):
    """(q, kv_pool, layer, block_tables, kv_lens, cu_q_lens) for sequences (kv_len, q_len).

    `pad_tokens` padding tokens follow the real ones in q; `pad_seqs` padding
    sequences (kv_len 0, q_len 0) follow the real ones.  Block tables are
    padded with 0 to `width` (default: one more than the longest needs).
    """
    rng = np.random.default_rng(seed)
    kv_lens = np.array([kv for kv, _ in seqs] + [0] * pad_seqs, np.int32)
    q_lens = np.array([ql for _, ql in seqs] + [0] * pad_seqs, np.int32)
    assert (q_lens <= kv_lens).all()
    S = len(kv_lens)
    n_blk = -(-kv_lens // BS)
    W = width or max(1, int(n_blk.max())) + 1
    NB = num_blocks or 1 + int(n_blk.sum()) + 3           # + null block + spares
    assert W >= n_blk.max() and NB >= 1 + n_blk.sum()
    pool = rng.standard_normal((NB, NUM_LAYERS, 2, KVH, BS, D)).astype(np.float32)
    poison = np.ones(pool.shape, bool)
    bt = np.zeros((S, W), np.int32)
    phys = rng.permutation(np.arange(1, NB))
    k = 0
    for s in range(S):
        ids = phys[k:k + n_blk[s]]
        k += n_blk[s]
        bt[s, :n_blk[s]] = ids
        for j, blk in enumerate(ids):
            poison[blk, layer, :, :, :min(BS, kv_lens[s] - j * BS)] = False
    if nan:
        pool[poison] = np.nan
    T = int(q_lens.sum()) + pad_tokens
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((T, G * KVH, D))
    return (jnp.asarray(q, dtype), jnp.asarray(pool, dtype), layer, jnp.asarray(bt),
            jnp.asarray(kv_lens), jnp.asarray(cu))


def attention_per_layer(impl: str, q, pool, block_tables, kv_lens, cu_q_lens, *, sm_scale=0.3,
                        **jit_kwargs):
    """[NUM_LAYERS, T, H, D]: paged_attention of every layer through the public entry
    point, the layer index traced inside lax.scan under jit (as a scanned model does)."""
    import pallas_kernels

    def body(carry, layer):
        return carry, pallas_kernels.paged_attention(q, pool, layer, block_tables, kv_lens,
                                                     cu_q_lens, impl=impl, sm_scale=sm_scale)
    return jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(NUM_LAYERS))[1], **jit_kwargs)()


def check_ragged(out, args, seed: int, what: str) -> None:
    """out matches the reference; padding tokens are exactly zero."""
    q, cu = args[0], np.asarray(args[5])
    assert out.shape == q.shape and out.dtype == q.dtype, f"{what}: {out.shape} {out.dtype}"
    ref = np.asarray(reference(*args), np.float32)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), f"{what}: non-finite output (seed={seed})"
    np.testing.assert_allclose(out, ref, **TOL[np.dtype(q.dtype)], err_msg=f"{what} seed={seed}")
    assert (out[cu[-1]:] == 0).all(), f"{what}: padding tokens not zero (seed={seed})"


def lens_profile(rng, n: int, BS: int, max_len: int) -> list[int]:
    """Lengths mixing 1, exact block boundaries, boundary + 1, the maximum and random."""
    special = [1, BS, BS + 1, 2 * BS, max_len, max_len - 1, (max_len // BS) * BS]
    out = [special[i] if i < len(special) else int(rng.integers(1, max_len + 1)) for i in range(n)]
    rng.shuffle(out)
    return [max(1, min(max_len, x)) for x in out]


def mixed_seqs(rng, n: int, BS: int, max_len: int, max_q: int) -> list[tuple[int, int]]:
    """n sequences: decodes, whole prompts and prefill chunks over a cached prefix."""
    seqs = []
    for i, kv in enumerate(lens_profile(rng, n, BS, max_len)):
        kind = i % 3
        q = 1 if kind == 0 else min(kv, max_q) if kind == 1 else int(rng.integers(1, min(kv, max_q) + 1))
        seqs.append((kv, q))
    return seqs

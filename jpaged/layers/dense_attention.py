"""decode.score's attention: dense causal attention over B rows of L tokens, with no pool.

`DENSE` is a pallas_kernels `Backend` whose "pool" is the layer's own K/V: its
write_kv stacks them, its attention is a masked [B, KVH, G, L, L] softmax in
fp32 with the reference's arithmetic (scale, soft cap, sliding window).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import Backend
from pallas_kernels.reference import MASK_VALUE, attention_options


def dense_write_kv(kv: jax.Array, layer: jax.Array | int, k: jax.Array, v: jax.Array,
                   blocks: jax.Array, offsets: jax.Array) -> jax.Array:
    """No cache: the layer's own k, v [T, kv_heads, head_dim], stacked [2, T, ...],
    are the "pool" its attention reads (and what the next layer ignores)."""
    return jnp.stack([k, v]).astype(kv.dtype)


def dense_causal_attention(q: jax.Array, kv: jax.Array, layer: jax.Array | int,
                           block_tables: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array, *,
                           sm_scale: float | None = None, sliding_window: int | None = None,
                           soft_cap: float | None = None) -> jax.Array:
    """Causal attention of q [T, H, D] over kv [2, T, KVH, D] (this layer's), T = B * L:
    B rows of L tokens each (B = kv_lens.shape[0]), position i of a row seeing its
    positions j <= i (and j > i - sliding_window).  The reference's arithmetic
    (fp32 scores, scale, soft cap, mask, softmax) over a dense [B, KVH, G, L, L]."""
    sliding_window, soft_cap = attention_options(sliding_window, soft_cap)
    B, (T, H, D), KVH = kv_lens.shape[0], q.shape, kv.shape[2]
    L, G = T // B, H // KVH
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    qg = q.astype(jnp.float32).reshape(B, L, KVH, G, D)
    k, v = kv.astype(jnp.float32).reshape(2, B, L, KVH, D)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    pos = jnp.arange(L)
    visible = pos[None, :] <= pos[:, None]                  # [L queries, L keys]
    if sliding_window is not None:
        visible &= pos[None, :] > pos[:, None] - sliding_window
    probs = jax.nn.softmax(jnp.where(visible, scores, MASK_VALUE), axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(T, H, D).astype(q.dtype)


# decode.score's attention: dense causal over [B, L] tokens, no pool (see `score`).
DENSE = Backend("dense", dense_causal_attention, dense_write_kv)

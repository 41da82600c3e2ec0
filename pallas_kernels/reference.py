"""Pure-jnp paged attention: the oracle every kernel is tested against.

It gathers each sequence's K/V blocks out of the pool through its block table
(a copy the Pallas kernels avoid) and runs masked dense attention in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30  # finite, so a row with no visible key gives zeros, not NaN


def paged_attention_reference(q: jax.Array, kv_pool: jax.Array, layer: jax.Array | int,
                              block_tables: jax.Array, kv_lens: jax.Array, q_lens: jax.Array,
                              *, sm_scale: float | None = None) -> jax.Array:
    """See `pallas_kernels.paged_attention` for shapes and semantics."""
    B, Q, H, D, KVH, BS, G, W, scale = attention_dims(q, kv_pool, block_tables, sm_scale)
    # One gather per K and V, straight into [B, KVH, W, BS, D] (indices broadcast
    # over (B, KVH, W)) so that no transpose copy follows: -> [B, KVH, W*BS, D].
    blocks = block_tables[:, None, :]
    heads = jnp.arange(KVH)[None, :, None]
    k = kv_pool[blocks, layer, 0, heads].reshape(B, KVH, W * BS, D)
    v = kv_pool[blocks, layer, 1, heads].reshape(B, KVH, W * BS, D)

    key_pos = jnp.arange(W * BS)[None, :]                                   # [1, S]
    q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(Q)[None, :]            # [B, Q]
    q_valid = jnp.arange(Q)[None, :] < q_lens[:, None]                      # [B, Q]
    visible = (key_pos[:, None, :] <= q_pos[:, :, None]) & (key_pos[:, None, :] < kv_lens[:, None, None])
    visible &= q_valid[:, :, None]                                          # [B, Q, S]
    # Blocks a sequence does not own may hold anything (NaN included): zero
    # them so that 0 * NaN never reaches the output.
    key_valid = key_pos < kv_lens[:, None]                                  # [B, S]
    k = jnp.where(key_valid[:, None, :, None], k, 0).astype(jnp.float32)
    v = jnp.where(key_valid[:, None, :, None], v, 0).astype(jnp.float32)

    qg = q.astype(jnp.float32).reshape(B, Q, KVH, G, D)
    scores = jnp.einsum("bqkgd,bksd->bkgqs", qg, k) * scale
    scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None], probs, 0.0)
    out = jnp.einsum("bkgqs,bksd->bqkgd", probs, v)
    return out.reshape(B, Q, H, D).astype(q.dtype)


def attention_dims(q: jax.Array, kv_pool: jax.Array, block_tables: jax.Array,
                   sm_scale: float | None) -> tuple[int, int, int, int, int, int, int, int, float]:
    """(B, Q, H, D, KVH, BS, G, W, scale) of a paged_attention call, checked."""
    B, Q, H, D = q.shape
    KVH, BS, Dk = kv_pool.shape[3:]
    if Dk != D or H % KVH:
        raise ValueError(f"q {q.shape} does not fit pool {kv_pool.shape}: head_dim must match "
                         "and num_heads must be a multiple of num_kv_heads")
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    return B, Q, H, D, KVH, BS, H // KVH, block_tables.shape[1], scale


def row_tile_span(t, block_m: int, group: int, q_len, kv_len):
    """(first new token, last key position seen) of row tile t in the ragged kernels.

    The kernels flatten a row's new tokens x the G query heads of a KV head
    into rows (row r is token r // G) tiled by block_m; a tile with
    first token >= q_len holds only padding.
    """
    first_tok = (t * block_m) // group
    last_tok = jnp.minimum((t * block_m + block_m - 1) // group, q_len - 1)
    return first_tok, kv_len - q_len + last_tok

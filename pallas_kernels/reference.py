"""Pure-jnp ragged paged attention: the oracle every kernel is tested against.

Each query token gathers its own sequence's K/V blocks out of the pool through
the block table (a copy the kernels avoid) and runs masked dense attention in
fp32.  Tokens are processed in tiles (`lax.map` with a batch size) so that the
gathered K/V stay bounded: tile x kv_heads x W*block_size x head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30  # finite, so a row with no visible key gives zeros, not NaN
TOKEN_TILE = 16


def token_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sequence [T], position [T], valid [T]) of each flat query token.

    Token t belongs to the sequence s with cu_q_lens[s] <= t < cu_q_lens[s + 1];
    tokens at or past cu_q_lens[-1] are padding (valid False, sequence clamped).
    """
    S = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1, 0, S - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, pos, t < cu_q_lens[S]


def paged_attention_reference(q: jax.Array, kv_pool: jax.Array, layer: jax.Array | int,
                              block_tables: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array,
                              *, sm_scale: float | None = None) -> jax.Array:
    """See `pallas_kernels.paged_attention` for shapes and semantics."""
    T, H, D, KVH, BS, G, S, W, scale = attention_dims(q, kv_pool, block_tables, kv_lens,
                                                      cu_q_lens, sm_scale)
    seq, pos, valid = token_layout(cu_q_lens, kv_lens, T)
    heads = jnp.arange(KVH)[:, None]
    key_pos = jnp.arange(W * BS)

    def attend(args):
        q_t, s, p, ok = args                                   # [H, D], scalars
        blocks = block_tables[s][None, :]                      # [1, W]
        k = kv_pool[blocks, layer, 0, heads].reshape(KVH, W * BS, D)
        v = kv_pool[blocks, layer, 1, heads].reshape(KVH, W * BS, D)
        owned = key_pos < kv_lens[s]
        visible = owned & (key_pos <= p) & ok                  # [W*BS]
        # Blocks a sequence does not own may hold anything (NaN included):
        # zero them so that 0 * NaN never reaches the output.
        k = jnp.where(owned[None, :, None], k, 0).astype(jnp.float32)
        v = jnp.where(owned[None, :, None], v, 0).astype(jnp.float32)
        qg = q_t.astype(jnp.float32).reshape(KVH, G, D)
        scores = jnp.einsum("kgd,ksd->kgs", qg, k) * scale
        scores = jnp.where(visible, scores, MASK_VALUE)
        probs = jnp.where(visible, jax.nn.softmax(scores, axis=-1), 0.0)
        return jnp.einsum("kgs,ksd->kgd", probs, v).reshape(H, D)

    out = jax.lax.map(attend, (q, seq, pos, valid), batch_size=min(T, TOKEN_TILE))
    return out.astype(q.dtype)


def attention_dims(q: jax.Array, kv_pool: jax.Array, block_tables: jax.Array, kv_lens: jax.Array,
                   cu_q_lens: jax.Array, sm_scale: float | None
                   ) -> tuple[int, int, int, int, int, int, int, int, float]:
    """(T, H, D, KVH, BS, G, S, W, scale) of a ragged paged_attention call, checked."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {q.shape}")
    T, H, D = q.shape
    if kv_pool.ndim != 6 or kv_pool.shape[2] != 2:
        raise ValueError(f"kv_pool must be [num_blocks, num_layers, 2, kv_heads, block_size, "
                         f"head_dim], got {kv_pool.shape}")
    KVH, BS, Dk = kv_pool.shape[3:]
    if Dk != D or H % KVH:
        raise ValueError(f"q {q.shape} does not fit pool {kv_pool.shape}: head_dim must match "
                         "and num_heads must be a multiple of num_kv_heads")
    S, W = block_tables.shape
    if kv_lens.shape != (S,) or cu_q_lens.shape != (S + 1,):
        raise ValueError(f"block_tables {block_tables.shape} needs kv_lens [{S}] and cu_q_lens "
                         f"[{S + 1}], got {kv_lens.shape} and {cu_q_lens.shape}")
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    return T, H, D, KVH, BS, H // KVH, S, W, scale


def write_kv_reference(kv_pool: jax.Array, layer: jax.Array | int, k: jax.Array, v: jax.Array,
                       blocks: jax.Array, offsets: jax.Array) -> jax.Array:
    """kv_pool with k, v [T, kv_heads, head_dim] written at (blocks[T], offsets[T]) of `layer`.

    One XLA scatter; with the pool donated it updates in place.  Padding tokens
    point at the null block 0, which no sequence reads unmasked.
    """
    kv = jnp.stack([k, v], axis=1).astype(kv_pool.dtype)  # [T, 2, KVH, D]
    return kv_pool.at[blocks, layer, :, :, offsets].set(kv, mode="drop", unique_indices=False)


def row_tile_span(t, block_m: int, group: int, q_len, kv_len):
    """(first new token, last key position seen) of row tile t of one sequence.

    The ragged kernels flatten a sequence's new tokens x the G query heads of a
    KV head into rows (row r is token r // G) tiled by block_m; a tile with
    first token >= q_len holds only padding.
    """
    first_tok = (t * block_m) // group
    last_tok = jnp.minimum((t * block_m + block_m - 1) // group, q_len - 1)
    return first_tok, kv_len - q_len + last_tok

"""Paged-attention kernels: a jnp reference and Pallas kernels for GPU and TPU.

Importable on its own (no dependency on jpaged).  One public entry point,
`paged_attention`, dispatches by `impl`.
"""

from __future__ import annotations

import jax

from pallas_kernels.reference import paged_attention_reference

IMPLS = ("reference",)


def paged_attention(q: jax.Array, kv_pool: jax.Array, layer: jax.Array | int,
                    block_tables: jax.Array, kv_lens: jax.Array, q_lens: jax.Array,
                    *, impl: str = "reference", sm_scale: float | None = None) -> jax.Array:
    """Attention of new query tokens over their sequence's paged K/V.

    Args:
      q: [B, Q, num_heads, head_dim] queries of the new tokens of B sequences,
        each row padded to Q tokens.  Decode is Q == 1; prefill chunks and mixed
        batches use Q > 1 with ragged `q_lens`.
      kv_pool: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim];
        axis 2 is (K, V).  Block 0 is the null block that padded block-table
        entries point at; its contents are never read unmasked.
      layer: which layer's K/V to read (a scalar, traced inside the layer scan).
      block_tables: [B, W] int32, physical block of logical block j of sequence b.
      kv_lens: [B] int32, tokens of sequence b in the pool, the new ones included
        (their K/V are written before attention).  0 for padding rows.
      q_lens: [B] int32, valid new tokens of row b (<= Q; 0 for padding rows).
        New token i of row b sits at position kv_lens[b] - q_lens[b] + i and
        attends causally to keys 0..that position.
      impl: "reference" (jnp), or a Pallas kernel registered in IMPLS.
      sm_scale: softmax scale, default head_dim ** -0.5.

    Returns:
      [B, Q, num_heads, head_dim] in q's dtype; rows beyond q_lens are zero.
      num_heads must be a multiple of num_kv_heads (GQA; query head h reads KV
      head h // (num_heads // num_kv_heads)).
    """
    if impl == "reference":
        return paged_attention_reference(q, kv_pool, layer, block_tables, kv_lens, q_lens,
                                         sm_scale=sm_scale)
    raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")


__all__ = ["paged_attention", "paged_attention_reference", "IMPLS"]

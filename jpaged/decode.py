"""The functional API: pure, jit-able pieces for use inside other JAX programs.

Nothing here holds state.  A caller owns the KV pool (an array it threads
through every call and should donate), the block tables (int32 arrays it builds
with any allocator it likes) and the lengths.

    pool = create_kv_pool(cfg, num_blocks=64, block_size=16, dtype=jnp.float32)
    logits, pool = forward_step(graphdef, params, pool, prompt[None], block_tables,
                                context_lens=jnp.array([0]), q_lens=jnp.array([n]))
    token = sample(logits, None)            # greedy; or SamplingArrays per row

See README "Using jpaged.decode" for a whole loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.kv_cache import NULL_BLOCK, create_kv_pool
from jpaged.model import AttentionMetadata, forward
from jpaged.sampling import SamplingArrays, greedy
from jpaged.sampling import sample as _sample


def make_metadata(block_tables: jax.Array, context_lens: jax.Array, q_lens: jax.Array,
                  q_pad: int, block_size: int) -> AttentionMetadata:
    """Attention metadata for rows of q_pad new tokens each (q_lens valid).

    context_lens[b] tokens of row b are already in the pool; its new tokens
    take positions context_lens[b] .. context_lens[b] + q_lens[b] - 1.
    """
    offsets = jnp.arange(q_pad, dtype=jnp.int32)[None, :]
    positions = context_lens[:, None] + offsets                       # [B, Q]
    valid = offsets < q_lens[:, None]
    logical = jnp.minimum(positions // block_size, block_tables.shape[1] - 1)
    blocks = jnp.take_along_axis(block_tables, logical, axis=1)
    slots = jnp.where(valid, blocks * block_size + positions % block_size, NULL_BLOCK)
    return AttentionMetadata(positions=jnp.where(valid, positions, 0), slot_mapping=slots,
                             block_tables=block_tables, kv_lens=context_lens + q_lens, q_lens=q_lens)


def forward_step(graphdef: nnx.GraphDef, params: nnx.State, kv_pool: jax.Array,
                 tokens: jax.Array, block_tables: jax.Array, context_lens: jax.Array,
                 q_lens: jax.Array, *, attention_impl: str = "reference",
                 logits: str = "last") -> tuple[jax.Array, jax.Array]:
    """Runs tokens[B, Q] (prefill chunks, or Q == 1 for decode) through the model.

    Returns (logits, new kv_pool): logits [B, vocab] of each row's last valid
    token, or [B, Q, vocab] with logits="all".
    """
    meta = make_metadata(block_tables, context_lens, q_lens, tokens.shape[1], kv_pool.shape[4])
    return forward(graphdef, params, tokens, meta, kv_pool, attention_impl=attention_impl,
                   logits=logits)


def sample(logits: jax.Array, sampling: SamplingArrays | None) -> jax.Array:
    """Next tokens [B]; `None` means greedy for every row."""
    return greedy(logits) if sampling is None else _sample(logits, sampling)


def generate_step(graphdef: nnx.GraphDef, params: nnx.State, kv_pool: jax.Array,
                  tokens: jax.Array, block_tables: jax.Array, context_lens: jax.Array,
                  q_lens: jax.Array, sampling: SamplingArrays | None, *,
                  attention_impl: str = "reference") -> tuple[jax.Array, jax.Array]:
    """forward_step + sample: one engine step, (next tokens [B], new kv_pool)."""
    logits, kv_pool = forward_step(graphdef, params, kv_pool, tokens, block_tables, context_lens,
                                   q_lens, attention_impl=attention_impl)
    return sample(logits, sampling), kv_pool


__all__ = ["create_kv_pool", "make_metadata", "forward_step", "sample", "generate_step",
           "SamplingArrays"]

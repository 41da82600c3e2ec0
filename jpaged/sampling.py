"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Each row draws from its own key, fold_in(seed, number of tokens it has
generated), so a seeded request samples the same tokens whatever else shares
its batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling controls, [B] each."""

    temperature: jax.Array  # 0 -> greedy
    top_k: jax.Array        # <= 0 -> disabled
    top_p: jax.Array        # 1 -> disabled
    seed: jax.Array         # uint32
    step: jax.Array         # tokens generated so far


def greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _sample_row(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                seed: jax.Array, step: jax.Array) -> jax.Array:
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    rank = jnp.arange(vocab)
    keep = rank < jnp.where(top_k > 0, top_k, vocab)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    # Keep the smallest prefix whose mass reaches top_p (the first token always).
    keep &= (jnp.cumsum(probs) - probs) < top_p
    key = jax.random.fold_in(jax.random.key(seed), step)
    choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf))
    return order[choice].astype(jnp.int32)


def sample(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """Next token per row of logits[B, vocab]; rows with temperature 0 are greedy."""
    drawn = jax.vmap(_sample_row)(logits, params.temperature, params.top_k, params.top_p,
                                  params.seed, params.step)
    return jnp.where(params.temperature > 0, drawn, greedy(logits))

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
    """Per-row sampling controls, [B] each.

    top_k / top_p are None when no row of the batch filters: that step samples
    from the full softmax and skips the vocabulary sort (a different pytree
    structure, so a separate compiled variant).
    """

    temperature: jax.Array  # 0 -> greedy
    seed: jax.Array         # uint32
    step: jax.Array         # tokens generated so far
    top_k: jax.Array | None = None  # <= 0 -> disabled
    top_p: jax.Array | None = None  # 1 -> disabled


def greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _gumbel(seed: jax.Array, step: jax.Array, vocab: int) -> jax.Array:
    return jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), step), (vocab,))


def _sample_row(logits: jax.Array, temperature: jax.Array, seed: jax.Array, step: jax.Array) -> jax.Array:
    # Gumbel-max: argmax(logits / T + g) is a draw from softmax(logits / T).
    return jnp.argmax(logits / jnp.maximum(temperature, 1e-6) + _gumbel(seed, step, logits.shape[-1]))


def _sample_row_filtered(logits: jax.Array, temperature: jax.Array, seed: jax.Array,
                         step: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    keep = jnp.arange(vocab) < jnp.where(top_k > 0, top_k, vocab)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    # Keep the smallest prefix whose mass reaches top_p (the first token always).
    keep &= (jnp.cumsum(probs) - probs) < top_p
    keep = jnp.zeros(vocab, bool).at[order].set(keep)
    # The same noise, in vocabulary order, as the unfiltered path: a row that
    # filters nothing draws the same token whichever variant its batch runs.
    return jnp.argmax(jnp.where(keep, scaled + _gumbel(seed, step, vocab), -jnp.inf))


def sample(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """Next token per row of logits[B, vocab]; rows with temperature 0 are greedy."""
    rows = (logits, params.temperature, params.seed, params.step)
    if params.top_k is None:
        drawn = jax.vmap(_sample_row)(*rows)
    else:
        drawn = jax.vmap(_sample_row_filtered)(*rows, params.top_k, params.top_p)
    return jnp.where(params.temperature > 0, drawn.astype(jnp.int32), greedy(logits))

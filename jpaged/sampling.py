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


def _filter_row(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """scaled with the tokens outside top-k / top-p set to -inf."""
    vocab = scaled.shape[-1]
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    keep = jnp.arange(vocab) < jnp.where(top_k > 0, top_k, vocab)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    # Keep the smallest prefix whose mass reaches top_p (the first token always).
    keep &= (jnp.cumsum(probs) - probs) < top_p
    keep = jnp.zeros(vocab, bool).at[order].set(keep)
    return jnp.where(keep, scaled, -jnp.inf)


def processed_logits(logits: jax.Array, params: SamplingArrays | None) -> jax.Array:
    """The logits each row samples from: divided by its temperature, top-k / top-p
    filtered (-inf outside); a greedy row's are its raw logits."""
    if params is None:
        return logits
    scaled = logits / jnp.maximum(params.temperature, 1e-6)[:, None]
    if params.top_k is not None:
        scaled = jax.vmap(_filter_row)(scaled, params.top_k, params.top_p)
    return jnp.where(params.temperature[:, None] > 0, scaled, logits)


def sample(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """Next token per row of logits[B, vocab]; rows with temperature 0 are greedy."""
    return sample_processed(logits, processed_logits(logits, params), params)


def sample_processed(logits: jax.Array, processed: jax.Array, params: SamplingArrays) -> jax.Array:
    """`sample`, given processed_logits(logits, params) already computed.

    Gumbel-max: argmax(processed + g) is a draw from softmax(processed).  Every
    row draws the same noise (in vocabulary order) whether or not its batch
    filters, so a row that filters nothing draws the same token in either variant.
    """
    noise = jax.vmap(_gumbel, in_axes=(0, 0, None))(params.seed, params.step, logits.shape[-1])
    drawn = jnp.argmax(processed + noise, axis=-1)
    return jnp.where(params.temperature > 0, drawn.astype(jnp.int32), greedy(logits))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (fp32) of chosen tokens and the top alternatives, per row."""

    chosen: jax.Array     # [R] of the row's token
    top_ids: jax.Array    # [R, k], best first
    top_values: jax.Array  # [R, k]


def token_logprobs(logits: jax.Array, token_ids: jax.Array, k: int) -> TokenLogprobs:
    """log_softmax of logits[R, vocab] at token_ids[R], and its k best entries."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top_values, top_ids = jax.lax.top_k(logprobs, k)
    return TokenLogprobs(chosen, top_ids.astype(jnp.int32), top_values)

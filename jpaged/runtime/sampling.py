"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

A sampled row draws one uniform u from its own key, fold_in(key(seed), number
of tokens it has generated), and inverts the CDF of softmax(processed logits)
in vocabulary order: the token is the first one whose cumulative probability
reaches u.  Everything is computed row by row, so a seeded request samples the
same tokens whatever else shares its batch; a row that filters nothing has the
same processed logits, hence draws the same token, whether or not its batch
compiles the top-k / top-p variant.  A token of probability 0 (filtered out by
top-k / top-p) is never drawn, whatever the rounding of the cumulative sums.
u is an fp32 uniform (2^-23 steps), so each token's probability is honoured to
about 1e-7 absolute.  Rows with temperature 0 are greedy.

Nothing sorts the vocabulary.  What a step pays: an all-greedy step (no
SamplingArrays) one argmax per row; a sampled step one argmax (a greedy row's
token, and every row's maximum for the softmax), one exp pass and the two-level
inverse CDF; only when a sampled row filters, the top-k / top-p threshold
search (up to 2 x 32 passes over the vocabulary), skipped at run time when the
rows that carry top_k / top_p arrays filter nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling controls, [B] each.

    top_k / top_p are None when no row of the batch filters: that step samples
    from the full softmax and skips the top-k / top-p threshold search (a different pytree
    structure, so a separate compiled variant).
    """

    temperature: jax.Array  # 0 -> greedy
    seed: jax.Array         # uint32
    step: jax.Array         # tokens generated so far
    top_k: jax.Array | None = None  # <= 0 -> disabled
    top_p: jax.Array | None = None  # 1 -> disabled


def greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _uniform(seed: jax.Array, step: jax.Array) -> jax.Array:
    """u in (0, 1] from the row's key (0 excluded: u = 0 would select a leading
    token of probability 0)."""
    return 1.0 - jax.random.uniform(jax.random.fold_in(jax.random.key(seed), step), ())


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values x (-0.0 counts as +0.0):
    a >= b exactly when key(a) >= key(b), for every non-NaN a, b."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _largest_key_where(pred, batch: int) -> jax.Array:
    """Per row, the largest uint32 t with pred(t) true, for pred -> [B] monotone
    (true up to some key, false above) and true at 0: built bit by bit from the top,
    32 steps of one pass over the vocabulary each.  pred gets t[B, 1]."""
    def body(i, t):
        cand = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(pred(cand[:, None]), cand, t)

    return jax.lax.fori_loop(0, 32, body, jnp.zeros(batch, jnp.uint32))


@jax.jit  # one compilation per shape, also when called eagerly (its loops and conds close over arrays)
def _filter_rows(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """scaled[B, vocab] with the tokens outside top-k / top-p set to -inf, row by
    row (see _threshold_filter); when no row filters (top_k <= 0 or >= vocab,
    top_p >= 1 everywhere) it comes back as it is, without the threshold work."""
    vocab = scaled.shape[-1]
    filters = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)
    return jax.lax.cond(jnp.any(filters), _threshold_filter, lambda x, k, p: x, scaled, top_k, top_p)


def _threshold_filter(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """scaled[B, vocab] with the tokens outside top-k / top-p set to -inf, row by row.

    No sort: each row keeps the tokens at or above a threshold value, found by
    bisection over the order-preserving integer keys of the fp32 values.
    top-k: the threshold is the k-th largest value (top_k <= 0 or >= vocab: none).
    top-p: among the top-k-kept tokens, with probabilities renormalised over
    them, the threshold is the largest value v such that the tokens >= v hold at
    least top_p of the mass, i.e. the smallest prefix in descending order whose
    mass reaches top_p; the largest value at least (the first token is always
    kept), and no filtering at all when top_p >= 1.
    Ties: a threshold keeps every token equal to it, so when several tokens tie
    at the k-th value (or at the top-p cut) all of them are kept, possibly more
    than k tokens; without ties this is exactly the sort-based definition.
    A row that filters nothing comes out unchanged.
    """
    B, vocab = scaled.shape
    keys = _order_keys(scaled)
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)

    def kth_largest():  # largest t with #{keys >= t} >= k: the k-th largest key
        def pred(t):
            return (keys >= t).sum(axis=-1, dtype=jnp.int32) >= k
        return _largest_key_where(pred, B)

    no_k = jnp.all(k >= vocab)
    t_k = jax.lax.cond(no_k, lambda: jnp.zeros(B, jnp.uint32), kth_largest)

    def nucleus():  # largest t with mass(keys >= t) >= top_p * mass(top-k set)
        weights = jnp.where(keys >= t_k[:, None], jnp.exp(scaled - scaled.max(axis=-1, keepdims=True)), 0.0)
        target = jnp.minimum(top_p, 1.0) * weights.sum(axis=-1)

        def pred(t):
            return jnp.where(keys >= t, weights, 0.0).sum(axis=-1) >= target
        t_p = jnp.minimum(_largest_key_where(pred, B), keys.max(axis=-1))  # the first token at least
        return jnp.where(top_p >= 1, t_k, jnp.maximum(t_p, t_k))

    t = jax.lax.cond(jnp.all(top_p >= 1), lambda: t_k, nucleus)
    return jnp.where(keys >= t[:, None], scaled, -jnp.inf)


def processed_logits(logits: jax.Array, params: SamplingArrays | None) -> jax.Array:
    """The logits each row samples from: divided by its temperature, top-k / top-p
    filtered (-inf outside); a greedy row's are its raw logits."""
    if params is None:
        return logits
    scaled = logits / jnp.maximum(params.temperature, 1e-6)[:, None]
    if params.top_k is not None:  # a greedy row's filters count for nothing: it keeps its logits
        sampled = params.temperature > 0
        scaled = _filter_rows(scaled, jnp.where(sampled, params.top_k, 0), jnp.where(sampled, params.top_p, 1))
    return jnp.where(params.temperature[:, None] > 0, scaled, logits)


def sample(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """Next token per row of logits[B, vocab]; rows with temperature 0 are greedy."""
    return sample_processed(processed_logits(logits, params), params)


def sample_processed(processed: jax.Array, params: SamplingArrays) -> jax.Array:
    """`sample`, given processed_logits(logits, params) already computed.

    A greedy row's processed logits are its logits: one argmax gives its token,
    and every row's maximum (the softmax's shift) with it.  A sampled row: the
    inverse CDF with one uniform per row (see the module docstring), in two
    levels so that no cumulative sum runs over the whole vocabulary: the
    vocabulary is cut into blocks of about sqrt(vocab) tokens, the block is
    chosen from the cumulative block masses, then the token within it.
    """
    B, V = processed.shape
    size = _block_size(V)
    best = greedy(processed)
    top = jnp.take_along_axis(processed, best[:, None], axis=-1)  # the row's maximum (NaN if it holds one)
    weights = jnp.exp(processed - top)  # fp32, 0 where -inf
    weights = jnp.pad(weights, ((0, 0), (0, -V % size))).reshape(B, -1, size)
    u = jax.vmap(_uniform)(params.seed, params.step)
    block_mass = weights.sum(axis=-1)                                 # [B, blocks]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    block = _first_reaching(block_cdf, block_mass > 0, u * block_cdf[:, -1])
    before = jnp.take_along_axis(block_cdf - block_mass, block[:, None], axis=-1)[:, 0]
    inner = jnp.take_along_axis(weights, block[:, None, None], axis=1)[:, 0]  # [B, size]
    target = u * block_cdf[:, -1] - before
    drawn = block * size + _first_reaching(jnp.cumsum(inner, axis=-1), inner > 0, target)
    return jnp.where(params.temperature > 0, drawn.astype(jnp.int32), best)


def _block_size(vocab: int) -> int:
    """A power of two near sqrt(vocab): the inner block of the two-level search."""
    return 1 << max(0, round(math.log2(vocab) / 2))


def _first_reaching(cdf: jax.Array, positive: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the first entry of positive weight whose cdf reaches target (the
    inverse CDF); the last entry of positive weight if rounding left target above
    every cdf value.  Only entries of positive weight can come out."""
    hit = positive & (cdf >= target[:, None])
    last = positive.shape[-1] - 1 - jnp.argmax(positive[:, ::-1], axis=-1)
    return jnp.where(hit.any(axis=-1), jnp.argmax(hit, axis=-1), last).astype(jnp.int32)


RowSum = Callable[[jax.Array], jax.Array]  # x [..., n] -> its sum over n [..., 1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (fp32) of chosen tokens and the top alternatives, per row."""

    chosen: jax.Array     # [R] of the row's token
    top_ids: jax.Array    # [R, k], best first
    top_values: jax.Array  # [R, k]


def token_logprobs(logits: jax.Array, token_ids: jax.Array, k: int, row_sum: RowSum | None = None
                   ) -> TokenLogprobs:
    """log_softmax of logits[R, vocab] at token_ids[R], and its k best entries.
    `row_sum`: how the exponentials are summed (batch_invariant's, or jnp.sum)."""
    shifted, lse = _shifted_logsumexp(logits, row_sum)
    logprobs = shifted - lse
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top_values, top_ids = jax.lax.top_k(logprobs, k)
    return TokenLogprobs(chosen, top_ids.astype(jnp.int32), top_values)


def chosen_logprobs(logits: jax.Array, token_ids: jax.Array, row_sum: RowSum | None = None) -> jax.Array:
    """log_softmax(logits[..., vocab])[..., token_ids] without the [..., vocab]
    result, bit for bit token_logprobs' chosen values (decode.score's logprobs)."""
    shifted, lse = _shifted_logsumexp(logits, row_sum)
    chosen = jnp.take_along_axis(shifted, token_ids[..., None].astype(jnp.int32), axis=-1)
    return (chosen - lse)[..., 0]


def _shifted_logsumexp(logits: jax.Array, row_sum: RowSum | None) -> tuple[jax.Array, jax.Array]:
    """(logits - max, log sum exp of that) over the last axis in fp32: jax.nn.log_softmax's steps."""
    logits = logits.astype(jnp.float32)
    shifted = logits - jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    exp = jnp.exp(shifted)
    return shifted, jnp.log(jnp.sum(exp, axis=-1, keepdims=True) if row_sum is None else row_sum(exp))

"""Verifying draft tokens on the device: which drafts a row keeps, and the token after them.

A row with k draft tokens d_0 .. d_{k-1} ran k + 1 positions through the
model; position j's logits give the target distribution p_j of the token after
d_0 .. d_{j-1}.

The engine's drafts are deterministic (prompt lookup copies tokens; the draft
model proposes its greedy tokens), and `verify` couples them to the engine's
own sampler: position j's token is the one the engine would draw there without
drafts (argmax, or the inverse CDF at the row's uniform for that position), and
the row keeps drafts while they equal it.  Its output is then the output it
gets without speculation, token for token (a seeded request repeats whether or
not, and however much, it was drafted), and a draft d is kept with probability
p(d), as under the standard rule below for a point-mass draft.

`verify_sampled` is the standard speculative-sampling rule, for drafts drawn
from a distribution q (a sampling draft model):

    keep d_j with probability min(1, p_j(d_j) / q_j(d_j));
    at the first rejection emit a token drawn from max(p_j - q_j, 0), renormalised;
    if every draft is kept, emit a token drawn from p_k.

It emits exactly the target distribution whatever q is, but not the tokens of
plain sampling for the same seed; no proposer of the engine needs it yet.
Greedy rows (both): keep the longest prefix of drafts equal to the argmax,
then the argmax at the first mismatch (or after the last draft: the bonus token).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jpaged.runtime.sampling import SamplingArrays, greedy, sample


def verify(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, sampling: SamplingArrays | None,
           first_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A step's verification of deterministic drafts (prompt lookup, a greedy
    draft model).  logits [S, k+1, V] at each row's decode token and drafts,
    drafts [S, k], num_drafts [S] -> (tokens [S, k+1], num_accepted [S]).

    Position j's token is drawn exactly as the engine draws without drafts:
    greedy rows take the argmax, sampled rows sample their processed logits
    (temperature, top-k / top-p) with the row's own uniform for that position,
    fold_in(key(seed), step + j).  A row keeps its drafts while they equal those
    tokens, then emits the first token that differs (or the bonus token).  So a
    row's tokens are the ones it gets without speculation, seeded ones
    included, and a draft d is kept with probability p(d): the acceptance of the
    speculative-sampling rule for a point-mass draft (verify_sampled).  A row
    without drafts emits first_tokens[s] (its token sampled as usual)."""
    S, k1, V = logits.shape
    if sampling is None:
        target = greedy(logits)
    else:
        positions = jnp.arange(k1, dtype=jnp.int32)
        per_position = jax.tree.map(lambda x: jnp.repeat(x, k1, axis=0), sampling)
        per_position = dataclasses.replace(per_position, step=(sampling.step[:, None] + positions).reshape(-1))
        target = sample(logits.reshape(S * k1, V), per_position).reshape(S, k1)
    has_drafts = num_drafts > 0
    accepted = jnp.where(has_drafts, _accepted_prefix(drafts == target[:, :-1], num_drafts), 0)
    return target.at[:, 0].set(jnp.where(has_drafts, target[:, 0], first_tokens)), accepted


def verify_greedy(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [S, k+1, V], drafts [S, k], num_drafts [S] (<= k) ->
    (tokens [S, k+1], num_accepted [S]): row s emits tokens[s, :num_accepted[s] + 1]."""
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)              # [S, k+1]
    return target, _accepted_prefix(drafts == target[:, :-1], num_drafts)


def verify_sampled(probs: jax.Array, drafts: jax.Array, num_drafts: jax.Array, seed: jax.Array,
                   step: jax.Array, draft_probs: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The speculative-sampling rule (module docstring).  probs [S, k+1, V]: the
    target distributions (softmax of the processed logits); draft_probs [S, k, V]
    the draft's, or None for point-mass drafts; seed [S] uint32, step [S] tokens
    generated so far.  -> (tokens [S, k+1], num_accepted [S]) as verify_greedy:
    tokens[s, j] for j < num_accepted[s] are the kept drafts, and
    tokens[s, num_accepted[s]] the drawn one."""
    S, k1, V = probs.shape
    k = k1 - 1
    p_draft = jnp.take_along_axis(probs[:, :k], drafts[..., None], axis=-1)[..., 0]   # p_j(d_j)
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
        residual = probs[:, :k] * (1.0 - jax.nn.one_hot(drafts, V, dtype=probs.dtype))
    else:
        q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        residual = jnp.maximum(probs[:, :k] - draft_probs, 0.0)
    keys = jax.vmap(lambda s, t: jax.vmap(lambda j: jax.random.fold_in(jax.random.key(s), t + j))(
        jnp.arange(k1)))(seed, step)                                                    # [S, k+1] keys
    u_accept = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 0))))(keys[:, :k])
    keep = u_accept * q_draft < p_draft                                  # u < p / q, without dividing
    accepted = _accepted_prefix(keep, num_drafts)
    # The distribution of the token emitted after the kept drafts: p at num_drafts when
    # every draft was kept, else the residual where the first one was rejected.
    bonus = accepted >= num_drafts
    at_residual = jnp.minimum(accepted, k - 1)[:, None, None]
    dist = jnp.where(bonus[:, None], jnp.take_along_axis(probs, num_drafts[:, None, None], axis=1)[:, 0],
                     jnp.take_along_axis(residual, at_residual, axis=1)[:, 0])            # [S, V]
    draw_key = jax.vmap(lambda ks, j: jax.random.fold_in(ks[j], 1))(keys, accepted)
    drawn = jax.vmap(lambda key, d: jax.random.categorical(key, jnp.log(d)))(draw_key, dist).astype(jnp.int32)
    tokens = jnp.concatenate([drafts, jnp.zeros((S, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(k1)[None, :] == accepted[:, None], drawn[:, None], tokens)
    return tokens, accepted


def _accepted_prefix(keep: jax.Array, num_drafts: jax.Array) -> jax.Array:
    """Per row, how many leading positions j < num_drafts are kept."""
    k = keep.shape[1]
    keep = keep & (jnp.arange(k)[None, :] < num_drafts[:, None])
    return jnp.argmin(jnp.concatenate([keep, jnp.zeros((keep.shape[0], 1), bool)], axis=1), axis=1).astype(
        jnp.int32)

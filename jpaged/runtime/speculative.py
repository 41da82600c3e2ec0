"""Verifying draft tokens on the device: which drafts a row keeps, and the token after them.

A row with k draft tokens d_0 .. d_{k-1} ran k + 1 positions through the
model; position j's logits give the target distribution p_j of the token after
d_0 .. d_{j-1}.  Greedy rows keep the longest prefix of drafts equal to the
argmax and then emit the argmax at the first mismatch (or after the last
draft: the bonus token).  Sampled rows use the speculative-sampling rule,
which emits exactly the target distribution whatever the drafts:

    keep d_j with probability min(1, p_j(d_j) / q_j(d_j));
    at the first rejection emit a token drawn from max(p_j - q_j, 0), renormalised;
    if every draft is kept, emit a token drawn from p_k.

q_j is the draft's distribution: a draft model's, or for a proposer that
copies tokens (prompt lookup) a point mass at d_j, where the rule is "keep d_j
with probability p_j(d_j), else draw from p_j without d_j".  Each row draws
from its own key, fold_in(key(seed), tokens generated + j) per position, so a
seeded request repeats whatever shares its batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jpaged.runtime.sampling import SamplingArrays, processed_logits


def verify(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, sampling: SamplingArrays | None,
           first_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A step's verification: logits [S, k+1, V] at each row's decode token and
    drafts, drafts [S, k], num_drafts [S]; greedy rows by verify_greedy, sampled
    ones (temperature > 0) by verify_sampled on their processed logits (temperature,
    top-k / top-p at every position).  A row without drafts emits first_tokens[s]
    (sampled exactly as without speculation).  -> (tokens [S, k+1], num_accepted [S])."""
    S, k1, V = logits.shape
    tokens, accepted = verify_greedy(logits, drafts, num_drafts)
    if sampling is not None:
        per_position = jax.tree.map(lambda x: jnp.repeat(x, k1, axis=0), sampling)
        probs = jax.nn.softmax(processed_logits(logits.reshape(S * k1, V), per_position), axis=-1)
        drawn, drawn_accepted = verify_sampled(probs.reshape(S, k1, V), drafts, num_drafts,
                                               sampling.seed, sampling.step)
        sampled = sampling.temperature > 0
        tokens = jnp.where(sampled[:, None], drawn, tokens)
        accepted = jnp.where(sampled, drawn_accepted, accepted)
    has_drafts = num_drafts > 0
    tokens = tokens.at[:, 0].set(jnp.where(has_drafts, tokens[:, 0], first_tokens))
    return tokens, jnp.where(has_drafts, accepted, 0)


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

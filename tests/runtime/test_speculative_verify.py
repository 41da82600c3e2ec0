"""Draft verification (jpaged.runtime.speculative): greedy rows keep the drafts
that equal the argmax; sampled rows emit exactly the target distribution
whatever the drafts (chi-square over many seeded rows), for point-mass drafts
(prompt lookup) and for a draft model's distributions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jpaged.runtime.speculative import verify_greedy, verify_sampled

ROWS = 20000


def test_greedy_keeps_the_matching_prefix_then_the_argmax():
    logits = np.full((3, 4, 6), -1.0, np.float32)
    for s, best in enumerate([[1, 2, 3, 4], [1, 5, 0, 2], [3, 3, 3, 3]]):
        logits[s, np.arange(4), best] = 1.0
    drafts = jnp.array([[1, 2, 3], [1, 2, 0], [3, 3, 3]], jnp.int32)
    tokens, accepted = verify_greedy(jnp.asarray(logits), drafts, jnp.array([3, 3, 2], jnp.int32))
    assert accepted.tolist() == [3, 1, 2]
    assert tokens[0].tolist() == [1, 2, 3, 4]       # all kept, then the bonus token
    assert tokens[1, :2].tolist() == [1, 5]          # the first mismatch: the argmax instead
    assert tokens[2, :3].tolist() == [3, 3, 3]       # only num_drafts drafts count


def sample(probs, drafts, draft_probs=None, num_drafts=None):
    S = ROWS
    k = drafts.shape[0]
    probs_b = jnp.broadcast_to(jnp.asarray(probs, jnp.float32), (S, *probs.shape))
    drafts_b = jnp.broadcast_to(jnp.asarray(drafts, jnp.int32), (S, k))
    q = None if draft_probs is None else jnp.broadcast_to(jnp.asarray(draft_probs, jnp.float32),
                                                          (S, *draft_probs.shape))
    n = jnp.full(S, k if num_drafts is None else num_drafts, jnp.int32)
    tokens, accepted = verify_sampled(probs_b, drafts_b, n, jnp.arange(S, dtype=jnp.uint32),
                                      jnp.zeros(S, jnp.int32), q)
    return np.asarray(tokens), np.asarray(accepted)


def assert_distribution(tokens, p):
    if len(tokens) < 500:  # (a draft of probability 0 is never kept: nothing after it to test)
        return
    counts = np.bincount(tokens, minlength=len(p))
    expected = np.asarray(p) * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    assert stats.chisquare(counts[keep], expected[keep]).pvalue > 1e-3, (counts, expected)


P = np.array([[0.1, 0.4, 0.3, 0.2, 0.0],
              [0.25, 0.25, 0.05, 0.4, 0.05],
              [0.5, 0.1, 0.1, 0.1, 0.2]])


@pytest.mark.parametrize("drafts", [[1, 3], [4, 2], [0, 0]])  # likely, impossible (p = 0), mixed
def test_point_mass_drafts_emit_the_target_distribution(drafts):
    tokens, accepted = sample(P, np.array(drafts))
    assert_distribution(tokens[:, 0], P[0])                      # the first token emitted ~ p_0
    kept = accepted >= 1                                         # after d_0 was kept: the next ~ p_1
    assert_distribution(tokens[kept, 1], P[1])
    both = accepted == 2
    assert_distribution(tokens[both, 2], P[2])                   # the bonus token ~ p_2
    assert np.isclose(kept.mean(), P[0, drafts[0]], atol=0.015)  # d_0 kept with probability p_0(d_0)


def test_draft_model_distributions_emit_the_target_distribution():
    q = np.array([[0.4, 0.1, 0.1, 0.1, 0.3], [0.2, 0.2, 0.2, 0.2, 0.2]])
    rng = np.random.default_rng(0)
    drafts = np.array([rng.choice(5, p=q[0]), rng.choice(5, p=q[1])])
    # Drafts drawn from q per row, as a draft model would: vary them over the rows.
    d = np.stack([rng.choice(5, size=ROWS, p=q[0]), rng.choice(5, size=ROWS, p=q[1])], axis=1)
    probs = jnp.broadcast_to(jnp.asarray(P, jnp.float32), (ROWS, *P.shape))
    qb = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (ROWS, *q.shape))
    tokens, accepted = verify_sampled(probs, jnp.asarray(d, jnp.int32), jnp.full(ROWS, 2, jnp.int32),
                                      jnp.arange(ROWS, dtype=jnp.uint32), jnp.zeros(ROWS, jnp.int32), qb)
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    assert_distribution(tokens[:, 0], P[0])
    assert_distribution(tokens[accepted >= 1, 1], P[1])
    assert drafts.shape == (2,)


def test_fewer_drafts_than_slots_and_seeded_repeats():
    tokens, accepted = sample(P, np.array([1, 3]), num_drafts=1)
    assert accepted.max() <= 1
    assert_distribution(tokens[accepted == 1, 1], P[1])           # the bonus comes from p_1
    again, _ = sample(P, np.array([1, 3]), num_drafts=1)
    assert (again == tokens).all()                                # same seeds, same tokens

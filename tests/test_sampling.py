"""Sampling: per-request seeds, top-k / top-p, stop conditions, and the sampler itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_prompts
from jpaged.decode import sample as decode_sample
from jpaged.sampling import SamplingArrays, sample
from jpaged.sequence import SamplingParams

PROMPTS = random_prompts([7, 20, 33, 4, 50, 12], seed=31)
N = 16


@pytest.fixture(scope="module")
def greedy(tiny_llm):
    return tiny_llm.generate(PROMPTS[:2], SamplingParams(max_tokens=N, ignore_eos=True))


# ------------------------------------------------------------------ engine level
def test_seeded_request_is_batch_invariant(tiny_llm, greedy):
    target = SamplingParams(max_tokens=N, temperature=1.0, top_p=0.95, top_k=100, seed=1234, ignore_eos=True)
    alone = tiny_llm.generate([PROMPTS[0]], target)[0].token_ids
    assert alone != greedy[0].token_ids, "the seeded request should actually sample"
    others = [
        SamplingParams(max_tokens=5, temperature=1.0, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=N, ignore_eos=True),  # greedy
        SamplingParams(max_tokens=30, temperature=0.5, top_k=5, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.3, ignore_eos=True),  # engine-drawn seed
        SamplingParams(max_tokens=N, temperature=0.8, top_p=0.5, seed=1234, ignore_eos=True),
    ]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[4], PROMPTS[5]]
    params = others[:2] + [target] + others[2:]
    outs = tiny_llm.generate(prompts, params)
    assert outs[2].token_ids == alone
    # And again, in a different position and company.
    outs = tiny_llm.generate([PROMPTS[0], PROMPTS[0]], [target, others[0]])
    assert outs[0].token_ids == alone


def test_top_k_1_and_tiny_top_p_are_greedy(tiny_llm, greedy):
    want = [g.token_ids for g in greedy]
    for seed in (0, 1, 2):
        k1 = SamplingParams(max_tokens=N, temperature=1.5, top_k=1, seed=seed, ignore_eos=True)
        p0 = SamplingParams(max_tokens=N, temperature=1.5, top_p=1e-6, seed=seed, ignore_eos=True)
        outs = tiny_llm.generate(PROMPTS[:2] * 2, [k1, k1, p0, p0])
        assert [o.token_ids for o in outs] == want * 2, f"seed {seed}"


def test_unseeded_sampling_varies(tiny_llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    outs = tiny_llm.generate([PROMPTS[0]] * 6, params)
    distinct = {tuple(o.token_ids) for o in outs}
    assert len(distinct) >= 4, distinct


def test_stop_token_ids(tiny_llm, greedy):
    ref = greedy[0].token_ids
    k = next(i for i in range(3, N) if ref[i] not in ref[:i])  # first occurrence of a token
    params = SamplingParams(max_tokens=N, stop_token_ids=(ref[k], 255 if ref[k] != 255 else 254),
                            ignore_eos=True)
    out = tiny_llm.generate([PROMPTS[0]], params)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:k + 1]  # the stop token is the last one returned


@pytest.mark.parametrize("max_tokens", [1, 2, 17])
def test_max_tokens_gives_length(tiny_llm, max_tokens):
    outs = tiny_llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                           SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3,
                                                          ignore_eos=True),
                                           SamplingParams(max_tokens=max_tokens + 1, ignore_eos=True)])
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert [len(o.token_ids) for o in outs] == [max_tokens, max_tokens, max_tokens + 1]


# ------------------------------------------------------------------ the sampler
def _arrays(n, temperature=1.0, top_k=0, top_p=1.0, seeds=None, step=0):
    seeds = np.arange(n, dtype=np.uint32) if seeds is None else np.asarray(seeds, np.uint32)
    full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
    return SamplingArrays(temperature=full(temperature, jnp.float32), top_k=full(top_k, jnp.int32),
                          top_p=full(top_p, jnp.float32), seed=jnp.asarray(seeds),
                          step=full(step, jnp.int32))


LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, -0.5], np.float32)
_sample = jax.jit(sample)


def _draw(n=4000, **kw) -> np.ndarray:
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, LOGITS.size))
    return np.asarray(_sample(logits, _arrays(n, **kw)))


def _chi2(draws: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(draws, minlength=probs.size)
    expected = probs * draws.size
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_sample_matches_softmax_distribution():
    """4000 seeds; chi-square with 7 degrees of freedom: P(chi2 > 30) < 1e-4 under the
    right distribution, while the wrong temperature gives hundreds."""
    draws = _draw(temperature=0.7)
    assert _chi2(draws, _softmax(LOGITS / 0.7)) < 30
    assert _chi2(draws, _softmax(LOGITS / 1.0)) > 100  # the test can tell temperatures apart


def test_top_k_masks_all_but_k():
    draws = _draw(temperature=2.0, top_k=3)
    top3 = set(np.argsort(-LOGITS)[:3])
    assert set(np.unique(draws)) == top3
    probs = np.where(np.isin(np.arange(LOGITS.size), list(top3)), _softmax(LOGITS / 2.0), 0)
    assert _chi2(draws, probs / probs.sum()) < 25


@pytest.mark.parametrize("top_p", [0.5, 0.75, 0.9])
def test_top_p_keeps_the_nucleus(top_p):
    p = _softmax(LOGITS)
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]  # mass strictly before each token
    nucleus = order[before < top_p]  # smallest prefix reaching top_p
    draws = _draw(temperature=1.0, top_p=top_p)
    assert set(np.unique(draws)) == set(nucleus)
    q = np.zeros_like(p)
    q[nucleus] = p[nucleus]
    assert _chi2(draws, q / q.sum()) < 30


def test_sample_seed_and_step_determinism():
    a = _draw(n=64, seeds=np.arange(64))
    assert np.array_equal(a, _draw(n=64, seeds=np.arange(64)))  # same seeds, same draws
    assert not np.array_equal(a, _draw(n=64, seeds=np.arange(64) + 1000))
    assert not np.array_equal(a, _draw(n=64, seeds=np.arange(64), step=1))  # step folds in
    # A row's draw depends on its own seed only, not on its row index or neighbours.
    rev = _draw(n=64, seeds=np.arange(64)[::-1])
    assert np.array_equal(rev[::-1], a)


def test_temperature_zero_rows_are_greedy():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(8, 50)).astype(np.float32))
    arrays = _arrays(8, temperature=0.0)
    arrays = SamplingArrays(temperature=jnp.array([0, 1, 0, 1, 0, 1, 0, 1], jnp.float32),
                            top_k=arrays.top_k, top_p=arrays.top_p, seed=arrays.seed, step=arrays.step)
    got = np.asarray(sample(logits, arrays))
    want = np.argmax(np.asarray(logits), axis=-1)
    np.testing.assert_array_equal(got[::2], want[::2])
    np.testing.assert_array_equal(np.asarray(decode_sample(logits, None)), want)

"""Sampling: per-request seeds, top-k / top-p, stop conditions, and the sampler itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_prompts
from jpaged.decode import sample as decode_sample
from jpaged.runtime.sampling import SamplingArrays, _filter_rows, processed_logits, sample, sample_processed
from jpaged.core.sequence import SamplingParams

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
    got = np.asarray(_sample(logits, arrays))   # jitted: one program, not op-by-op dispatches
    want = np.argmax(np.asarray(logits), axis=-1)
    np.testing.assert_array_equal(got[::2], want[::2])
    np.testing.assert_array_equal(np.asarray(decode_sample(logits, None)), want)


# ------------------------------------------------- inverse CDF over a real vocabulary
V = 1000  # 32 blocks of 32 tokens in the two-level search, the last one padded
LIKELY = np.unique(np.concatenate([[0, 31, 32, 63, 64, 511, 512, 991, 999],
                                   np.random.default_rng(5).choice(V, 31, replace=False)]))
_sample_many = jax.jit(sample)


def _big_logits() -> np.ndarray:
    """Tokens of LIKELY (at the vocabulary's ends and on block edges among them)
    around 0, every other token around -3: the tail holds about half the mass."""
    rng = np.random.default_rng(6)
    logits = rng.normal(-3.0, 0.5, V).astype(np.float32)
    logits[LIKELY] = rng.normal(0.0, 1.0, LIKELY.size)
    return logits


_processed_logits = jax.jit(processed_logits)
_sample_processed = jax.jit(sample_processed)


def _draw_big(logits: np.ndarray, n: int = 10000, check_rows: int = 256, **kw) -> np.ndarray:
    """n seeded draws from one row of logits.  sample is sample_processed after
    processed_logits: the row is processed (temperature, top-k / top-p) once and its
    n copies drawn from, since the filter over 10000 identical rows is most of the
    cost; the first check_rows draws must be, bit for bit, sample's on the raw rows."""
    seeds = np.arange(n) + 10**6
    processed = _processed_logits(jnp.asarray(logits)[None], _arrays(1, **kw))
    draws = np.asarray(_sample_processed(jnp.broadcast_to(processed, (n, V)), _arrays(n, seeds=seeds, **kw)))
    raw = jnp.broadcast_to(jnp.asarray(logits), (check_rows, V))
    np.testing.assert_array_equal(np.asarray(_sample_many(raw, _arrays(check_rows, seeds=seeds[:check_rows], **kw))),
                                  draws[:check_rows])
    return draws


def _chi2_binned(draws: np.ndarray, probs: np.ndarray, bins: np.ndarray) -> tuple[float, int]:
    """Chi-square of the draws against probs, tokens grouped into bins (token -> bin);
    (statistic, degrees of freedom).  Fails on any draw of a probability-0 token."""
    assert np.all(probs[draws] > 0), "drew a token of probability 0"
    counts = np.bincount(bins[draws], minlength=bins.max() + 1)
    expected = np.bincount(bins, weights=probs, minlength=bins.max() + 1) * draws.size
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 0, 1.0), (1.0, len(LIKELY), 1.0),
                                                     (1.3, 25, 1.0), (0.8, 0, 0.9), (1.0, 30, 0.8)])
def test_sampler_draws_softmax_of_processed_logits(temperature, top_k, top_p):
    """10000 seeded draws over 1000 tokens against softmax(logits / T) with top-k /
    top-p applied in numpy: each likely token is its own bin, the tail one bin
    (its tokens are never drawn when filtered).  The seeds are fixed, so the test
    cannot flake; the bound is the chi-square's 1e-6 tail, and a wrong temperature
    (1.15 T) exceeds it by far."""
    from scipy.stats import chi2

    logits = _big_logits()
    draws = _draw_big(logits, temperature=temperature, top_k=top_k, top_p=top_p)

    def target(t: float) -> np.ndarray:
        p = _softmax(logits.astype(np.float64) / t)
        order = np.argsort(-p, kind="stable")
        keep = np.zeros(V, bool)
        kept = order[:top_k] if top_k > 0 else order
        q = p[kept] / p[kept].sum()
        kept = kept[np.cumsum(q) - q < top_p]  # the smallest prefix whose mass reaches top_p
        keep[kept] = True
        p = np.where(keep, p, 0.0)
        return p / p.sum()

    bins = np.full(V, LIKELY.size)  # the tail's bin
    bins[LIKELY] = np.arange(LIKELY.size)
    stat, dof = _chi2_binned(draws, target(temperature), bins)
    assert dof >= 10 and stat < chi2.isf(1e-6, dof), (stat, dof)
    wrong, dof = _chi2_binned(draws, target(1.15 * temperature), bins)  # power: a nearby temperature fails
    assert wrong > chi2.isf(1e-6, dof), wrong


# Only called with _uniform patched (test_inverse_cdf_edges_...): its own jit cache.
_sample_given_u = jax.jit(lambda logits, arrays: sample(logits, arrays))


@pytest.mark.parametrize("u", [1.0, 1e-30, 0.0])
def test_inverse_cdf_edges_draw_positive_probability_tokens(monkeypatch, u):
    """u at the ends of its range (1.0 is reachable; 0 is excluded by construction,
    checked anyway): the draw is the last / first token of positive probability,
    never a filtered token before or after it, whatever the rounding of the sums."""
    import jpaged.runtime.sampling as sampling

    # u comes in as the seed's bits, so every u runs through one jitted program.
    monkeypatch.setattr(sampling, "_uniform", lambda seed, step: jax.lax.bitcast_convert_type(seed, jnp.float32))
    logits = _big_logits()
    logits[[0, V - 1]] = -10.0  # filtered out by top-k 20: zeros at both ends of the CDF
    kept = np.sort(np.argsort(-logits)[:20])
    rows = jnp.asarray(np.stack([logits, logits]))
    seed = np.full(2, u, np.float32).view(np.uint32)
    arrays = SamplingArrays(temperature=jnp.ones(2), seed=jnp.asarray(seed), step=jnp.zeros(2, jnp.int32),
                            top_k=jnp.array([20, 0], jnp.int32), top_p=jnp.ones(2))
    drawn = np.asarray(_sample_given_u(rows, arrays))
    assert drawn[0] == (kept[-1] if u == 1.0 else kept[0])
    assert drawn[1] == (V - 1 if u == 1.0 else 0)  # unfiltered: every token has weight > 0


# ------------------------------------------- top-k / top-p threshold filter vs a sort
def _reference_keep(row: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The sort-based definition, in float64: the top_k highest (top_k <= 0: all),
    then the smallest prefix in descending order whose mass (softmax over the top-k
    set) reaches top_p, the first token always; top_p >= 1 filters nothing."""
    order = np.argsort(-row, kind="stable")
    kept = order[:top_k] if top_k > 0 else order
    if top_p < 1:
        q = np.exp(row[kept].astype(np.float64) - row[kept].max())
        q /= q.sum()
        kept = kept[np.cumsum(q) - q < top_p]
    keep = np.zeros(row.size, bool)
    keep[kept] = True
    return keep


def _near_top_p_cut(row: np.ndarray, top_k: int, top_p: float) -> bool:
    """Whether some cumulative mass lies within float32 rounding of top_p (there the
    two summation orders may disagree by one token)."""
    order = np.argsort(-row, kind="stable")
    kept = order[:top_k] if top_k > 0 else order
    q = np.exp(row[kept].astype(np.float64) - row[kept].max())
    return top_p < 1 and bool(np.any(np.abs(np.cumsum(q / q.sum()) - top_p) < 1e-5))


_filter = _filter_rows  # jitted


def test_threshold_filter_matches_sort_reference():
    """Random logits without ties (checked), about 650 rows over a 1000-token vocabulary
    at scales from 1e-30 to 1e30, every combination of edge and ordinary top_k / top_p: the
    filter keeps exactly the sort-based set and leaves kept logits untouched."""
    rng = np.random.default_rng(11)
    ks = [-5, 0, 1, 2, 3, 17, 200, 999, 1000, 10**6]
    ps = [1e-9, 1e-3, 0.2, 0.5, 0.8, 0.95, 0.999, 1.0, 1.7]
    rows, kk, pp = [], [], []
    for scale in (0.01, 0.3, 1.0, 3.0, 10.0, 100.0, 1e-30, 1e30):
        for k in ks:
            for p in ps:
                if scale == 1e-30 and p < 1:  # all probabilities 1 / V: the top-p cuts are exact boundaries
                    continue
                row = np.zeros(2)
                while np.unique(row).size < row.size:  # fp32 rounding makes the odd tie: draw again
                    row = (rng.normal(size=V) * scale).astype(np.float32)
                if scale == 1.0:  # both signs, zero and subnormals, -inf (an already masked token)
                    row[:4] = [0.0, 1e-40, -1e-40, -np.inf]
                rows.append(row), kk.append(k), pp.append(p)
    rows = np.stack(rows)
    finite = [r[np.isfinite(r)] for r in rows]
    assert all(np.unique(r).size == r.size for r in finite), "the test wants no ties"
    got = np.asarray(_filter(jnp.asarray(rows), jnp.asarray(kk, jnp.int32), jnp.asarray(pp, jnp.float32)))
    skipped = 0
    for row, k, p, out in zip(rows, kk, pp, got):
        if _near_top_p_cut(row, k, p):
            skipped += 1
            continue
        keep = _reference_keep(row, k, p)
        np.testing.assert_array_equal(np.isfinite(out) | (out == row), keep | (row == -np.inf), err_msg=f"{k} {p}")
        np.testing.assert_array_equal(out[keep], row[keep])
        assert np.all(out[~keep] == -np.inf)
    assert skipped < len(rows) // 50, skipped


def test_threshold_filter_rows_are_independent_and_unfiltered_rows_unchanged():
    """A row's result does not depend on its neighbours (the batch-level shortcuts
    taken when no row uses top-k or top-p give the same answer), and rows with
    filters off come out bit for bit unchanged."""
    rng = np.random.default_rng(12)
    x = rng.normal(size=(6, V)).astype(np.float32) * 2
    k = np.array([0, 5, 0, 40, 0, -1], np.int32)
    p = np.array([1.0, 1.0, 0.7, 0.9, 1.0, 1.0], np.float32)
    together = np.asarray(_filter(jnp.asarray(x), jnp.asarray(k), jnp.asarray(p)))
    for i in range(6):
        alone = np.asarray(_filter(jnp.asarray(x[i:i + 1]), jnp.asarray(k[i:i + 1]), jnp.asarray(p[i:i + 1])))
        np.testing.assert_array_equal(alone[0], together[i])
        np.testing.assert_array_equal(np.isfinite(alone[0]), _reference_keep(x[i], int(k[i]), float(p[i])))
    np.testing.assert_array_equal(together[[0, 4, 5]], x[[0, 4, 5]])


def test_threshold_filter_keeps_every_tied_token():
    """The tie rule: the filter keeps every token whose value equals the threshold, so
    tokens tied at the k-th value (or at the top-p cut) are all kept, possibly more
    than top_k of them (a sort would keep exactly k, tied ones in arbitrary order).
    -0.0 and +0.0 are one value."""
    row = np.array([3.0, 2.0, 1.0, 2.0, 0.0, 2.0, -0.0, -1.0], np.float32)
    cases = [  # (top_k, top_p, kept tokens)
        (1, 1.0, {0}),
        (2, 1.0, {0, 1, 3, 5}),        # three tokens tie at the 2nd value: 4 kept
        (4, 1.0, {0, 1, 3, 5}),        # k lands on the last of the tie: exactly k
        (5, 1.0, {0, 1, 2, 3, 5}),
        (6, 1.0, {0, 1, 2, 3, 4, 5, 6}),  # 0.0 and -0.0 tie at the 6th value
        (0, 0.5, {0, 1, 3, 5}),        # p(3.0) ~ 0.42 < 0.5: the cut falls inside the tie at 2.0
        (0, 0.4, {0}),
    ]
    p3 = np.exp(3.0) / np.exp(row.astype(np.float64)).sum()
    assert 0.4 < p3 < 0.5 < p3 + np.exp(2.0) / np.exp(row.astype(np.float64)).sum()
    got = np.asarray(_filter(jnp.asarray(np.tile(row, (len(cases), 1))),
                             jnp.array([c[0] for c in cases], jnp.int32), jnp.array([c[1] for c in cases], jnp.float32)))
    for (k, p, want), out in zip(cases, got):
        assert set(np.flatnonzero(np.isfinite(out))) == want, (k, p)
    # Every token tied at the top: top_k 1 and a tiny top_p keep them all.
    flat = np.full((2, 10), 0.5, np.float32)
    got = np.asarray(_filter(jnp.asarray(flat), jnp.array([1, 0], jnp.int32), jnp.array([1.0, 1e-6], jnp.float32)))
    np.testing.assert_array_equal(got, flat)

"""Sampling's cheap paths (jpaged.runtime.sampling): one argmax serves the greedy
rows and the softmax's shift, greedy rows' top-k / top-p count for nothing, and
the threshold search is skipped when no row filters.  Every mix of rows (greedy,
temperature, top-k, top-p, seeds, ties, masked tokens) draws the tokens, and
yields the processed logits, of the implementation before these changes, kept
below as the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.runtime import sampling
from jpaged.runtime.sampling import SamplingArrays, processed_logits, sample


# ------------------------------------------------- the previous implementation
def reference_processed(logits, params):
    scaled = logits / jnp.maximum(params.temperature, 1e-6)[:, None]
    if params.top_k is not None:  # every row through the threshold search, greedy ones too
        scaled = sampling._threshold_filter(scaled, params.top_k, params.top_p)
    return jnp.where(params.temperature[:, None] > 0, scaled, logits)


@jax.jit
def reference_sample(logits, params):
    processed = reference_processed(logits, params)
    B, V = processed.shape
    size = sampling._block_size(V)
    weights = jnp.exp(processed - jnp.max(processed, axis=-1, keepdims=True))
    weights = jnp.pad(weights, ((0, 0), (0, -V % size))).reshape(B, -1, size)
    u = jax.vmap(sampling._uniform)(params.seed, params.step)
    block_mass = weights.sum(axis=-1)
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    block = sampling._first_reaching(block_cdf, block_mass > 0, u * block_cdf[:, -1])
    before = jnp.take_along_axis(block_cdf - block_mass, block[:, None], axis=-1)[:, 0]
    inner = jnp.take_along_axis(weights, block[:, None, None], axis=1)[:, 0]
    target = u * block_cdf[:, -1] - before
    drawn = block * size + sampling._first_reaching(jnp.cumsum(inner, axis=-1), inner > 0, target)
    return jnp.where(params.temperature > 0, drawn.astype(jnp.int32), jnp.argmax(logits, axis=-1).astype(jnp.int32))


# ---------------------------------------------------------------------- rows
def random_rows(rng: np.random.Generator, B: int, V: int, filtered: bool) -> tuple[jax.Array, SamplingArrays]:
    logits = rng.standard_normal((B, V)).astype(np.float32) * rng.choice([0.5, 3.0, 12.0])
    if rng.random() < 0.3:
        logits = np.round(logits * 2) / 2  # many ties
    if rng.random() < 0.3:
        logits[rng.random((B, V)) < 0.5] = -np.inf  # a constrained row's masked tokens
        logits[:, rng.integers(V)] = 1.0  # at least one token left per row
    temperature = rng.choice([0.0, 0.0, 0.3, 1.0, 1.7], B).astype(np.float32)
    k = rng.choice([0, 0, 1, 2, 7, V - 1, V, V + 5], B).astype(np.int32)
    p = rng.choice([1.0, 1.0, 0.95, 0.5, 0.1], B).astype(np.float32)
    params = SamplingArrays(jnp.asarray(temperature), jnp.asarray(rng.integers(0, 2**32, B, dtype=np.uint32)),
                            jnp.asarray(rng.integers(0, 100, B).astype(np.int32)),
                            jnp.asarray(k) if filtered else None, jnp.asarray(p) if filtered else None)
    return jnp.asarray(logits), params


fast_sample = jax.jit(sample)
fast_processed = jax.jit(processed_logits)


@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("V", [50, 1000])
def test_same_tokens_and_processed_logits_as_before(filtered, V):
    rng = np.random.default_rng(V + filtered)
    for _ in range(40):
        logits, params = random_rows(rng, 12, V, filtered)
        np.testing.assert_array_equal(fast_sample(logits, params), reference_sample(logits, params))
        np.testing.assert_array_equal(fast_processed(logits, params), jax.jit(reference_processed)(logits, params))


@pytest.mark.parametrize("case", ["all greedy", "greedy rows filter", "no row filters", "one row filters"])
def test_the_mixes_that_skip_work(case):
    """The rows whose filters the fast path skips: greedy rows carrying top_k /
    top_p, and filter arrays that filter nothing (k >= vocab, p = 1)."""
    rng = np.random.default_rng(5)
    B, V = 8, 300
    logits = jnp.asarray(rng.standard_normal((B, V)).astype(np.float32) * 4)
    temperature = np.full(B, 0.9, np.float32)
    k, p = np.zeros(B, np.int32), np.ones(B, np.float32)
    if case == "all greedy":
        temperature[:] = 0
        k[:], p[:] = 3, 0.5
    elif case == "greedy rows filter":
        temperature[::2] = 0
        k[::2], p[::2] = 1, 0.2
    elif case == "no row filters":
        k[::3] = V
    else:
        k[5], p[6] = 4, 0.6
    for seed in range(20):
        params = SamplingArrays(jnp.asarray(temperature), jnp.arange(B, dtype=jnp.uint32) + seed * B,
                                jnp.zeros(B, jnp.int32), jnp.asarray(k), jnp.asarray(p))
        np.testing.assert_array_equal(fast_sample(logits, params), reference_sample(logits, params))


def test_greedy_rows_of_a_sampled_step_take_the_argmax():
    rng = np.random.default_rng(9)
    logits = jnp.asarray(rng.standard_normal((6, 700)).astype(np.float32))
    params = SamplingArrays(jnp.asarray([0, 1, 0, 1, 0, 0.5], jnp.float32), jnp.arange(6, dtype=jnp.uint32),
                            jnp.zeros(6, jnp.int32), jnp.asarray([5, 0, 0, 3, 2, 0], jnp.int32),
                            jnp.asarray([1, 0.9, 0.3, 1, 1, 1], jnp.float32))
    tokens = np.asarray(fast_sample(logits, params))
    greedy = np.asarray(jnp.argmax(logits, axis=-1))
    np.testing.assert_array_equal(tokens[[0, 2, 4]], greedy[[0, 2, 4]])

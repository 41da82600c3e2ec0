"""The two compiled sampling variants (with and without top-k/top-p filters) agree."""

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.runtime.sampling import SamplingArrays, sample


def test_unfiltered_row_draws_the_same_token_in_either_variant():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 1000)) * 3, jnp.float32)
    temperature = jnp.array([0.7, 1.0, 1.3, 0.0, 0.9, 2.0], jnp.float32)
    seed = jnp.arange(6, dtype=jnp.uint32) * 7919
    for step in range(20):
        steps = jnp.full(6, step, jnp.int32)
        plain = sample(logits, SamplingArrays(temperature, seed, steps))
        # Same rows, through the filtered variant but with filters off.
        filtered = sample(logits, SamplingArrays(temperature, seed, steps,
                                                 top_k=jnp.zeros(6, jnp.int32),
                                                 top_p=jnp.ones(6, jnp.float32)))
        np.testing.assert_array_equal(plain, filtered)


def test_filtered_variant_respects_top_k():
    logits = jnp.tile(jnp.arange(50, dtype=jnp.float32)[None] * 0.01, (4, 1))  # nearly flat
    draws = set()
    for step in range(200):
        params = SamplingArrays(jnp.ones(4), jnp.arange(4, dtype=jnp.uint32), jnp.full(4, step),
                                top_k=jnp.full(4, 3, jnp.int32), top_p=jnp.ones(4))
        draws.update(np.asarray(sample(logits, params)).tolist())
    assert draws == {47, 48, 49}


def test_greedy_rows_ignore_the_key():
    logits = jax.random.normal(jax.random.key(1), (3, 64))
    params = SamplingArrays(jnp.zeros(3), jnp.arange(3, dtype=jnp.uint32), jnp.zeros(3, jnp.int32))
    np.testing.assert_array_equal(sample(logits, params), jnp.argmax(logits, -1))

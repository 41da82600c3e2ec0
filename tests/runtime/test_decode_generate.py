"""jpaged.decode.generate: the jittable fixed-batch generation loop matches the engine
token for token (greedy and seeded sampling), compiles once under jax.jit, and stops at eos."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_prompts
from jpaged.decode import SamplingArrays, generate
from jpaged.core.sequence import SamplingParams

N = 16      # new tokens: with prompts up to 40, the sequences span 4 blocks of 16
P = 40      # padded prompt width (one static shape for every call in this file)
STATIC = ("max_new_tokens", "eos_token_id", "block_size", "attention_impl", "kv_dtype")


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm  # the session's engine on TINY_ENGINE: these tests only call generate()


@pytest.fixture(scope="module")
def gen(llm):
    """generate jitted once for the module, with a trace counter."""
    traces = []

    def traced(params, prompts, prompt_lens, sampling, rng, **kw):
        traces.append(1)
        return generate(llm.graphdef, params, prompts, prompt_lens, sampling=sampling, rng=rng,
                        attention_impl="reference", block_size=llm.config.block_size,
                        kv_dtype=llm.kv_dtype, **kw)

    jitted = jax.jit(traced, static_argnames=("max_new_tokens", "eos_token_id"))
    jitted.traces = traces
    return jitted


def padded(prompts: list[list[int]]) -> tuple[jax.Array, jax.Array]:
    out = np.zeros((len(prompts), P), np.int32)
    for b, p in enumerate(prompts):
        out[b, :len(p)] = p
    return jnp.asarray(out), jnp.asarray([len(p) for p in prompts], jnp.int32)


def engine_tokens(llm, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def greedy_params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, ignore_eos=True, **kw)


def test_greedy_matches_engine(llm, gen):
    prompts = random_prompts([5, 17, 40], seed=1)
    tokens, lengths = gen(llm.params, *padded(prompts), None, None, max_new_tokens=N)
    assert tokens.shape == (3, N) and tokens.dtype == jnp.int32
    assert np.asarray(tokens).tolist() == engine_tokens(llm, prompts, greedy_params())
    assert np.asarray(lengths).tolist() == [N] * 3


def test_seeded_sampling_matches_engine(llm, gen):
    prompts = random_prompts([5, 17, 40, 23], seed=2)
    per_row = [dict(temperature=0.8, top_k=20, seed=11), dict(temperature=0.8, seed=12),
               dict(temperature=0.8, top_k=20, seed=2**32 - 5), dict(temperature=0.0, seed=0)]
    expected = engine_tokens(llm, prompts, [greedy_params(**r) for r in per_row])
    sampling = SamplingArrays(
        temperature=jnp.asarray([r["temperature"] for r in per_row], jnp.float32),
        seed=jnp.asarray([r["seed"] for r in per_row], jnp.uint32),
        step=jnp.full(4, 123, jnp.int32),  # ignored: the loop sets it
        top_k=jnp.asarray([r.get("top_k", 0) for r in per_row], jnp.int32),
        top_p=jnp.ones(4, jnp.float32))
    tokens, _ = gen(llm.params, *padded(prompts), sampling, None, max_new_tokens=N)
    assert np.asarray(tokens).tolist() == expected
    assert expected[0] != engine_tokens(llm, prompts[:1], greedy_params())[0]  # really sampled

    # rng replaces the seeds by jax.random.bits(rng, (B,), uint32).
    rng = jax.random.key(7)
    by_rng, _ = gen(llm.params, *padded(prompts), sampling, rng, max_new_tokens=N)
    seeds = np.asarray(jax.random.bits(rng, (4,), jnp.uint32)).tolist()
    reseeded = [greedy_params(**{**r, "seed": s}) for r, s in zip(per_row, seeds)]
    expected = engine_tokens(llm, prompts, reseeded)
    assert np.asarray(by_rng).tolist() == expected


def test_jit_compiles_once(llm, gen):
    before = len(gen.traces)
    batches = [random_prompts([9, 40, 1], seed=3), random_prompts([30, 2, 16], seed=4)]
    counts = []
    for prompts in batches:
        tokens, _ = gen(llm.params, *padded(prompts), None, None, max_new_tokens=N)
        assert np.asarray(tokens).tolist() == engine_tokens(llm, prompts, greedy_params())
        counts.append(len(gen.traces))
    # Only the first batch may trace (not even it if test_greedy_matches_engine ran before).
    assert counts[0] - before <= 1 and counts[1] == counts[0]

    # The form the docstring shows: generate itself under jit, graphdef static.
    direct = jax.jit(generate, static_argnums=0, static_argnames=STATIC)
    again, _ = direct(llm.graphdef, llm.params, *padded(batches[1]), max_new_tokens=N, sampling=None,
                      rng=None, kv_dtype=llm.kv_dtype)
    np.testing.assert_array_equal(again, tokens)


def test_eos_stops_and_pads(llm, gen):
    prompts = random_prompts([5, 17, 40], seed=1)
    full = engine_tokens(llm, prompts, greedy_params())
    # An eos that first appears mid-way through row 0.
    eos = next(t for i, t in enumerate(full[0]) if i >= 3 and t not in full[0][:i])
    expected = engine_tokens(llm, prompts, greedy_params(stop_token_ids=(eos,)))
    assert len(expected[0]) < N
    tokens, lengths = gen(llm.params, *padded(prompts), None, None, max_new_tokens=N, eos_token_id=eos)
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    assert lengths.tolist() == [len(e) for e in expected]
    for row, n, e in zip(tokens, lengths, expected):
        assert row[:n].tolist() == e
        assert (row[n:] == eos).all()

"""A token's stored K/V and its logits do not depend on how its sequence was cut
into steps, on every pool dtype: so speculative decoding (a row of k + 1 tokens
in place of k + 1 decode steps) and chunked prefill give the plain run's tokens.

Every query reads every key, its own step's included, as the pool stores it
(rounded: jpaged.models.base.paged_attention writes before it attends).  What
else moves with the step is the last bits of XLA's matmuls, which block by the
step's token count (jpaged.layers.batch_invariant); a quantized pool rounds K/V
that differ in their last bits to different codes now and then, and the next
layers and tokens carry that on.  batch_invariant mode takes those bits out, so
these checks are exact (assert_array_equal) on the tiny random Llama with the
C++ CPU kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_prompts
from jpaged import decode
from jpaged.core.rounding import next_pow2
from jpaged.core.sequence import SamplingParams
from jpaged.models.base import kv_rotation, paged_attention
from jpaged.runtime.kv_pool import create_kv_pool
from pallas_kernels import IMPLS, cpu, get_backend
from pallas_kernels.reference import is_quantized, read_pages

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs the C++ CPU kernels (g++)")

BS = 16
SEQ = random_prompts([40], seed=21)[0]
# The same 40 tokens cut into steps as a plain prefill, decode steps (one token,
# the M = 1 matmuls), a verified row of drafts (4 tokens) and prefill chunks.
GROUPINGS = {"one step": [40], "chunks, decodes": [32, 1, 7], "a row of drafts": [36, 4]}


@pytest.fixture(scope="module")
def invariant_llm(make_tiny_llm):
    return make_tiny_llm(attention_impl="cpu", batch_invariant=True, num_blocks=8)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, pool, tokens, context_len, q_len):
    meta = decode.ragged_metadata(jnp.arange(1, 5, dtype=jnp.int32)[None], context_len[None], q_len[None],
                                  tokens.shape[0], BS)
    return decode.forward_step(graphdef, params, pool, tokens, meta, attention_impl="cpu", logits="all")


def run_in_steps(llm, dtype, groups: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(the sequence's pool rows [tokens, ...] as stored, logits [tokens, vocab]) after
    running SEQ in steps of `groups` tokens, each padded to a power of two (as the
    engine's buckets are: each step runs with its own token count)."""
    pool = create_kv_pool(llm.model_config, 8, BS, jnp.dtype(dtype))
    done, logits = 0, []
    for g in groups:
        tokens = np.zeros(next_pow2(g), np.int32)
        tokens[:g] = SEQ[done:done + g]
        out, pool = _forward(llm.graphdef, llm.params, pool, jnp.asarray(tokens), jnp.int32(done), jnp.int32(g))
        logits.append(np.asarray(out[:g]))
        done += g
    blocks = np.asarray(pool)[1:5]                          # [4, layers, 2, kv_heads, BS, D(+1)]
    rows = np.moveaxis(blocks, 4, 1).reshape(4 * BS, -1)    # one row per token
    return rows[:len(SEQ)], np.concatenate(logits)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "bfloat16"])
def test_stored_kv_and_logits_do_not_depend_on_the_steps(invariant_llm, dtype):
    want_rows, want_logits = run_in_steps(invariant_llm, dtype, GROUPINGS["one step"])
    for name, groups in list(GROUPINGS.items())[1:]:
        rows, logits = run_in_steps(invariant_llm, dtype, groups)
        np.testing.assert_array_equal(rows, want_rows, err_msg=name)
        np.testing.assert_array_equal(logits, want_logits, err_msg=name)


# The Pallas kernels run a bf16 pool's dots in bf16 (q and the probabilities rounded
# too: pallas_kernels/gpu.py, tpu.py), which hides the pool's own rounding from this check.
READS = [(impl, dtype) for impl in IMPLS for dtype in ("int8", "float8_e4m3fn", "bfloat16")
         if not (impl.startswith("pallas") and dtype == "bfloat16")]


@pytest.mark.parametrize("impl, dtype", READS)
def test_a_step_reads_its_own_kv_as_stored(invariant_llm, impl, dtype):
    """The step's queries see its own new keys and values as the pool stores them
    (rounded), the same as a later step would, in every implementation (the
    Pallas ones interpreted): dense attention over the stored rows gives the
    output to fp32 rounding, and over the unrounded K/V it would not."""
    cfg = invariant_llm.model_config
    T, H, KVH, D = 12, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((T, h, D)), jnp.float32)
               for i, h in enumerate((H, KVH, KVH)))
    meta = decode.ragged_metadata(jnp.array([[1]], jnp.int32), jnp.array([0]), jnp.array([T]), T, BS)
    pool = create_kv_pool(cfg, 2, BS, jnp.dtype(dtype))
    out, pool = paged_attention(cfg, q, k, v, 0, None, pool, meta, get_backend(impl))
    stored = read_pages(pool[1, 0])[:, :, :T]                # [2, KVH, T, D], rotated if quantized
    rot = kv_rotation(D) if is_quantized(pool.dtype) else np.eye(D, dtype=np.float32)

    def dense(keys, values):  # causal attention of q over [KVH, T, D] K/V, in the rotated frame
        qg = np.asarray(q, np.float64).reshape(T, KVH, H // KVH, D) @ rot
        s = np.einsum("tkgd,ksd->tkgs", qg, keys) * cfg.sm_scale
        s = np.where(np.tril(np.ones((T, T), bool))[:, None, None, :], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("tkgs,ksd->tkgd", p / p.sum(-1, keepdims=True), values) @ rot.T
        return o.reshape(T, H * D)

    as_stored = dense(*np.asarray(stored, np.float64))
    unrounded = dense(*(np.asarray(x, np.float64).transpose(1, 0, 2) @ rot for x in (k, v)))
    got = np.asarray(out, np.float64)
    np.testing.assert_allclose(got, as_stored, rtol=0, atol=2e-5)
    assert np.abs(got - unrounded).max() > 1e-3   # the pool's rounding is larger than the tolerance


# ------------------------------------------------------------- the engine
_rng = np.random.default_rng(8)
# Half the prompts repeat a pattern (prompt lookup drafts, often right), half are random.
PROMPTS = [(p * (1 + 40 // len(p)))[:40] if i % 2 else p
           for i, p in enumerate(random_prompts(_rng.integers(5, 30, size=6).tolist(), seed=9))]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
# Drafts for every row whatever the batch; a 16-token budget cuts each prompt into chunks.
SPEC_AND_CHUNKS = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                       prompt_lookup_max=3, speculative_disable_by_batch_size=0, max_num_batched_tokens=16)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_speculation_and_chunked_prefill_give_the_plain_tokens(make_tiny_llm, kv_cache_dtype):
    common = dict(attention_impl="cpu", batch_invariant=True, kv_cache_dtype=kv_cache_dtype)
    plain, other = make_tiny_llm(**common), make_tiny_llm(**common, **SPEC_AND_CHUNKS)
    want, got = plain.generate(PROMPTS, GREEDY), other.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    s = other.stats
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens  # kept some, rejected some
    # Teacher-forced, chunk by chunk against one step: the same bits.
    teacher = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for w, g in zip(plain.generate(PROMPTS, teacher), other.generate(PROMPTS, teacher)):
        np.testing.assert_array_equal([lp.logprob for lp in g.prompt_logprobs[1:]],
                                      [lp.logprob for lp in w.prompt_logprobs[1:]])

"""batch_invariant mode: a request's logprobs bit for bit the same alone, in a
mixed batch of 32, chunked differently, after a recompute preemption, and equal
to decode.score's on the same tokens (jpaged.layers.batch_invariant).

On the tiny random Llama (fp32) with the C++ CPU kernels; every comparison is
exact (assert_array_equal), not within a tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_prompts
from jpaged import decode
from jpaged.core.config import ConfigError
from jpaged.core.sequence import SamplingParams
from jpaged.layers import batch_invariant
from pallas_kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs the C++ CPU kernels (g++)")

TARGET = random_prompts([37], seed=11)[0]
TARGET_PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1)
_score = jax.jit(decode.score, static_argnums=0)


def logprobs_of(out) -> np.ndarray:
    return np.array([lp.logprob for lp in out.logprobs], np.float32)


def prompt_logprobs_of(out) -> np.ndarray:
    return np.array([lp.logprob for lp in out.prompt_logprobs[1:]], np.float32)


def others(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n requests of mixed lengths and sampling, to share the target's steps."""
    rng = np.random.default_rng(seed)
    prompts = random_prompts(rng.integers(3, 60, size=n).tolist(), seed=seed)
    params = [SamplingParams(max_tokens=int(rng.integers(4, 20)), temperature=float(rng.choice([0.0, 0.8])),
                             seed=i, ignore_eos=True, logprobs=int(rng.integers(0, 3)) or None)
              for i in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def alone(make_tiny_llm):
    """The target request alone, its 37-token prompt in one step."""
    llm = make_tiny_llm(attention_impl="cpu", batch_invariant=True)
    return llm, llm.generate([TARGET], TARGET_PARAMS)[0]


def test_mixed_batch_of_32_and_other_chunking(alone, make_tiny_llm):
    _, want = alone
    # 32 rows a step, 48 tokens: the target's prompt is split over steps shared with others.
    llm = make_tiny_llm(attention_impl="cpu", batch_invariant=True, max_num_seqs=32, max_num_batched_tokens=48,
                        num_blocks=256)
    prompts, params = others(31, seed=1)
    out = llm.generate(prompts + [TARGET], params + [TARGET_PARAMS])[-1]
    assert out.token_ids == want.token_ids
    np.testing.assert_array_equal(logprobs_of(out), logprobs_of(want))
    np.testing.assert_array_equal(prompt_logprobs_of(out), prompt_logprobs_of(want))


def test_after_recompute_preemption(alone, make_tiny_llm):
    _, want = alone
    # 14 blocks of 16 tokens cannot hold the batch: the latest arrival (the target) is preempted.
    llm = make_tiny_llm(attention_impl="cpu", batch_invariant=True, num_blocks=14, max_num_seqs=8,
                        preemption_mode="recompute")
    prompts, params = others(5, seed=2)
    out = llm.generate(prompts + [TARGET], params + [TARGET_PARAMS])[-1]
    assert llm.stats.recompute_preemptions > 0
    assert out.token_ids == want.token_ids
    np.testing.assert_array_equal(logprobs_of(out), logprobs_of(want))


def test_equal_to_decode_score(alone):
    llm, want = alone
    ids = TARGET + want.token_ids
    scored = np.asarray(_score(llm.graphdef, llm.params, jnp.array([ids]), jnp.array([len(ids)])))[0]
    np.testing.assert_array_equal(scored[len(TARGET) - 1:], logprobs_of(want))
    np.testing.assert_array_equal(scored[:len(TARGET) - 1], prompt_logprobs_of(want))
    # In a batch of rows of other lengths, padded: the same bits.
    other = random_prompts([9, 60], seed=5)
    rows = [ids, *other]
    width = max(map(len, rows))
    batch = jnp.array([r + [0] * (width - len(r)) for r in rows])
    batched = np.asarray(_score(llm.graphdef, llm.params, batch, jnp.array(list(map(len, rows)))))[0]
    np.testing.assert_array_equal(batched[:len(ids) - 1], scored)


def test_score_gradient(alone, tiny_llm):
    """score stays differentiable: the kernels' VJPs are XLA's ops, and agree with
    the default mode's gradient (tiny_llm: the same weights, default mode)."""
    llm, want = alone
    plain = tiny_llm
    ids = jnp.array([TARGET + want.token_ids])
    lens = jnp.array([ids.shape[1]])

    def loss(graphdef):
        return lambda params: decode.score(graphdef, params, ids, lens).sum()

    # Jitted: one program per mode, not hundreds of op-by-op dispatches.
    g_inv = jax.jit(jax.grad(loss(llm.graphdef)))(llm.params)
    g_ref = jax.jit(jax.grad(loss(plain.graphdef)))(plain.params)
    for a, b in zip(jax.tree.leaves(g_inv), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-4)


# Jitted as the engine runs it: one program per shape, not op-by-op dispatches.
_matmul = jax.jit(batch_invariant.matmul, static_argnames=("transpose_w", "soft_cap"))


@pytest.mark.parametrize("shape", [(64, 64), (64, 13), (7, 1), (33, 200)])
@pytest.mark.parametrize("transpose", [False, True])
def test_matmul_rows_do_not_depend_on_the_batch(shape, transpose):
    K, N = shape
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((N, K) if transpose else (K, N)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((150, K)), jnp.float32)
    full = np.asarray(_matmul(x, w, transpose_w=transpose))
    np.testing.assert_allclose(full, np.asarray(x @ (w.T if transpose else w)), rtol=1e-5, atol=1e-5)
    for m in (1, 5, 6, 7, 48, 145):
        np.testing.assert_array_equal(np.asarray(_matmul(x[:m], w, transpose_w=transpose)), full[:m])
    perm = rng.permutation(150)
    np.testing.assert_array_equal(np.asarray(_matmul(x[perm], w, transpose_w=transpose)), full[perm])


@pytest.mark.parametrize("fields, name", [(dict(attention_impl="reference"), "attention_impl"),
                                          (dict(attention_impl="cpu", tensor_parallel_size=2), "tensor_parallel_size"),
                                          (dict(attention_impl="cpu", dtype="bfloat16"), "dtype")])
def test_config_refuses_what_has_no_invariant_form(make_tiny_llm, fields, name):
    with pytest.raises(ConfigError, match=name):
        make_tiny_llm(batch_invariant=True, **fields)


@pytest.mark.parametrize("kind", ["qwen3", "gemma2"])  # q/k norms; sliding window, soft caps, (1 + w) norms
def test_other_families(kind, request):
    from jpaged.engine.llm import LLM
    from helpers import TINY_ENGINE
    model_dir = request.getfixturevalue(f"tiny_{kind}")[0]
    llm = LLM(model=str(model_dir), **{**TINY_ENGINE, "attention_impl": "cpu", "batch_invariant": True,
                                       "max_num_batched_tokens": 32})
    alone = llm.generate([TARGET], TARGET_PARAMS)[0]
    prompts, params = others(7, seed=3)
    mixed = llm.generate(prompts + [TARGET], params + [TARGET_PARAMS])[-1]
    assert mixed.token_ids == alone.token_ids
    np.testing.assert_array_equal(logprobs_of(mixed), logprobs_of(alone))
    ids = TARGET + alone.token_ids
    scored = np.asarray(_score(llm.graphdef, llm.params, jnp.array([ids]), jnp.array([len(ids)])))[0]
    np.testing.assert_array_equal(scored[len(TARGET) - 1:], logprobs_of(alone))


def test_lora_rows(tiny_llama, make_tiny_llm, tmp_path):
    """An adapter's request alone and among base-model rows, and decode.score under
    the same slot: the same bits."""
    from helpers import make_peft_adapter
    make_peft_adapter(tiny_llama[1], tmp_path / "a", seed=0, r=8,
                      target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    llm = make_tiny_llm(attention_impl="cpu", batch_invariant=True, lora_modules=f"a={tmp_path / 'a'}",
                        max_num_batched_tokens=32)
    target = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1, lora="a")
    alone = llm.generate([TARGET], target)[0]
    prompts, params = others(6, seed=4)
    mixed = llm.generate(prompts + [TARGET], params + [target])[-1]
    assert mixed.token_ids == alone.token_ids
    np.testing.assert_array_equal(logprobs_of(mixed), logprobs_of(alone))
    weights, slots = llm.lora_weights()
    ids = TARGET + alone.token_ids
    scored = np.asarray(jax.jit(decode.score, static_argnums=0)(llm.graphdef, llm.params, jnp.array([ids]), jnp.array([len(ids)]),
                                     lora=weights, lora_slots=jnp.array([slots["a"]], jnp.int32)))[0]
    np.testing.assert_array_equal(scored[len(TARGET) - 1:], logprobs_of(alone))


def test_quantized_pool_rows(make_tiny_llm):
    """With an int8 pool the engine stays batch-invariant (decode.score, which keeps
    K/V unrounded, then differs by the pool's rounding)."""
    llm = make_tiny_llm(attention_impl="cpu", batch_invariant=True, kv_cache_dtype="int8", max_num_batched_tokens=32)
    alone = llm.generate([TARGET], TARGET_PARAMS)[0]
    prompts, params = others(6, seed=5)
    mixed = llm.generate(prompts + [TARGET], params + [TARGET_PARAMS])[-1]
    assert mixed.token_ids == alone.token_ids
    np.testing.assert_array_equal(logprobs_of(mixed), logprobs_of(alone))


def test_data_parallel_replicas(alone, tiny_llama_dir):
    """Each replica is a batch-invariant engine of its own: the target's logprobs are
    the single engine's, whichever replica and batch it lands in."""
    from helpers import TINY_ENGINE
    from jpaged.engine.router import create_engine
    _, want = alone
    dp = create_engine(model=tiny_llama_dir, **{**TINY_ENGINE, "attention_impl": "cpu", "batch_invariant": True,
                                                "data_parallel_size": 2})
    prompts, params = others(5, seed=6)
    out = dp.generate(prompts + [TARGET], params + [TARGET_PARAMS])[-1]
    np.testing.assert_array_equal(logprobs_of(out), logprobs_of(want))

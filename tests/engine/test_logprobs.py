"""Logprobs, decode.score and update_params: what a training loop needs from the engine.

On the tiny random Llama (fp32).  `decode.score` is the independent side of the
agreement checks: one causal pass over whole sequences, against the engine's
chunked prefills, decode steps, preemptions and prefix-cache hits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_prompts
from jpaged import decode
from jpaged.core.sequence import MAX_LOGPROBS, SamplingParams

ATOL = 1e-5


def scored(llm, prompt: list[int], output: list[int]) -> np.ndarray:
    """decode.score's logprob of every token after the first of prompt + output."""
    ids = prompt + output
    return np.asarray(_score(llm.graphdef, llm.params, jnp.array([ids]), jnp.array([len(ids)])))[0]


_score = jax.jit(decode.score, static_argnums=0)  # one trace per shape for the module


def engine_logprobs(out) -> np.ndarray:
    """The prompt's logprobs (when asked for) then the generated tokens'."""
    prompt = [lp.logprob for lp in out.prompt_logprobs[1:]] if out.prompt_logprobs else []
    return np.array(prompt + [lp.logprob for lp in out.logprobs])


@pytest.fixture(scope="module")
def llm(make_tiny_llm):
    # A 16-token budget chunks the 40-token prompt over three steps.
    return make_tiny_llm(max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)


def test_logprob_contract(llm):
    prompts = random_prompts([5, 17, 40], seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3))
    for prompt, out in zip(prompts, outs):
        assert len(out.logprobs) == len(out.token_ids) == 6
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for lp, token in zip(out.logprobs, out.token_ids):
            values = [v for _, v in lp.top]
            assert lp.token_id == token and len(lp.top) == 5
            assert values == sorted(values, reverse=True)
            assert lp.top[0] == (token, lp.logprob)  # greedy: the chosen token is the best
        for lp, token in zip(out.prompt_logprobs[1:], prompt[1:]):
            assert lp.token_id == token and len(lp.top) == 3 and lp.logprob <= lp.top[0][1]
        # The chosen token's logprob is the log-softmax of the logits it came from.
        np.testing.assert_allclose(engine_logprobs(out), scored(llm, prompt, out.token_ids), atol=ATOL)


def test_logprobs_ask_nothing_by_default(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0]
    assert out.logprobs is None and out.prompt_logprobs is None
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1).validate()


def test_sampled_raw_vs_processed(llm, make_tiny_llm):
    """raw: the model's log-softmax whatever was sampled; processed: of the
    distribution sampled from (temperature 0.7, top-k 4): only 4 tokens remain."""
    prompt = random_prompts([12], seed=4)[0]
    params = SamplingParams(max_tokens=8, temperature=0.7, top_k=4, seed=11, ignore_eos=True, logprobs=8)
    raw = llm.generate([prompt], params)[0]
    np.testing.assert_allclose(engine_logprobs(raw), scored(llm, prompt, raw.token_ids)[len(prompt) - 1:],
                               atol=ATOL)
    processed_llm = make_tiny_llm(logprobs_mode="processed", max_num_seqs=4)
    processed = processed_llm.generate([prompt], params)[0]
    assert processed.token_ids == raw.token_ids  # same seed, same draws
    for lp_raw, lp in zip(raw.logprobs, processed.logprobs):
        assert len(lp.top) == 4 and len(lp_raw.top) == 8
        np.testing.assert_allclose(sum(np.exp(v) for _, v in lp.top), 1.0, rtol=1e-5)
        assert {t for t, _ in lp.top} == {t for t, _ in lp_raw.top[:4]}
        assert lp.logprob > lp_raw.logprob  # renormalised over 4 tokens, sharpened by T < 1


def test_logprobs_survive_preemption_and_prefix_cache(make_tiny_llm):
    """A pool too small for the batch preempts (recompute and swap); a repeated
    prompt hits the prefix cache: every logprob still equals decode.score's."""
    prompts = random_prompts([30, 30, 30, 30], seed=5)
    prompts[1] = prompts[0][:24] + prompts[1][24:]  # shares a full block with prompt 0
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1)
    for mode in ("recompute", "swap"):
        small = make_tiny_llm(num_blocks=10, max_num_seqs=4, preemption_mode=mode, enable_prefix_caching=True)
        outs = small.generate(prompts, params)
        assert small.stats.preemptions > 0, mode
        again = small.generate([prompts[0]], params)[0]
        assert again.num_cached_tokens > 0
        for prompt, out in zip(prompts + [prompts[0]], outs + [again]):
            want = scored(small, prompt, out.token_ids)[len(prompt) - 1:]
            np.testing.assert_allclose(engine_logprobs(out), want, atol=ATOL)


def test_prompt_logprobs_bypass_the_prefix_cache(llm):
    prompt = random_prompts([40], seed=6)[0]
    llm.generate([prompt], SamplingParams(max_tokens=1))
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
    np.testing.assert_allclose([lp.logprob for lp in out.prompt_logprobs[1:]],
                               scored(llm, prompt, out.token_ids)[:len(prompt) - 1], atol=ATOL)


def test_score_is_differentiable(llm):
    ids = jnp.array(random_prompts([9, 9], seed=7))
    loss = lambda p: -decode.score(llm.graphdef, p, ids, jnp.array([9, 6])).sum()  # noqa: E731
    grads = jax.jit(jax.grad(loss))(llm.params)  # one program, not op by op
    norms = [float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads)]
    assert all(np.isfinite(norms)) and sum(norms) > 0
    lp = decode.score(llm.graphdef, llm.params, ids, jnp.array([9, 6]))
    assert np.all(np.asarray(lp)[1, 5:] == 0) and np.all(np.asarray(lp)[0] < 0)


# ----------------------------------------------------------------- update_params
def perturbed(params, scale: float = 0.05, seed: int = 0):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype) if x.ndim else x
                                     for x, k in zip(leaves, keys)])


def test_update_params_no_recompile_no_stale_cache(make_tiny_llm, tiny_llama_dir):
    from jpaged.engine.llm import LLM
    from helpers import TINY_ENGINE
    llm = make_tiny_llm(enable_prefix_caching=True, max_num_seqs=4)
    prompts = random_prompts([20, 33], seed=8)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    before = llm.generate(prompts, params)
    llm.runner.wait_for_programs()  # the buckets the first run queued in the background
    compiles = llm.num_compilations
    assert llm.block_manager.num_cached_blocks > 0
    new = perturbed(llm.params)
    llm.update_params(new)
    assert llm.block_manager.num_cached_blocks == 0
    after = llm.generate(prompts, params)
    assert llm.num_compilations == compiles
    assert all(o.num_cached_tokens == 0 for o in after)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    fresh = LLM(model=tiny_llama_dir, **{**TINY_ENGINE, "enable_prefix_caching": True, "max_num_seqs": 4})
    fresh.update_params(new)  # the same weights through a fresh engine
    assert [o.token_ids for o in fresh.generate(prompts, params)] == [o.token_ids for o in after]


def test_update_params_rejects_a_bad_tree(llm):
    good = llm.params
    leaves, tree = jax.tree.flatten(good)
    with pytest.raises(ValueError, match="expected"):
        llm.update_params(jax.tree.unflatten(tree, [x.astype(jnp.bfloat16) for x in leaves]))
    with pytest.raises(ValueError, match="expected"):
        llm.update_params(jax.tree.unflatten(tree, [jnp.zeros((1,) + x.shape, x.dtype) for x in leaves]))
    with pytest.raises(ValueError, match="tree"):
        llm.update_params({"embed": leaves[0]})
    with pytest.raises(ValueError, match="in_flight"):
        llm.update_params(good, in_flight="later")
    assert llm.params is good


def test_update_params_in_flight(make_tiny_llm):
    llm = make_tiny_llm(max_num_seqs=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for policy, reason in (("abort", "abort"), ("keep", "length")):
        seq = llm.get_sequence(llm.add_request(random_prompts([10], seed=9)[0], params))
        llm.step()
        llm.step()
        llm.update_params(llm.params, in_flight=policy)
        while llm.has_unfinished_requests():
            llm.step()
        assert seq.finish_reason == reason, policy
    assert llm.block_manager.num_used_blocks == 0

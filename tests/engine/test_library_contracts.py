"""Library contracts (issue 22): prompts of the wrong type and out-of-vocabulary
stop ids are that request's error; decode.score / decode.generate name bad
arrays; update_params refuses NaN weights; a step with NaN logits warns; every
memory setting is checked against this machine before the pool is allocated."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged import decode
from jpaged.core.config import ConfigError
from jpaged.core.sequence import SamplingParams
from jpaged.runtime.params import NonFiniteParamsError

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


def test_prompts_of_the_wrong_type_are_that_requests_error(tiny_llm):
    prompts = [b"hello", bytearray(b"hi"), ["a", "b"], [1.0, 2.0], [[1, 2], [3]], 7, None,
               "\ud800", {"prompt": "ok \udfff"}, {"messages": [{"role": "user", "content": "\ud83d"}]},
               [1, 2, 3]]
    outs = tiny_llm.generate(prompts, GREEDY)
    *bad, good = outs
    assert good.error is None and len(good.token_ids) == 2
    assert all(o.finish_reason == "error" and o.token_ids == [] for o in bad), [o.error for o in bad]
    errors = [o.error for o in bad]
    assert "prompt is bytes" in errors[0] and "prompt is bytearray" in errors[1]
    assert all("token ids must be integers" in e for e in errors[2:5]), errors[2:5]
    assert "prompt is int" in errors[5] and "prompt is NoneType" in errors[6]
    assert errors[7] == "prompt is not valid Unicode (lone surrogate '\\ud800' at character 0)"
    assert errors[8] == "prompt is not valid Unicode (lone surrogate '\\udfff' at character 3)"
    assert errors[9].startswith("messages[0].content is not valid Unicode")


def test_out_of_vocabulary_stop_token_ids_are_that_requests_error(tiny_llm):
    vocab = tiny_llm.model_config.vocab_size
    bad, good = tiny_llm.generate([[1, 2, 3]] * 2, [SamplingParams(max_tokens=2, stop_token_ids=[5, vocab]),
                                                    SamplingParams(max_tokens=2, stop_token_ids=[vocab - 1])])
    assert bad.finish_reason == "error" and f"stop_token_ids outside the vocabulary [0, {vocab})" in bad.error
    assert good.error is None
    assert tiny_llm.check_request([1, 2], SamplingParams(stop_token_ids=[-1])) is not None


# ------------------------------------------------------------------ decode
def test_score_and_generate_check_their_arrays(tiny_llm):
    g, p = tiny_llm.graphdef, tiny_llm.params
    vocab = tiny_llm.model_config.vocab_size
    ids = np.array([[1, 2, 3, 0], [4, 5, 0, 0]], np.int32)
    lens = np.array([4, 2], np.int32)
    assert decode.score(g, p, ids, lens).shape == (2, 3)
    cases = [
        ((ids[0], lens), "token_ids must be \\[batch, length\\]"),
        ((ids[:0], lens[:0]), "token_ids is empty"),
        ((ids, lens[:1]), "lengths must be \\[2\\]"),
        ((ids, np.array([4, 0])), "lengths\\[1\\] = 0 is outside \\[1, 4\\]"),
        ((ids, np.array([5, 2])), "lengths\\[0\\] = 5 is outside \\[1, 4\\]"),
        ((np.where(np.arange(4) == 1, vocab, ids), lens),
         f"token_ids\\[0, 1\\] = {vocab} is outside the vocabulary"),
        ((ids.astype(np.float32), lens), "token_ids must hold integers"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            decode.score(g, p, *args)
    padded = np.where(np.arange(4) >= lens[:, None], -1, ids)  # padding past lengths is not checked
    assert decode.score(g, p, padded, lens).shape == (2, 3)

    gen = lambda prompts, prompt_lens, **kw: decode.generate(g, p, prompts, prompt_lens,  # noqa: E731
                                                             max_new_tokens=2, **kw)
    assert gen(ids, lens)[0].shape == (2, 2)
    for args, kw, message in [((ids, np.array([0, 2])), {}, "prompt_lens\\[0\\] = 0"),
                              ((np.full((2, 4), -3), lens), {}, "prompts\\[0, 0\\] = -3"),
                              ((ids[:0], lens[:0]), {}, "prompts is empty"),
                              ((ids, lens), {"eos_token_id": vocab}, "eos_token_id")]:
        with pytest.raises(ValueError, match=message):
            gen(*args, **kw)
    # Under jit only shapes are checked (documented): values are not known there.
    scored = jax.jit(decode.score, static_argnums=0)(g, p, jnp.asarray(ids), jnp.array([9, 2]))
    assert scored.shape == (2, 3)
    with pytest.raises(ValueError, match="lengths must be"):
        jax.jit(decode.score, static_argnums=0)(g, p, jnp.asarray(ids), jnp.array([4]))


# -------------------------------------------------------- weights and NaNs
def test_update_params_refuses_nan_weights_and_nan_logits_warn(make_tiny_llm, caplog):
    llm = make_tiny_llm(max_num_seqs=2)
    leaves, treedef = jax.tree.flatten(llm.params)
    poisoned = jax.tree.unflatten(treedef, [leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan), *leaves[1:]])
    with pytest.raises(NonFiniteParamsError, match="holds NaN or Inf"):
        llm.update_params(poisoned)
    assert llm.weights_version == 0  # refused: nothing changed
    nan_all = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                           llm.params)
    llm.update_params(nan_all, check_finite=False)
    with caplog.at_level(logging.WARNING, logger="jpaged.engine.core"):
        out = llm.generate([[1, 2, 3]], GREEDY)[0]
    assert len(out.token_ids) == 2
    assert any("NaN logits" in r.getMessage() for r in caplog.records), caplog.text


# ------------------------------------------------------------------ memory
def test_memory_settings_are_checked_before_the_pool_is_allocated(make_tiny_llm, monkeypatch):
    with pytest.raises(ConfigError, match="^num_blocks: 2147483647 KV blocks of .* more than the"):
        make_tiny_llm(num_blocks=2**31 - 1)
    with pytest.raises(ConfigError, match="^kv_memory_fraction: 1e-15 of the .* holds 0 KV blocks"):
        make_tiny_llm(num_blocks=0, kv_memory_fraction=1e-15)
    from jpaged.runtime import kv_pool
    monkeypatch.setattr(kv_pool, "available_host_memory", lambda: 2**30)
    with pytest.raises(ConfigError, match="^swap_space_gb: 2 GiB of host swap space is more than"):
        make_tiny_llm(preemption_mode="swap", swap_space_gb=2.0)


def test_explicit_memory_settings_are_checked_before_any_weight_is_read(make_tiny_llm, monkeypatch):
    """From the model's metadata alone: a huge num_blocks or swap space fails in one
    line before loading (seconds, not the load's minutes on a big model)."""
    from jpaged.engine import setup
    from jpaged.runtime import kv_pool

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were read before the memory settings were checked")
    monkeypatch.setattr(setup, "load_weights", no_loading)
    with pytest.raises(ConfigError, match="^num_blocks: 2147483647 KV blocks of .* more than the"):
        make_tiny_llm(num_blocks=2**31 - 1)
    monkeypatch.setattr(kv_pool, "available_host_memory", lambda: 2**30)
    with pytest.raises(ConfigError, match="^swap_space_gb: 2 GiB of host swap space is more than"):
        make_tiny_llm(preemption_mode="swap", swap_space_gb=2.0)
    with pytest.raises(AssertionError, match="weights were read"):  # settings that fit go on to load
        make_tiny_llm(num_blocks=16)

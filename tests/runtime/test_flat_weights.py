"""config.flat_weights: the step programs take the weights as one flat list of
arrays (their tree closed over) instead of the (nnx.State, LoRA) tree; the same
logits, so the same tokens, greedy and seeded, unrolled and scanned, and the
list follows every replacement of the weights (update_params, sleep / wake)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import random_prompts
from jpaged.core.sequence import SamplingParams

ENGINE = dict(num_blocks=57, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
PROMPTS = random_prompts([5, 9, 6, 13], seed=37)
MIXED = [SamplingParams(max_tokens=6, ignore_eos=True),
         SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=1),
         SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, top_k=5, seed=2),
         SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7, top_p=0.8, seed=3)]
LOGPROBS = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)


def outputs(llm, params=MIXED):
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_flat_and_tree_weights_give_the_same_tokens_and_logprobs(make_tiny_llm, layer_loop):
    tree = make_tiny_llm(**ENGINE, layer_loop=layer_loop, flat_weights=False)
    flat = make_tiny_llm(**ENGINE, layer_loop=layer_loop, flat_weights=True)
    assert isinstance(flat.runner.step_weights(), list)
    assert len(flat.runner.step_weights()) == len(jax.tree.leaves(flat.runner.weights))
    assert isinstance(tree.runner.step_weights(), tuple)
    assert outputs(flat) == outputs(tree)
    a, b = flat.generate(PROMPTS[:2], LOGPROBS), tree.generate(PROMPTS[:2], LOGPROBS)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]


def test_the_flat_list_follows_new_weights(make_tiny_llm):
    """update_params and a sleep / wake cycle replace the weights: the next step
    reads the new arrays (the list is rebuilt), as the tree form does."""
    flat = make_tiny_llm(**ENGINE, flat_weights=True)
    tree = make_tiny_llm(**ENGINE, flat_weights=False)
    before = outputs(flat)
    scaled = jax.tree.map(lambda x: x * 1.5, flat.params)
    for llm in (flat, tree):
        llm.update_params(jax.tree.map(lambda x: x * 1.5, llm.params))
    after = outputs(flat)
    assert after == outputs(tree) and after != before
    assert all(np.array_equal(a, b) for a, b in zip(flat.runner.step_weights(), jax.tree.leaves(scaled)))
    flat.sleep(level=1)
    flat.wake_up()
    assert outputs(flat) == after

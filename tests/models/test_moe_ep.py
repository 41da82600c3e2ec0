"""Expert parallelism (enable_expert_parallel) on four simulated CPU devices:
each device holds num_experts / tensor_parallel_size whole experts, routes every
token, runs its own experts' rows and one all-reduce combines the devices; the
engine gives one device's greedy tokens at EP = 2 and 4 for Qwen3-MoE (with its
dense layer 0) and Mixtral.  Bad settings fail with the config errors.

The tiny checkpoints (tests/conftest.py): 2 layers, 4 experts, top-2.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import TINY_ENGINE, random_prompts
from jpaged.core.config import ConfigError
from jpaged.core.model_config import ModelConfig
from jpaged.core.sequence import SamplingParams
from jpaged.layers.moe import EXPERT_SPECS, EXPERTS, UNITS, moe_mlp, moe_mlp_dense
from jpaged.layers.sharding import check_experts, collectives, make_mesh

FAMILIES = ("qwen3_moe", "mixtral")
EP_SIZES = (2, 4)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)
PROMPTS = random_prompts([5, 23, 40, 3, 17], seed=44)
LOGPROB_ATOL = 1e-4  # fp32: the devices' partial sums are added in another order than one device's


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(kind, checkpoint dir, one device's greedy outputs of PROMPTS)."""
    from jpaged.engine.llm import LLM
    path = request.getfixturevalue(f"tiny_{request.param}")[0]
    one = LLM(model=str(path), **TINY_ENGINE)
    return request.param, path, one.generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module", params=EP_SIZES, ids=lambda n: f"ep{n}")
def ep_engine(request, family):
    from jpaged.engine.llm import LLM
    return LLM(model=str(family[1]), **TINY_ENGINE, tensor_parallel_size=request.param,
               enable_expert_parallel=True)


def _leaves(params, part: str) -> dict[str, jax.Array]:
    return {jax.tree_util.keystr(k): x for k, x in jax.tree_util.tree_flatten_with_path(params)[0]
            if part in jax.tree_util.keystr(k)}


def test_each_device_holds_its_own_whole_experts(family, ep_engine):
    kind = family[0]
    tp, E = ep_engine.config.tensor_parallel_size, ep_engine.model_config.num_experts
    assert ep_engine.model_config.expert_parallel
    experts = _leaves(ep_engine.params, "experts_")
    assert len(experts) == 3 * (1 if kind == "qwen3_moe" else 2)  # layer 1 / layers 0 and 1 (unrolled)
    for key, x in experts.items():
        assert x.shape[0] == E and x.sharding.spec == P("model", None, None), key
        shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start)
        assert len({s.device for s in shards}) == tp
        assert [(s.index[0].start, s.index[0].stop) for s in shards] == \
               [(i * E // tp, (i + 1) * E // tp) for i in range(tp)], key
        assert all(s.data.shape == (E // tp, *x.shape[1:]) for s in shards), key
    routers = _leaves(ep_engine.params, "router")
    assert routers and all(x.sharding.spec == P() for x in routers.values())
    # Attention stays tensor-parallel: q split by column.
    assert all(x.sharding.spec == P(None, "model") for x in _leaves(ep_engine.params, "'wq'").values())


def test_greedy_tokens_equal_one_device(family, ep_engine):
    got = ep_engine.generate(PROMPTS, GREEDY)
    for i, (g, w) in enumerate(zip(got, family[2])):
        assert g.token_ids == w.token_ids, f"prompt {i}"
        np.testing.assert_allclose([t.logprob for t in g.logprobs], [t.logprob for t in w.logprobs],
                                   rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.parametrize("tp", EP_SIZES)
@pytest.mark.parametrize("split", [EXPERTS, UNITS])
def test_layer_collectives_and_values(tp, split):
    """The MoE layer under each split: the one-hot oracle's values, and one all-reduce
    of the [T, d] fp32 partial sums as its only collective (no expert is gathered)."""
    rng = np.random.default_rng(tp)
    T, d, f, E = 29, 16, 8, 4
    router = rng.standard_normal((d, E)).astype(np.float32)
    weights = [(rng.standard_normal(s) * 0.3).astype(np.float32) for s in ((E, d, f), (E, d, f), (E, f, d))]
    x = rng.standard_normal((T, d)).astype(np.float32)
    mesh = make_mesh(tp)
    placed = [jax.device_put(w, NamedSharding(mesh, s)) for w, s in zip(weights, EXPERT_SPECS[split])]
    layer = jax.jit(lambda x, w: moe_mlp(x, router, *w, top_k=2, renormalize=True,
                                         expert_parallel=split == EXPERTS))
    with jax.set_mesh(mesh):
        got = layer(x, placed)
        hlo = layer.lower(x, placed).compile().as_text()
    np.testing.assert_allclose(np.asarray(got), moe_mlp_dense(x, router, *weights, top_k=2, renormalize=True),
                               rtol=0, atol=1e-5)
    ops = collectives(hlo)
    assert [(op, n) for op, _, n in ops] == [("all-reduce", T * d * 4)], ops


def test_expert_parallel_needs_several_devices(tiny_qwen3_moe):
    from jpaged.engine.llm import LLM
    with pytest.raises(ConfigError, match="enable_expert_parallel: is set but tensor_parallel_size is 1"):
        LLM(model=str(tiny_qwen3_moe[0]), **TINY_ENGINE, enable_expert_parallel=True)


def test_expert_parallel_on_a_dense_model_is_refused(tiny_llama):
    from jpaged.engine.llm import LLM
    with pytest.raises(ConfigError, match="enable_expert_parallel: llama is a dense model"):
        LLM(model=str(tiny_llama[0]), **TINY_ENGINE, tensor_parallel_size=2, enable_expert_parallel=True)


def test_experts_that_do_not_divide_are_refused():
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, architecture="qwen3_moe", num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 4 does not divide qwen3_moe's 6 experts; false, "
                                          r"or a tensor_parallel_size in \[2\]"):
        check_experts(cfg, 4, True)
    check_experts(cfg, 2, True)
    check_experts(cfg, 4, False)  # without expert parallelism nothing is split by expert


def test_scanned_layers_and_merged_projections(family):
    """EP = 2 with Mixtral's layers in a scan (the experts stacked [L, E, ...], split
    on E) and with Qwen3-MoE's merged projections (its dense layer's gate|up)."""
    from jpaged.engine.llm import LLM
    kind, path, want = family
    extra = {"layer_loop": "scan"} if kind == "mixtral" else {"merge_projections": True}
    llm = LLM(model=str(path), **TINY_ENGINE, tensor_parallel_size=2, enable_expert_parallel=True, **extra)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in want]
    stacked = P(None, "model", None, None) if kind == "mixtral" else P("model", None, None)
    assert {x.sharding.spec for x in _leaves(llm.params, "experts_").values()} == {stacked}


def test_decode_step_gathers_no_expert(family):
    """The EP = 2 decode step's collectives: one all-reduce of the [8, d] activations
    after the embedding and two per layer (attention's o, then the MoE layer's
    combine or a dense layer's down), one of the [8] NaN flags, and no all-gather but
    the argmax's [8, tp] candidates: no expert moves between devices."""
    from jpaged.engine.llm import LLM
    llm = LLM(model=str(family[1]), **TINY_ENGINE, tensor_parallel_size=2, enable_expert_parallel=True)
    llm.precompile(8)  # the decode bucket
    (exe,) = llm.runner.executables()
    ops = collectives(exe.as_text())
    activations = 8 * llm.model_config.hidden_size * 4
    assert sorted(b for op, _, b in ops if op == "all-reduce") == \
           [8] + [activations] * (1 + 2 * llm.model_config.num_layers)
    assert sorted(b for op, _, b in ops if op == "all-gather") == [8 * 2 * 4] * 2, ops

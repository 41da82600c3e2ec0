"""merge_projections: wq|wk|wv -> wqkv and w_gate|w_up -> w_gate_up give the separate
weights' logits (fp32 rounding of the wider GEMMs) and greedy tokens, in every family,
under scan, with q/k/v biases, under tensor parallelism (per-shard column layout, KV
heads repeated), with LoRA adapters on the merged targets, and after update_params
with a tree of separate weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import make_peft_adapter, random_prompts
from jpaged.core.config import ConfigError, apply_overrides, default_config, validate_config
from jpaged.core.sequence import SamplingParams
from jpaged.decode import generate, score
from jpaged.loading.weights import load_weights
from jpaged.models import build_model
from jpaged.models.base import split_model
from jpaged.models.merged import interleave, merge_params, split_columns
from jpaged.layers.sharding import collectives, weight_spec

LOGPROB_ATOL = 1e-4
PROMPTS = random_prompts([6, 13, 3], seed=5)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)


def leaves(params) -> dict[str, jax.Array]:
    """keystr of each leaf's path -> the leaf, e.g. "['layers'][0]['wq'].value"."""
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def leaf_name(key: str) -> str:
    return key.rsplit("['", 1)[1].split("']")[0]


def leaf_names(params) -> set[str]:
    return {leaf_name(k) for k in leaves(params)}


def padded(prompts):
    ids = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    return jnp.asarray(ids), jnp.asarray([len(p) for p in prompts], jnp.int32)


_generate = jax.jit(generate, static_argnums=0, static_argnames=("max_new_tokens",))
# decode.score as one program per model, not its ops one by one (seconds a call, eagerly).
_score = jax.jit(score, static_argnums=0)


def test_interleave_lays_columns_out_per_shard():
    q, k, v = (np.arange(n, dtype=np.float32)[None] + base for n, base in ((4, 0), (2, 100), (2, 200)))
    merged = interleave([q, k, v], 2)
    np.testing.assert_array_equal(merged[0], [0, 1, 100, 200, 2, 3, 101, 201])
    for got, want in zip(split_columns(jnp.asarray(merged), (4, 2, 2), 2), (q, k, v)):
        np.testing.assert_array_equal(got, want)


# qwen2: q/k/v biases (bqkv); qwen3: q/k norms after the split; gemma2: its own layer (GeGLU)
@pytest.mark.parametrize("kind,scan", [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True),
                                       ("qwen3", False), ("gemma2", False)])
def test_merged_model_matches_separate_weights(request, kind, scan):
    """decode.score logprobs within fp32 rounding, decode.generate greedy tokens equal."""
    path, _ = request.getfixturevalue(f"tiny_{kind}")
    loaded = load_weights(str(path), load_format="hf")
    ids, lens = padded(PROMPTS)
    results = []
    for merged in (False, True):
        graphdef, params = split_model(build_model(loaded.config, loaded.arrays, jnp.float32, scan_layers=scan,
                                                   merge_projections=merged))
        names = leaf_names(params)
        assert ({"wqkv", "w_gate_up"} <= names) == merged and ("wq" in names) != merged
        assert ("bqkv" in names) == (merged and loaded.config.attention_bias)
        tokens, _ = _generate(graphdef, params, ids, lens, max_new_tokens=6)
        results.append((np.asarray(_score(graphdef, params, ids, lens)), np.asarray(tokens)))
    (want_lp, want_tokens), (got_lp, got_tokens) = results
    np.testing.assert_allclose(got_lp, want_lp, atol=LOGPROB_ATOL)
    np.testing.assert_array_equal(got_tokens, want_tokens)


def test_bad_shard_count_fails_clearly(tiny_llama):
    loaded = load_weights(str(tiny_llama[0]), load_format="hf")
    with pytest.raises(ValueError, match=r"wqkv: columns \(64, 32, 32\) do not split into 3"):
        build_model(loaded.config, loaded.arrays, jnp.float32, merge_projections=True, tensor_parallel_size=3)


def test_config_field_is_checked():
    with pytest.raises(ConfigError, match="merge_projections"):
        validate_config(apply_overrides(default_config(), merge_projections="yes"))


# ------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def separate(make_tiny_llm):
    return make_tiny_llm()


@pytest.fixture(scope="module")
def expected(separate):
    return separate.generate(PROMPTS, GREEDY)


def assert_same(outputs, expected) -> None:
    for got, want in zip(outputs, expected):
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose([t.logprob for t in got.logprobs], [t.logprob for t in want.logprobs],
                                   atol=LOGPROB_ATOL)


@pytest.mark.parametrize("tp", [2, 4])  # 4 > the tiny Llama's 2 KV heads: they are repeated before the merge
def test_tensor_parallel_merged_matches_one_device(make_tiny_llm, expected, tp):
    llm = make_tiny_llm(merge_projections=True, tensor_parallel_size=tp)
    assert llm.model_config.num_kv_heads == max(2, tp)
    assert_same(llm.generate(PROMPTS, GREEDY), expected)
    for key, leaf in leaves(llm.params).items():
        assert leaf.sharding.spec == weight_spec(leaf_name(key), leaf.ndim), key
    wqkv = leaves(llm.params)["['layers'][0]['wqkv'].value"]
    assert wqkv.sharding.shard_shape(wqkv.shape)[1] == wqkv.shape[1] // tp


def test_tp_merged_step_moves_no_weight(make_tiny_llm):
    """The per-shard column layout gives each device its own q, k, v (gate, up) columns:
    the merged step has the separate one's collectives, one all-reduce per row-parallel
    matmul, and no all-gather / all-to-all of projections (a [q | k | v] layout split by
    column would need them to regroup the heads)."""
    llm = make_tiny_llm(tensor_parallel_size=2, attention_impl="cpu", merge_projections=True)
    llm.precompile(8)  # the decode bucket
    (exe,) = llm.runner.executables()
    ops = collectives(exe.as_text())
    activations = 8 * llm.model_config.hidden_size * 4
    assert sorted(b for op, _, b in ops if op == "all-reduce") == [8] + [activations] * (
        1 + 2 * llm.model_config.num_layers)
    assert not [op for op, _, _ in ops if op in ("all-to-all", "collective-permute")]
    assert all(b < activations // 8 for op, _, b in ops if op == "all-gather")  # the argmax's [8, tp] candidates


def test_update_params_takes_separate_weights(make_tiny_llm, separate):
    """A tree with wq/wk/wv, w_gate/w_up (a trainer's, here the separate engine's scaled)
    is merged into the engine's layout; awake, and asleep at level 2."""
    new = jax.tree.map(lambda x: x * 1.05, separate.params)
    merged = make_tiny_llm(merge_projections=True)
    before = merged.params
    merged.update_params(new)
    assert {"wqkv", "w_gate_up"} <= leaf_names(merged.params)
    embed = "['embed'].value"
    assert leaves(merged.params)[embed] is leaves(new)[embed]  # the other leaves: the caller's arrays
    reference = make_tiny_llm()
    reference.update_params(new)
    want = reference.generate(PROMPTS, GREEDY)
    assert_same(merged.generate(PROMPTS, GREEDY), want)
    merged.update_params(before)  # the engine's own (merged) tree as well
    merged.sleep(level=2)
    merged.update_params(new)
    merged.wake_up()
    assert_same(merged.generate(PROMPTS, GREEDY), want)
    broken = jax.tree.map(lambda x: x, new)
    del broken["layers"][0]["wv"]
    with pytest.raises(ValueError, match=r"missing .*\['layers'\]\[0\]\['wv'\]"):
        merged.update_params(broken)


def test_update_params_under_tensor_parallelism(make_tiny_llm):
    separate, merged = (make_tiny_llm(tensor_parallel_size=2, merge_projections=m) for m in (False, True))
    new = jax.tree.map(lambda x: x * 0.97, separate.params)
    separate.update_params(new)
    merged.update_params(new)
    wqkv = leaves(merged.params)["['layers'][1]['wqkv'].value"]
    assert wqkv.sharding.spec == weight_spec("wqkv", 2)
    assert_same(merged.generate(PROMPTS, GREEDY), separate.generate(PROMPTS, GREEDY))


def test_merge_params_is_identity_for_the_engines_own_tree(separate):
    assert merge_params(separate.params, separate.params, 1) is separate.params


# ------------------------------------------------------------------ LoRA
@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):
    _, hf = tiny_llama
    path = tmp_path_factory.mktemp("merged-lora") / "qkvgu"
    make_peft_adapter(hf, path, seed=7, r=8, lora_alpha=16,
                      target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])
    return str(path)


@pytest.mark.parametrize("overrides", [{}, {"layer_loop": "scan"}, {"tensor_parallel_size": 2}])
def test_lora_on_merged_targets(make_tiny_llm, adapter, overrides):
    """Each part of a merged GEMM adds its own target's update: the separate engine's
    scores and tokens under the adapter (mixed with base-model rows)."""
    engines = [make_tiny_llm(lora_modules=f"a={adapter}", max_loras=2, merge_projections=m, **overrides)
               for m in (False, True)]
    ids, lens = padded(PROMPTS)
    slots = jnp.asarray([0, -1, 0], jnp.int32)
    scores = [np.asarray(_score(e.graphdef, e.params, ids, lens, lora=e.lora_weights()[0], lora_slots=slots))
              for e in engines]
    np.testing.assert_allclose(scores[1], scores[0], atol=LOGPROB_ATOL)
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1, lora=n)
              for n in ("a", None, "a")]
    want = engines[0].generate(PROMPTS, params)
    assert_same(engines[1].generate(PROMPTS, params), want)
    base = engines[0].generate(PROMPTS[:1], params[1:2])[0]
    assert base.token_ids != want[0].token_ids  # the adapter changes the tokens


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_dummy_weights_drawn_on_the_devices_merge(make_tiny_llm, layer_loop):
    """load_format=dummy hands over device arrays (per-layer lists when unrolled), sharded:
    they merge where they are, and give the separate engine's tokens."""
    engines = [make_tiny_llm(load_format="dummy", tensor_parallel_size=2, layer_loop=layer_loop,
                             merge_projections=m) for m in (False, True)]
    want, got = (e.generate(PROMPTS, GREEDY) for e in engines)
    assert_same(got, want)

"""load_format="dummy": random weights drawn on the device (jpaged.runtime.dummy_weights).

The draw must give every weight its shape and dtype, the documented spread,
the same values for a seed whatever the layer layout or tensor-parallel
placement, and an engine that runs on them.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jpaged.core.sequence import SamplingParams
from jpaged.engine.llm import LLM
from jpaged.loading.weights import load_weights
from jpaged.models import config_from_hf, weight_shapes
from jpaged.models.llama import Llama
from jpaged.runtime.dummy_weights import STD, _sharding, dummy_weights, load_dummy
from jpaged.layers.sharding import make_mesh, weight_spec

# Qwen2-shaped (attention biases) tiny Llama: one KV head, so two devices repeat it.
HF = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
      "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
CFG = config_from_hf(HF)
ENGINE = dict(load_format="dummy", max_model_len=64, block_size=16, num_blocks=32, max_num_seqs=4,
              max_num_batched_tokens=64, attention_impl="auto", enable_prefix_caching=False,
              buckets_per_octave=1)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 4, 5, 6, 7], [9, 8, 7]]


def as_numpy(a) -> np.ndarray:
    """A weight as one float32 host array (per-layer lists stacked)."""
    return np.stack([np.asarray(x, np.float32) for x in a]) if isinstance(a, list) else np.asarray(a, np.float32)


def test_shapes_dtypes_spread_and_norms():
    arrays = dummy_weights(CFG, seed=0, dtype=jnp.bfloat16)
    assert {k: v.shape for k, v in arrays.items()} == weight_shapes(CFG)
    assert all(isinstance(v, jax.Array) and v.dtype == jnp.bfloat16 for v in arrays.values())
    for name, a in arrays.items():
        values = as_numpy(a)
        if name.endswith("norm"):
            assert np.all(values == 1), name
        else:  # uniform on (-a, a): std 0.02, nothing outside a = 0.02 * sqrt(3)
            tolerance = 5 * STD / np.sqrt(values.size)  # over 5 sampling sigmas for std and mean
            assert abs(values.std() - STD) < tolerance and abs(values.mean()) < tolerance, name
            assert np.abs(values).max() <= STD * 3 ** 0.5 * 1.01, name
    wq = as_numpy(arrays["layers.wq"])
    assert not np.array_equal(wq[0], wq[1])  # each layer its own draw


def test_unrolled_layout_is_per_layer_arrays_with_the_stacked_values():
    stacked = dummy_weights(CFG, seed=3, scan_layers=True)
    unrolled = dummy_weights(CFG, seed=3, scan_layers=False)
    for name, shape in weight_shapes(CFG).items():
        if name.startswith("layers."):
            assert isinstance(unrolled[name], list) and len(unrolled[name]) == CFG.num_layers
            assert all(x.shape == shape[1:] for x in unrolled[name])
        else:
            assert unrolled[name].shape == shape
        np.testing.assert_array_equal(as_numpy(unrolled[name]), as_numpy(stacked[name]), err_msg=name)


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = (dummy_weights(CFG, seed=s, dtype=jnp.bfloat16) for s in (5, 5, 6))
    for name in a:
        np.testing.assert_array_equal(as_numpy(a[name]), as_numpy(b[name]), err_msg=name)
    assert not np.array_equal(as_numpy(a["embed"]), as_numpy(c["embed"]))
    assert not np.array_equal(as_numpy(a["layers.w_up"]), as_numpy(c["layers.w_up"]))


def test_drawn_on_the_mesh_with_the_engine_shardings():
    mesh = make_mesh(2)
    single = dummy_weights(CFG, seed=1, scan_layers=False)
    sharded = dummy_weights(CFG, seed=1, scan_layers=False, mesh=mesh)
    for name, a in sharded.items():
        for x in (a if isinstance(a, list) else [a]):
            assert x.sharding.spec == weight_spec(name.rsplit(".", 1)[-1], x.ndim), name
            assert x.sharding.mesh == mesh
        np.testing.assert_array_equal(as_numpy(a), as_numpy(single[name]), err_msg=name)
    w_up = sharded["layers.w_up"][0]  # split by column: each device holds half
    assert {s.data.shape for s in w_up.addressable_shards} == {(64, 64)}
    # An axis the mesh does not divide is drawn replicated (the engine places it).
    assert _sharding(mesh, "layers.wk", (64, 3), True).spec == P()


def test_load_dummy(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF))
    lw = load_dummy(str(tmp_path / "config.json"), dtype="bfloat16")
    assert lw.config == CFG and lw.tokenizer is None and not lw.from_cache and lw.load_seconds > 0
    assert lw.source == f"dummy:{tmp_path / 'config.json'}"
    assert {k: v.shape for k, v in lw.arrays.items()} == weight_shapes(CFG)
    assert all(v.dtype == jnp.bfloat16 for v in lw.arrays.values())
    Llama(CFG, lw.arrays, dtype=jnp.bfloat16)
    unrolled = load_dummy(str(tmp_path), scan_layers=False)  # the directory holding config.json
    Llama(CFG, unrolled.arrays)  # per-layer lists, as the unrolled loop keeps them
    with pytest.raises(ValueError, match="draws its weights on the devices: use jpaged.runtime.dummy_weights"):
        load_weights(str(tmp_path), load_format="dummy")


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dummy_qwen2")
    (path / "config.json").write_text(json.dumps(HF))
    return str(path)


def layer0_wq(llm: LLM) -> np.ndarray:
    """Layer 0's wq as the engine holds it (scanned: the first of the stack)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(llm.params)[0]:
        keys = [getattr(k, "key", None) for k in path]  # ["layers", 0, "wq", None] unrolled
        if "wq" in keys:
            return np.asarray(leaf if 0 in keys else leaf[0])
    raise AssertionError("no wq in the params")


def test_engine_generates_on_dummy_weights_in_every_layout(config_dir):
    """One device unrolled, one device scanned, two devices (KV head repeated on the
    devices): the same weights, so the same greedy tokens."""
    want = dummy_weights(CFG, seed=0, scan_layers=False)["layers.wq"][0]
    tokens = None
    for overrides in (dict(layer_loop="unroll"), dict(layer_loop="scan"),
                      dict(layer_loop="unroll", tensor_parallel_size=2)):
        llm = LLM(model=config_dir, **ENGINE, **overrides)
        out = llm.generate(PROMPTS, GREEDY)
        assert all(len(o.token_ids) == GREEDY.max_tokens for o in out), overrides
        tokens = tokens or [o.token_ids for o in out]
        assert [o.token_ids for o in out] == tokens, overrides
        np.testing.assert_array_equal(layer0_wq(llm), np.asarray(want), err_msg=str(overrides))
        if overrides.get("tensor_parallel_size") == 2:
            assert llm.model_config.num_kv_heads == 2  # the one KV head, repeated per device
            for path, leaf in jax.tree_util.tree_flatten_with_path(llm.params)[0]:
                names = [getattr(k, "key", None) for k in path]
                name = next(n for n in reversed(names) if isinstance(n, str) and n != "value")
                assert leaf.sharding.spec == weight_spec(name, leaf.ndim), path

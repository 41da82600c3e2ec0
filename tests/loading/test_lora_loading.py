"""PEFT LoRA adapters on the host (jpaged/loading/peft.py), checked against peft's own modules."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers import import_torch
from jpaged.core.model_config import ModelConfig
from jpaged.core.lora_adapters import LORA_TARGETS, adapter_name_error, lora_module_shapes, parse_lora_modules
from jpaged.loading.peft import (MAX_CONFIG_BYTES, MAX_HEADER_BYTES, PeftFiles, lora_from_arrays, load_peft_adapter,
                                 read_peft_files)
from jpaged.loading.peft_config import PEFT_MODULES, parse_adapter_config

peft = pytest.importorskip("peft")
ALL = list(PEFT_MODULES)
OURS = {ours: hf for hf, ours in PEFT_MODULES.items()}


def config_of(hf_model) -> ModelConfig:
    c = hf_model.config
    return ModelConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                       num_kv_heads=c.num_key_value_heads,
                       head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                       architecture="qwen3" if c.model_type == "qwen3" else "llama")


def make_adapter(hf_model, out: pathlib.Path, **lora):
    """Saves a random (non-zero B) PEFT LoRA of hf_model to `out`; returns the peft model."""
    torch = import_torch()
    torch.manual_seed(0)
    model = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(
        **{"r": 8, "lora_alpha": 16, "target_modules": ALL, "init_lora_weights": False, **lora})).eval()
    model.save_pretrained(out)
    return model


def peft_delta(model, layer: int, proj: str, x: np.ndarray) -> np.ndarray:
    """What peft's module adds to the base layer's output for inputs x (zeros if not adapted)."""
    torch = import_torch()
    block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    module = model.get_submodule(f"base_model.model.model.layers.{layer}.{block}.{proj}")
    xt = torch.from_numpy(x)
    with torch.no_grad():
        if not hasattr(module, "base_layer"):
            return np.zeros((x.shape[0], module.out_features), np.float32)
        return (module(xt) - module.base_layer(xt)).numpy()


@pytest.fixture(scope="module")
def good_adapter(tiny_llama, tmp_path_factory):
    """(dir, cfg) of an r=8 adapter on all 7 modules of the tiny Llama."""
    out = tmp_path_factory.mktemp("lora") / "good"
    make_adapter(tiny_llama[1], out)
    return out, config_of(tiny_llama[1])


CASES = {
    "r8": dict(),
    "r16": dict(r=16, lora_alpha=8),
    "rslora": dict(r=16, lora_alpha=4, use_rslora=True),
    "patterns": dict(rank_pattern={"q_proj": 16, "model.layers.1.mlp.down_proj": 4},
                     alpha_pattern={"v_proj": 3, "layers.0.mlp.gate_proj": 40}),
    "layers": dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[1]),
    "regex": dict(target_modules=r".*\.(k_proj|up_proj)"),
    "all-linear": dict(target_modules="all-linear"),
}


@pytest.mark.parametrize("case, kind", [(c, "llama") for c in CASES] + [("r8", "qwen3"), ("patterns", "qwen3")])
def test_matches_peft(case, kind, request, tmp_path):
    """x @ A[l] @ B[l] is what peft's module adds, for every adapted module and layer."""
    hf_model = request.getfixturevalue(f"tiny_{kind}")[1]
    cfg = config_of(hf_model)
    model = make_adapter(hf_model, tmp_path, **CASES[case])
    adapter = load_peft_adapter("a", tmp_path, cfg, max_rank=16)
    assert adapter.name == "a" and adapter.path == str(tmp_path)
    ranks = [m.lora_A["default"].weight.shape[0] for m in model.modules() if hasattr(m, "lora_A")]
    assert adapter.rank == max(ranks)
    adapted = {PEFT_MODULES[n.rsplit(".", 1)[-1]] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert list(adapter.modules) == [t for t in LORA_TARGETS if t in adapted]
    x = np.random.default_rng(0).standard_normal((5, max(cfg.hidden_size, cfg.intermediate_size,
                                                         cfg.num_heads * cfg.head_dim)), dtype=np.float32)
    for target, (a, b) in adapter.modules.items():
        n_in, n_out = lora_module_shapes(cfg)[target]
        assert a.shape == (cfg.num_layers, n_in, adapter.rank) and b.shape == (cfg.num_layers, adapter.rank, n_out)
        assert a.dtype == b.dtype == np.float32
        for layer in range(cfg.num_layers):
            xs = x[:, :n_in]
            want = peft_delta(model, layer, OURS[target], xs)
            np.testing.assert_allclose(xs @ a[layer] @ b[layer], want, rtol=1e-4, atol=1e-4)
            assert np.abs(want).max() > 0 or not np.any(a[layer]), "the case should exercise a real delta"


def test_merged_weights_agree(tiny_llama, tmp_path):
    """A @ B per layer is merge_and_unload()'s weight minus the base weight, transposed."""
    torch = import_torch()
    model = make_adapter(tiny_llama[1], tmp_path, rank_pattern={"o_proj": 4})
    adapter = load_peft_adapter("a", tmp_path, config_of(tiny_llama[1]), max_rank=8)
    base = {k: v.numpy() for k, v in tiny_llama[1].state_dict().items()}
    with torch.no_grad():
        merged = {k: v.numpy() for k, v in model.merge_and_unload().state_dict().items()}
    for target, (a, b) in adapter.modules.items():
        proj = OURS[target]
        block = "self_attn" if target in ("wq", "wk", "wv", "wo") else "mlp"
        for layer in range(2):
            key = f"model.layers.{layer}.{block}.{proj}.weight"
            np.testing.assert_allclose(a[layer] @ b[layer], (merged[key] - base[key]).T, atol=1e-5)


def test_adapter_name_in_keys_and_bf16(good_adapter, tmp_path):
    """Keys with the adapter name (lora_A.default.weight) and bf16 tensors load the same."""
    torch = import_torch()
    from safetensors.torch import save_file as save_torch
    src, cfg = good_adapter
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    tensors = load_file(src / "adapter_model.safetensors")
    renamed = {k.replace(".weight", ".default.weight"): torch.from_numpy(v).to(torch.bfloat16)
               for k, v in tensors.items()}
    save_torch(renamed, tmp_path / "adapter_model.safetensors")
    want = load_peft_adapter("a", src, cfg, max_rank=8)
    got = load_peft_adapter("a", tmp_path, cfg, max_rank=8)
    for target, (a, b) in want.modules.items():
        np.testing.assert_allclose(got.modules[target][0], a, rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(got.modules[target][1], b, rtol=1e-2, atol=1e-2)


def test_lora_from_arrays(good_adapter):
    src, cfg = good_adapter
    loaded = load_peft_adapter("a", src, cfg, max_rank=8)
    wq, wo = loaded.modules["wq"], loaded.modules["wo"]
    small = (wo[0][:, :, :4], wo[1][:, :4])
    adapter = lora_from_arrays("t", {"wq": wq, "wo": small}, cfg, max_rank=8)
    assert (adapter.name, adapter.path, adapter.rank, list(adapter.modules)) == ("t", "", 8, ["wq", "wo"])
    np.testing.assert_array_equal(adapter.modules["wq"][0], wq[0])
    np.testing.assert_array_equal(adapter.modules["wo"][1][:, :4], small[1])
    assert not adapter.modules["wo"][1][:, 4:].any() and not adapter.modules["wo"][0].flags.writeable

    def bad(modules, match, max_rank=8):
        with pytest.raises(ValueError, match=match) as e:
            lora_from_arrays("t", modules, cfg, max_rank=max_rank)
        assert "'t'" in str(e.value)

    bad({}, "no modules")
    bad({"lm_head": wq}, "unknown target 'lm_head'")
    bad({"wk": wq}, r"do not fit the base model's weight \(in 64, out 32\)")
    bad({"wq": (wq[0][:1], wq[1][:1])}, "num_layers=2")
    bad({"wq": (wq[0], wq[1][:, :4])}, r"ranks of A \(8\) and B \(4\) disagree")
    bad({"wq": wq}, "rank 8 is above the limit 4 .*max_lora_rank", max_rank=4)
    nan = wq[1].copy()
    nan[1, 2, 3] = np.inf
    bad({"wq": (wq[0], nan)}, "non-finite")


def edit_config(d: pathlib.Path, **changes) -> pathlib.Path:
    path = d / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return path


def edit_tensors(d: pathlib.Path, edit) -> pathlib.Path:
    path = d / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return path


Q = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"


def _set(key: str, value):
    def edit(t):
        t[key] = value(t) if callable(value) else value
    return edit


def _nan(t):
    t[Q.format(0, "B")][3, 1] = np.nan


def _rename_layer(t):
    for k in [k for k in t if ".layers.1." in k]:
        t[k.replace(".layers.1.", ".layers.5.")] = t.pop(k)


ERRORS = {  # name -> (change to the good adapter dir (returns the file the message names), message pattern)
    "no dir": (lambda d: d / "nope", "not a readable LoRA adapter directory"),
    "no config": (lambda d: (d / "adapter_config.json").unlink() or d, "not a readable LoRA adapter directory"),
    "not json": (lambda d: (d / "adapter_config.json").write_text("{oops") and d / "adapter_config.json",
                 "not JSON"),
    "no weights": (lambda d: (d / "adapter_model.safetensors").unlink() or d / "adapter_model.safetensors",
                   "missing"),
    "pickle": (lambda d: [(d / "adapter_model.safetensors").rename(d / "adapter_model.bin"),
                          d / "adapter_model.safetensors"][1], "adapter_model.bin, a pickle.*safe_serialization"),
    "peft type": (lambda d: edit_config(d, peft_type="IA3"), "peft_type is 'IA3'"),
    "dora": (lambda d: edit_config(d, use_dora=True), "DoRA"),
    "bias": (lambda d: edit_config(d, bias="all"), "bias is 'all'"),
    "modules_to_save": (lambda d: edit_config(d, modules_to_save=["lm_head"]), "modules_to_save"),
    "fan_in_fan_out": (lambda d: edit_config(d, fan_in_fan_out=True), "fan_in_fan_out"),
    "target lm_head": (lambda d: edit_config(d, target_modules=["q_proj", "lm_head"]), r"\['lm_head'\]"),
    "target embed": (lambda d: edit_config(d, target_modules=["embed_tokens"]), r"\['embed_tokens'\]"),
    "target regex": (lambda d: edit_config(d, target_modules=r".*(q_proj|lm_head)"), r"\['lm_head'\]"),
    "unknown key": (lambda d: edit_tensors(d, _set("base_model.model.lm_head.lora_A.weight", np.ones((8, 64),
                    np.float32))), "base_model.model.lm_head.lora_A.weight"),
    "A shape": (lambda d: edit_tensors(d, _set(Q.format(0, "A"), np.ones((8, 32), np.float32))),
                r"model.layers.0.self_attn.q_proj: .*do not fit .*\(in 64, out 64\)"),
    "B shape": (lambda d: edit_tensors(d, _set(Q.format(1, "B"), np.ones((60, 8), np.float32))),
                r"model.layers.1.self_attn.q_proj: .*do not fit"),
    "layer": (lambda d: edit_tensors(d, _rename_layer), "layer 5, but the model has 2 layers"),
    "ranks": (lambda d: edit_tensors(d, _set(Q.format(0, "B"), np.ones((64, 4), np.float32))),
              r"ranks of A \(8\) and B \(4\) disagree"),
    "A without B": (lambda d: edit_tensors(d, lambda t: t.pop(Q.format(1, "B"))),
                    "model.layers.1.self_attn.q_proj has lora_A but no lora_B"),
    "nan": (lambda d: edit_tensors(d, _nan), "q_proj: non-finite"),
    "rank vs config": (lambda d: edit_config(d, r=4) and d / "adapter_model.safetensors",
                       "rank 8 in the file, but adapter_config.json gives r=4"),
    "layers_to_transform": (lambda d: edit_config(d, layers_to_transform=0) and d / "adapter_model.safetensors",
                            r"layer 1 is not in layers_to_transform \[0\]"),
    "empty": (lambda d: edit_tensors(d, dict.clear), "no LoRA tensors"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors(name, good_adapter, tmp_path):
    src, cfg = good_adapter
    d = tmp_path / "adapter"
    shutil.copytree(src, d)
    change, pattern = ERRORS[name]
    named = change(d)
    with pytest.raises(ValueError, match=pattern) as e:
        load_peft_adapter("a", d if name != "no dir" else named, cfg, max_rank=8)
    assert str(named) in str(e.value)


def test_rank_above_max(tiny_llama, tmp_path):
    make_adapter(tiny_llama[1], tmp_path, rank_pattern={"layers.1.self_attn.o_proj": 16})
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.o_proj: rank 16 is above the limit 8 "
                                         r"\(the config field max_lora_rank") as e:
        load_peft_adapter("a", tmp_path, config_of(tiny_llama[1]), max_rank=8)
    assert str(tmp_path / "adapter_model.safetensors") in str(e.value)


@pytest.mark.parametrize("spec, want", [
    (None, {}), ("", {}), ({}, {}),
    ("a=/x/y", {"a": "/x/y"}),
    (" sql-lora = /ad/sql ,  org/b:v1.2=rel/p=q , ", {"sql-lora": "/ad/sql", "org/b:v1.2": "rel/p=q"}),
    ({"x_1": " /p "}, {"x_1": "/p"}),
])
def test_parse_lora_modules(spec, want):
    assert parse_lora_modules(spec) == want


@pytest.mark.parametrize("spec, match", [
    ("a", "not name=path"), ("a=/x,b", "not name=path"), ("=/x", "is not 1 to 128"), ("a=", "empty path"),
    ("a b=/x", "is not 1 to 128 characters"), ("../x=/x", "without '..'"), ("a=/x,a=/y", "given twice"), ({"a": 3}, "strings"), (["a=/x"], "expected"),
])
def test_parse_lora_modules_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_lora_modules(spec)


def test_host_only():
    """The loader runs without jax, torch, peft or transformers."""
    code = ("import sys, jpaged.loading.peft; "
            "print([m for m in ('jax', 'torch', 'peft', 'transformers', 'flax') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------- hostile adapters
GOOD_CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}

BAD_CONFIGS = {  # name -> (fields over GOOD_CONFIG, the field named, message pattern)
    "rank 0": ({"rank_pattern": {"q_proj": 0}}, "rank_pattern", r"\['q_proj'\] is 0, not a positive integer"),
    "alpha text": ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern", "'x', not a positive finite number"),
    "bad regex": ({"rank_pattern": {"(": 8}}, "rank_pattern", "key '\\(' is not a regular expression"),
    "slow regex": ({"rank_pattern": {"(a+)+$": 8}}, "rank_pattern", "repeats a repetition"),
    "many stars": ({"alpha_pattern": {"a.*b.*c": 8}}, "alpha_pattern", "2 repetitions"),
    "long key": ({"rank_pattern": {"q" * 300: 8}}, "rank_pattern", "above the limit of 256"),
    "many keys": ({"rank_pattern": {f"k{i}": 8 for i in range(1025)}}, "rank_pattern", "1,025 entries"),
    "pattern list": ({"rank_pattern": [8]}, "rank_pattern", "not a JSON object"),
    "layers float": ({"layers_to_transform": 1.5}, "layers_to_transform", "1.5, not a layer index"),
    "layers mixed": ({"layers_to_transform": [0, "1"]}, "layers_to_transform", "not a layer index"),
    "layers negative": ({"layers_to_transform": -1}, "layers_to_transform", "not a layer index"),
    "r float": ({"r": 8.5}, "r", "8.5, not a positive integer"),
    "r bool": ({"r": True}, "r", "True, not a positive integer"),
    "r zero": ({"r": 0}, "r", "0, not a positive integer"),
    "alpha inf": ({"lora_alpha": float("inf")}, "lora_alpha", "inf, not a positive finite number"),
    "alpha text 2": ({"lora_alpha": "16"}, "lora_alpha", "not a positive finite number"),
    "rslora": ({"use_rslora": "yes"}, "use_rslora", "not true or false"),
    "targets int": ({"target_modules": 5}, "target_modules", "not a list of names or a regex"),
    "targets bad regex": ({"target_modules": "("}, "target_modules", "not a regular expression"),
    "targets slow regex": ({"target_modules": "((.*)*)*x"}, "target_modules", "repeats a repetition"),
    "peft type": ({"peft_type": ["LORA"]}, "peft_type", "LoRA adapters only"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_config_validator(name):
    """Each malformed adapter_config.json is a ValueError naming the file and the field."""
    changes, field, pattern = BAD_CONFIGS[name]
    with pytest.raises(ValueError, match=pattern) as e:
        parse_adapter_config({**GOOD_CONFIG, **changes}, "/ad/adapter_config.json")
    assert str(e.value).startswith(f"/ad/adapter_config.json: {field}")


def test_config_validator_accepts_peft_shapes():
    config = parse_adapter_config({**GOOD_CONFIG, "rank_pattern": {"q_proj": 4, r"layers\.\d+\.mlp\.up_proj": 2},
                                   "alpha_pattern": {"v_proj": 2.5}, "layers_to_transform": 0,
                                   "use_rslora": True}, "c.json")
    assert config.module_scale("model.layers.0.self_attn.q_proj") == (4, 16 / 2)
    assert config.module_scale("model.layers.3.mlp.up_proj") == (2, 16 / 2 ** 0.5)
    assert config.module_scale("model.layers.0.self_attn.v_proj") == (8, 2.5 / 8 ** 0.5)
    assert config.layers_to_transform == {0}
    with pytest.raises(ValueError, match="^x.json: not a JSON object"):
        parse_adapter_config([GOOD_CONFIG], "x.json")


def _copy(good_adapter, tmp_path) -> pathlib.Path:
    d = tmp_path / "adapter"
    shutil.copytree(good_adapter[0], d)
    return d


def test_deep_json_is_an_error(good_adapter, tmp_path):
    """100,000-deep JSON, in adapter_config.json or in the safetensors header, is a
    ValueError naming the file (not a RecursionError)."""
    d = _copy(good_adapter, tmp_path)
    deep = b"[" * 100_000 + b"]" * 100_000
    (d / "adapter_config.json").write_bytes(deep)
    with pytest.raises(ValueError, match="adapter_config.json: the file is nested too deeply"):
        read_peft_files(d)
    shutil.copy(good_adapter[0] / "adapter_config.json", d / "adapter_config.json")
    header = b'{"a": ' + deep + b"}"
    (d / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match="adapter_model.safetensors: the safetensors header is nested too deeply"):
        read_peft_files(d)


def test_reads_are_bounded(good_adapter, tmp_path):
    """A 1 GiB adapter_config.json (sparse: nothing to read) is refused by its size, and a
    safetensors header length above the cap by that length, before either is read."""
    d = _copy(good_adapter, tmp_path)
    with open(d / "adapter_config.json", "r+b") as f:
        f.truncate(1 << 30)
    with pytest.raises(ValueError, match=f"adapter_config.json: the file is 1,073,741,824 bytes, above the limit "
                                         f"of {MAX_CONFIG_BYTES:,}"):
        read_peft_files(d)
    (d / "adapter_config.json").write_bytes(b" " * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ValueError, match="above the limit"):
        read_peft_files(d)
    shutil.copy(good_adapter[0] / "adapter_config.json", d / "adapter_config.json")
    weights = d / "adapter_model.safetensors"
    weights.write_bytes((MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match=f"safetensors header is {MAX_HEADER_BYTES + 1:,} bytes, above the limit"):
        read_peft_files(d)


def test_unreadable_paths_say_the_same(good_adapter, tmp_path):
    """A missing path, a file, an empty directory, a directory whose adapter_config.json
    is a directory or a FIFO (not opened blocking): one message, naming only the path."""
    (tmp_path / "file").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "dir_config" / "adapter_config.json").mkdir(parents=True)
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "adapter_config.json")
    for name in ("missing", "file", "empty", "dir_config", "fifo", "nul\0byte"):
        with pytest.raises(ValueError) as e:
            read_peft_files(tmp_path / name)
        assert str(e.value) == (f"{tmp_path / name}: not a readable LoRA adapter directory (one holding "
                                f"adapter_config.json and adapter_model.safetensors)")


def test_read_off_the_engine_then_fitted(good_adapter):
    """read_peft_files holds the data in memory (no memory map); load_peft_adapter fits
    it to the model without reading the directory again, as from its path."""
    src, cfg = good_adapter
    files = read_peft_files(src)
    assert isinstance(files, PeftFiles) and os.fspath(files) == str(src)
    assert all(not isinstance(t, np.memmap) and t.base is None for pair in files.pairs.values() for t in pair.values())
    from_files, from_path = (load_peft_adapter("a", p, cfg, max_rank=8) for p in (files, src))
    assert from_files.path == from_path.path and from_files.rank == from_path.rank
    for target, (a, b) in from_path.modules.items():
        np.testing.assert_array_equal(from_files.modules[target][0], a)
        np.testing.assert_array_equal(from_files.modules[target][1], b)


@pytest.mark.parametrize("name, ok", [
    ("sql", True), ("org/sql-lora:v1.2", True), ("a_b.c", True), ("x" * 128, True),
    ("", False), ("x" * 129, False), ("x" * 100_000, False), ("<|im_end|>", False), ("../x", False),
    ("a/../b", False), ("/abs", False), ("trail/", False), ("a,b", False), ("a b", False), ("tab\t", False),
    ("é", False), (None, False), (3, False),
])
def test_adapter_name_rule(name, ok):
    assert (adapter_name_error(name) is None) == ok


def _synthetic_adapter(d: pathlib.Path, config: dict, tensors: dict) -> pathlib.Path:
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, d / "adapter_model.safetensors")
    return d


def test_pattern_matching_and_tensor_names_are_bounded(tmp_path):
    """Patterns x modules matched is capped (each match is bounded by the key checks), and
    so is a tensor's name, before any regex meets it."""
    a, b = np.ones((8, 4), np.float32), np.ones((4, 8), np.float32)
    tensors = {Q.format(i, ab): t for i in range(513) for ab, t in (("A", a), ("B", b))}
    many = _synthetic_adapter(tmp_path / "many", {**GOOD_CONFIG, "rank_pattern": {f"k{i}": 8 for i in range(1024)}},
                              tensors)
    with pytest.raises(ValueError, match="513 modules against 1,024 rank_pattern and alpha_pattern keys is above "
                                         "the limit of 524,288 matches"):
        read_peft_files(many)
    long = _synthetic_adapter(tmp_path / "long", GOOD_CONFIG, {Q.replace("model.model.", "model.model." + "x" * 80)
                                                               .format(0, "A"): a})
    with pytest.raises(ValueError, match="is above the limit of 128 characters"):
        read_peft_files(long)

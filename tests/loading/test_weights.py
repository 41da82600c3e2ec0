"""Weight loading and tokenizers, checked against transformers' own loaders."""

from __future__ import annotations

import json
import pathlib
import shutil

import ml_dtypes
import numpy as np
import pytest

from jpaged.formats.gguf import gguf_metadata, read_gguf
from jpaged.models import weight_shapes
from jpaged.models.llama import HF_LAYER_NAMES, Llama
from jpaged.tokenizer.tokenizer import Tokenizer
from jpaged.loading.weights import embedded_gguf_path, load_gguf, load_hf_dir, load_weights

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _tiny_hf_model(kind: str, tmp_path: pathlib.Path, *, dtype: str = "float32",
                   shard: bool = False) -> tuple[pathlib.Path, dict[str, np.ndarray], dict]:
    """Saves a tiny random transformers model; returns (dir, expected arrays, hf config dict)."""
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        rope = {"rope_theta": 500000.0, **LLAMA3_ROPE} if kind == "llama3" else None
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False,
                                       **({"rope_parameters": rope} if rope else {}))
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # biases and norms are 0 / 1 at init: randomise so the test means something
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = model.to(getattr(torch, dtype))
    out = tmp_path / kind
    model.save_pretrained(out, max_shard_size="40KB" if shard else "10GB")

    to_np = lambda t: t.float().numpy().astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)  # noqa: E731
    sd = {k: to_np(v) for k, v in model.state_dict().items()}
    expected: dict[str, list] = {}
    for k, v in sd.items():
        if k.startswith("model.layers."):
            _, _, idx, rest = k.split(".", 3)
            ours, t = HF_LAYER_NAMES[rest]  # (the map itself is checked by the parity tests)
            expected.setdefault(ours, [None] * 2)[int(idx)] = v.T if t else v
    arrays = {k: np.stack(v) for k, v in expected.items()}
    arrays["embed"] = sd["model.embed_tokens.weight"]
    arrays["final_norm"] = sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        arrays["lm_head"] = sd["lm_head.weight"].T
    return out, arrays, json.loads((out / "config.json").read_text())


def _assert_arrays_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


# ------------------------------------------------------------------ HF dirs
@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2"])
def test_load_hf_dir_matches_state_dict(kind, tmp_path):
    path, want, hf = _tiny_hf_model(kind, tmp_path, shard=(kind == "llama"))
    if kind == "llama":
        assert (path / "model.safetensors.index.json").exists()  # the sharded code path
    cfg, arrays = load_hf_dir(path)
    _assert_arrays_equal(arrays, want)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 64, 4, 2, 16)
    assert cfg.vocab_size == 256 and cfg.intermediate_size == 128
    assert cfg.tie_word_embeddings == (kind == "qwen2")
    assert cfg.attention_bias == (kind == "qwen2")
    assert cfg.architecture == "llama"  # the family: Llama, Mistral and Qwen2 alike
    if kind == "llama3":
        assert dict(cfg.rope_scaling) == LLAMA3_ROPE and cfg.rope_theta == 500000.0
    else:
        assert cfg.rope_scaling is None
    Llama(cfg, arrays)  # shapes accepted by the model


def test_load_hf_dir_bf16(tmp_path):
    path, want, _ = _tiny_hf_model("qwen2", tmp_path, dtype="bfloat16")
    _, arrays = load_hf_dir(path, dtype="bfloat16")
    _assert_arrays_equal(arrays, want)


# ---------------------------------------------------------------- GGUF model
@pytest.fixture(scope="module")
def smollm_cache(tmp_path_factory):
    """First (converting) load of the embedded model into a fresh cache dir."""
    cache = tmp_path_factory.mktemp("jpaged-cache")
    return cache, load_weights("smollm2-135m", cache_dir=cache)


@pytest.fixture(scope="module")
def smollm_gguf(smollm_cache):
    _, lw = smollm_cache
    return lw.config, lw.arrays


def test_load_gguf_direct():
    """load_gguf itself (no cache), in bf16, agrees with the converted fp32 load's config."""
    cfg, arrays, meta = load_gguf(embedded_gguf_path(), dtype="bfloat16")
    assert meta["general.architecture"] == "llama" and cfg.num_layers == 30
    assert arrays["layers.wq"].dtype == ml_dtypes.bfloat16


def test_gguf_config(smollm_gguf):
    cfg, arrays = smollm_gguf
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.intermediate_size == 1536 and cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings and "lm_head" not in arrays
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.rope_scaling is None
    assert {k: v.shape for k, v in arrays.items()} == weight_shapes(cfg)
    assert all(v.dtype == np.float32 for v in arrays.values())


def test_gguf_weights_match_transformers(smollm_gguf):
    """Our dequantised, un-permuted weights equal transformers' GGUF tensor processing."""
    pytest.importorskip("torch")
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    cfg, arrays = smollm_gguf
    proc = LlamaTensorProcessor(config={"num_attention_heads": cfg.num_heads,
                                        "num_key_value_heads": cfg.num_kv_heads})
    reader = gguf.GGUFReader(str(embedded_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}

    # Our fast GGUF parser agrees with the gguf package's reader.
    meta, ours_tensors = read_gguf(embedded_gguf_path())
    want_meta = {k: v for k, v in gguf_metadata(reader).items() if not k.startswith("GGUF.")}
    assert meta == want_meta
    assert {n: t.tensor_type for n, t in ours_tensors.items()} == {n: t.tensor_type for n, t in tensors.items()}

    def theirs(name: str) -> np.ndarray:  # torch layout [out, in]
        t = tensors[name]
        return proc.process(weights=gguf.dequantize(t.data, t.tensor_type), name=name).weights

    np.testing.assert_allclose(arrays["embed"], theirs("token_embd.weight"), rtol=0, atol=1e-6)
    np.testing.assert_allclose(arrays["final_norm"], theirs("output_norm.weight"), rtol=0, atol=1e-6)
    ours_of = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
               "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down"}
    for layer in (0, 17, 29):
        for g, o in ours_of.items():
            np.testing.assert_allclose(arrays[f"layers.{o}"][layer], theirs(f"blk.{layer}.{g}.weight").T,
                                       rtol=0, atol=1e-6, err_msg=f"{g} layer {layer}")
        np.testing.assert_allclose(arrays["layers.attn_norm"][layer], theirs(f"blk.{layer}.attn_norm.weight"))
        np.testing.assert_allclose(arrays["layers.mlp_norm"][layer], theirs(f"blk.{layer}.ffn_norm.weight"))

    # Independent of transformers: llama.cpp's forward permutation maps our wq back to the file.
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    raw_q = gguf.dequantize(tensors["blk.3.attn_q.weight"].data, tensors["blk.3.attn_q.weight"].tensor_type)
    np.testing.assert_array_equal(permute(np.ascontiguousarray(arrays["layers.wq"][3].T), cfg.num_heads), raw_q)


# ---------------------------------------------------------------- tokenizer
TEXTS = [
    "Hello world!", "The year 2024 had 366 days; 3.14159 is pi.", "1234567890", " leading space",
    "trailing space ", "multiple   spaces\tand\ttabs", "new\nlines\n\n\nhere", "   ",
    "Unicode: café, naïve, 日本語, 한국어, emoji 🎉🚀", "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>after", "code: def f(x):\n    return x**2  # square", "I'm sure they'll've done it",
    "ALL CAPS AND lower", "email@example.com http://x.y/z?a=1&b=2", "¡Hola! ¿Qué tal?",
    "x = [1, 22, 333, 4444]", "<repo_name>jpaged<file_sep>", "\u00a0non-breaking\u2003em space", "",
]


@pytest.fixture(scope="module")
def smollm_tokenizers():
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    path = embedded_gguf_path()
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Tokenizer.from_gguf(path), theirs


def test_gguf_tokenizer_matches_transformers(smollm_tokenizers):
    ours, theirs = smollm_tokenizers
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.bos_token_id == 1 and ours.eos_token_ids == [2] and ours.pad_token_id == 2
    assert ours.vocab_size == 49152 and not ours.add_bos_token
    assert ours.decode(ours.encode("<|im_start|>hi<|im_end|>")) == "hi"  # specials skipped by default


def test_chat_template_matches_transformers(smollm_tokenizers):
    ours, theirs = smollm_tokenizers
    chats = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    ]
    for chat in chats:
        for gen in (True, False):
            want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == want


def test_tokenizer_json_roundtrip(smollm_tokenizers):
    ours, _ = smollm_tokenizers
    again = Tokenizer.from_json(ours.to_json())
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text)
    assert again.eos_token_ids == ours.eos_token_ids and again.chat_template == ours.chat_template


# ---------------------------------------------------------------- orbax cache
def test_embedded_model_cache(smollm_cache):
    tmp_path, first = smollm_cache
    second = load_weights("smollm2-135m", cache_dir=tmp_path)
    assert not first.from_cache and second.from_cache
    assert second.config == first.config
    _assert_arrays_equal(second.arrays, first.arrays)
    text = "<|im_start|>user\nTell me 42 jokes<|im_end|>"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]  # no temp dirs left


def test_corrupt_cache_is_rebuilt(tmp_path):
    path, want, _ = _tiny_hf_model("llama3", tmp_path)
    cache = tmp_path / "cache"
    load_weights(str(path), cache_dir=cache, use_cache=True, dtype="bfloat16")
    (entry,) = list(cache.iterdir())
    for f in (entry / "arrays").rglob("*"):  # damage the orbax payload
        if f.is_file():
            f.write_bytes(b"garbage")
    again = load_weights(str(path), cache_dir=cache, use_cache=True, dtype="bfloat16")
    assert not again.from_cache and again.cache_note.startswith("cache entry damaged (arrays/")
    _assert_arrays_equal(again.arrays, {k: v.astype(ml_dtypes.bfloat16) for k, v in want.items()})
    third = load_weights(str(path), cache_dir=cache, use_cache=True, dtype="bfloat16")
    assert third.from_cache and third.cache_note == ""
    assert third.config.rope_scaling == again.config.rope_scaling
    shutil.rmtree(entry / "arrays")  # a missing payload is also rebuilt
    assert not load_weights(str(path), cache_dir=cache, use_cache=True, dtype="bfloat16").from_cache


def test_loader_tells_the_model_and_its_format_as_the_config_check_does(tmp_path):
    """load_weights asks jpaged.core.config (model_path, auto_load_format), as validate_config does."""
    from jpaged.core.config import ConfigError
    from jpaged.loading.weights import _resolve_format
    with pytest.raises(ConfigError, match=r"^model: '/no/such/model' is neither 'smollm2-135m' nor an existing"):
        load_weights("/no/such/model")
    (tmp_path / "config.json").write_text("{}")
    assert _resolve_format(str(tmp_path), "auto") == ("hf", tmp_path)
    assert _resolve_format(str(tmp_path / "config.json"), "dummy") == ("dummy", tmp_path / "config.json")
    odd = tmp_path / "m.bin"
    odd.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="cannot tell the format of .*; pass load_format"):
        _resolve_format(str(odd), "auto")
    assert _resolve_format(str(odd), "gguf") == ("gguf", odd)
    with pytest.raises(ValueError, match="load_format must be auto, gguf, hf or dummy"):
        _resolve_format(str(odd), "safetensors")

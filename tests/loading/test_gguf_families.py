"""GGUF reading of Qwen3, Gemma 2 and Gemma 3, checked against an independent reader.

No real GGUF of these families is available offline, so each test writes one from
a tiny random checkpoint (tests/conftest.py) the way llama.cpp's
convert_hf_to_gguf.py does for that architecture: its `{arch}.*` metadata keys, a
minimal tokenizer, and F32 tensors under llama.cpp's names in torch [out, in]
layout (no Q/K row permutation for these architectures; Gemma's norm weights with
the 1 of `x * (1 + w)` added in).  Then:

* transformers' own GGUF loader reads the file back to the original state dict
  (so the writer follows the format as an independent reader understands it);
* jpaged's `load_gguf` reads it to exactly the arrays `load_hf_dir` reads from
  the original checkpoint, and to the same config, except for what GGUF does not
  store and llama.cpp hard-codes (asserted as `gemma.config_from_gguf` documents).

The name map and metadata below are written out from llama.cpp's conventions, not
taken from jpaged's GGUF_* maps, so that the test does not merely mirror them.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

from helpers import import_torch, tiny_gguf_writer
from jpaged.core.model_config import FULL, SLIDING
from jpaged.models import gemma
from jpaged.loading.weights import load_gguf, load_hf_dir

KINDS = ("qwen3", "gemma2", "gemma3")
GEMMA = ("gemma2", "gemma3")

# HF parameter name after "model.layers.N." -> llama.cpp tensor name after "blk.N."
# (gguf-py's tensor_mapping.py, as convert_hf_to_gguf applies it).
_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
BLOCK_NAMES = {
    # Llama-style block: the norm after attention is the one before the MLP.
    "qwen3": {**_BLOCK, "post_attention_layernorm.weight": "ffn_norm.weight"},
    # Gemma: a norm before and after each of attention and MLP.
    **dict.fromkeys(GEMMA, {**_BLOCK,
                            "post_attention_layernorm.weight": "post_attention_norm.weight",
                            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                            "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}),
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}

# Gemma norms go through a float32 (w + 1) - 1 round trip, which may lose the last bit.
ATOL = 1e-6


def _gguf_name(hf_name: str, kind: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    model, layers, idx, rest = hf_name.split(".", 3)
    assert (model, layers) == ("model", "layers"), hf_name
    return f"blk.{idx}.{BLOCK_NAMES[kind][rest]}"


def _write_gguf(kind: str, model, path: pathlib.Path) -> None:
    """`model` (a transformers CausalLM) as an F32 GGUF the way convert_hf_to_gguf writes it."""
    import gguf

    c = model.config
    w = tiny_gguf_writer(path, kind, c)  # the architecture strings are the kind names
    w.add_name(f"tiny-{kind}")
    rope = c.rope_parameters
    if kind == "gemma3":  # per layer type (transformers 5): the base is the global layers'
        w.add_rope_freq_base(rope[FULL]["rope_theta"])
        w.add_rope_freq_base_swa(rope[SLIDING]["rope_theta"])  # llama.cpp ignores it for gemma3 (10000)
        if rope[FULL].get("rope_type") == "linear":  # only the global layers are scaled
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope[FULL]["factor"])
    elif kind == "qwen3":
        w.add_rope_freq_base(rope["rope_theta"])
    # Gemma2Model.set_gguf_parameters writes no rope.freq_base: llama.cpp's default 10000 applies.
    if kind in GEMMA:
        w.add_sliding_window(c.sliding_window)
    if kind == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)

    # A minimal tokenizer: what llama.cpp and transformers need to know the vocabulary.
    tokens = ["<pad>", "<bos>", "<eos>"] + [f"<t{i}>" for i in range(3, c.vocab_size)]
    if kind == "qwen3":  # byte-level BPE
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_merges(["<t 3>"])
    else:  # SentencePiece
        w.add_tokenizer_model("llama")
        w.add_token_scores([0.0] * len(tokens))
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)

    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # tied: llama.cpp writes no output.weight
        gname = _gguf_name(name, kind)
        arr = t.detach().float().numpy().copy()
        if kind in GEMMA and gname.endswith("norm.weight"):
            arr += np.float32(1.0)  # convert_hf_to_gguf: `data_torch + 1` for every *norm.weight
        w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=KINDS)
def case(request, tmp_path_factory):
    """(kind, HF checkpoint dir, HF model, GGUF path) for each family."""
    kind = request.param
    ckpt, model = request.getfixturevalue(f"tiny_{kind}")
    path = tmp_path_factory.mktemp(f"gguf-{kind}") / f"tiny-{kind}-f32.gguf"
    _write_gguf(kind, model, path)
    return kind, pathlib.Path(ckpt), model, path


# ---------------------------------------------------------------- the writer, by transformers
def test_transformers_reads_the_file_back(case):
    """transformers' GGUF loader recovers the original state dict and config from the file."""
    torch = import_torch()
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    kind, _, model, path = case
    c = model.config

    # Metadata: every config field transformers maps from the file equals the original.
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    want = {"model_type": c.model_type, "max_position_embeddings": c.max_position_embeddings,
            "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "vocab_size": c.vocab_size,
            "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
            "tie_word_embeddings": c.tie_word_embeddings}
    if kind in GEMMA:
        want.update(head_dim=c.head_dim, sliding_window=c.sliding_window)
    assert {k: parsed[k] for k in want} == want
    assert parsed["rms_norm_eps"] == pytest.approx(c.rms_norm_eps, rel=1e-6)  # stored as float32
    if kind == "gemma2":
        assert "rope_theta" not in parsed  # the converter writes none for Gemma 2
    else:
        assert parsed["rope_theta"] == c.rope_parameters.get(FULL, c.rope_parameters)["rope_theta"]

    # Tensors: the whole model, loaded from the GGUF alone.  transformers' GGUF config map
    # for qwen3 has no attention.key_length (only qwen3_moe's does), so it would build
    # Qwen3Config's default head_dim (128) instead of 32: pass head_dim for that one.
    # The soft caps and Gemma 3's rope scaling are not mapped either, but they shape
    # no weight.
    extra = {"head_dim": c.head_dim} if kind == "qwen3" else {}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **extra)
    assert type(loaded) is type(model)
    got, ref = loaded.state_dict(), model.state_dict()
    assert set(got) == set(ref)
    for name, t in ref.items():
        np.testing.assert_allclose(got[name].numpy(), t.numpy(), rtol=0,
                                   atol=ATOL if "norm" in name and kind in GEMMA else 0, err_msg=name)


# ---------------------------------------------------------------- jpaged's reader
@pytest.fixture(scope="module")
def loaded(case):
    """(kind, jpaged GGUF load, jpaged HF-dir load, GGUF metadata, HF model)."""
    kind, ckpt, model, path = case
    gguf_cfg, gguf_arrays, meta = load_gguf(path)
    hf_cfg, hf_arrays = load_hf_dir(ckpt)
    return kind, (gguf_cfg, gguf_arrays), (hf_cfg, hf_arrays), meta, model


def test_gguf_arrays_equal_hf_dir(loaded):
    kind, (_, got), (_, want), _, _ = loaded
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == np.float32 and g.shape == w.shape, name
        if kind in GEMMA and name.endswith("norm"):  # stored as w + 1 (about 2), read back as (w + 1) - 1
            np.testing.assert_allclose(g, w, rtol=0, atol=ATOL, err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)
    # Tied families have no lm_head; Qwen3's is its own matrix.
    assert ("lm_head" in got) == (kind == "qwen3")


# What GGUF does not store, as gemma.config_from_gguf documents llama.cpp's fixed values.
def _not_in_gguf(kind: str, hf_cfg) -> dict:
    if kind == "qwen3":
        return {}
    # The softmax scale is head_dim ** -0.5 (hidden / heads only for the 46-layer Gemma 2 27B);
    # the tiny checkpoints say otherwise (gemma2: 24; gemma3: HF's default 256).
    out = {"query_pre_attn_scalar": hf_cfg.head_dim}
    if kind == "gemma3":
        # llama.cpp: one global layer every 6th; the tiny model has one every 3rd.
        out["layer_types"] = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(hf_cfg.num_layers))
        out["rope_local_theta"] = 10000.0
    return out


def test_gguf_config_equals_hf_dir(loaded):
    kind, (got, _), (want, _), meta, _ = loaded
    assert meta["general.architecture"] == kind
    fixed = _not_in_gguf(kind, want)
    # Spell out the fields that matter, so a failure names them, then compare the rest.
    assert (got.architecture, got.qk_norm) == ({"qwen3": "qwen3"}.get(kind, "gemma"), kind != "gemma2")
    assert (got.vocab_size, got.hidden_size, got.intermediate_size, got.num_layers) == (256, 64, 128, want.num_layers)
    assert (got.num_heads, got.num_kv_heads, got.head_dim) == (4, 2, want.head_dim)
    if kind == "qwen3":  # head_dim comes from attention.key_length, not hidden / heads
        assert got.head_dim == 32 != got.hidden_size // got.num_heads
    assert got.rms_norm_eps == want.rms_norm_eps == 1e-6
    assert got.rope_theta == want.rope_theta
    assert got.rope_scaling == want.rope_scaling
    assert got.sliding_window == want.sliding_window
    assert (got.attn_logit_softcap, got.final_logit_softcap) == (want.attn_logit_softcap, want.final_logit_softcap)
    assert got.tie_word_embeddings == want.tie_word_embeddings == (kind != "qwen3")
    assert got.max_position_embeddings == want.max_position_embeddings == 512
    assert dataclasses.asdict(got) == {**dataclasses.asdict(want), **fixed}
    if kind == "gemma2":
        assert got.layer_types == (SLIDING, FULL, SLIDING, FULL) == want.layer_types  # llama.cpp alternates too
        assert (got.query_pre_attn_scalar, want.query_pre_attn_scalar) == (16, 24)
        assert got.rope_theta == 10000.0  # llama.cpp's default: the converter writes no freq_base
    if kind == "gemma3":
        assert want.layer_types == (SLIDING, SLIDING, FULL) and got.layer_types == (SLIDING,) * 3
        assert dict(got.rope_scaling) == {"factor": 4.0, "rope_type": "linear"} and got.rope_theta == 1e6
        assert (got.query_pre_attn_scalar, want.query_pre_attn_scalar) == (16, 256)


# ---------------------------------------------------------------- llama.cpp's fixed query scale
def _gemma_meta(arch: str, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """Metadata of a full-size Gemma GGUF (no tensors needed for its config)."""
    p = f"{arch}."
    return {"general.architecture": arch, p + "context_length": 8192, p + "embedding_length": hidden,
            p + "block_count": layers, p + "feed_forward_length": 4 * hidden, p + "attention.head_count": heads,
            p + "attention.head_count_kv": kv_heads, p + "attention.key_length": head_dim,
            p + "attention.value_length": head_dim, p + "attention.layer_norm_rms_epsilon": 1e-6,
            p + "attention.sliding_window": 4096, p + "vocab_size": 256000}


def test_gemma2_27b_query_scale():
    """llama.cpp (llm_load_hparams, LLM_ARCH_GEMMA2): the 46-layer 27B scales queries by
    (hidden / heads) ** -0.5 = 144 ** -0.5, as its HF config's query_pre_attn_scalar says."""
    cfg = gemma.config_from_gguf(_gemma_meta("gemma2", 46, 4608, 32, 16, 128), {"token_embd.weight"})
    assert cfg.query_pre_attn_scalar == 144 and cfg.head_dim == 128
    small = gemma.config_from_gguf(_gemma_meta("gemma2", 42, 3584, 16, 8, 256), {"token_embd.weight"})
    assert small.query_pre_attn_scalar == 256  # Gemma 2 9B: head_dim


def test_gemma3_27b_query_scale():
    """llama.cpp (LLM_ARCH_GEMMA3): n_layer 62 is the 27B, whose queries scale by
    (5376 / 32) ** -0.5 = 168 ** -0.5, not head_dim (128) ** -0.5."""
    cfg = gemma.config_from_gguf(_gemma_meta("gemma3", 62, 5376, 32, 16, 128), {"token_embd.weight"})
    assert cfg.query_pre_attn_scalar == 168


def test_gemma_gguf_without_optional_keys():
    """What llama.cpp assumes when keys are absent: no window key -> every layer
    global; Gemma 2 without cap keys -> caps 50 and 30."""
    meta = _gemma_meta("gemma2", 42, 3584, 16, 8, 256)
    del meta["gemma2.attention.sliding_window"]
    cfg = gemma.config_from_gguf(meta, {"token_embd.weight"})
    assert cfg.sliding_window is None and cfg.layer_window(0) is None
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)

"""Gemma 2 and Gemma 3 (text): sliding-window layers interleaved with global ones.

Against the Llama block: RMSNorms scale by (1 + w) and wrap both the attention
and the MLP (a norm before and after each); the embedding is scaled by
sqrt(hidden_size); the MLP is GeGLU (tanh GeLU); the softmax scale comes from
query_pre_attn_scalar; embeddings are tied.  Gemma 2 soft-caps attention
scores and the final logits and alternates sliding and global layers; Gemma 3
drops the caps, normalises each q/k head, puts one global layer after every
five sliding ones and gives sliding layers their own RoPE base.

Sliding layers only read the last `sliding_window` keys (the kernels skip the
blocks before).  With the hybrid KV layout (kv_layout=auto, the default) they
keep their K/V in block tables of their own, which give back the blocks
behind the window (jpaged.core.kv_layout); with kv_layout=shared every layer
keeps its K/V for the whole sequence.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.formats.gguf import gguf_base_config
from jpaged.core.model_config import FULL, SLIDING, ModelConfig, hf_rope
from jpaged.models import llama
from jpaged.models.base import Decoder, StepMetadata, apply_rope, paged_attention
from pallas_kernels import Backend

HF_LAYER_NAMES = {
    "input_layernorm.weight": ("layers.attn_norm", False),
    "post_attention_layernorm.weight": ("layers.post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("layers.mlp_norm", False),
    "post_feedforward_layernorm.weight": ("layers.post_mlp_norm", False),
    "self_attn.q_norm.weight": ("layers.q_norm", False),
    "self_attn.k_norm.weight": ("layers.k_norm", False),
    **{k: v for k, v in llama.HF_LAYER_NAMES.items() if k.startswith(("self_attn.", "mlp."))},
}
HF_GLOBAL_NAMES = llama.HF_GLOBAL_NAMES
GGUF_LAYER_NAMES = {
    **llama.GGUF_LAYER_NAMES,
    "post_attention_norm.weight": ("layers.post_attn_norm", False),
    "post_ffw_norm.weight": ("layers.post_mlp_norm", False),
    "attn_q_norm.weight": ("layers.q_norm", False),
    "attn_k_norm.weight": ("layers.k_norm", False),
}
GGUF_GLOBAL_NAMES = llama.GGUF_GLOBAL_NAMES
GEMMA3_SLIDING_PATTERN = 6  # every 6th layer is global (HF's default, llama.cpp's fixed value)


def _layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json of model_type gemma2 or gemma3_text."""
    gemma3 = hf.get("model_type") == "gemma3_text"
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with bidirectional attention (an encoder) is not a decoder jpaged runs")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma with hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:  # per layer type (transformers 5)
        rope_theta, rope_scaling = hf_rope({"rope_parameters": params[FULL]})
        local_theta, local_scaling = hf_rope({"rope_parameters": params.get(SLIDING, params[FULL])})
        if local_scaling is not None:
            raise ValueError("RoPE scaling on Gemma's sliding-window layers is not supported")
    else:
        rope_theta, rope_scaling = hf_rope(hf)
        local_theta = hf.get("rope_local_base_freq", 10000.0) if gemma3 else None
    num_layers, num_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    layer_types = hf.get("layer_types") or _layer_types(
        num_layers, (hf.get("sliding_window_pattern") or GEMMA3_SLIDING_PATTERN) if gemma3 else 2)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads, head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope_theta, rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=bool(hf.get("attention_bias", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 8192), architecture="gemma",
        qk_norm=gemma3, sliding_window=hf.get("sliding_window"), layer_types=tuple(layer_types),
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar") or head_dim,
        rope_local_theta=float(local_theta) if local_theta is not None else None,
        hidden_act="gelu_tanh",
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str],
                     rope_freqs: np.ndarray | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata of architecture gemma2 or gemma3.  What
    llama.cpp hard-codes rather than stores is filled in as llama.cpp does: the
    layer pattern (Gemma 2 alternates, Gemma 3 puts a global layer every 6th;
    no window key: every layer global), Gemma 3's local RoPE base (10000),
    Gemma 2's caps when absent (50 and 30) and the query scale (head_dim, but
    hidden_size / heads for the 27B models: 46-layer Gemma 2, 62-layer Gemma 3)."""
    arch = meta["general.architecture"]
    base = gguf_base_config(meta, tensor_names, rope_freqs)
    g = lambda key: meta.get(f"{arch}.{key}")  # noqa: E731
    gemma3 = arch == "gemma3"
    is_27b = (arch, base["num_layers"]) in {("gemma2", 46), ("gemma3", 62)}
    pre_attn = base["hidden_size"] / base["num_heads"] if is_27b else base["head_dim"]
    window = g("attention.sliding_window")
    caps = (None, None) if gemma3 else (g("attn_logit_softcapping") or 50.0, g("final_logit_softcapping") or 30.0)
    return ModelConfig(
        **base, architecture="gemma", qk_norm=gemma3, sliding_window=int(window) if window else None,
        layer_types=_layer_types(base["num_layers"], GEMMA3_SLIDING_PATTERN if gemma3 else 2),
        attn_logit_softcap=caps[0], final_logit_softcap=caps[1],
        query_pre_attn_scalar=pre_attn, rope_local_theta=10000.0 if gemma3 else None,
        hidden_act="gelu_tanh")


def from_gguf_tensor(ours: str, w: np.ndarray, cfg: ModelConfig, gguf_arch: str) -> np.ndarray:
    """llama.cpp stores Gemma's norm weights with the 1 of (1 + w) added in."""
    return w - 1.0 if ours.endswith("norm") else w


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    L, d = cfg.num_layers, cfg.hidden_size
    shapes = {**llama.weight_shapes(cfg), "layers.post_attn_norm": (L, d), "layers.post_mlp_norm": (L, d)}
    if cfg.qk_norm:
        shapes.update({"layers.q_norm": (L, cfg.head_dim), "layers.k_norm": (L, cfg.head_dim)})
    return shapes


class Gemma(Decoder):
    norm_offset = 1.0

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        embed = self.embed[...]
        return embed[tokens] * jnp.asarray(self.cfg.hidden_size ** 0.5, embed.dtype)

    def layer(self, h: jax.Array, w: dict[str, jax.Array], layer: jax.Array | int, kv_pool: jax.Array,
              meta: StepMetadata, rope: tuple[jax.Array, jax.Array], backend: Backend
              ) -> tuple[jax.Array, jax.Array]:
        cfg, T = self.cfg, h.shape[0]
        norm = lambda x, name: self.norm(x, w[name])  # noqa: E731
        x = norm(h, "attn_norm")
        q, k, v = self.project_qkv(x, w)
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)
        k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = norm(q, "q_norm"), norm(k, "k_norm")
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        attn, kv_pool = paged_attention(cfg, q, k, v, layer, self.window(layer), kv_pool, meta, backend)
        h = h + norm(self.linear(attn.astype(h.dtype), w, "wo"), "post_attn_norm")
        x = norm(h, "mlp_norm")
        gate, up = self.linears(x, w, "w_gate_up")
        mlp = self.linear(jax.nn.gelu(gate, approximate=True) * up, w, "w_down")
        return h + norm(mlp, "post_mlp_norm"), kv_pool


Model = Gemma


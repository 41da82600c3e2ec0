"""The Llama family: Llama 2/3, Mistral, Qwen2, SmolLM2.

Pre-norm blocks (RMSNorm, attention with GQA and RoPE, RMSNorm, SwiGLU MLP);
Qwen2 adds biases to q, k and v; Llama 3 scales RoPE; Mistral 7B v0.1 slides a
4096-token window over every layer.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jpaged.formats.gguf import gguf_base_config, unpermute_qk
from jpaged.core.model_config import ModelConfig, hf_rope
from jpaged.models.base import Decoder, StepMetadata, apply_rope, paged_attention
from pallas_kernels import Backend

# Hugging Face name (after "model.layers.N.") -> (our name, transpose?)
HF_LAYER_NAMES = {
    "input_layernorm.weight": ("layers.attn_norm", False),
    "post_attention_layernorm.weight": ("layers.mlp_norm", False),
    "self_attn.q_proj.weight": ("layers.wq", True),
    "self_attn.k_proj.weight": ("layers.wk", True),
    "self_attn.v_proj.weight": ("layers.wv", True),
    "self_attn.o_proj.weight": ("layers.wo", True),
    "mlp.gate_proj.weight": ("layers.w_gate", True),
    "mlp.up_proj.weight": ("layers.w_up", True),
    "mlp.down_proj.weight": ("layers.w_down", True),
    "self_attn.q_proj.bias": ("layers.bq", False),
    "self_attn.k_proj.bias": ("layers.bk", False),
    "self_attn.v_proj.bias": ("layers.bv", False),
}
HF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
# llama.cpp name (after "blk.N.") -> (our name, transpose?)
GGUF_LAYER_NAMES = {
    "attn_norm.weight": ("layers.attn_norm", False),
    "ffn_norm.weight": ("layers.mlp_norm", False),
    "attn_q.weight": ("layers.wq", True),
    "attn_k.weight": ("layers.wk", True),
    "attn_v.weight": ("layers.wv", True),
    "attn_output.weight": ("layers.wo", True),
    "ffn_gate.weight": ("layers.w_gate", True),
    "ffn_up.weight": ("layers.w_up", True),
    "ffn_down.weight": ("layers.w_down", True),
    "attn_q.bias": ("layers.bq", False),
    "attn_k.bias": ("layers.bk", False),
    "attn_v.bias": ("layers.bv", False),
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": ("embed", False),
    "output_norm.weight": ("final_norm", False),
    "output.weight": ("lm_head", True),
}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a Hugging Face `config.json` of model_type llama, mistral or qwen2."""
    model_type = hf.get("model_type", "llama")
    if hf.get("use_sliding_window"):  # Qwen2's optional window over only some layers
        raise ValueError(f"{model_type} with use_sliding_window is not supported")
    num_heads = hf["num_attention_heads"]
    rope_theta, rope_scaling = hf_rope(hf)
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        architecture="llama",
        sliding_window=hf.get("sliding_window") if model_type == "mistral" else None,
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str],
                     rope_freqs: np.ndarray | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata of architecture llama or qwen2."""
    return ModelConfig(**gguf_base_config(meta, tensor_names, rope_freqs), architecture="llama",
                       attention_bias="blk.0.attn_q.bias" in tensor_names)


def from_gguf_tensor(ours: str, w: np.ndarray, cfg: ModelConfig, gguf_arch: str) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (llama GGUFs; qwen2 ones are stored as in HF)."""
    if gguf_arch == "llama" and ours in ("layers.wq", "layers.bq"):
        return unpermute_qk(w, cfg.num_heads)
    if gguf_arch == "llama" and ours in ("layers.wk", "layers.bk"):
        return unpermute_qk(w, cfg.num_kv_heads)
    return w


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every weight; loaders produce exactly these arrays.
    `layers.*` carry a leading num_layers axis."""
    L, d, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "embed": (cfg.vocab_size, d),
        "final_norm": (d,),
        "layers.attn_norm": (L, d),
        "layers.wq": (L, d, q),
        "layers.wk": (L, d, kv),
        "layers.wv": (L, d, kv),
        "layers.wo": (L, q, d),
        "layers.mlp_norm": (L, d),
        "layers.w_gate": (L, d, f),
        "layers.w_up": (L, d, f),
        "layers.w_down": (L, f, d),
    }
    if cfg.attention_bias:
        shapes.update({"layers.bq": (L, q), "layers.bk": (L, kv), "layers.bv": (L, kv)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes


class Llama(Decoder):
    """Decoder-only Llama-family transformer over one flat ragged batch of tokens."""

    def qkv(self, x: jax.Array, w: dict[str, jax.Array], rope: tuple[jax.Array, jax.Array]
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Projects x [T, d] to q [T, heads, hd] and k, v [T, kv_heads, hd], RoPE applied."""
        cfg, T = self.cfg, x.shape[0]
        q, k, v = self.project_qkv(x, w)
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)
        k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.norm_heads(q, k, w)
        return apply_rope(q, *rope), apply_rope(k, *rope), v.reshape(T, cfg.num_kv_heads, cfg.head_dim)

    def norm_heads(self, q: jax.Array, k: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        return q, k  # Qwen3 normalises each head here

    def layer(self, h: jax.Array, w: dict[str, jax.Array], layer: jax.Array | int, kv_pool: jax.Array,
              meta: StepMetadata, rope: tuple[jax.Array, jax.Array], backend: Backend
              ) -> tuple[jax.Array, jax.Array]:
        q, k, v = self.qkv(self.norm(h, w["attn_norm"]), w, rope)
        attn, kv_pool = paged_attention(self.cfg, q, k, v, layer, self.window(layer), kv_pool, meta, backend)
        h = h + self.linear(attn.astype(h.dtype), w, "wo")
        h = h + self.mlp(self.norm(h, w["mlp_norm"]), w)
        return h, kv_pool

    def mlp(self, x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
        """The SwiGLU MLP of x [T, d] (the MoE families route some layers to experts here)."""
        gate, up = self.linears(x, w, "w_gate_up")
        return self.linear(jax.nn.silu(gate) * up, w, "w_down")


Model = Llama

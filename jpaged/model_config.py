"""A Llama-family architecture as plain data: its config, the names and shapes
of its weights and its RoPE frequencies.  No jax here, so that loaders, sizing
and host-side code can describe a model without importing the device stack."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (the fields of a HF config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen dict items
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k and v projections
    max_position_embeddings: int = 4096
    architecture: str = "llama"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Builds a config from a Hugging Face `config.json` dictionary."""
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"unsupported model_type {model_type!r} (architectures {archs}); "
                             "jpaged supports llama, qwen2 and mistral")
        num_heads = hf["num_attention_heads"]
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind not in ("llama3", "linear"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}")
            if scaling is not None:
                scaling["rope_type"] = kind
                scaling.pop("type", None)
                scaling.pop("rope_theta", None)
        rope_theta = hf.get("rope_theta")
        if rope_theta is None and isinstance(hf.get("rope_parameters"), dict):
            rope_theta = hf["rope_parameters"].get("rope_theta")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            architecture=model_type,
        )


# Names and shapes of every weight; loaders produce exactly these arrays
# (numpy, float32 or the target dtype).  `layers.*` carry a leading num_layers
# axis (the model keeps one array per layer; loaders stack for simplicity).
def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
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


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies, with Llama 3 / linear scaling applied as in HF."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if cfg.rope_scaling is None:
        return inv_freq.astype(np.float32)
    s = dict(cfg.rope_scaling)
    if s["rope_type"] == "linear":
        return (inv_freq / s["factor"]).astype(np.float32)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)

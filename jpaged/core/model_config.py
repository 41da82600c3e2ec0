"""A decoder's architecture as plain data: its config and its RoPE frequencies.

One dataclass for every family (`jpaged.models`): the Llama fields plus the
optional features other families switch on (q/k norms, sliding windows, soft
caps).  Each family parses its own config.json / GGUF metadata into it and
names its own weights.  No jax here, so that sizing and host code can describe
a model without importing the device stack."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types values


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (the fields of a HF config.json)."""

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
    architecture: str = "llama"   # the family in jpaged.models that runs it
    # Features of other families (off for Llama):
    qk_norm: bool = False                       # RMSNorm on each head of q and k (Qwen3, Gemma 3)
    sliding_window: int | None = None           # keys a sliding-window layer sees (itself included)
    layer_types: tuple[str, ...] | None = None  # SLIDING or FULL per layer; None: every layer
    #                                             sliding if sliding_window is set, else full
    attn_logit_softcap: float | None = None     # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None    # the same on the output logits (Gemma 2)
    query_pre_attn_scalar: float | None = None  # softmax scale is its -1/2 power (default head_dim)
    rope_local_theta: float | None = None       # RoPE base of sliding layers (Gemma 3)
    hidden_act: str = "silu"                    # silu | gelu_tanh (the gated MLP's activation)
    # Mixture of experts (Qwen3-MoE, Mixtral; jpaged.layers.moe); num_experts 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0                # k: experts each token is routed to
    moe_intermediate_size: int = 0              # each expert's MLP width (intermediate_size: the dense layers')
    norm_topk_prob: bool = True                 # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] | None = None   # the layers with experts; None: every layer (when num_experts)
    expert_parallel: bool = False               # the engine's layout, not the checkpoint's: experts split whole
    #                                             over the 'model' mesh axis (enable_expert_parallel)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Inverse of dataclasses.asdict after a JSON round trip (lists back to tuples)."""
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = tuple(tuple(kv) for kv in d["rope_scaling"])
        for key in ("layer_types", "moe_layers"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**d)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None for global attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (else a dense SwiGLU MLP)."""
        return self.num_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    def mlp_layers(self, moe: bool) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts (`moe`), or dense, in order."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i) == moe)

    @property
    def sm_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


def hf_rope(hf: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, rope_scaling items) from a HF config.json, old style
    (`rope_scaling` + `rope_theta`) or new (`rope_parameters`)."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling") or params
    theta = hf.get("rope_theta")
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
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
    return float(theta or 10000.0), tuple(sorted(scaling.items())) if scaling else None


def rope_inv_freq(cfg: ModelConfig, *, local: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies, with Llama 3 / linear scaling applied as in HF.
    `local`: those of sliding-window layers (base rope_local_theta, unscaled)."""
    hd = cfg.head_dim
    theta, rope_scaling = (cfg.rope_local_theta, None) if local else (cfg.rope_theta, cfg.rope_scaling)
    inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if rope_scaling is None:
        return inv_freq.astype(np.float32)
    s = dict(rope_scaling)
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

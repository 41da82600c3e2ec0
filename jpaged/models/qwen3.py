"""Qwen3: the Llama block with an RMSNorm on each query and key head before RoPE
(and no q/k/v biases)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jpaged.core.model_config import ModelConfig
from jpaged.models import llama

HF_LAYER_NAMES = {**llama.HF_LAYER_NAMES,
                  "self_attn.q_norm.weight": ("layers.q_norm", False),
                  "self_attn.k_norm.weight": ("layers.k_norm", False)}
HF_GLOBAL_NAMES = llama.HF_GLOBAL_NAMES
GGUF_LAYER_NAMES = {**llama.GGUF_LAYER_NAMES,
                    "attn_q_norm.weight": ("layers.q_norm", False),
                    "attn_k_norm.weight": ("layers.k_norm", False)}
GGUF_GLOBAL_NAMES = llama.GGUF_GLOBAL_NAMES


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return _qwen3(llama.config_from_hf(hf))


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str],
                     rope_freqs: np.ndarray | None = None) -> ModelConfig:
    return _qwen3(llama.config_from_gguf(meta, tensor_names, rope_freqs))


def _qwen3(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, architecture="qwen3", qk_norm=True)


def from_gguf_tensor(ours: str, w: np.ndarray, cfg: ModelConfig, gguf_arch: str) -> np.ndarray:
    return w  # llama.cpp stores Qwen3's q/k rows as HF does (NeoX RoPE)


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    head = (cfg.num_layers, cfg.head_dim)
    return {**llama.weight_shapes(cfg), "layers.q_norm": head, "layers.k_norm": head}


class Qwen3(llama.Llama):
    def norm_heads(self, q: jax.Array, k: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        return self.norm(q, w["q_norm"]), self.norm(k, w["k_norm"])


Model = Qwen3

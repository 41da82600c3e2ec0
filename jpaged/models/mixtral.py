"""Mixtral (8x7B, 8x22B): the Llama block (Mistral's) with a mixture of experts in
every layer's MLP (top-2 of 8, the two softmax weights renormalised;
jpaged.models.moe_common).  llama.cpp writes Mixtral as architecture "llama"
with expert tensors (jpaged.models.GGUF_MOE_FAMILIES)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jpaged.core.model_config import ModelConfig
from jpaged.models import llama
from jpaged.models.moe_common import GGUF_MOE_NAMES, MoEMixin, gguf_moe_fields, hf_moe_names, moe_weight_shapes, \
    with_experts

# block_sparse_moe.experts.N.w1 (gate), w3 (up), w2 (down); later transformers name the block `mlp`.
HF_LAYER_NAMES = {**llama.HF_LAYER_NAMES,
                  **hf_moe_names("block_sparse_moe", "gate", "w1", "w3", "w2"),
                  **hf_moe_names("mlp", "gate", "w1", "w3", "w2")}
HF_GLOBAL_NAMES = llama.HF_GLOBAL_NAMES
GGUF_LAYER_NAMES = {**llama.GGUF_LAYER_NAMES, **GGUF_MOE_NAMES}
GGUF_GLOBAL_NAMES = llama.GGUF_GLOBAL_NAMES


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    cfg = dataclasses.replace(llama.config_from_hf(hf), architecture="mixtral",
                              sliding_window=hf.get("sliding_window"))
    return with_experts(cfg, num_experts=int(hf.get("num_local_experts", 0)),
                        top_k=int(hf.get("num_experts_per_tok", 0)),
                        moe_intermediate_size=cfg.intermediate_size, norm_topk_prob=True, moe_layers=None)


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str],
                     rope_freqs: np.ndarray | None = None) -> ModelConfig:
    cfg = dataclasses.replace(llama.config_from_gguf(meta, tensor_names, rope_freqs), architecture="mixtral")
    return with_experts(cfg, **gguf_moe_fields(meta, tensor_names, cfg.num_layers, cfg.intermediate_size))


def from_gguf_tensor(ours: str, w: np.ndarray, cfg: ModelConfig, gguf_arch: str) -> np.ndarray:
    return llama.from_gguf_tensor(ours, w, cfg, gguf_arch)  # llama.cpp's Q/K row permutation


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return moe_weight_shapes(cfg, llama.weight_shapes(cfg))


class Mixtral(MoEMixin, llama.Llama):
    pass


Model = Mixtral

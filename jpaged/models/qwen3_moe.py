"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): the Qwen3 block with a mixture of experts
as the MLP (top-k of a softmax, renormalised with `norm_topk_prob`; no shared
expert), dense MLP layers where `mlp_only_layers` and `decoder_sparse_step` put
them (jpaged.models.moe_common)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jpaged.core.model_config import ModelConfig
from jpaged.models import qwen3
from jpaged.models.moe_common import GGUF_MOE_NAMES, MoEMixin, gguf_moe_fields, hf_moe_names, moe_weight_shapes, \
    with_experts

HF_LAYER_NAMES = {**qwen3.HF_LAYER_NAMES, **hf_moe_names("mlp", "gate", "gate_proj", "up_proj", "down_proj")}
HF_GLOBAL_NAMES = qwen3.HF_GLOBAL_NAMES
GGUF_LAYER_NAMES = {**qwen3.GGUF_LAYER_NAMES, **GGUF_MOE_NAMES}
GGUF_GLOBAL_NAMES = qwen3.GGUF_GLOBAL_NAMES


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    cfg = dataclasses.replace(qwen3.config_from_hf(hf), architecture="qwen3_moe")
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    return with_experts(cfg, num_experts=num_experts, top_k=int(hf.get("num_experts_per_tok", 0)),
                        moe_intermediate_size=int(hf.get("moe_intermediate_size", 0)),
                        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                        moe_layers=_hf_moe_layers(hf, cfg.num_layers))


def _hf_moe_layers(hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Qwen3MoeDecoderLayer's rule: experts in layer i unless i is in mlp_only_layers
    or (i + 1) is not a multiple of decoder_sparse_step."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"qwen3_moe: decoder_sparse_step is {step!r}, not a positive integer")
    bad = [i for i in dense if not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"qwen3_moe: mlp_only_layers {bad} are not layers of a {num_layers}-layer model")
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str],
                     rope_freqs: np.ndarray | None = None) -> ModelConfig:
    cfg = dataclasses.replace(qwen3.config_from_gguf(meta, tensor_names, rope_freqs), architecture="qwen3_moe")
    f_moe = int(meta[f"{meta['general.architecture']}.expert_feed_forward_length"])
    return with_experts(cfg, **gguf_moe_fields(meta, tensor_names, cfg.num_layers, f_moe))


def from_gguf_tensor(ours: str, w: np.ndarray, cfg: ModelConfig, gguf_arch: str) -> np.ndarray:
    return w  # as Qwen3: llama.cpp stores the q/k rows as HF does


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return moe_weight_shapes(cfg, qwen3.weight_shapes(cfg))


class Qwen3Moe(MoEMixin, qwen3.Qwen3):
    pass


Model = Qwen3Moe

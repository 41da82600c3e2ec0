"""Model families, one file each, found by Hugging Face `model_type` or GGUF architecture.

A family file holds everything about its architecture:

    config_from_hf(hf) / config_from_gguf(meta, tensor_names, rope_freqs) -> ModelConfig
    weight_shapes(cfg)                     our weight names and shapes
    HF_LAYER_NAMES, HF_GLOBAL_NAMES        checkpoint name -> (our name, transpose?)
    GGUF_LAYER_NAMES, GGUF_GLOBAL_NAMES    the same for llama.cpp names
    from_gguf_tensor(ours, w, cfg, arch)   undoes llama.cpp's conversions of a tensor
    Model                                  the flax module (a `base.Decoder`)

`layers.*` weights are stacked over the layers that hold them
(`stacked_layers`): every layer, except in a mixture-of-experts model, where
the router and the experts (`MOE_WEIGHTS`, the experts [L, E, in, out]) stack
over its MoE layers and the dense MLP's weights over its dense layers.  A
layer name map may hold `experts.*.` for a checkpoint's per-expert names
(`experts.0.`, `experts.1.`, ...): the loaders fill that expert's slice.

This registry imports a family only when asked for it, so loading the registry
loads no jax; the family files hold flax modules and do.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from jpaged.core.model_config import ModelConfig

# family -> (HF model_types, GGUF architectures) it runs
FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llama": (("llama", "mistral", "qwen2"), ("llama", "qwen2")),
    "qwen3": (("qwen3",), ("qwen3",)),
    "gemma": (("gemma2", "gemma3_text"), ("gemma2", "gemma3")),
    "qwen3_moe": (("qwen3_moe",), ("qwen3moe",)),
    "mixtral": (("mixtral",), ()),
}
# llama.cpp writes some MoE models under a dense architecture's name, with expert
# tensors (Mixtral as "llama"): architecture -> the family that runs it then.
GGUF_MOE_FAMILIES = {"llama": "mixtral"}
GGUF_ROUTER = "ffn_gate_inp.weight"  # blk.N.<this>: layer N routes to experts

# The weights of a mixture-of-experts layer (router [L, d, E], experts [L, E, in, out])
# and of a dense MLP layer, merged or not: each stacks over its own kind of layer.
MOE_WEIGHTS = ("layers.router", "layers.experts_gate", "layers.experts_up", "layers.experts_down")
EXPERT_WEIGHTS = MOE_WEIGHTS[1:]
DENSE_MLP_WEIGHTS = ("layers.w_gate", "layers.w_up", "layers.w_down", "layers.w_gate_up")


def family(name: str) -> ModuleType:
    """The family module `jpaged.models.<name>` (a ModelConfig's `architecture`)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; jpaged has {sorted(FAMILIES)}")
    return importlib.import_module(f"jpaged.models.{name}")


def _family_of(key: str, which: int, what: str) -> ModuleType:
    for name, keys in FAMILIES.items():
        if key in keys[which]:
            return family(name)
    supported = sorted(k for keys in FAMILIES.values() for k in keys[which])
    raise ValueError(f"unsupported {what} {key!r}; jpaged supports {', '.join(supported)}")


def hf_family(model_type: str) -> ModuleType:
    return _family_of(model_type, 0, "model_type")


def gguf_family(architecture: str, tensor_names: Any = ()) -> ModuleType:
    """The family of a GGUF file of `architecture` holding `tensor_names`."""
    if architecture in GGUF_MOE_FAMILIES and any(n.endswith(GGUF_ROUTER) for n in tensor_names):
        return family(GGUF_MOE_FAMILIES[architecture])
    return _family_of(architecture, 1, "GGUF architecture")


def stacked_layers(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The layers whose weights the `layers.*` array `name` stacks, in order (its leading axis)."""
    if name in MOE_WEIGHTS:
        return cfg.mlp_layers(moe=True)
    if name in DENSE_MLP_WEIGHTS and cfg.num_experts:
        return cfg.mlp_layers(moe=False)
    return tuple(range(cfg.num_layers))


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a Hugging Face `config.json` dictionary, by its model_type."""
    return hf_family(hf.get("model_type", "llama")).config_from_hf(hf)


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return family(cfg.architecture).weight_shapes(cfg)


def build_model(cfg: ModelConfig, arrays: dict[str, Any], dtype: Any, scan_layers: bool = False,
                batch_invariant: bool = False, merge_projections: bool = False,
                tensor_parallel_size: int = 1, matmul_impl: str = "xla") -> Any:
    """The family's flax module holding `arrays` (named as its weight_shapes) in dtype
    (`scan_layers`, `batch_invariant`: see jpaged.models.base.Decoder).  With
    `merge_projections` its params tree holds wqkv (bqkv) and w_gate_up in place of
    wq/wk/wv (bq/bk/bv) and w_gate/w_up, laid out for `tensor_parallel_size`
    column shards (jpaged.models.merged); without it, the separate arrays.  `matmul_impl`
    "cpu": steps of few tokens multiply by the C++ skinny kernel (jpaged.layers.skinny_matmul)."""
    return family(cfg.architecture).Model(cfg, arrays, dtype, scan_layers=scan_layers,
                                          batch_invariant=batch_invariant, merge_projections=merge_projections,
                                          tensor_parallel_size=tensor_parallel_size, matmul_impl=matmul_impl)

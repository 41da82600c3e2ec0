"""What the mixture-of-experts families (qwen3_moe, mixtral) share: their config
fields, expert weights and names, and the block's MLP, routed to experts
(jpaged.layers.moe) in MoE layers and dense in the others.

Weights (see jpaged.models.stacked_layers): `layers.router` [L_moe, d, E] and
the experts `layers.experts_gate` / `experts_up` [L_moe, E, d, f_moe] and
`experts_down` [L_moe, E, f_moe, d], stacked over the MoE layers; a dense
layer's `w_gate` / `w_up` / `w_down` stacked over the dense layers, present
only where the model has some (Qwen3-MoE's `mlp_only_layers`,
`decoder_sparse_step`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jpaged.core.model_config import ModelConfig
from jpaged.layers import skinny_matmul
from jpaged.layers.moe import moe_mlp, route, skinny_swiglu_experts
from jpaged.models import GGUF_ROUTER

# llama.cpp's stacked expert tensors (after "blk.N."): [E, out, in] each, transposed per expert.
GGUF_MOE_NAMES = {
    GGUF_ROUTER: ("layers.router", True),
    "ffn_gate_exps.weight": ("layers.experts_gate", True),
    "ffn_up_exps.weight": ("layers.experts_up", True),
    "ffn_down_exps.weight": ("layers.experts_down", True),
}


def hf_moe_names(block: str, router: str, gate: str, up: str, down: str) -> dict[str, tuple[str, bool]]:
    """A HF checkpoint's per-expert names (after "model.layers.N."), `block` the MoE module."""
    return {f"{block}.{router}.weight": ("layers.router", True),
            f"{block}.experts.*.{gate}.weight": ("layers.experts_gate", True),
            f"{block}.experts.*.{up}.weight": ("layers.experts_up", True),
            f"{block}.experts.*.{down}.weight": ("layers.experts_down", True)}


def with_experts(cfg: ModelConfig, *, num_experts: int, top_k: int, moe_intermediate_size: int,
                 norm_topk_prob: bool, moe_layers: tuple[int, ...] | None) -> ModelConfig:
    """`cfg` with its experts; ValueError for settings jpaged cannot run."""
    if num_experts < 1:
        raise ValueError(f"{cfg.architecture}: num_experts is {num_experts}; a MoE model needs at least one")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{cfg.architecture}: num_experts_per_tok is {top_k}, not in 1..{num_experts}")
    if moe_intermediate_size < 1:
        raise ValueError(f"{cfg.architecture}: the experts' intermediate size is {moe_intermediate_size}")
    if moe_layers is not None:
        moe_layers = tuple(sorted(moe_layers))
        if moe_layers == tuple(range(cfg.num_layers)):
            moe_layers = None  # every layer: the common case, kept simple
        elif not moe_layers:
            raise ValueError(f"{cfg.architecture}: no layer has experts (mlp_only_layers / "
                             "decoder_sparse_step leave none); load it as the dense family")
    return dataclasses.replace(cfg, num_experts=num_experts, num_experts_per_tok=top_k,
                               moe_intermediate_size=moe_intermediate_size, norm_topk_prob=norm_topk_prob,
                               moe_layers=moe_layers)


def gguf_moe_fields(meta: dict[str, Any], tensor_names: set[str], num_layers: int,
                    moe_intermediate_size: int) -> dict[str, Any]:
    """with_experts' arguments from GGUF metadata: the MoE layers are those with a router tensor."""
    arch = meta["general.architecture"]
    return dict(num_experts=int(meta[f"{arch}.expert_count"]), top_k=int(meta[f"{arch}.expert_used_count"]),
                moe_intermediate_size=moe_intermediate_size,
                norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)),
                moe_layers=tuple(i for i in range(num_layers) if f"blk.{i}.{GGUF_ROUTER}" in tensor_names))


def moe_weight_shapes(cfg: ModelConfig, dense: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A dense family's weight shapes `dense` with the MLP weights stacked over the
    dense layers only (dropped where there are none) and the experts added."""
    d, f, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    n_dense, n_moe = len(cfg.mlp_layers(moe=False)), len(cfg.mlp_layers(moe=True))
    shapes = {}
    for name, shape in dense.items():
        if name in ("layers.w_gate", "layers.w_up", "layers.w_down"):
            if n_dense:
                shapes[name] = (n_dense, *shape[1:])
        else:
            shapes[name] = shape
    shapes.update({"layers.router": (n_moe, d, E), "layers.experts_gate": (n_moe, E, d, f),
                   "layers.experts_up": (n_moe, E, d, f), "layers.experts_down": (n_moe, E, f, d)})
    return shapes


class MoEMixin:
    """Routes the MLP of a MoE layer (one holding a router) through the experts;
    put before a dense family's Decoder class in the bases."""

    def __init__(self, cfg: ModelConfig, *args: Any, batch_invariant: bool = False, **kwargs: Any):
        if batch_invariant:
            raise ValueError(f"batch_invariant is not supported for {cfg.architecture} (mixture of experts): "
                             "the grouped matmuls (jax.lax.ragged_dot) have no batch-invariant kernel, so a "
                             "token's result could depend on how many rows its experts get")
        super().__init__(cfg, *args, batch_invariant=batch_invariant, **kwargs)

    def mlp(self, x: jax.Array, w: dict[str, Any]) -> jax.Array:
        """A MoE layer's MLP; its routed experts [T, k] go into w["aux"] (the Decoder's
        per-layer records: expert load and routing capture, jpaged.runtime.step)."""
        if "router" not in w:
            return super().mlp(x, w)
        cfg = self.cfg
        routing = route(x, w["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
        if "aux" in w:
            w["aux"]["experts"] = routing[1]
        # A decode step's experts by the CPU's grouped skinny kernel where matmul_impl
        # says so (as Decoder.matmul does the dense weights); else the platform's choice.
        grouped = (skinny_swiglu_experts if self.cpu_matmul and skinny_matmul.grouped_applies(x, w["experts_gate"])
                   else None)
        return moe_mlp(x, w["router"], w["experts_gate"], w["experts_up"], w["experts_down"],
                       top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob, routing=routing,
                       expert_parallel=cfg.expert_parallel, grouped=grouped)


def expert_load(experts: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
    """Tokens routed to each expert per MoE layer [L_moe, E] (int32) from the routed
    experts [L_moe, T, k], counting only the tokens where valid [T] (not padding)."""
    layers = jnp.arange(experts.shape[0])[:, None, None]
    counts = jnp.broadcast_to(valid[None, :, None].astype(jnp.int32), experts.shape)
    return jnp.zeros((experts.shape[0], num_experts), jnp.int32).at[layers, experts].add(counts)

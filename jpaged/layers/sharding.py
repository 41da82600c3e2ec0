"""Tensor and data parallelism with jax.sharding: the mesh, the weight rules, the pool's sharding.

One `Mesh` with axes ('data', 'model'), both `AxisType.Auto` (with Explicit
axes, jax 0.10's default, the row-parallel matmuls fail to type-check).  A
data-parallel replica owns one row of the mesh: a (1, tp) mesh of its own.

Weights are sharded Megatron-style by one rule table, keyed by the weight's
name (the last part of its `nnx.State` path):

    wq wk wv w_gate w_up   [d, out]  split by column (heads / MLP units)
    wqkv w_gate_up         [d, out]  the same, merged (merge_projections): laid
                                     out per shard (jpaged.models.merged)
    bq bk bv bqkv          [out]     split with their columns
    wo w_down              [in, d]   split by row: XLA adds one all-reduce
    embed                  [V, d]    split on vocab (a masked gather + all-reduce)
    lm_head                [d, V]    split on vocab (logits stay vocab-sharded)
    experts_gate experts_up          [E, d, f] a MoE layer's experts, as jpaged.layers.moe's
    experts_down                     [E, f, d] expert_split says: whole experts per device
                                     (enable_expert_parallel), or each expert's units split
                                     as a dense MLP's (the default)
    everything else                  replicated (norms, RoPE tables, MoE routers)

Scanned layers carry a leading layer axis, which is never split.  The KV pool
is split on its kv-head axis, so each device holds the K/V of its own heads;
block tables, the allocator, the prefix cache and the scheduler are host state
and do not change: paging is per block, not per head.  When a model has fewer
KV heads than devices, each KV head is repeated (as tpu-inference does) so
that every device holds the one its query heads read.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jpaged.core.config import ConfigError
from jpaged.core.model_config import ModelConfig
from jpaged.layers.moe import EXPERT_SPECS, REPLICATED, expert_split

MESH_AXES = ("data", "model")

COLUMN, ROW, VOCAB_ROWS = P(None, "model"), P("model", None), P("model", None)
WEIGHT_RULES: dict[str, P] = {
    "wq": COLUMN, "wk": COLUMN, "wv": COLUMN, "w_gate": COLUMN, "w_up": COLUMN,
    "bq": P("model"), "bk": P("model"), "bv": P("model"),
    "wqkv": COLUMN, "w_gate_up": COLUMN, "bqkv": P("model"),  # merged: columns laid out per shard
    "wo": ROW, "w_down": ROW,
    "embed": VOCAB_ROWS, "lm_head": COLUMN,
}
EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")  # in EXPERT_SPECS' order
# The pool [blocks, layers, 2, kv_heads, block_size, head_dim]: split on kv heads.
POOL_SPEC = P(None, None, None, "model", None, None)


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1,
              devices: list[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over the first dp * tp devices (of every process)."""
    devices = list(jax.devices() if devices is None else devices)
    need = tensor_parallel_size * data_parallel_size
    if len(devices) < need:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size="
                         f"{data_parallel_size} needs {need} devices; {len(devices)} are visible")
    grid = np.array(devices[:need]).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One (1, tp) mesh per data-parallel row: each replica's own devices."""
    return [Mesh(row[None, :], MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))
            for row in mesh.devices]


def tensor_parallel_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape["model"]


def check_heads(cfg: ModelConfig, tp: int) -> None:
    """ConfigError (raised at start-up) when `cfg` cannot be split over tp devices."""
    problems = split_problems(cfg, tp)
    if not problems:
        return
    sizes = [d for d in range(1, cfg.num_heads + 1) if not split_problems(cfg, d)]
    raise ConfigError("tensor_parallel_size",
                      f"{tp} does not divide {cfg.architecture}'s {' and '.join(problems)}",
                      f"one of {sizes} for this model (query heads, and KV heads or their "
                      "multiple, split evenly)")


def split_problems(cfg: ModelConfig, tp: int) -> list[str]:
    """What keeps tp devices from each taking an equal share of the heads and MLP units."""
    return [f"{n} {what}" for n, what, ok in (
        (cfg.num_heads, "query heads", cfg.num_heads % tp == 0),
        (cfg.num_kv_heads, "KV heads", cfg.num_kv_heads % tp == 0 or tp % cfg.num_kv_heads == 0),
        (cfg.intermediate_size, "MLP units", cfg.intermediate_size % tp == 0)) if not ok]


def check_experts(cfg: ModelConfig, tp: int, expert_parallel: bool) -> None:
    """ConfigError (raised at start-up) when expert parallelism cannot split `cfg`'s
    experts over tp devices (the config's own check has made sure tp > 1)."""
    if not expert_parallel:
        return
    if not cfg.num_experts:
        raise ConfigError("enable_expert_parallel", f"{cfg.architecture} is a dense model (no experts to split)",
                          "false for this model (true only for a mixture of experts: qwen3_moe, mixtral)")
    if cfg.num_experts % tp:
        sizes = [d for d in range(2, cfg.num_experts + 1) if cfg.num_experts % d == 0 and not split_problems(cfg, d)]
        raise ConfigError("enable_expert_parallel", f"tensor_parallel_size {tp} does not divide "
                          f"{cfg.architecture}'s {cfg.num_experts} experts",
                          f"false, or a tensor_parallel_size in {sizes} (whole experts per device, and the "
                          "heads split evenly)")


def with_expert_parallel(cfg: ModelConfig, tp: int, expert_parallel: bool) -> ModelConfig:
    """`cfg` as the engine lays it out: its experts split whole over the tp devices
    with `expert_parallel` (checked by check_experts first)."""
    check_experts(cfg, tp, expert_parallel)
    return dataclasses.replace(cfg, expert_parallel=True) if expert_parallel else cfg


def replicate_kv_heads(cfg: ModelConfig, arrays: dict[str, Any], tp: int
                       ) -> tuple[ModelConfig, dict[str, Any]]:
    """With fewer KV heads than devices, repeats each KV head tp / kv_heads times
    (weights, biases and the config), so device i holds the KV head its query
    heads i*h/tp .. (i+1)*h/tp - 1 read.  Unchanged when kv_heads >= tp."""
    kv = cfg.num_kv_heads
    if kv >= tp:
        return cfg, arrays
    repeat, hd = tp // kv, cfg.head_dim

    def repeated(a: Any) -> Any:
        if isinstance(a, list):  # per-layer arrays (dummy weights for the unrolled loop)
            return [repeated(x) for x in a]
        xp = jnp if isinstance(a, jax.Array) else np  # dummy weights are drawn on the devices
        heads = xp.asarray(a).reshape(*a.shape[:-1], kv, hd)
        return xp.repeat(heads, repeat, axis=-2).reshape(*a.shape[:-1], kv * repeat * hd)

    out = dict(arrays)
    for name in ("layers.wk", "layers.wv", "layers.bk", "layers.bv"):
        if name in out:
            out[name] = repeated(out[name])
    return dataclasses.replace(cfg, num_kv_heads=kv * repeat), out


def weight_spec(name: str, ndim: int, vocab_split: bool = True, experts: str = REPLICATED) -> P:
    """The PartitionSpec of the weight called `name` (last path part) with ndim axes;
    `experts`: how a MoE layer's experts are split (jpaged.layers.moe.expert_split)."""
    spec = EXPERT_SPECS[experts][EXPERT_WEIGHTS.index(name)] if name in EXPERT_WEIGHTS else WEIGHT_RULES.get(name)
    if not spec or (name in ("embed", "lm_head") and not vocab_split):
        return P()
    return P(*([None] * (ndim - len(spec))), *spec)  # a scanned layer axis stays whole


def param_specs(params: Any, cfg: ModelConfig, tp: int) -> Any:
    """The PartitionSpec of every leaf of `params` (an nnx.State)."""
    vocab_split = cfg.vocab_size % tp == 0
    experts = expert_split(cfg.num_experts, cfg.moe_intermediate_size, tp, cfg.expert_parallel)

    def spec(path: tuple, leaf: Any) -> P:
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        name = next((n for n in reversed(names) if isinstance(n, str) and n != "value"), "")
        return weight_spec(name, np.ndim(leaf), vocab_split, experts)
    return jax.tree_util.tree_map_with_path(spec, params)


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """A host (or one-device) array placed with `sharding`: works across processes,
    where every process holds the same full value.  An array already on exactly
    the sharding's devices (dummy weights, drawn there) is resharded in place:
    as it is when it already has the sharding, never through the host."""
    if isinstance(x, jax.Array) and x.sharding.device_set == sharding.device_set:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def shard_params(params: Any, cfg: ModelConfig, mesh: Mesh) -> Any:
    """`params` placed by WEIGHT_RULES on `mesh` (replicated over 'data')."""
    specs = param_specs(params, cfg, tensor_parallel_size(mesh))
    return jax.tree.map(lambda x, s: put(x, NamedSharding(mesh, s)), params, specs)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def pool_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, POOL_SPEC)


def bytes_per_device(tree: Any) -> dict[str, int]:
    """Bytes each device holds of the arrays in `tree` (its shards), by device name."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            key = f"{shard.device.platform}:{shard.device.id}"
            out[key] = out.get(key, 0) + math.prod(shard.data.shape) * leaf.dtype.itemsize
    return out


_COLLECTIVE = re.compile(r"=\s*(\(?[a-z0-9]+\[[0-9,]*\][^ ]*)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def collectives(hlo_text: str) -> list[tuple[str, str, int]]:
    """(op, result shape, bytes) of every collective in a compiled program's HLO text."""
    out = []
    for result, op in _COLLECTIVE.findall(hlo_text):
        shapes = _ARRAY.findall(result)
        nbytes = sum(np.dtype(_HLO_DTYPES.get(t, t)).itemsize * math.prod(int(d) for d in dims.split(",") if d)
                     for t, dims in shapes)
        out.append((op, result, nbytes))
    return out


_HLO_DTYPES = {"f32": "float32", "bf16": "uint16", "f16": "float16", "s32": "int32", "u32": "uint32",
               "s8": "int8", "u8": "uint8", "pred": "bool", "s64": "int64", "f64": "float64"}

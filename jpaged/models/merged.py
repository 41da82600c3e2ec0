"""Merged projections (config `merge_projections`): wq|wk|wv as one `wqkv`
[d, q + 2 kv] (their biases as one `bqkv`) and w_gate|w_up as one `w_gate_up`
[d, 2 f], so a layer runs 4 weight GEMMs instead of 7, as vLLM's
QKVParallelLinear and MergedColumnParallelLinear do.

Merging is a step of the model build (`jpaged.models.build_model`): loaders
keep producing the separate arrays of `weight_shapes(cfg)`, and the Decoder
merges them before it holds them.  Under tensor parallelism the merged
columns are laid out per shard, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], so that the
ordinary column split gives each device its own query and KV heads (its own
gate and up units); KV heads repeated for tp > kv heads
(jpaged.layers.sharding.replicate_kv_heads) are repeated before the merge.
The model splits a merged GEMM's output back into its parts, each of which
then takes its LoRA update from the separate targets' slots (adapters still
name q_proj .. up_proj).

A params tree of a merged model holds `wqkv` / `bqkv` / `w_gate_up` where an
unmerged one holds the parts.  `merge_params` turns a tree with the parts
into the merged one (what LLM.update_params does with such a tree).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.model_config import ModelConfig

# merged weight -> the weights it is made of, in column order within a shard
MERGED: dict[str, tuple[str, ...]] = {
    "wqkv": ("wq", "wk", "wv"),
    "bqkv": ("bq", "bk", "bv"),
    "w_gate_up": ("w_gate", "w_up"),
}


def part_sizes(cfg: ModelConfig, merged: str) -> tuple[int, ...]:
    """The column count of each part of `merged` (all shards together)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return (cfg.intermediate_size,) * 2 if merged == "w_gate_up" else (q, kv, kv)


def check_shards(cfg: ModelConfig, shards: int) -> None:
    """ValueError unless every part splits evenly into `shards` column blocks."""
    if shards < 1:
        raise ValueError(f"merged projections need a shard count >= 1, got {shards}")
    for merged in ("wqkv", "w_gate_up"):
        uneven = [n for n in part_sizes(cfg, merged) if n % shards]
        if uneven:
            raise ValueError(f"{merged}: columns {part_sizes(cfg, merged)} do not split into {shards} "
                             "tensor-parallel shards (repeat the KV heads first: replicate_kv_heads)")


def interleave(parts: list[Any], shards: int) -> Any:
    """The parts [..., n_i] concatenated on their last axis shard by shard:
    [..., sum n_i] = [p0_0 p1_0 .. | p0_1 p1_1 .. | ...] (numpy in, numpy out)."""
    xp = jnp if any(isinstance(p, jax.Array) for p in parts) else np
    blocks = [p.reshape(*p.shape[:-1], shards, p.shape[-1] // shards) for p in parts]
    merged = xp.concatenate(blocks, axis=-1)
    return merged.reshape(*merged.shape[:-2], -1)


def split_columns(y: jax.Array, sizes: tuple[int, ...], shards: int) -> list[jax.Array]:
    """The inverse of `interleave` on y [..., sum sizes]: each part [..., size]."""
    y = y.reshape(*y.shape[:-1], shards, sum(sizes) // shards)
    cuts = np.cumsum([n // shards for n in sizes])[:-1].tolist()
    return [p.reshape(*y.shape[:-2], -1) for p in jnp.split(y, cuts, axis=-1)]


def merge_arrays(cfg: ModelConfig, arrays: dict[str, Any], expected: dict[str, tuple[int, ...]],
                 shards: int) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """(arrays, shapes) with the loader's `layers.<part>` arrays (named and shaped as
    `expected`, the family's weight_shapes; stacked, or lists of per-layer arrays)
    merged for `shards` column shards.  Host arrays merge on the host, device
    arrays (dummy weights) on their devices."""
    check_shards(cfg, shards)
    arrays, shapes = dict(arrays), dict(expected)
    for merged, parts in MERGED.items():
        names = [f"layers.{p}" for p in parts]
        if names[0] not in shapes:  # no biases
            continue
        found = [arrays.pop(n) for n in names]
        arrays[f"layers.{merged}"] = ([interleave(list(layer), shards) for layer in zip(*found)]
                                      if isinstance(found[0], list) else interleave(found, shards))
        first = shapes[names[0]]
        shapes[f"layers.{merged}"] = (*first[:-1], sum(shapes.pop(n)[-1] for n in names))
    return arrays, shapes


def _leaf_name(path: tuple) -> str:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return next((n for n in reversed(names) if isinstance(n, str) and n != "value"), "")


def _renamed(path: tuple, old: str, new: str) -> str:
    """keystr of `path` with its key `old` (the last one) replaced by `new`."""
    i = max(j for j, k in enumerate(path) if getattr(k, "key", None) == old)
    return jax.tree_util.keystr((*path[:i], jax.tree_util.DictKey(new), *path[i + 1:]))


def merge_params(params: Any, like: Any, shards: int) -> Any:
    """`params` as `like` (a merged model's params tree, or its ShapeDtypeStructs)
    holds them: unchanged when it already has like's structure or like merges
    nothing; else its separate wq/wk/wv (bq/bk/bv) and w_gate/w_up leaves are
    merged on the devices, placed with like's shardings (the other leaves are
    kept as they are).  ValueError naming a missing or unexpected weight."""
    like_leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    merged_here = any(_leaf_name(p) in MERGED for p, _ in like_leaves)
    if not merged_here or jax.tree.structure(params) == treedef:
        return params
    source = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    leaves, groups, where, used = [], [], [], set()
    for path, target in like_leaves:
        name = _leaf_name(path)
        keys = [_renamed(path, name, part) for part in MERGED[name]] if name in MERGED else \
            [jax.tree_util.keystr(path)]
        missing = [k for k in keys if k not in source]
        if missing:
            raise ValueError(f"params tree differs: missing {missing[:3]} (the engine merges projections: "
                             "pass its own tree, or one with the separate wq/wk/wv, w_gate/w_up)")
        used.update(keys)
        leaves.append(source[keys[0]])
        if name in MERGED:
            groups.append(tuple(source[k] for k in keys))
            where.append((len(leaves) - 1, target.sharding))
    unexpected = sorted(set(source) - used)
    if unexpected:
        raise ValueError(f"params tree differs: unexpected {unexpected[:5]}")
    out = _merge_groups(groups, shards, tuple(s for _, s in where))
    for (i, _), x in zip(where, out):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


@functools.partial(jax.jit, static_argnames=("shards", "shardings"))
def _merge_groups(groups: list[tuple[jax.Array, ...]], shards: int, shardings: tuple) -> list[jax.Array]:
    return [jax.lax.with_sharding_constraint(interleave(list(g), shards), s)
            for g, s in zip(groups, shardings)]

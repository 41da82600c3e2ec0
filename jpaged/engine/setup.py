"""What an engine is built from: the config's choices resolved, the weights
loaded (and sharded over the engine's devices), the KV pool sized.

`LLM.__init__` calls these once, in order; nothing here keeps state.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

import pallas_kernels
from jpaged.core.config import ATTENTION_IMPLS, KV_CACHE_DTYPES, LAYER_LOOPS, MATMUL_IMPLS, ConfigError
from jpaged.core.model_config import ModelConfig
from jpaged.loading.gguf_blocks import BlockMatrix, read_block_matrices
from jpaged.loading.weights import LoadedWeights, default_cache_dir, load_weights, read_model_config
from jpaged.models import build_model, gguf_family, weight_shapes
from jpaged.models.base import split_model
from jpaged.runtime.distributed import broadcast_step
from jpaged.runtime.dummy_weights import load_dummy
from jpaged.core.kv_layout import KVLayout, kv_layout
from jpaged.runtime.kv_pool import bytes_per_block, check_swap_space, num_blocks_for, pool_dtype
from jpaged.layers.sharding import (Mesh, check_heads, make_mesh, replicate_kv_heads, shard_params,
                                     tensor_parallel_size, with_expert_parallel)

log = logging.getLogger(__name__)


def resolve_kv_cache_dtype(name: str, dtype: jnp.dtype) -> jnp.dtype:
    """The KV pool's dtype: "auto" follows the model dtype."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return dtype if name == "auto" else pool_dtype(name)


def resolve_attention_impl(name: str) -> tuple[str, str]:
    """(the impl that will really run, why it differs from the one asked for or "")."""
    if name == "auto":
        return pallas_kernels.default_impl(), ""
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {list(ATTENTION_IMPLS)}, got {name!r}")
    if name == "cpu":
        from pallas_kernels import cpu
        if not cpu.available():  # the backend would fall back to the reference on every call
            return "reference", f"cpu kernel unavailable: {cpu.unavailable_reason()}"
    return name, ""


def resolve_matmul_impl(name: str, dtype: str, tensor_parallel_size: int) -> str:
    """The weight matmuls that will really run: "cpu" (the C++ skinny kernel for steps
    of few tokens, jpaged.layers.skinny_matmul) or "xla".  "auto" is "cpu" on a CPU
    backend with float32 weights, one device per engine and the C++ kernels built;
    an explicit "cpu" (the config checked dtype and devices) runs "xla" only where
    the kernels cannot, with a warning."""
    if name not in MATMUL_IMPLS:
        raise ValueError(f"matmul_impl must be one of {MATMUL_IMPLS}, got {name!r}")
    if name == "xla" or (name == "auto" and (dtype != "float32" or tensor_parallel_size != 1)):
        return "xla"
    from pallas_kernels import cpu
    why = ("not a CPU backend" if jax.default_backend() != "cpu"
           else "" if cpu.available() else f"the C++ kernels are unavailable: {cpu.unavailable_reason()}")
    if why and name == "cpu":
        log.warning("matmul_impl=cpu: %s; running XLA's dot", why)
    return "xla" if why else "cpu"


def resolve_layer_loop(name: str) -> bool:
    """True to scan over stacked layers.  "auto": unrolled on every backend for now
    (see benchmarks/README.md, "Layer loop", for the measurements behind it)."""
    if name not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {name!r}")
    return name == "scan"


def use_compilation_cache(directory: pathlib.Path) -> None:
    """Points JAX's persistent compilation cache (a process-wide setting) at
    `directory`, unless the program has already chosen one: only asked for
    (config `compilation_cache`, on in the CLI's configs), never on import."""
    current = jax.config.jax_compilation_cache_dir
    if current and pathlib.Path(current) != directory:
        log.info("keeping the program's compilation cache %s (not %s)", current, directory)
        return
    jax.config.update("jax_compilation_cache_dir", str(directory))


def program_cache_dir(cfg: ml_collections.ConfigDict) -> pathlib.Path | None:
    """Where serialized step programs live (jpaged.runtime.compilation): beside
    JAX's cache, when the config's compilation_cache is on."""
    return pathlib.Path(cfg.cache_dir or default_cache_dir()) / "programs" if cfg.compilation_cache else None


def engine_mesh(cfg: ml_collections.ConfigDict, mesh: Mesh | None) -> Mesh | None:
    """The (1, tensor_parallel_size) devices of one engine: `mesh` as given (a
    data-parallel router's replica), else the first devices (None: one device)."""
    if mesh is not None:
        if mesh.shape["model"] != cfg.tensor_parallel_size or mesh.shape["data"] != 1:
            raise ValueError(f"mesh {dict(mesh.shape)} is not one replica of tensor_parallel_size="
                             f"{cfg.tensor_parallel_size}")
        return mesh
    if cfg.data_parallel_size > 1:
        raise ConfigError("data_parallel_size", f"{cfg.data_parallel_size} replicas need a router",
                          "build the engine with jpaged.engine.router.create_engine (one LLM is one replica)")
    return make_mesh(cfg.tensor_parallel_size) if cfg.tensor_parallel_size > 1 else None


@dataclasses.dataclass
class LoadedModel:
    """The model an engine serves, its weights on the engine's devices."""
    loaded: LoadedWeights      # where the weights came from (its arrays dropped: params hold them)
    model_config: ModelConfig  # after KV heads are repeated for tensor parallelism
    tokenizer: Any
    graphdef: nnx.GraphDef
    params: nnx.State
    weight_bytes: int          # per device
    matmul_impl: str           # resolved: "cpu" or "xla"
    # A quantised GGUF's blocks for the CPU decode kernels (gguf_weight_blocks), or None.
    weight_blocks: dict[tuple[str, int | None], BlockMatrix] | None = None


def load_model(cfg: ml_collections.ConfigDict, mesh: Mesh | None, scan_layers: bool) -> LoadedModel:
    """Loads cfg.model, builds its Flax module and places the weights on `mesh`."""
    if cfg.compilation_cache:
        use_compilation_cache(pathlib.Path(cfg.cache_dir or default_cache_dir()) / "xla")
    check_memory_before_loading(cfg, tensor_parallel_size(mesh))
    if cfg.load_format == "dummy":  # drawn on the devices, in the layout and shardings the params keep
        loaded = load_dummy(cfg.model, dtype=cfg.dtype, scan_layers=scan_layers, mesh=mesh)
    else:
        loaded = load_weights(cfg.model, load_format=cfg.load_format, dtype=cfg.dtype,
                              cache_dir=cfg.cache_dir or None)
    tp = tensor_parallel_size(mesh)
    check_heads(loaded.config, tp)
    model_config, arrays = replicate_kv_heads(loaded.config, loaded.arrays, tp)
    model_config = with_expert_parallel(model_config, tp, cfg.enable_expert_parallel)
    matmul_impl = resolve_matmul_impl(cfg.matmul_impl, cfg.dtype, tp)
    graphdef, params = split_model(build_model(model_config, arrays, jnp.dtype(cfg.dtype),
                                               scan_layers=scan_layers, batch_invariant=cfg.batch_invariant,
                                               merge_projections=cfg.merge_projections, tensor_parallel_size=tp,
                                               matmul_impl=matmul_impl))
    if mesh is not None:
        params = shard_params(params, model_config, mesh)
    weight_bytes = weights_nbytes(model_config, jnp.dtype(cfg.dtype)) // tp
    loaded.arrays = {}  # the device copy in params is the one we keep
    blocks = gguf_weight_blocks(cfg, loaded, model_config, matmul_impl)
    return LoadedModel(loaded, model_config, loaded.tokenizer, graphdef, params, weight_bytes, matmul_impl, blocks)


def gguf_weight_blocks(cfg: ml_collections.ConfigDict, loaded: LoadedWeights, model_config: ModelConfig,
                       matmul_impl: str) -> dict[tuple[str, int | None], BlockMatrix] | None:
    """A quantised GGUF's matrices in its own blocks, for the CPU decode kernels to
    read instead of the float32 params (config gguf_blocks; jpaged.runtime.weight_blocks);
    None unless the weights came from a GGUF and matmul_impl resolved to cpu."""
    if not cfg.gguf_blocks or matmul_impl != "cpu" or loaded.load_format != "gguf":
        return None
    return read_block_matrices(loaded.source, model_config, gguf_family) or None


def params_from_path(path: str | pathlib.Path, cfg: ml_collections.ConfigDict, base: ModelConfig,
                     like: nnx.State, mesh: Mesh | None, scan_layers: bool) -> nnx.State:
    """Weights a trainer saved, placed like `like` (the engine's own): an orbax
    checkpoint of the params tree (restored straight into `like`'s shapes and
    shardings), or a model as `cfg.model` could name one (a HF checkpoint
    directory, a .gguf file), whose config must match the served model's."""
    path = pathlib.Path(path)
    if path.is_dir() and any((path / f).exists() for f in ("_CHECKPOINT_METADATA", "_METADATA")):
        import orbax.checkpoint as ocp
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(path.resolve(), target)
    loaded = load_weights(str(path), dtype=cfg.dtype, cache_dir=cfg.cache_dir or None, use_cache=False)
    if loaded.config != base:
        raise ValueError(f"{path}: its config differs from the served model's ({_config_diff(loaded.config, base)})")
    tp = tensor_parallel_size(mesh)
    model_config, arrays = replicate_kv_heads(loaded.config, loaded.arrays, tp)
    model_config = with_expert_parallel(model_config, tp, cfg.enable_expert_parallel)
    _, params = split_model(build_model(model_config, arrays, jnp.dtype(cfg.dtype), scan_layers=scan_layers,
                                        merge_projections=cfg.merge_projections, tensor_parallel_size=tp))
    return params if mesh is None else shard_params(params, model_config, mesh)


def _config_diff(a: ModelConfig, b: ModelConfig) -> str:
    diff = [f"{f.name} {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}" for f in dataclasses.fields(a)
            if getattr(a, f.name) != getattr(b, f.name)]
    return ", ".join(diff[:4])


def weights_nbytes(model_config: ModelConfig, dtype: jnp.dtype) -> int:
    """Bytes of all of a model's weights in `dtype` (the params hold them in it)."""
    return sum(math.prod(s) for s in weight_shapes(model_config).values()) * dtype.itemsize


def check_memory_before_loading(cfg: ml_collections.ConfigDict, num_shards: int) -> None:
    """ConfigError, before any weight is read, when an explicit num_blocks or the
    swap space cannot fit beside the weights (both sized from the model's
    metadata).  size_pool checks again, exactly, once the weights are in place."""
    if cfg.num_blocks <= 0 and cfg.preemption_mode != "swap":
        return  # a pool sized from kv_memory_fraction is checked by size_pool
    model_config = read_model_config(cfg.model, cfg.load_format)
    dtype = jnp.dtype(cfg.dtype)
    kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, dtype)
    weight_bytes = weights_nbytes(model_config, dtype) // num_shards
    geometry = pool_geometry(cfg, kv_layout(model_config, cfg.kv_layout))
    num_blocks = num_blocks_for(
        model_config, block_size=cfg.block_size, dtype=kv_dtype, num_blocks=cfg.num_blocks,
        kv_memory_fraction=cfg.kv_memory_fraction, weight_bytes=weight_bytes, max_num_seqs=cfg.max_num_seqs,
        max_model_len=cfg.max_model_len, num_shards=num_shards, weights_loaded=False, **geometry)
    if cfg.preemption_mode == "swap":
        check_swap_space(cfg.swap_space_gb, num_blocks * bytes_per_block(
            model_config, cfg.block_size, kv_dtype, geometry["layers_per_page"]))


def pool_geometry(cfg: ml_collections.ConfigDict, layout: KVLayout) -> dict[str, int]:
    """num_blocks_for's layout arguments: the layers of a page, and the most pages a
    sequence of max_model_len holds at once."""
    return dict(layers_per_page=layout.layers_per_page,
                pages_per_seq=layout.max_pages_per_seq(cfg.max_model_len, cfg.block_size,
                                                       cfg.max_num_batched_tokens))


def size_pool(cfg: ml_collections.ConfigDict, model: LoadedModel, kv_dtype: jnp.dtype, num_shards: int,
              layout: KVLayout) -> int:
    """The KV pool's block count: cfg.num_blocks, or what kv_memory_fraction of the
    free device memory holds; in a multi-process run, process 0's count for all.
    Every memory setting is checked here, after the weights are on the devices
    and before the pool (or the host swap space) is allocated: ConfigError when
    num_blocks, kv_memory_fraction or swap_space_gb does not fit this machine."""
    geometry = pool_geometry(cfg, layout)
    num_blocks = num_blocks_for(
        model.model_config, block_size=cfg.block_size, dtype=kv_dtype, num_blocks=cfg.num_blocks,
        kv_memory_fraction=cfg.kv_memory_fraction, weight_bytes=model.weight_bytes,
        max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, num_shards=num_shards, **geometry)
    if cfg.preemption_mode == "swap":  # host memory, checked before anything is allocated
        check_swap_space(cfg.swap_space_gb, num_blocks * bytes_per_block(
            model.model_config, cfg.block_size, kv_dtype, geometry["layers_per_page"]))
    if jax.process_count() > 1:  # free memory differs by host
        num_blocks = int(broadcast_step(num_blocks))
        if cfg.preemption_mode == "swap":
            raise ConfigError("preemption_mode", "swap keeps blocks in process 0's host memory, "
                              "which the other processes cannot read", "recompute in a multi-process run")
    return num_blocks

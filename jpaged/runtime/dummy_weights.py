"""Random weights drawn on the device (load_format="dummy"), for benchmarks of
shapes we have no checkpoint for.

Each tensor is computed under `jax.jit`, straight in the model's dtype and, on
a mesh, straight into its tensor-parallel sharding (jpaged.layers.sharding's
rules): no float32 copy, no host copy, and no device ever holds a whole split
tensor.  Drawing a Llama-3-8B shape with numpy on the host took 48 s of a lent
H200's time.

Values: matrices uniform on (-a, a) with standard deviation a / sqrt(3) = 0.02,
norm weights 1.  They are a hash (murmur3's 32-bit finalizer) of each
element's index within its layer, salted by (seed, tensor k of
`weight_shapes(cfg)` in its order, layer i): a handful of integer operations
per element, one fused loop, where jax.random's threefry costs about 3.5x
numpy's time on a CPU.  Weights for benchmarks need spread, not statistical
quality.  The element index is global (an iota the partitioner splits), so the
values are the same for either layer layout and any tensor-parallel size.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jpaged import models
from jpaged.core.model_config import ModelConfig
from jpaged.loading.weights import LoadedWeights, dummy_model
from jpaged.layers.sharding import tensor_parallel_size, weight_spec

STD = 0.02
_HALF_WIDTH = STD * math.sqrt(3.0)  # uniform(-a, a) has std a / sqrt(3)


def load_dummy(model: str, *, dtype: Any = jnp.float32, seed: int = 0, scan_layers: bool = True,
               mesh: Mesh | None = None) -> LoadedWeights:
    """load_format="dummy": `model`'s config.json (and a tokenizer beside it), with
    `dummy_weights` in the engine's layout and placement; load_seconds counts the draw."""
    t0 = time.perf_counter()
    cfg, tokenizer, source = dummy_model(model)
    arrays = dummy_weights(cfg, seed=seed, dtype=dtype, scan_layers=scan_layers, mesh=mesh)
    return LoadedWeights(cfg, arrays, tokenizer, source, time.perf_counter() - t0, False,
                         origin="random weights (load_format=dummy), drawn on the devices")


def dummy_weights(cfg: ModelConfig, *, seed: int = 0, dtype: Any = jnp.float32, scan_layers: bool = True,
                  mesh: Mesh | None = None) -> dict[str, jax.Array | list[jax.Array]]:
    """Every weight of `weight_shapes(cfg)`, random, on the device and ready.

    scan_layers: `layers.*` arrays stacked [num_layers, ...] (the scanned layer
        loop's layout); False: a list of num_layers per-layer arrays (the
        unrolled loop's), each drawn on its own, so no stacked copy is made.
    mesh: where the engine's weights live; each tensor is drawn with its
        sharding there.  None: the default device.
    """
    dtype = jnp.dtype(dtype)
    vocab_split = mesh is not None and cfg.vocab_size % tensor_parallel_size(mesh) == 0
    arrays: dict[str, jax.Array | list[jax.Array]] = {}
    for index, (name, shape) in enumerate(models.weight_shapes(cfg).items()):
        key = jnp.array([seed, index, 0], jnp.uint32)  # (seed, tensor, layer): the values' salt
        is_norm = name.endswith("norm")
        if not name.startswith("layers."):
            arrays[name] = _drawer(shape, dtype, is_norm, None, _sharding(mesh, name, shape, vocab_split))(key)
        elif scan_layers:
            arrays[name] = _drawer(shape[1:], dtype, is_norm, shape[0],
                                   _sharding(mesh, name, shape, vocab_split))(key)
        else:
            draw = _drawer(shape[1:], dtype, is_norm, None, _sharding(mesh, name, shape[1:], vocab_split))
            arrays[name] = [draw(key.at[2].set(layer)) for layer in range(shape[0])]
    # Drawing is asynchronous: wait, so that load times count it and a failure shows here.
    return jax.block_until_ready(arrays)


def _sharding(mesh: Mesh | None, name: str, shape: tuple[int, ...], vocab_split: bool
              ) -> NamedSharding | None:
    """The engine's sharding of weight `name` on `mesh`; replicated where a split axis
    does not divide evenly (jit outputs must: the KV heads of a model with fewer KV
    heads than devices, which the engine repeats and places itself)."""
    if mesh is None:
        return None
    spec = weight_spec(name.rsplit(".", 1)[-1], len(shape), vocab_split)
    even = all(axis is None or size % mesh.shape[axis] == 0 for axis, size in zip(spec, shape))
    return NamedSharding(mesh, spec if even else P())


def _mix(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: every input bit moves about half the output bits."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _uniform(shape: tuple[int, ...], salt: jax.Array, dtype: jnp.dtype, layer_axis: bool = False) -> jax.Array:
    """Uniform values on (-a, a) of `shape`: a hash of each element's flat index
    within one layer, salted (a uint32 scalar; with `layer_axis`, axis 0 stacks
    layers and `salt` holds one per layer, broadcast along the other axes)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(int(layer_axis), len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    bits = _mix(index * jnp.uint32(0x9E3779B1) + salt)
    unit = (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24))  # [0, 1), 24 bits
    return ((2.0 * unit - 1.0) * _HALF_WIDTH).astype(dtype)


def _salt(key: jax.Array) -> jax.Array:
    """One uint32 per (seed, tensor, layer) row of key [..., 3]."""
    x = _mix(key[..., 0]) ^ (key[..., 1] * jnp.uint32(0x27D4EB2F))
    return _mix(_mix(x) ^ (key[..., 2] * jnp.uint32(0x165667B1)))


@functools.cache
def _drawer(shape: tuple[int, ...], dtype: jnp.dtype, is_norm: bool, layers: int | None,
            sharding: NamedSharding | None) -> Callable[[jax.Array], jax.Array]:
    """A jitted key (seed, tensor, layer) -> tensor (one compilation per distinct
    tensor kind): ones for a norm, else uniform values; with `layers`, that many
    stacked, layer i salted as a per-layer draw of layer i is (the same values)."""
    full = shape if layers is None else (layers, *shape)

    def draw(key: jax.Array) -> jax.Array:
        if is_norm:
            return jnp.ones(full, dtype)
        if layers is None:
            return _uniform(shape, _salt(key), dtype)
        keys = jnp.tile(key, (layers, 1)).at[:, 2].set(jnp.arange(layers, dtype=jnp.uint32))
        return _uniform(full, _salt(keys).reshape((layers,) + (1,) * len(shape)), dtype, layer_axis=True)

    return jax.jit(draw) if sharding is None else jax.jit(draw, out_shardings=sharding)

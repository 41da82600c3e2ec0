"""Random weights drawn on the device (load_format="dummy"), for benchmarks of
shapes we have no checkpoint for.

Each tensor is drawn by `jax.random` under `jax.jit`, straight in the model's
dtype and, on a mesh, straight into its tensor-parallel sharding
(jpaged.runtime.sharding's rules): no float32 copy, no host copy, and no
device ever holds a whole split tensor.  Drawing a Llama-3-8B shape with numpy
on the host took 48 s of a lent H200's time (not yet measured this way on a
GPU).  On a CPU the threefry bits cost about 3.5x numpy's time (a 0.3B bf16
shape: 10 s vs 3 s of CPU on the 2-core VM); one way for every backend is
kept anyway, since the large shapes this exists for run on accelerators.

Values: matrices uniform on (-a, a) with standard deviation a / sqrt(3) = 0.02,
norm weights 1.  Tensor k of `weight_shapes(cfg)` (in its order) is drawn with
key fold_in(key(seed), k), and its layer i with fold_in(that key, i); jax's
partitionable threefry makes the bits independent of the sharding, so the
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
from jpaged.runtime.sharding import tensor_parallel_size, weight_spec

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
    root = jax.random.key(seed)
    vocab_split = mesh is not None and cfg.vocab_size % tensor_parallel_size(mesh) == 0
    arrays: dict[str, jax.Array | list[jax.Array]] = {}
    for index, (name, shape) in enumerate(models.weight_shapes(cfg).items()):
        key = jax.random.fold_in(root, index)
        is_norm = name.endswith("norm")
        if not name.startswith("layers."):
            arrays[name] = _drawer(shape, dtype, is_norm, None, _sharding(mesh, name, shape, vocab_split))(key)
        elif scan_layers:
            arrays[name] = _drawer(shape[1:], dtype, is_norm, shape[0],
                                   _sharding(mesh, name, shape, vocab_split))(key)
        else:
            draw = _drawer(shape[1:], dtype, is_norm, None, _sharding(mesh, name, shape[1:], vocab_split))
            arrays[name] = [draw(jax.random.fold_in(key, layer)) for layer in range(shape[0])]
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


@functools.cache
def _drawer(shape: tuple[int, ...], dtype: jnp.dtype, is_norm: bool, layers: int | None,
            sharding: NamedSharding | None) -> Callable[[jax.Array], jax.Array]:
    """A jitted key -> tensor (one compilation per distinct tensor kind): ones for a
    norm, else uniform values; with `layers`, that many stacked, layer i from
    fold_in(key, i) (the same values a per-layer draw gives)."""
    full = shape if layers is None else (layers, *shape)

    def draw(key: jax.Array) -> jax.Array:
        if is_norm:
            return jnp.ones(full, dtype)
        one = lambda k: jax.random.uniform(k, shape, dtype, -_HALF_WIDTH, _HALF_WIDTH)  # noqa: E731
        if layers is None:
            return one(key)
        return jax.vmap(lambda i: one(jax.random.fold_in(key, i)))(jnp.arange(layers))

    return jax.jit(draw) if sharding is None else jax.jit(draw, out_shardings=sharding)

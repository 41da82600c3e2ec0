"""The paged KV pool on the device: its layout, its size, and the jitted block
moves on it (copy-on-write, swap).  Which block holds what is host bookkeeping,
in jpaged.core.block_manager.

Pool layout, chosen block-major so that one block (all layers, K and V) is one
contiguous slab: copy-on-write and swap move a block with one slice.

    kv_pool[num_blocks, num_layers, 2, num_kv_heads, block_size (+ 1 quantized), head_dim]

Quantized pools (int8, float8_e4m3fn; pallas_kernels.reference) keep one
array ("option A" of the GPU plan): each page of one (layer, K/V, KV head) is
[block_size + 1, head_dim], the tokens' value rows, then one row whose first
block_size elements are those rows' scale codes.  Chosen over a separate
scale array because every block move (copy-on-write, swap gather/scatter,
the host swap space, tensor-parallel head splits) keeps moving one array with
one slice, unchanged, while the value rows are exactly head_dim bytes and
aligned (the GPU kernel loads them 16 bytes at a time; rows of head_dim + 1
with the code inline were byte loads).  The codes cost 1/block_size of the
values (head_dim bytes a page) instead of 1/(head_dim + 1), and need
block_size <= head_dim (ValueError otherwise).

(num_layers: the layers of one page, fewer than the model's in a hybrid layout,
jpaged.core.kv_layout.)

Block 0 is the null block: padded block-table entries and padding tokens point
at it, and it is never handed out.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.config import ConfigError
from jpaged.core.model_config import ModelConfig
from jpaged.core.rounding import cdiv, next_pow2
from pallas_kernels.reference import check_page_layout, page_rows


# The pool dtype of each kv_cache_dtype but "auto"; int8 and float8_e4m3fn pools are
# quantized (a scale per row: pallas_kernels.reference.quantize_rows).
POOL_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn}


def pool_dtype(kv_cache_dtype: str) -> jnp.dtype:
    """The pool's dtype for a resolved kv_cache_dtype (not "auto")."""
    return jnp.dtype(POOL_DTYPES[kv_cache_dtype])


def block_shape(cfg: ModelConfig, block_size: int, dtype: jnp.dtype,
                layers_per_page: int | None = None) -> tuple[int, ...]:
    """One block of the pool (K and V of every layer, or of `layers_per_page` layers
    in a hybrid layout: jpaged.core.kv_layout): also the host swap space's unit.
    Pages of a quantized pool (int8, fp8) carry their rows' scale codes in one more
    row (ValueError when block_size > head_dim: the codes would not fit it)."""
    check_page_layout(block_size, cfg.head_dim, dtype)
    return (layers_per_page or cfg.num_layers, 2, cfg.num_kv_heads, page_rows(block_size, dtype),
            cfg.head_dim)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: jnp.dtype,
                    layers_per_page: int | None = None) -> int:
    """What one block really holds: values and, quantized, their scales."""
    return math.prod(block_shape(cfg, block_size, dtype, layers_per_page)) * jnp.dtype(dtype).itemsize


def check_block_size(cfg: ModelConfig, block_size: int, dtype: jnp.dtype) -> None:
    """ConfigError when a page of a quantized pool cannot hold its block_size codes
    in its one code row of head_dim elements."""
    try:
        check_page_layout(block_size, cfg.head_dim, dtype)
    except ValueError as e:
        raise ConfigError("block_size", str(e), f"at most {cfg.head_dim} (the model's head_dim) "
                          "with an int8 / fp8_e4m3 kv_cache_dtype") from None


def free_device_memory(weight_bytes: int, *, weights_loaded: bool = True) -> int:
    """Bytes left for the KV pool after the weights: device stats on GPU/TPU,
    available system memory on the CPU; `weights_loaded` False: the weights
    (weight_bytes) are still to come out of it."""
    stats = jax.local_devices()[0].memory_stats() or {}  # another process's devices have none
    to_come = 0 if weights_loaded else weight_bytes
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", weight_bytes) - to_come)
    available = available_host_memory()
    if available is None:
        raise RuntimeError("cannot tell the memory available for the KV pool (no /proc/meminfo): "
                           "set num_blocks")
    return available - to_come


def num_blocks_for(cfg: ModelConfig, *, block_size: int, dtype: jnp.dtype, num_blocks: int,
                   kv_memory_fraction: float, weight_bytes: int, max_num_seqs: int,
                   max_model_len: int, num_shards: int = 1, weights_loaded: bool = True,
                   layers_per_page: int | None = None, pages_per_seq: int | None = None) -> int:
    """Pool size: explicit `num_blocks`, else a fraction of the memory left after the
    weights, capped at what max_num_seqs sequences of max_model_len can ever use.
    ConfigError when an explicit num_blocks does not fit in that memory, or the
    fraction holds fewer than 2 blocks (checked before the pool is allocated).
    With the pool split over num_shards devices, each holds 1/num_shards of a
    block (weight_bytes: one device's share).  A hybrid layout's blocks hold
    layers_per_page layers, and a sequence holds at most pages_per_seq of them."""
    check_block_size(cfg, block_size, dtype)
    block_bytes = bytes_per_block(cfg, block_size, dtype, layers_per_page)
    platform = jax.local_devices()[0].platform
    free = free_device_memory(weight_bytes, weights_loaded=weights_loaded)
    # What one memory holds of each block: CPU "devices" share one memory (no per-device budget).
    share = block_bytes if platform == "cpu" else cdiv(block_bytes, num_shards)
    where = "available system memory" if platform == "cpu" else f"free {platform} memory per device"
    if num_blocks > 0:
        if num_blocks * share > free:
            raise ConfigError("num_blocks", f"{num_blocks} KV blocks of {_mib(share)} need "
                              f"{_mib(num_blocks * share)}, more than the {_mib(free)} of {where} "
                              "after the weights", f"at most {max(free // share, 0)}, or 0 to size the pool "
                              "from kv_memory_fraction")
        return num_blocks
    by_budget = int(free * kv_memory_fraction) // share
    if by_budget < 2:
        raise ConfigError("kv_memory_fraction", f"{kv_memory_fraction:g} of the {_mib(free)} of {where} "
                          f"after the weights holds {by_budget} KV blocks of {_mib(share)}",
                          "a fraction that holds at least 2 blocks, or an explicit num_blocks")
    useful = max_num_seqs * (pages_per_seq or cdiv(max_model_len, block_size)) + 1
    return int(min(by_budget, useful))


def _mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def check_swap_space(swap_space_gb: float, pool_bytes: int) -> None:
    """ConfigError when swap_space_gb of host memory (swap mode) is more than this
    machine has available now; on the CPU the KV pool (pool_bytes, not allocated
    yet) comes out of the same memory."""
    need = int(swap_space_gb * 2**30)
    available = available_host_memory()
    if available is None or need == 0:
        return
    if jax.devices()[0].platform == "cpu":
        available -= pool_bytes
    if need > available:
        raise ConfigError("swap_space_gb", f"{swap_space_gb:g} GiB of host swap space is more than the "
                          f"{_mib(max(available, 0))} of memory available" + (" besides the KV pool"
                          if jax.devices()[0].platform == "cpu" else ""),
                          f"at most {max(available, 0) / 2**30:.1f}, or preemption_mode recompute")


def available_host_memory() -> int | None:
    """MemAvailable of /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return int(info["MemAvailable"])
    except (OSError, KeyError, ValueError, IndexError):
        return None


def create_kv_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype,
                   sharding: jax.sharding.Sharding | None = None,
                   layers_per_page: int | None = None) -> jax.Array:
    """A zeroed pool; with `sharding`, created in place on its devices (never whole on one)."""
    if not 1 <= block_size <= 256:
        raise ValueError(f"block_size must be in [1, 256], got {block_size}")
    shape = (num_blocks, *block_shape(cfg, block_size, dtype, layers_per_page))
    if sharding is None:
        return jnp.zeros(shape, dtype=dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype=dtype), out_shardings=sharding)()


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_blocks(kv_pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    # Gather every source first, then scatter: a block that is both a source
    # and a destination in one batch is read before it is overwritten.
    return kv_pool.at[dst].set(kv_pool[src])


def _pad(rows: list | np.ndarray, dtype: np.dtype) -> np.ndarray:
    """rows padded with zeros to a power-of-two count, so that few shapes compile;
    a zero block id is the null block, which nothing reads."""
    rows = np.asarray(rows, dtype)
    out = np.zeros((next_pow2(len(rows)), *rows.shape[1:]), dtype)
    out[:len(rows)] = rows
    return out


def copy_blocks(kv_pool: jax.Array, copies: list[tuple[int, int]]) -> jax.Array:
    """Copy-on-write on the device: one jitted, donated pool update for all
    (src, dst) block copies of a step (padding: null-block self-copies)."""
    pairs = _pad(copies, np.int32)
    return _copy_blocks(kv_pool, jnp.asarray(pairs[:, 0]), jnp.asarray(pairs[:, 1]))


@jax.jit
def _gather_blocks(kv_pool: jax.Array, ids: jax.Array) -> jax.Array:
    return kv_pool[ids]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_blocks(kv_pool: jax.Array, ids: jax.Array, blocks: jax.Array) -> jax.Array:
    return kv_pool.at[ids].set(blocks)


def gather_blocks(kv_pool: jax.Array, block_ids: list[int]) -> np.ndarray:
    """Swap-out: the given device blocks, copied to host, in one jitted gather."""
    return np.asarray(_gather_blocks(kv_pool, jnp.asarray(_pad(block_ids, np.int32))))[:len(block_ids)]


def scatter_blocks(kv_pool: jax.Array, block_ids: list[int], blocks: np.ndarray) -> jax.Array:
    """Swap-in: writes host `blocks` into device `block_ids` with one jitted, donated
    `kv_pool.at[ids].set(blocks)`; padding rows go to the null block."""
    ids, data = _pad(block_ids, np.int32), _pad(blocks, kv_pool.dtype)
    return _scatter_blocks(kv_pool, jnp.asarray(ids), jnp.asarray(data))

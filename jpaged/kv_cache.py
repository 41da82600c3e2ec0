"""The paged KV pool: one device array, a host free list and per-sequence block tables.

Pool layout, chosen block-major so that one block (all layers, K and V) is one
contiguous slab: copy-on-write and swap move a block with one slice.

    kv_pool[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]

Block 0 is the null block: padded block-table entries and padding tokens point
at it, and it is never handed out.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.model_config import ModelConfig
from jpaged.rounding import cdiv, next_pow2

NULL_BLOCK = 0


class NoFreeBlocksError(RuntimeError):
    """The pool has no free block left."""


class BlockAllocator:
    """O(1) free-list allocator over physical blocks 1..num_blocks-1."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: collections.deque[int] = collections.deque(range(1, num_blocks))
        self._in_use = np.zeros(num_blocks, dtype=bool)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError("KV pool exhausted: no free block")
        block = self._free.popleft()
        self._in_use[block] = True
        return block

    def free(self, block: int) -> None:
        if block == NULL_BLOCK or not self._in_use[block]:
            raise ValueError(f"block {block} is not allocated (double free?)")
        self._in_use[block] = False
        self._free.append(block)

    def is_allocated(self, block: int) -> bool:
        return bool(self._in_use[block])


@dataclasses.dataclass
class BlockTable:
    """One sequence's map from logical block to physical block (grown and copied
    by the BlockManager, which owns the block size)."""

    block_ids: list[int] = dataclasses.field(default_factory=list)

    def release(self, allocator) -> None:
        """Frees every block, last first (so that the deepest is evicted first)."""
        for block in reversed(self.block_ids):
            allocator.free(block)
        self.block_ids.clear()


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: jnp.dtype) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * block_size * cfg.head_dim * jnp.dtype(dtype).itemsize


def free_device_memory(weight_bytes: int) -> int:
    """Bytes left for the KV pool after the weights: device stats on GPU/TPU,
    available system memory on the CPU (where weights were already loaded)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", weight_bytes))
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return int(info["MemAvailable"])


def num_blocks_for(cfg: ModelConfig, *, block_size: int, dtype: jnp.dtype, num_blocks: int,
                   kv_memory_fraction: float, weight_bytes: int, max_num_seqs: int,
                   max_model_len: int) -> int:
    """Pool size: explicit `num_blocks`, else a fraction of the memory left after the
    weights, capped at what max_num_seqs sequences of max_model_len can ever use."""
    if num_blocks > 0:
        return num_blocks
    budget = int(free_device_memory(weight_bytes) * kv_memory_fraction)
    by_budget = budget // bytes_per_block(cfg, block_size, dtype)
    useful = max_num_seqs * cdiv(max_model_len, block_size) + 1
    return int(max(2, min(by_budget, useful)))


def create_kv_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype) -> jax.Array:
    if not 1 <= block_size <= 256:
        raise ValueError(f"block_size must be in [1, 256], got {block_size}")
    shape = (num_blocks, cfg.num_layers, 2, cfg.num_kv_heads, block_size, cfg.head_dim)
    return jnp.zeros(shape, dtype=dtype)


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_blocks(kv_pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    # Gather every source first, then scatter: a block that is both a source
    # and a destination in one batch is read before it is overwritten.
    return kv_pool.at[dst].set(kv_pool[src])


def copy_blocks(kv_pool: jax.Array, copies: list[tuple[int, int]]) -> jax.Array:
    """Copy-on-write on the device: one jitted, donated pool update for all
    (src, dst) block copies of a step.  The count is padded to a power of two
    with null-block self-copies so few shapes compile."""
    n = next_pow2(len(copies))
    pairs = np.zeros((n, 2), np.int32)  # padding: NULL_BLOCK -> NULL_BLOCK
    pairs[:len(copies)] = copies
    return _copy_blocks(kv_pool, jnp.asarray(pairs[:, 0]), jnp.asarray(pairs[:, 1]))


# ----------------------------------------------------------------------- swap
class HostSwapSpace:
    """Host-memory (numpy) pool that preempted sequences' blocks are swapped to.

    `capacity` blocks of the device block shape; the array is allocated on the
    first swap-out (np.empty: pages are committed only as they are written).
    Slot accounting (allocate/free) is the scheduler's; the engine moves data
    with `store` (device -> host) and `load` (host -> device).
    """

    def __init__(self, capacity: int, block_shape: tuple[int, ...], dtype):
        self.capacity = max(0, int(capacity))
        self.block_shape = tuple(block_shape)
        self.dtype = np.dtype(dtype)
        self._free: collections.deque[int] = collections.deque(range(self.capacity))
        self.data: np.ndarray | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.capacity - len(self._free)

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.dtype.itemsize

    def allocate(self, n: int) -> list[int] | None:
        """n host slots, or None (taking nothing) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def _array(self) -> np.ndarray:
        if self.data is None:
            self.data = np.empty((self.capacity, *self.block_shape), self.dtype)
        return self.data

    def store(self, slots: list[int], blocks: np.ndarray) -> None:
        self._array()[np.asarray(slots, np.int64)] = blocks

    def load(self, slots: list[int]) -> np.ndarray:
        return self._array()[np.asarray(slots, np.int64)]


def swap_capacity_blocks(swap_space_gb: float, block_bytes: int) -> int:
    return int(swap_space_gb * 2**30) // block_bytes


@jax.jit
def _gather_blocks(kv_pool: jax.Array, ids: jax.Array) -> jax.Array:
    return kv_pool[ids]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_blocks(kv_pool: jax.Array, ids: jax.Array, blocks: jax.Array) -> jax.Array:
    return kv_pool.at[ids].set(blocks)


def gather_blocks(kv_pool: jax.Array, block_ids: list[int]) -> np.ndarray:
    """Swap-out: the given device blocks, copied to host, in one jitted gather.
    The count is padded to a power of two (with the null block) so few shapes compile."""
    ids = np.zeros(next_pow2(len(block_ids)), np.int32)
    ids[:len(block_ids)] = block_ids
    return np.asarray(_gather_blocks(kv_pool, jnp.asarray(ids)))[:len(block_ids)]


def scatter_blocks(kv_pool: jax.Array, block_ids: list[int], blocks: np.ndarray) -> jax.Array:
    """Swap-in: writes host `blocks` into device `block_ids` with one jitted, donated
    `kv_pool.at[ids].set(blocks)`; padding rows (power-of-two count) go to the null block."""
    n = next_pow2(len(block_ids))
    ids = np.zeros(n, np.int32)
    ids[:len(block_ids)] = block_ids
    data = np.zeros((n, *kv_pool.shape[1:]), kv_pool.dtype)
    data[:len(block_ids)] = blocks
    return _scatter_blocks(kv_pool, jnp.asarray(ids), jnp.asarray(data))

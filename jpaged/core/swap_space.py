"""Host memory for swapped-out blocks: numpy, no jax (the scheduler imports it)."""

from __future__ import annotations

import collections
import math

import numpy as np


class HostSwapSpace:
    """Host-memory (numpy) pool that preempted sequences' blocks are swapped to.

    `capacity` blocks of the device block shape; the array is allocated on the
    first swap-out (np.empty: pages are committed only as they are written).
    Slot accounting (allocate/free) is the scheduler's; the runner moves data
    with `store` (device -> host) and `load` (host -> device).
    """

    def __init__(self, capacity: int, block_shape: tuple[int, ...], dtype):
        self.block_shape = tuple(block_shape)
        self.dtype = np.dtype(dtype)
        self.reset(capacity)

    def reset(self, capacity: int) -> None:
        """Empty, with room for `capacity` blocks (nothing may be swapped out)."""
        self.capacity = max(0, int(capacity))
        self._free: collections.deque[int] = collections.deque(range(self.capacity))
        self.data: np.ndarray | None = None

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

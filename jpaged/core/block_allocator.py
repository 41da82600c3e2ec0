"""The free list of physical KV blocks: which block ids are handed out and which are free.

Block 0 is the null block (NULL_BLOCK): padding in block tables and step arrays,
never handed out.  Reference counts, prefix caching and eviction sit on top, in
jpaged.core.block_manager.
"""

from __future__ import annotations

import collections

NULL_BLOCK = 0  # padding in block tables and step arrays; never handed out


class NoFreeBlocksError(RuntimeError):
    """The pool has no free block left."""


class BlockAllocator:
    """O(1) free-list allocator over physical blocks 1..num_blocks-1."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: collections.deque[int] = collections.deque(range(1, num_blocks))
        self._in_use = bytearray(num_blocks)  # 1: allocated

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


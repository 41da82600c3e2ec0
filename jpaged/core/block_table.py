"""A sequence's block table: its map from logical block to physical block."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from jpaged.core.block_allocator import NULL_BLOCK


class BlockOwner(Protocol):
    """What a released block goes back to: a BlockAllocator or the BlockManager."""

    def free(self, block: int) -> None: ...


@dataclasses.dataclass
class BlockTable:
    """One sequence's map from logical block to physical block (grown and copied
    by the BlockManager, which owns the block size)."""

    block_ids: list[int] = dataclasses.field(default_factory=list)
    start: int = 0  # entries before it are the null block (a sliding group's, before its window)

    def release(self, allocator: BlockOwner) -> None:
        """Frees every block, last first (so that the deepest is evicted first);
        null entries (a sliding group's blocks before its window) hold nothing."""
        for block in reversed(self.block_ids):
            if block != NULL_BLOCK:
                allocator.free(block)
        self.block_ids.clear()
        self.start = 0


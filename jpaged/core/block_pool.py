"""Reference-counted physical blocks over the free list (BlockAllocator), with the
prefix cache's blocks kept until evicted, and copy-on-write.  The BlockManager
(jpaged.core.block_manager) is this pool plus prefix matching and the per-sequence
tables of every layer group.

  allocate() -> block      a block with refcount 1: a free one, else the
                           least recently used cached one is evicted
  free(block)              refcount - 1; at 0 a cached block stays cached
                           (evictable), an uncached one returns to the free list
  share(block)             refcount + 1 (revives a cached block at refcount 0)
  cow(block) -> block      the block itself if the caller may write into it,
                           else a private copy (the device copy is queued;
                           take_copies() hands the step's copies to the runner)

A block may be written only when its refcount is 1 and it is not in the prefix
index: cached content is immutable, so a request whose whole prompt is cached
copies its last block before recomputing the last prompt token (for its
logits) instead of writing into the shared block.

Eviction: blocks at refcount 0 that are cached sit in one OrderedDict in
release order; eviction pops its head (least recently used).  A sequence
releases its blocks last-to-first, so among blocks released together the
deepest (end of the longest prefix) is evicted first.  Every operation is O(1):
nothing scans the pool.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from jpaged.core.block_allocator import NULL_BLOCK, BlockAllocator, NoFreeBlocksError
from jpaged.core.prefix_cache import make_index
from jpaged.core.stats import EngineStats


@dataclasses.dataclass(frozen=True)
class GroupKey:
    """A cached block of group > 0: found by group 0's handle of the same logical block."""
    group: int
    handle: Any


class BlockPool:
    """Reference counts, cached blocks (in the prefix index, or for groups > 0 by
    group 0's handle) and their eviction, and the queued copy-on-write copies."""

    def __init__(self, num_blocks: int, *, index: str = "hash", allocator: BlockAllocator | None = None,
                 stats: EngineStats | None = None):
        self.index_kind = index
        self.stats = stats if stats is not None else EngineStats()  # shared with the engine
        self.reset(num_blocks, allocator=allocator)

    def reset(self, num_blocks: int | None = None, *, allocator: BlockAllocator | None = None) -> None:
        """Empties the pool in place (no sequence may hold blocks): a fresh free
        list of num_blocks blocks (default: as many as now) and an empty prefix cache."""
        self.allocator = allocator if allocator is not None else BlockAllocator(num_blocks or self.num_blocks)
        self.num_blocks = self.allocator.num_blocks
        self.index = make_index(self.index_kind)
        self._group_index: dict[GroupKey, int] = {}  # groups > 0: cached blocks by group 0's handle
        self.refcount = [0] * self.num_blocks
        self._handle: dict[int, Any] = {}  # block -> its index handle, for cached blocks
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._copies: list[tuple[int, int]] = []
        self.num_shared_blocks = 0  # blocks with refcount > 1

    # ------------------------------------------------------------- accounting
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocate() can return: free ones plus evictable cached ones."""
        return self.allocator.num_free_blocks + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._handle)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, next victim first (for tests and debugging)."""
        return list(self._evictable)

    # -------------------------------------------------------------- block API
    def allocate(self) -> int:
        if self.allocator.num_free_blocks == 0:
            if not self._evictable:
                raise NoFreeBlocksError("KV pool exhausted: no free or evictable block")
            self._evict_one()
        block = self.allocator.allocate()
        self.refcount[block] = 1
        return block

    def _evict_one(self) -> None:
        block, _ = self._evictable.popitem(last=False)
        handle = self._handle.pop(block)
        if isinstance(handle, GroupKey):
            del self._group_index[handle]
        else:
            self.index.remove(handle, block)
        self.allocator.free(block)
        self.stats.evictions += 1

    def drop_cached(self) -> int:
        """Evicts every cached block no sequence holds; returns how many."""
        n = len(self._evictable)
        while self._evictable:
            self._evict_one()
        return n

    def free(self, block: int) -> None:
        rc = self.refcount[block]
        if block == NULL_BLOCK or rc <= 0:
            raise ValueError(f"block {block} is not referenced (double free?)")
        rc -= 1
        self.refcount[block] = rc
        if rc == 1:
            self.num_shared_blocks -= 1
        elif rc == 0:
            if block in self._handle:
                self._evictable[block] = None  # most recently used end
            else:
                self.allocator.free(block)

    def share(self, block: int) -> None:
        rc = self.refcount[block]
        if rc == 0:
            if block not in self._evictable:
                raise ValueError(f"block {block} is neither referenced nor cached")
            del self._evictable[block]
        elif rc == 1:
            self.num_shared_blocks += 1
            self.stats.shared_blocks_peak = max(self.stats.shared_blocks_peak, self.num_shared_blocks)
        self.refcount[block] = rc + 1

    def needs_cow(self, block: int) -> bool:
        return self.refcount[block] > 1 or block in self._handle

    def cow(self, block: int) -> int:
        """A block the caller may write: `block` itself when it holds the only
        reference to an uncached block, else a fresh copy (refcount moved)."""
        if not self.needs_cow(block):
            return block
        new = self.allocate()  # cannot evict `block`: its refcount is >= 1
        self._copies.append((block, new))
        self.free(block)
        self.stats.cow_copies += 1
        return new

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies to run on the device before the next forward."""
        copies, self._copies = self._copies, []
        return copies

    def check_invariants(self) -> None:
        """Slow consistency check for tests: every block is exactly one of free,
        referenced, or cached at refcount 0."""
        free = set(self.allocator._free)
        assert len(free) == len(self.allocator._free), "duplicate in free list"
        assert NULL_BLOCK not in free and self.refcount[NULL_BLOCK] == 0
        shared = 0
        for b in range(1, self.num_blocks):
            rc = self.refcount[b]
            assert rc >= 0
            shared += rc > 1
            if b in free:
                assert rc == 0 and b not in self._handle and b not in self._evictable, b
                assert not self.allocator.is_allocated(b)
            else:
                assert self.allocator.is_allocated(b), b
                assert rc > 0 or b in self._evictable, f"leaked block {b}"
            if b in self._evictable:
                assert rc == 0 and b in self._handle
        assert shared == self.num_shared_blocks
        assert len(self.index) + len(self._group_index) == len(self._handle)

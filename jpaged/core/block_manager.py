"""Block manager: the block pool (jpaged.core.block_pool: reference counts, cached
blocks and their eviction, copy-on-write) plus automatic prefix caching and the
per-sequence block tables (BlockTable, jpaged.core.block_table) of every layer group.
NULL_BLOCK, NoFreeBlocksError and BlockAllocator (jpaged.core.block_allocator),
BlockTable and PrefixHit (jpaged.core.prefix_hit) are importable from here too.
Host bookkeeping only: the device pool these block ids index is jpaged.runtime.kv_pool's.

API (the scheduler is its only writer), besides the pool's allocate / free / share / cow:

  match(seq)               the longest run of cached full blocks for seq's tokens
  cache_full_blocks(seq)   registers seq's newly filled, computed blocks

Sequence-level operations (what the scheduler calls) cover every layer group
of the KV layout (jpaged.core.kv_layout): seq.block_table is group 0's table,
seq.group_tables the others'.  A sliding-window group's table holds the null
block for every logical block wholly before the window of the next token to
compute (`prepare_seq_write` gives those blocks back), so its blocks per
sequence stop growing past the window.  Its cached blocks are found through
group 0's prefix-index handles: a prefix hit needs, in every sliding group,
the blocks that the first recomputed token's window reaches (`find_hit`).

  find_hit(seq) -> PrefixHit         the usable cached prefix in every group
  admit(seq, hit, end) -> bool       takes the hit's blocks and makes [.., end) writable
  prepare_seq_write(seq, start, end) every group's blocks for positions [start, end)
  truncate(seq, num_tokens)          drops blocks past num_tokens (rejected drafts)
  fork(leader, child)                the child shares every block of the leader
  release(seq)                       gives back every group's blocks
  swap_out(seq) / swap_in(seq, ...)  blocks to copy to host and back
"""

from __future__ import annotations

from typing import Any

from jpaged.core.block_allocator import NULL_BLOCK, BlockAllocator, NoFreeBlocksError
from jpaged.core.block_pool import BlockPool, GroupKey
from jpaged.core.block_table import BlockTable
from jpaged.core.kv_layout import KVLayout
from jpaged.core.prefix_cache import ROOT
from jpaged.core.prefix_hit import PrefixHit, usable_prefix
from jpaged.core.rounding import cdiv
from jpaged.core.stats import EngineStats

__all__ = ["NULL_BLOCK", "BlockAllocator", "BlockManager", "BlockTable", "NoFreeBlocksError", "PrefixHit"]


class BlockManager(BlockPool):
    """The block pool plus prefix matching and each sequence's tables of every layer group."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 index: str = "hash", allocator: BlockAllocator | None = None,
                 stats: EngineStats | None = None, layout: KVLayout | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.layout = layout if layout is not None else KVLayout(1, ((0,),), (None,))
        super().__init__(num_blocks, index=index, allocator=allocator, stats=stats)

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups

    # ------------------------------------------------------------ table writes
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens."""
        return cdiv(num_tokens, self.block_size)

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """Blocks `table` must grow by to hold num_tokens tokens in total."""
        return max(0, self.blocks_for(num_tokens) - len(table.block_ids))

    def prepare_write(self, table: BlockTable, start: int, end: int) -> bool:
        """Makes token positions [start, end) of `table` (a global group's) writable:
        copies-on-write the shared or cached blocks they fall in, then grows the
        table to `end`.  False, changing nothing, when the pool cannot provide
        the blocks."""
        return self._prepare([table], [0], start, end)

    # ---------------------------------------------------------- prefix cache
    def _block_tokens(self, token_ids: list[int], i: int) -> tuple[int, ...]:
        return tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])

    def match(self, seq) -> tuple[list[Any], list[int]]:
        """(handles, blocks) of the longest cached run of seq's leading full blocks.
        Changes nothing: the caller shares the blocks once it admits seq.  A
        sequence still owing prompt logprobs or routes computes every prompt token."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs or seq.owes_routes:
            return [], []
        token_ids, extra = seq.token_ids, seq.extra_keys
        handles, blocks = [], []
        parent = ROOT
        for i in range(len(token_ids) // self.block_size):
            hit = self.index.lookup(parent, self._block_tokens(token_ids, i), extra)
            if hit is None:
                break
            parent, block = hit
            handles.append(parent)
            blocks.append(block)
        return handles, blocks

    def cache_full_blocks(self, seq) -> None:
        """Registers the blocks of seq that are full and computed (prefill or decode)
        and whose tokens are all known (not a step's PLACEHOLDER still on the device)."""
        if not self.enable_prefix_caching:
            return
        table, keys = seq.block_table.block_ids, seq.block_keys
        num_full = min(min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size, len(table))
        if len(keys) >= num_full:
            return
        token_ids, extra = seq.token_ids, seq.extra_keys
        groups = self.tables(seq)[1:]
        for i in range(len(keys), num_full):
            block = table[i]
            handle = self._handle.get(block)
            if handle is None:
                parent = keys[i - 1] if i else ROOT
                handle, inserted = self.index.insert(parent, self._block_tokens(token_ids, i), extra, block)
                if inserted:
                    self._handle[block] = handle
                # else: the same content is cached in another block; ours stays private.
            keys.append(handle)
            for g, group_table in enumerate(groups, start=1):
                block = group_table.block_ids[i] if i < len(group_table.block_ids) else NULL_BLOCK
                key = GroupKey(g, handle)
                if block != NULL_BLOCK and block not in self._handle and key not in self._group_index:
                    self._group_index[key] = block
                    self._handle[block] = key

    # ------------------------------------------------------ sequence level
    def tables(self, seq) -> list[BlockTable]:
        """seq's table of every group (group 0's is seq.block_table)."""
        while len(seq.group_tables) < self.num_groups - 1:
            seq.group_tables.append(BlockTable())
        return [seq.block_table, *seq.group_tables]

    def _first_needed(self, group: int, position: int) -> int:
        return self.layout.first_needed_block(group, position, self.block_size)

    def pages_to_hold(self, start: int, end: int) -> int:
        """Blocks a sequence holds, over every group, while computing positions [start, end)."""
        n = self.blocks_for(end)
        return sum(n - self._first_needed(g, start) for g in range(self.num_groups))

    def _write_cost(self, tables: list[list[int]], firsts: list[int], start: int, end: int) -> int:
        """Blocks that making [start, end) writable takes: copies of shared or cached
        blocks the positions fall in, and new blocks (none before firsts[i])."""
        need, n = 0, self.blocks_for(end)
        for ids, first in zip(tables, firsts):
            need += sum(ids[i] != NULL_BLOCK and self.needs_cow(ids[i])
                        for i in range(start // self.block_size, min(n, len(ids))))
            need += max(0, n - max(len(ids), first))
        return need

    def _drop_before(self, table: BlockTable, first: int) -> None:
        """Gives back table's blocks before logical block `first` (out of every future window)."""
        ids = table.block_ids
        for j in range(table.start, min(first, len(ids))):
            if ids[j] != NULL_BLOCK:
                self.free(ids[j])
                ids[j] = NULL_BLOCK
        table.start = max(table.start, first)

    def prepare_seq_write(self, seq, start: int, end: int) -> bool:
        """Makes positions [start, end) of seq writable in every group (prepare_write
        per table); a sliding group first gives back its blocks wholly before the
        window of the token at `start` (no later token sees them) and gets null
        entries for them when it grows.  False when the pool cannot provide the
        blocks, changing nothing else."""
        tables = self.tables(seq)
        firsts = [self._first_needed(g, start) for g in range(len(tables))]
        for table, first in zip(tables, firsts):
            self._drop_before(table, first)
        return self._prepare(tables, firsts, start, end)

    def _prepare(self, tables: list[BlockTable], firsts: list[int], start: int, end: int) -> bool:
        """prepare_write of each table, whose entries before firsts[i] stay null."""
        if self._write_cost([t.block_ids for t in tables], firsts, start, end) > self.num_free_blocks:
            return False
        n = self.blocks_for(end)
        for table, first in zip(tables, firsts):
            ids = table.block_ids
            for i in range(start // self.block_size, min(n, len(ids))):
                if ids[i] != NULL_BLOCK:
                    ids[i] = self.cow(ids[i])
            ids += [NULL_BLOCK if j < first else self.allocate() for j in range(len(ids), n)]
        return True

    def truncate(self, seq, num_tokens: int) -> int:
        """Frees the blocks of every group's table of seq past those that hold
        num_tokens tokens, last first (rejected draft tokens' blocks); returns how many."""
        freed = 0
        for table in self.tables(seq):
            keep = self.blocks_for(num_tokens)
            extra = [b for b in table.block_ids[keep:] if b != NULL_BLOCK]
            for block in reversed(extra):
                self.free(block)
            del table.block_ids[keep:]
            table.start = min(table.start, keep)
            freed += len(extra)
        return freed

    def find_hit(self, seq) -> PrefixHit:
        """The longest cached prefix seq can use: group 0's run of cached full blocks
        (`match`), cut back until every sliding group also holds the blocks that
        the first recomputed token's window reaches."""
        handles, blocks = self.match(seq)
        if self.num_groups == 1 or not blocks:
            return PrefixHit(len(blocks), handles, [blocks] + [[] for _ in range(self.num_groups - 1)])
        found = [[self._group_index.get(GroupKey(g, h)) for h in handles] for g in range(1, self.num_groups)]

        def first_needed(group: int, num_hit_blocks: int) -> int:  # the first recomputed token's window
            return self._first_needed(group, min(num_hit_blocks * self.block_size, seq.num_tokens - 1))

        return usable_prefix(handles, blocks, found, first_needed)

    def admit(self, seq, hit: PrefixHit, computed: int, end: int) -> bool:
        """Gives seq the hit's blocks (computed tokens of them) and makes positions
        [computed, end) writable; False, changing nothing, when the pool cannot
        provide the blocks this takes (cached blocks revived, copies, new ones)."""
        revived = sum(self.refcount[b] == 0 for ids in hit.tables for b in ids if b != NULL_BLOCK)
        firsts = [self._first_needed(g, computed) for g in range(self.num_groups)]
        cost = self._write_cost(hit.tables, firsts, computed, end) if end > computed else 0
        if revived + cost > self.num_free_blocks:
            return False
        for g, (table, ids) in enumerate(zip(self.tables(seq), hit.tables)):
            for b in ids:
                if b != NULL_BLOCK:
                    self.share(b)
            table.block_ids = list(ids)
            table.start = min(self._first_needed(g, computed), len(ids))
        seq.block_keys = list(hit.handles)
        if end > computed:
            ok = self.prepare_seq_write(seq, computed, end)
            assert ok, "admission accounting is off"
        return True

    def fork(self, leader, child) -> None:
        """child shares every block of leader (parallel sampling)."""
        for src, dst in zip(self.tables(leader), self.tables(child)):
            for b in src.block_ids:
                if b != NULL_BLOCK:
                    self.share(b)
            dst.block_ids, dst.start = list(src.block_ids), src.start
        child.block_keys = list(leader.block_keys)

    def release(self, seq) -> None:
        """Gives back every block of seq (last first: the deepest is evicted first)."""
        for table in reversed(self.tables(seq)):
            table.release(self)
        seq.block_keys = []

    def swap_out(self, seq) -> list[int]:
        """The blocks holding seq's computed tokens, every group's in order (a sliding
        group's null entries skipped; which were null is kept for swap_in)."""
        n = self.blocks_for(seq.num_computed_tokens)
        tables = [t.block_ids[:n] for t in self.tables(seq)]
        seq.swapped_tables = [[b != NULL_BLOCK for b in ids] for ids in tables]
        return [b for ids in tables for b in ids if b != NULL_BLOCK]

    def swap_in_need(self, seq) -> int:
        """Blocks a swapped-out seq needs to resume: its own and its next token's."""
        n, grow = self.blocks_for(seq.num_computed_tokens), self.blocks_for(seq.num_computed_tokens + 1)
        return sum(map(sum, seq.swapped_tables)) + (grow - n) * self.num_groups

    def swap_in(self, seq) -> list[int]:
        """Fresh private blocks in place of the swapped-out ones (the host copy is
        their content), in swap_out's order."""
        blocks = []
        for table, present in zip(self.tables(seq), seq.swapped_tables):
            table.block_ids = [self.allocate() if p else NULL_BLOCK for p in present]
            table.start = next((j for j, p in enumerate(present) if p), len(present))
            blocks += [b for b in table.block_ids if b != NULL_BLOCK]
        seq.block_keys = []
        return blocks

    def record_admission(self, num_tokens: int, num_cached_tokens: int, num_hit_blocks: int) -> None:
        s = self.stats
        s.prompt_tokens += num_tokens
        s.cached_prompt_tokens += num_cached_tokens
        s.cache_hit_blocks += num_hit_blocks

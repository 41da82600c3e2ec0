"""BlockAllocator / BlockTable unit tests, a property test, and leak checks after engine runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import assert_all_blocks_free, random_prompts
from jpaged.core.block_manager import BlockManager
from jpaged.core.block_manager import NULL_BLOCK, BlockAllocator, BlockTable, NoFreeBlocksError
from jpaged.core.sequence import SamplingParams


# ------------------------------------------------------------------ allocator
def test_allocator_hands_out_every_block_but_null_once():
    a = BlockAllocator(6)
    assert a.num_free_blocks == 5 and a.num_used_blocks == 0
    got = [a.allocate() for _ in range(5)]
    assert sorted(got) == [1, 2, 3, 4, 5] and NULL_BLOCK not in got
    assert a.num_free_blocks == 0 and a.num_used_blocks == 5
    assert all(a.is_allocated(b) for b in got) and not a.is_allocated(NULL_BLOCK)
    with pytest.raises(NoFreeBlocksError):
        a.allocate()
    a.free(3)
    assert a.num_free_blocks == 1 and not a.is_allocated(3)
    assert a.allocate() == 3


def test_allocator_rejects_bad_frees_and_sizes():
    a = BlockAllocator(4)
    b = a.allocate()
    a.free(b)
    with pytest.raises(ValueError, match="double free"):
        a.free(b)
    with pytest.raises(ValueError):
        a.free(NULL_BLOCK)
    with pytest.raises(ValueError):
        a.free(2 if b != 2 else 3)  # never allocated
    assert a.num_free_blocks == 3  # failed frees changed nothing
    for n in (0, 1):
        with pytest.raises(ValueError, match="num_blocks"):
            BlockAllocator(n)


# ------------------------------------------------------------------ block table
def test_block_table_grow_and_release():
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    t = BlockTable()
    assert [bm.blocks_needed(t, n) for n in (0, 1, 4, 5, 9)] == [0, 1, 1, 2, 3]
    assert bm.prepare_write(t, 0, 5)
    assert len(t.block_ids) == 2 and bm.num_used_blocks == 2
    assert bm.prepare_write(t, 5, 8) and len(t.block_ids) == 2  # still fits
    assert bm.prepare_write(t, 8, 9) and len(t.block_ids) == 3 and bm.blocks_needed(t, 9) == 0
    t.release(bm)
    assert t.block_ids == [] and bm.num_free_blocks == 9


def test_block_table_grow_fails_cleanly_when_pool_runs_out():
    bm = BlockManager(3, 2, enable_prefix_caching=False)  # 2 usable blocks
    t = BlockTable()
    assert bm.prepare_write(t, 0, 4)
    assert not bm.prepare_write(t, 4, 5)  # changes nothing
    assert len(t.block_ids) == 2 and bm.num_free_blocks == 0


# ------------------------------------------------------------------ property test
@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(2, 24),
       ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "double_free"]), st.integers(0, 1000)),
                    max_size=120))
def test_allocator_random_ops(num_blocks, ops):
    a = BlockAllocator(num_blocks)
    held: list[int] = []
    freed: set[int] = set()
    for op, r in ops:
        if op == "alloc":
            if len(held) == num_blocks - 1:
                with pytest.raises(NoFreeBlocksError):
                    a.allocate()
                continue
            b = a.allocate()
            assert b != NULL_BLOCK and 1 <= b < num_blocks
            assert b not in held, f"block {b} handed out twice"
            held.append(b)
            freed.discard(b)
        elif op == "free" and held:
            b = held.pop(r % len(held))
            a.free(b)
            freed.add(b)
        elif op == "double_free" and freed:
            b = sorted(freed)[r % len(freed)]
            with pytest.raises(ValueError):
                a.free(b)
        assert a.num_free_blocks == num_blocks - 1 - len(held)
        assert a.num_used_blocks == len(held)
        assert {b for b in range(num_blocks) if a.is_allocated(b)} == set(held)
    for b in held:
        a.free(b)
    assert a.num_free_blocks == num_blocks - 1


# ------------------------------------------------------------------ engine leaks
@pytest.mark.parametrize("policy,caching", [("continuous", False), ("static", False), ("continuous", True)])
def test_engine_returns_every_block(make_tiny_llm, policy, caching):
    """After requests of all kinds (chunked prompts, early stops, errors, preemption),
    every block is back: allocator.num_free_blocks == num_blocks - 1 (with the prefix
    cache on: no block is referenced, cached ones are all evictable)."""
    llm = make_tiny_llm(scheduler=policy, num_blocks=12, max_num_seqs=3, max_num_batched_tokens=32,
                        enable_prefix_caching=caching)
    prompts = random_prompts([5, 40, 17, 33, 2, 64], seed=5) + [[], list(range(3, 200))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 3, 30, 12, 1, 8, 5, 5)]
    outs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length"] * 6 + ["error"] * 2
    assert_all_blocks_free(llm)
    if not caching:
        assert llm.allocator.num_free_blocks == llm.num_blocks - 1
    # A second run on the same engine sees the whole pool again.
    again = llm.generate(prompts[:2], params[:2])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:2]]
    assert_all_blocks_free(llm)

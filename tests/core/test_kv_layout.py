"""The hybrid KV layout: sliding-window layers in block tables of their own that
give their blocks back behind the window (jpaged.core.kv_layout).

The tiny Gemma 2 (4 layers: window 8 alternating with global) and Gemma 3
(3 layers: 2 sliding, 1 global) checkpoints of conftest run with 2 and 3 layer
groups; HF parity of their greedy tokens with the hybrid layout (the default)
is tests/models/test_hf_parity.py's.
"""

from __future__ import annotations

import dataclasses

import pytest

from helpers import TINY_ENGINE, assert_all_blocks_free, random_prompts
from jpaged.core.block_manager import NULL_BLOCK, BlockManager
from jpaged.core.kv_layout import kv_layout
from jpaged.core.model_config import FULL, SLIDING, ModelConfig
from jpaged.core.rounding import cdiv
from jpaged.core.sequence import SamplingParams, Sequence

BS = 4
WINDOW = 8  # the tiny Gemmas'


def _config(layer_types, window=4096) -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=len(layer_types),
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                       architecture="gemma", sliding_window=window, layer_types=tuple(layer_types))


# ------------------------------------------------------------- the layout
def test_gemma2_shape_two_groups_of_half_the_layers():
    cfg = _config([SLIDING, FULL] * 13)
    layout = kv_layout(cfg)
    assert layout.layers_per_page == 13 and layout.windows == (None, 4096)
    assert layout.groups == (tuple(range(1, 26, 2)), tuple(range(0, 26, 2)))
    assert layout.place(3) == (0, 1) and layout.place(4) == (1, 2)


def test_gemma3_shape_pads_the_last_sliding_group():
    types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(26)]   # Gemma 3 1B: 4 global, 22 sliding
    layout = kv_layout(_config(types, window=512))
    assert layout.layers_per_page == 4 and layout.num_groups == 7
    assert layout.windows == (None,) + (512,) * 6
    assert layout.groups[0] == (5, 11, 17, 23) and len(layout.groups[-1]) == 2
    assert sorted(sum(layout.groups, ())) == list(range(26))
    # A 16K-token sequence holds every block of the global group, ~the window of the others.
    assert layout.max_pages_per_seq(16384, 16, 16) == 1024 + 6 * (cdiv(511 + 16, 16) + 1)


def test_shared_layout_for_plain_models_and_on_request():
    gemma = _config([SLIDING, FULL] * 2)
    assert kv_layout(gemma, "shared").groups == ((0, 1, 2, 3),)
    llama = dataclasses.replace(gemma, architecture="llama", sliding_window=None, layer_types=None)
    assert not kv_layout(llama).is_hybrid
    with pytest.raises(ValueError, match="kv_layout"):
        kv_layout(gemma, "split")


# ------------------------------------------------------------- host bookkeeping
def _manager(num_blocks=64, caching=True) -> BlockManager:
    layout = kv_layout(_config([SLIDING, FULL], window=WINDOW))
    return BlockManager(num_blocks, BS, enable_prefix_caching=caching, layout=layout)


def _decode(bm: BlockManager, seq: Sequence, n: int) -> None:
    for _ in range(n):
        assert bm.prepare_seq_write(seq, seq.num_computed_tokens, seq.num_computed_tokens + 1)
        seq.num_computed_tokens += 1
        seq.output_token_ids.append(7)
        bm.cache_full_blocks(seq)


def test_sliding_group_gives_back_blocks_behind_the_window():
    bm = _manager()
    seq = Sequence(0, list(range(10)), SamplingParams())
    assert bm.admit(seq, bm.find_hit(seq), 0, 10)
    seq.num_computed_tokens = 10
    _decode(bm, seq, 50)
    full, sliding = bm.tables(seq)
    assert len(full.block_ids) == len(sliding.block_ids) == cdiv(60, BS)
    assert NULL_BLOCK not in full.block_ids
    live = [b for b in sliding.block_ids if b != NULL_BLOCK]
    # The last token written (position 59) saw positions 52..59: blocks 13 and 14 only.
    assert len(live) == 2 and sliding.block_ids[:13] == [NULL_BLOCK] * 13 and sliding.start == 13
    bm.check_invariants()
    bm.release(seq)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_prefix_hit_needs_the_sliding_blocks_of_the_window():
    bm = _manager()
    prompt = list(range(40))
    first = Sequence(0, prompt, SamplingParams())
    assert bm.admit(first, bm.find_hit(first), 0, 40)
    first.num_computed_tokens = 40
    bm.cache_full_blocks(first)
    _decode(bm, first, 12)            # blocks 0..9 of the sliding group are given back (cached, evictable)
    again = Sequence(1, prompt + [99], SamplingParams())
    hit = bm.find_hit(again)
    assert hit.num_blocks == 10        # every prompt block: the sliding ones are still cached
    assert hit.tables[1][:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in hit.tables[1][8:]
    # Once the sliding blocks behind the window are evicted, a hit must stop where
    # the sliding group still holds the window.
    bm.release(first)
    for table_block in hit.tables[1][8:10]:
        key = bm._handle[table_block]
        bm._evictable.move_to_end(table_block, last=False)
        assert key in bm._group_index
    while bm.allocator.num_free_blocks:
        bm.allocate()
    bm.allocate(), bm.allocate()      # evicts the two least recently used: those sliding blocks
    hit = bm.find_hit(again)
    # Blocks 8 and 9 are gone: a hit of h blocks needs sliding blocks (h*4 - 7)//4 .. h-1,
    # so the longest usable one is h = 8 (needs blocks 6, 7: still cached).
    assert hit.num_blocks == 8 and hit.tables[1][6:8] == [b for b in hit.tables[1][6:8] if b]
    bm.check_invariants()


# ------------------------------------------------------------- the engine
@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request):
    path, _ = request.getfixturevalue(f"tiny_{request.param}")
    return str(path)


def _engine(path, **overrides):
    from jpaged.engine.llm import LLM
    return LLM(model=path, **{**TINY_ENGINE, "block_size": BS, **overrides})


PROMPTS = random_prompts([5, 30, 12, 45, 20], seed=41)
# A 16-token system prefix (4 blocks: the window of 8 reaches 2 of them) before 6 prompts.
SYSTEM_PROMPTS = [random_prompts([16], seed=42)[0] + p for p in random_prompts([3, 20, 9, 14, 6, 25], seed=43)]
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def shared_tokens(gemma):
    """The shared layout's tokens for PROMPTS + SYSTEM_PROMPTS."""
    outs = _engine(gemma, kv_layout="shared").generate(PROMPTS + SYSTEM_PROMPTS, PARAMS)
    return [o.token_ids for o in outs]


def test_hybrid_gives_the_shared_layouts_tokens_and_bounded_sliding_blocks(gemma, shared_tokens):
    llm = _engine(gemma)
    layout = llm.kv_layout
    assert layout.is_hybrid and llm.runner.kv_pool.shape[1] == layout.layers_per_page
    for p in PROMPTS:
        llm.add_request(p, PARAMS)
    most = 0
    while llm.has_unfinished_requests():
        llm.step()
        for seq in llm.scheduler.running:
            for g, table in enumerate(llm.block_manager.tables(seq)):
                if layout.windows[g] is not None:
                    most = max(most, sum(b != NULL_BLOCK for b in table.block_ids))
    # A sliding table holds the window behind the next token plus the step's new tokens.
    assert 0 < most <= cdiv(WINDOW - 1 + 64, BS) + 1
    assert_all_blocks_free(llm)
    got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == shared_tokens[:len(PROMPTS)]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_and_prefix_cache_with_the_hybrid_layout(gemma, shared_tokens, mode):
    """A pool too small for the batch, prefix caching on, prompts behind a shared
    system prefix: the shared layout's tokens, preemptions, cache hits (every
    group's blocks of the prefix and the window), and an empty pool after."""
    llm = _engine(gemma, num_blocks=36, max_num_seqs=5, max_num_batched_tokens=32,
                  enable_prefix_caching=True, preemption_mode=mode, swap_space_gb=0.01)
    assert [o.token_ids for o in llm.generate(PROMPTS + SYSTEM_PROMPTS, PARAMS)] == shared_tokens
    assert llm.stats.preemptions > 0 and llm.totals.cache_hit_blocks > 0
    assert_all_blocks_free(llm)
    llm.block_manager.check_invariants()

"""Automatic prefix caching, the block manager, copy-on-write and parallel sampling.

Engine tests run a tiny random Llama (load_format="dummy") with 4-token blocks;
every engine test runs over both prefix indexes (hash map and radix tree).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from helpers import FEW_PROGRAMS
from jpaged.core.block_manager import BlockManager
from jpaged.engine.llm import LLM
from jpaged.core.block_manager import NoFreeBlocksError
from jpaged.entrypoints.metrics import format_summary, summarize
from jpaged.core.prefix_cache import block_hash
from jpaged.core.sequence import SamplingParams, Sequence

BS = 4
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
GREEDY = SamplingParams(max_tokens=5)
SYSTEM = list(range(10, 30))  # 5 full blocks


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def make_llm(config_path: str, **overrides) -> LLM:
    kw = dict(model=config_path, load_format="dummy", block_size=BS, num_blocks=64, max_model_len=96,
              max_num_batched_tokens=64, attention_impl="auto", max_num_seqs=8, **FEW_PROGRAMS)
    return LLM(**{**kw, **overrides})


_LLMS: dict = {}


@pytest.fixture(params=["hash", "radix"])
def llm(request, tiny_config):
    """A caching engine per index, reused across tests with a fresh cache."""
    key = request.param
    if key not in _LLMS:
        _LLMS[key] = make_llm(tiny_config, prefix_cache_index=key)
    engine = _LLMS[key]
    engine.reset_prefix_cache()
    yield engine
    assert_clean(engine)


@pytest.fixture(scope="module")
def ref_llm(tiny_config):
    return make_llm(tiny_config, enable_prefix_caching=False)


def assert_clean(engine: LLM) -> None:
    """No references left: every block is free or cached at refcount 0."""
    bm = engine.block_manager
    bm.check_invariants()
    assert sum(bm.refcount) == 0
    assert bm.num_free_blocks == engine.num_blocks - 1
    assert bm.allocator.num_free_blocks + bm.num_evictable_blocks == engine.num_blocks - 1


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


# ------------------------------------------------------------------ engine tests
def test_greedy_outputs_identical_with_and_without_caching(llm, ref_llm):
    prompts = [SYSTEM + [1, 2, 3], SYSTEM + [4, 5], SYSTEM, SYSTEM[:13], list(range(50, 61)), SYSTEM + [1, 2]]
    want = tokens(ref_llm.generate(prompts, GREEDY))
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)  # every prompt now (partly) cached
    assert tokens(first) == want and tokens(second) == want
    assert llm.stats.cached_prompt_tokens > 0
    assert [o.num_cached_tokens for o in second] == [20, 20, 19, 12, 8, 20]


def test_exact_reuse_counts(llm):
    base = list(range(100, 124))  # 6 full blocks
    llm.generate([base], GREEDY)
    for k in range(6):
        variant = list(base)
        variant[k * BS + 1] = 200 + k  # differs only inside block k
        out = llm.generate([variant], GREEDY)[0]
        assert out.num_cached_tokens == k * BS, k
        assert llm.stats.cache_hit_blocks == k
    # The whole prompt cached: all but its last token are reused; the last block
    # is copied (copy-on-write) before the last token is recomputed.
    out = llm.generate([base], GREEDY)[0]
    assert out.num_cached_tokens == len(base) - 1
    assert llm.stats.cache_hit_blocks == 6 and llm.stats.cow_copies == 1
    assert llm.stats.cache_hit_rate == pytest.approx(23 / 24)


def test_no_reuse_across_cache_salts(llm, ref_llm):
    prompt = SYSTEM + [7, 7]
    salted = lambda s: SamplingParams(max_tokens=5, cache_salt=s)  # noqa: E731
    assert llm.generate([prompt], salted("tenant-a"))[0].num_cached_tokens == 0
    assert llm.generate([prompt], salted("tenant-b"))[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    assert llm.generate([prompt], salted("tenant-a"))[0].num_cached_tokens == 20
    # (LoRA adapters are part of the key as well: tests/models/test_lora.py.)
    want = ref_llm.generate([prompt], GREEDY)[0].token_ids
    assert llm.generate([prompt], salted("tenant-b"))[0].token_ids == want


@pytest.mark.parametrize("prompt_len", [22, 25])  # shared partial last block / none
def test_parallel_sampling_matches_independent_runs(llm, ref_llm, prompt_len):
    prompt = list(range(30, 30 + prompt_len))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=3)
    want = [ref_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i))[0].token_ids
            for i in range(3)]
    out = llm.generate([prompt], params)[0]
    assert [s["token_ids"] for s in out.samples] == want
    assert out.token_ids == want[0] and out.text == out.samples[0]["text"]
    assert len({tuple(w) for w in want}) > 1  # the samples did diverge
    # The samples share the prompt's blocks; when the last prompt token falls
    # inside the shared partial block (22 tokens), two of the three copy it.
    copies = 2 if (prompt_len - 1) % BS else 0
    assert llm.stats.cow_copies == copies
    assert llm.stats.shared_blocks_peak >= prompt_len // BS
    # Again, now from the cache.
    out = llm.generate([prompt], params)[0]
    assert [s["token_ids"] for s in out.samples] == want
    assert out.num_cached_tokens == (prompt_len - 1) // BS * BS
    assert llm.stats.cow_copies == copies


def test_parallel_sampling_greedy_and_prefix_sharing_without_cache(tiny_config, ref_llm):
    """n > 1 shares blocks (and copies on write) with the prefix cache off, too."""
    prompt = SYSTEM + [3, 1]
    want = ref_llm.generate([prompt], GREEDY)[0].token_ids
    out = ref_llm.generate([prompt], SamplingParams(max_tokens=5, n=2))[0]
    assert [s["token_ids"] for s in out.samples] == [want, want]
    assert ref_llm.stats.cow_copies == 1 and ref_llm.stats.cached_prompt_tokens == 0
    assert_clean(ref_llm)


def test_preemption_with_caching(tiny_config, ref_llm):
    """A pool too small for the batch: preempted sequences free their blocks through
    the block manager and, on resume, hit the cache; outputs stay the same."""
    prompts = [SYSTEM + [i] for i in range(6)]
    params = SamplingParams(max_tokens=20)
    want = tokens(ref_llm.generate(prompts, params))
    small = make_llm(tiny_config, num_blocks=24)
    assert tokens(small.generate(prompts, params)) == want
    assert small.scheduler.stats.preemptions > 0
    assert small.stats.cached_prompt_tokens > 0
    assert_clean(small)


def test_static_scheduler_with_caching(tiny_config, ref_llm):
    prompts = [SYSTEM + [1, 2], SYSTEM + [3], SYSTEM[:9]]
    want = tokens(ref_llm.generate(prompts, GREEDY))
    static = make_llm(tiny_config, scheduler="static", max_num_seqs=2, prefix_cache_index="radix")
    assert tokens(static.generate(prompts, GREEDY)) == want
    assert static.stats.cached_prompt_tokens > 0  # the second batch reuses the first's blocks
    assert_clean(static)


def test_eviction_under_pressure_keeps_outputs(tiny_config, ref_llm):
    prompts = [[i] * 12 + [j] for i in range(1, 8) for j in (1, 2)]
    want = tokens(ref_llm.generate(prompts, GREEDY))
    small = make_llm(tiny_config, num_blocks=16, max_num_seqs=2)
    assert tokens(small.generate(prompts, GREEDY)) == want
    assert small.stats.evictions > 0
    summary = summarize(small.generate(prompts, GREEDY), small, 1.0)
    text = format_summary(summary)
    assert "prefix cache hit rate" in text and "evictions" in text
    assert_clean(small)


# ------------------------------------------------------------- block manager
def run_seq(bm: BlockManager, token_ids: list[int], salt=None) -> Sequence:
    """Admits a sequence, 'computes' all its tokens, registers its blocks."""
    seq = Sequence(0, token_ids, SamplingParams(cache_salt=salt))
    handles, blocks = bm.match(seq)
    for b in blocks:
        bm.share(b)
    seq.block_table.block_ids = list(blocks)
    seq.block_keys = list(handles)
    # grow only: the reused blocks are not rewritten
    seq.block_table.block_ids += [bm.allocate() for _ in range(bm.blocks_needed(seq.block_table, len(token_ids)))]
    seq.num_computed_tokens = len(token_ids)
    bm.cache_full_blocks(seq)
    return seq


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_eviction_order_lru_then_deepest(index):
    bm = BlockManager(8, BS, index=index)  # 7 usable blocks
    a = run_seq(bm, list(range(12)))           # blocks a0 a1 a2
    b = run_seq(bm, list(range(50, 58)))       # blocks b0 b1
    a_blocks, b_blocks = list(a.block_table.block_ids), list(b.block_table.block_ids)
    a.block_table.release(bm)                  # released first: least recently used
    b.block_table.release(bm)
    assert bm.evictable_blocks() == a_blocks[::-1] + b_blocks[::-1]
    # A cache hit on a's first block touches it: it becomes most recently used.
    c = run_seq(bm, list(range(4)) + [99])     # reuses a0, allocates one more block
    assert c.block_table.block_ids[0] == a_blocks[0]
    c.block_table.release(bm)
    evicted = []
    held = [bm.allocate() for _ in range(bm.allocator.num_free_blocks)]  # drain the free list
    for _ in range(bm.num_evictable_blocks):
        before = set(bm.evictable_blocks())
        held.append(bm.allocate())
        evicted.append((before - set(bm.evictable_blocks())).pop())
    assert evicted == [a_blocks[2], a_blocks[1], b_blocks[1], b_blocks[0], a_blocks[0]]
    assert bm.stats.evictions == 5 and bm.num_cached_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        bm.allocate()
    for blk in held:
        bm.free(blk)
    bm.check_invariants()
    # Evicted content is gone from the index.
    assert bm.match(Sequence(0, list(range(12)), SamplingParams())) == ([], [])


def test_share_free_cow_refcounts():
    bm = BlockManager(6, BS)
    blk = bm.allocate()
    bm.share(blk)
    assert bm.refcount[blk] == 2 and bm.num_shared_blocks == 1 and bm.needs_cow(blk)
    new = bm.cow(blk)
    assert new != blk and bm.refcount[blk] == 1 and bm.refcount[new] == 1
    assert bm.take_copies() == [(blk, new)] and bm.take_copies() == []
    assert bm.cow(new) == new  # sole owner of an uncached block writes in place
    bm.free(blk)
    bm.free(new)
    with pytest.raises(ValueError):
        bm.free(new)
    bm.check_invariants()
    assert bm.num_free_blocks == 5


def test_block_hash_is_stable_and_chained():
    h0 = block_hash(None, (1, 2, 3, 4), (None, None))
    assert h0 == block_hash(None, (1, 2, 3, 4), (None, None))
    assert h0.hex() == block_hash(None, [1, 2, 3, 4], (None, None)).hex()
    assert h0 != block_hash(None, (1, 2, 3, 4), (None, "salt"))
    assert block_hash(h0, (5, 6, 7, 8)) != block_hash(None, (5, 6, 7, 8))


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / extend / finish / evict against a shadow of the device pool:
    every reused block must hold exactly the tokens the reusing sequence expects."""

    index = "hash"

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS, index=self.index)
        self.content: dict[int, list] = {}  # block -> token per slot (the "device")
        self.running: list[Sequence] = []

    def _write(self, seq: Sequence, end: int) -> bool:
        """As the scheduler does: make [computed, end) writable, run the copies, write."""
        bm, table = self.bm, seq.block_table
        if not bm.prepare_write(table, seq.num_computed_tokens, end):
            return False
        for src, dst in bm.take_copies():
            self.content[dst] = list(self.content.get(src, [None] * BS))
        ids = seq.token_ids
        for pos in range(seq.num_computed_tokens, end):
            blk = table.block_ids[pos // BS]
            self.content.setdefault(blk, [None] * BS)[pos % BS] = ids[pos]
        seq.num_computed_tokens = end
        bm.cache_full_blocks(seq)
        return True

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 14), salt=st.sampled_from([None, "s"]),
          tail=st.integers(0, 3))
    def admit(self, prefix, length, salt, tail):
        ids = ([prefix] * length)[:-1] + [tail]  # shared runs -> cache hits
        seq = Sequence(0, ids, SamplingParams(cache_salt=salt))
        handles, blocks = self.bm.match(seq)
        computed = min(len(blocks) * BS, len(ids) - 1)
        for blk, i in zip(blocks, range(len(blocks))):
            assert self.content[blk] == ids[i * BS:(i + 1) * BS], "cache hit with wrong content"
        revived = sum(self.bm.refcount[b] == 0 for b in blocks)
        if revived > self.bm.num_free_blocks:
            return
        for b in blocks:
            self.bm.share(b)
        seq.block_table.block_ids, seq.block_keys = list(blocks), list(handles)
        seq.num_computed_tokens = computed
        if self._write(seq, len(ids)):
            self.running.append(seq)
        else:
            self._release(seq)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), token=st.integers(0, 3))
    def extend(self, i, token):
        seq = self.running[i % len(self.running)]
        seq.output_token_ids.append(token)
        if not self._write(seq, seq.num_tokens):
            self.running.remove(seq)
            self._release(seq)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        seq = self.running[i % len(self.running)]
        child = Sequence(1, seq.prompt_token_ids, seq.params)
        child.output_token_ids = list(seq.output_token_ids)
        for b in seq.block_table.block_ids:
            self.bm.share(b)
        child.block_table.block_ids, child.block_keys = list(seq.block_table.block_ids), list(seq.block_keys)
        child.num_computed_tokens = seq.num_computed_tokens
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        self._release(self.running.pop(i % len(self.running)))

    @rule(n=st.integers(1, 4))
    def evict(self, n):
        n = min(n, self.bm.num_free_blocks)
        held = [self.bm.allocate() for _ in range(n)]
        for b in held:
            self.content.pop(b, None)  # reused for something else
            self.bm.free(b)

    def _release(self, seq):
        seq.block_table.release(self.bm)
        seq.block_keys = []

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        held: dict[int, int] = {}
        for seq in self.running:
            for b in seq.block_table.block_ids:
                held[b] = held.get(b, 0) + 1
        assert all(self.bm.refcount[b] == held.get(b, 0) for b in range(1, self.bm.num_blocks))
        for seq in self.running:  # every computed token is where its table says
            ids = seq.token_ids
            for pos in range(seq.num_computed_tokens):
                assert self.content[seq.block_table.block_ids[pos // BS]][pos % BS] == ids[pos]

    def teardown(self):
        for seq in self.running:
            self._release(seq)
        self.bm.check_invariants()
        assert sum(self.bm.refcount) == 0


class RadixBlockManagerMachine(BlockManagerMachine):
    index = "radix"


TestBlockManagerHash = BlockManagerMachine.TestCase
TestBlockManagerHash.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBlockManagerRadix = RadixBlockManagerMachine.TestCase
TestBlockManagerRadix.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)

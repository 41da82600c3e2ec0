"""The draft-model proposer (jpaged.runtime.draft_model): its drafts are the draft
model's own greedy continuation (jpaged.decode.generate, no pool of ours) after
partial acceptance, partial catch-ups, a full pool and max_model_len; its blocks
all come back; few programs compile; the loader refuses another vocabulary."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_prompts, with_tokenizer
from jpaged.core.config import apply_overrides, default_config
from jpaged.decode import generate
from jpaged.engine.setup import load_model, resolve_attention_impl
from jpaged.engine.speculation import load_draft_proposer
from jpaged.runtime.draft_model import DraftModelProposer
from jpaged.tokenizer.tokenizer import Tokenizer

K = 4             # num_speculative_tokens of every proposer here
MAX_LEN = 128     # max_model_len
P = MAX_LEN       # the oracle's padded prompt width, B its rows: one compile for the module
B = 8
# The proposers attend with the default kernel (the C++ one on a CPU), the oracle with the reference.
PROPOSER = dict(num_blocks=64, block_size=16, kv_dtype=jnp.float32, attention_impl=resolve_attention_impl("auto")[0],
                max_model_len=MAX_LEN, max_num_seqs=B, num_speculative_tokens=K, max_num_batched_tokens=128)


def model_cfg(model: str, **overrides):
    return apply_overrides(default_config(), model=model, load_format="hf", dtype="float32",
                           attention_impl="reference", **overrides)


@pytest.fixture(scope="module")
def draft(tiny_qwen3):
    """The tiny Qwen3 as the draft model (vocabulary 256, like the tiny Llama target)."""
    return load_model(model_cfg(str(tiny_qwen3[0])), None, False)


@pytest.fixture(scope="module")
def make_proposer(draft):
    def make(**overrides) -> DraftModelProposer:
        return DraftModelProposer(draft.graphdef, draft.params, draft.model_config, **{**PROPOSER, **overrides})
    return make


@pytest.fixture(scope="module")
def oracle(draft):
    """seqs -> the draft model's greedy K next tokens of each (decode.generate, jitted once)."""
    gen = jax.jit(generate, static_argnums=0, static_argnames=("max_new_tokens", "attention_impl"))

    def continuation(seqs: list[list[int]]) -> list[list[int]]:
        prompts, lens = np.zeros((B, P), np.int32), np.ones(B, np.int32)
        for b, s in enumerate(seqs):
            prompts[b, :len(s)], lens[b] = s, len(s)
        tokens, _ = gen(draft.graphdef, draft.params, prompts, lens, max_new_tokens=K, attention_impl="reference")
        return np.asarray(tokens)[:len(seqs)].tolist()
    return continuation


def fed_kv(proposer: DraftModelProposer, seq_id: int, n: int) -> np.ndarray:
    """The K/V of the sequence's first n positions in the draft pool: [layers, 2, kv_heads, n, head_dim]."""
    blocks = np.asarray(proposer.kv_pool)[proposer._seqs[seq_id].table.block_ids]  # [W, layers, 2, heads, bs, d]
    by_position = np.moveaxis(blocks, 0, 3)                                         # [layers, 2, heads, W, bs, d]
    return by_position.reshape(*by_position.shape[:3], -1, by_position.shape[-1])[..., :n, :]


def all_free(proposer: DraftModelProposer) -> bool:
    return proposer.allocator.num_free_blocks == proposer.num_blocks - 1


def test_drafts_are_the_greedy_continuation(make_proposer, oracle):
    # Lengths inside a block, at its end, across several; k below K and 0 too.
    seqs = random_prompts([5, 16, 17, 40, 3], seed=1)
    ks = [K, K, 2, K, 0]
    p = make_proposer()
    out = p.propose([(10 + i, s, k) for i, (s, k) in enumerate(zip(seqs, ks))])
    assert out == [c[:k] for c, k in zip(oracle(seqs), ks)]
    assert p.num_compilations == 1  # 4 rows run (S 4), 78 catch-up tokens (T 128)
    p.reset()
    assert all_free(p)


def test_successive_calls_after_partial_acceptance(make_proposer, oracle):
    """The target keeps j drafts and appends a bonus token that differs from draft j:
    the draft's K/V past the kept ones is stale and must not leak into later drafts."""
    seqs = random_prompts([9, 30, 15], seed=2)
    p = make_proposer()
    accepted = [[0, 2, K], [K, 0, 1], [1, K, 0], [3, 3, 2], [0, 0, 0]]
    for j_row in accepted:
        drafts = p.propose([(i, s, K) for i, s in enumerate(seqs)])
        assert drafts == oracle(seqs)
        for i, j in enumerate(j_row):
            bonus = (drafts[i][j] + 1) % 256 if j < K else 7  # j < K: draft j rejected
            seqs[i] = seqs[i] + drafts[i][:j] + [bonus]
    # The target did not move (e.g. the sequence was not scheduled): the same drafts again.
    drafts = p.propose([(i, s, K) for i, s in enumerate(seqs)])
    assert drafts == oracle(seqs)
    # The target ignored the drafts and decoded 3 tokens of its own, the first not draft 0:
    # the fed drafts after the divergence are stale although the sequence is longer.
    seqs = [s + [(d[0] + 1) % 256] + d[1:3] for s, d in zip(seqs, drafts)]
    assert p.propose([(i, s, K) for i, s in enumerate(seqs)]) == oracle(seqs)
    for i in range(3):
        p.release(i)
    assert all_free(p)


def test_long_catch_up_is_fed_over_several_calls(make_proposer, oracle):
    short, long = random_prompts([6, 90], seed=3)
    p = make_proposer(max_num_batched_tokens=32)
    # Call 1: the short row takes 6 tokens, the long one the other 26; call 2: 1 + 31
    # (the short row re-feeds its last token); call 3: 1 + 31; call 4: the last 2 of 90.
    for call in range(4):
        out = p.propose([(0, short, K), (1, long, K)])
        expected = oracle([short, long])
        assert out[0] == expected[0]
        assert out[1] == (expected[1] if call == 3 else []), call
    p.reset()
    assert all_free(p)


def test_a_full_pool_gives_fewer_drafts_never_an_error(make_proposer, oracle):
    # 4 usable blocks of 16: a (40 tokens + 3 fed drafts) takes 3; b (14 + 3 = 17) finds one
    # block left, enough for 14 + 2 (3 drafts); c (40) finds none and drafts nothing.
    a, b, c = random_prompts([40, 14, 40], seed=4)
    p = make_proposer(num_blocks=5)
    out = p.propose([(0, a, K), (1, b, K), (2, c, K)])
    expected = oracle([a, b, c])
    assert out == [expected[0], expected[1][:3], []]
    assert p.allocator.num_free_blocks == 0
    p.release(0)  # a finished: its blocks go to c
    # c first takes 3 of the 3 free blocks; b still fits its 3 drafts in its one block.
    assert p.propose([(2, c, K), (1, b, K)]) == [expected[2], expected[1][:3]]
    p.release(1)
    p.release(2)
    p.release(2)  # twice, and an unknown id: no-ops
    p.release(12345)
    assert all_free(p)


def test_drafts_stop_at_max_model_len(make_proposer, oracle):
    seqs = random_prompts([MAX_LEN - 2, MAX_LEN - 1, MAX_LEN], seed=5)
    p = make_proposer(max_num_batched_tokens=2 * MAX_LEN)  # both catch-ups in one call
    out = p.propose([(i, s, K) for i, s in enumerate(seqs)])
    expected = oracle(seqs[:2])
    assert out == [expected[0][:2], expected[1][:1], []]  # the last draft at position MAX_LEN - 1
    # Nothing was written past MAX_LEN - 1 (a write there would land in the row's last
    # block): the pool holds what one plain forward over the same tokens writes.
    fed = seqs[0] + out[0][:1]
    plain = make_proposer(max_num_batched_tokens=2 * MAX_LEN)
    assert plain.propose([(0, fed, 1)]) == [expected[0][1:2]]
    np.testing.assert_allclose(fed_kv(p, 0, len(fed)), fed_kv(plain, 0, len(fed)), atol=1e-5)
    seqs[0] = seqs[0] + [(out[0][0] + 1) % 256]  # draft 0 rejected
    assert p.propose([(0, seqs[0], K)]) == [oracle(seqs[:1])[0][:1]]
    p.reset()
    assert all_free(p)


def test_release_reset_and_a_bounded_number_of_programs(make_proposer):
    p = make_proposer()
    seqs = random_prompts([20, 12], seed=6)
    for _ in range(3):  # one row of 1 catch-up token each time after the first: (S 2, T 2) once
        p.propose([(i, s, K) for i, s in enumerate(seqs)])
    assert p.num_compilations == 2
    compiled = getattr(p._step, "_cache_size", None)  # jax's own count, where it has one
    if compiled is not None:
        assert compiled() == p.num_compilations
    assert not all_free(p)
    p.reset()
    assert all_free(p)
    assert p.propose([]) == []
    with pytest.raises(ValueError, match="outside"):
        p.propose([(0, seqs[0], K + 1)])
    with pytest.raises(ValueError, match="twice"):
        p.propose([(0, seqs[0], K), (0, seqs[0], K)])
    with pytest.raises(ValueError, match="max_num_seqs"):
        p.propose([(i, seqs[0], K) for i in range(B + 1)])
    with pytest.raises(ValueError, match="unknown token"):
        p.propose([(0, seqs[0] + [-1], K)])  # a PLACEHOLDER still on the device


def test_a_reused_id_and_a_failed_call(make_proposer, oracle):
    """Safety nets: an id reused for another sequence without release() (its last fed
    token differs) starts over; a call that fails after donating the pool leaves a
    fresh pool and no sequence behind."""
    first, other = random_prompts([20, 12], seed=7)
    other[-1] = (first[-1] + 1) % 256
    p = make_proposer()
    p.propose([(0, first, K)])
    assert p.propose([(0, other, K)]) == oracle([other])

    def lost(params, kv_pool, *args):
        kv_pool.delete()
        raise RuntimeError("device lost")
    p._step, step = lost, p._step
    with pytest.raises(RuntimeError, match="device lost"):
        p.propose([(0, other + [5], K)])
    assert all_free(p) and not p.kv_pool.is_deleted()
    p._step = step
    assert p.propose([(0, first, K)]) == oracle([first])


# ------------------------------------------------------------------ loader
def spec_cfg(target_dir: str, draft_model: str):
    """The engine's config with the speculative fields (added here if the defaults lack them)."""
    base = default_config()
    if "speculative_model" not in base:
        base.speculative_model, base.num_speculative_tokens = "", 0
    return apply_overrides(base, model=target_dir, load_format="hf", dtype="float32", attention_impl="reference",
                           max_model_len=MAX_LEN, max_num_seqs=B, max_num_batched_tokens=128,
                           speculative_model=draft_model, num_speculative_tokens=3)


def permuted_tokenizer(dest: pathlib.Path) -> Tokenizer:
    """The byte-level tokenizer of helpers.with_tokenizer with two ids swapped."""
    vocab = json.loads((dest / "tokenizer.json").read_text())
    model_vocab = vocab["model"]["vocab"]
    first, second = sorted(model_vocab, key=model_vocab.get)[:2]
    model_vocab[first], model_vocab[second] = model_vocab[second], model_vocab[first]
    (dest / "tokenizer.json").write_text(json.dumps(vocab))
    return Tokenizer.from_hf_dir(dest)


def test_load_draft_proposer(tiny_llama_dir, tiny_qwen3, tmp_path):
    target = load_model(model_cfg(tiny_llama_dir), None, False)
    draft_dir = with_tokenizer(str(tiny_qwen3[0]), tmp_path / "draft")
    same = Tokenizer.from_hf_dir(draft_dir)
    p = load_draft_proposer(spec_cfg(tiny_llama_dir, str(draft_dir)), target.model_config, same, num_blocks=9)
    assert (p.num_blocks, p.num_speculative_tokens, p.model_config.vocab_size) == (9, 3, 256)
    assert p.model_config.qk_norm  # the Qwen3, not the target
    # A target without a tokenizer: vocab_size is all there is to compare.
    load_draft_proposer(spec_cfg(tiny_llama_dir, str(draft_dir)), target.model_config, None, num_blocks=9)

    shutil.copytree(draft_dir, tmp_path / "other")
    with pytest.raises(ValueError, match=r"speculative_model .*draft.* another tokenizer"):
        load_draft_proposer(spec_cfg(tiny_llama_dir, str(draft_dir)), target.model_config,
                            permuted_tokenizer(tmp_path / "other"), num_blocks=9)


def test_load_draft_proposer_refuses_another_vocab_size(tiny_llama_dir, tiny_qwen3, tmp_path):
    target_config = load_model(model_cfg(tiny_llama_dir), None, False).model_config
    bigger = tmp_path / "bigger"
    bigger.mkdir()
    hf = json.loads((pathlib.Path(tiny_qwen3[0]) / "config.json").read_text())
    # Only a config.json: refused from the metadata, before any weight loads.
    (bigger / "config.json").write_text(json.dumps({**hf, "vocab_size": 300}))
    with pytest.raises(ValueError, match=r"speculative_model .*bigger.* vocab_size 300, the target model 256"):
        load_draft_proposer(spec_cfg(tiny_llama_dir, str(bigger)), target_config, None, num_blocks=9)

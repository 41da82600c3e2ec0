"""Shared test helpers and engine settings (fixtures live in conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest


def import_torch():
    """torch for the reference side, on one thread: on a shared, loaded CPU its
    default thread pool oversubscribes the cores and runs ~8x slower."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    return torch


# Engine settings for the tiny Llama: small pool and lengths keep compiles cheap.
# Prefix caching is off so that these tests exercise plain paging (tests turn it on
# where they mean to; tests/test_prefix_cache.py covers it in depth).
TINY_ENGINE = dict(load_format="hf", max_model_len=128, block_size=16, num_blocks=64,
                   max_num_seqs=8, max_num_batched_tokens=128, attention_impl="reference",
                   enable_prefix_caching=False)


def assert_all_blocks_free(llm) -> None:
    """After a generate(): no block is referenced by a sequence any more.  With the
    prefix cache on, finished blocks may stay cached, but only as evictable ones."""
    bm = getattr(llm, "block_manager", None)
    if bm is not None:
        assert bm.num_used_blocks == 0
        assert bm.num_free_blocks == llm.num_blocks - 1
    if bm is None or not llm.config.enable_prefix_caching:
        assert llm.allocator.num_free_blocks == llm.num_blocks - 1
        assert not any(llm.allocator.is_allocated(b) for b in range(llm.num_blocks))


def random_prompts(lengths, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids 3.., avoiding bos/eos/pad)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


# The embedded SmolLM2: one engine for the whole session.
SMOLLM_ENGINE = dict(dtype="float32", max_model_len=256, block_size=16, num_blocks=96,
                     max_num_seqs=8, max_num_batched_tokens=256, attention_impl="reference")

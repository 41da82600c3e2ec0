"""Draft-model proposer: k greedy draft tokens per sequence from a small model
that shares the target's vocabulary, with a paged KV pool of its own.

The engine calls `propose` once per step with every running sequence's token
ids (prompt + output, all known) and verifies the drafts with the target
(jpaged.runtime.speculative).  Per sequence the proposer remembers its draft
block table and `fed`: the token ids whose draft K/V is in its pool, in order.
A call's valid prefix is the longest common prefix of `fed` and the given ids:
drafts the target rejected are not among the new ids, so their K/V (past the
valid prefix) is stale and the catch-up chunk, token_ids[valid:], overwrites
it.  The chunk is at least the last token, whose logits give the first draft.

One jitted program per call (the pool donated): a ragged forward over every
row's catch-up chunk packed back to back, the first draft from each row's last
logits, then a `fori_loop` of K - 1 one-token decode steps, each row feeding its
previous draft; the drafts come back as [S, K] int32.  Shapes come from a few
buckets: S rows = next power of two of the rows run, T flat tokens = next power
of two of their catch-up tokens, K = num_speculative_tokens, block tables
ceil(max_model_len / block_size) wide; each (S, T) is one compiled program.

Limits: at most max_num_batched_tokens catch-up tokens per call (a longer
catch-up is fed in parts over several calls, drafting nothing until it is
done); a row whose blocks the draft pool cannot provide drafts fewer tokens or
none this call; no draft goes past position max_model_len - 1.  Host code is
numpy only; one device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.core.block_manager import BlockAllocator, BlockTable
from jpaged.core.model_config import ModelConfig
from jpaged.core.rounding import cdiv, next_pow2
from jpaged.runtime.step import forward_step, ragged_metadata
from jpaged.runtime.kv_pool import create_kv_pool
from jpaged.runtime.sampling import greedy
from pallas_kernels.reference import token_layout

__all__ = ["DraftModelProposer", "draft_step"]


def draft_step(graphdef: nnx.GraphDef, params: nnx.State, kv_pool: jax.Array, tokens: jax.Array,
               block_tables: jax.Array, context_lens: jax.Array, q_lens: jax.Array,
               num_drafts: jax.Array, *, num_speculative_tokens: int, block_size: int,
               attention_impl: str) -> tuple[jax.Array, jax.Array]:
    """Catch-up forward then greedy drafting, all on the device: (drafts [S, K] int32, new kv_pool).

    Row s has context_lens[s] tokens in the pool and q_lens[s] new ones in
    tokens[T] (packed back to back, then padding); it drafts num_drafts[s] <= K
    tokens (0 for padding rows and rows still catching up), so decode step i
    (1 <= i < K) feeds its draft i - 1 only while i < num_drafts[s]: a row writes
    no K/V past what it drafts.  drafts[s, j] for j >= num_drafts[s] is garbage.
    """
    S, K = block_tables.shape[0], num_speculative_tokens
    meta = ragged_metadata(block_tables, context_lens, q_lens, tokens.shape[0], block_size)
    logits, kv_pool = forward_step(graphdef, params, kv_pool, tokens, meta, attention_impl=attention_impl)
    first = greedy(logits)
    drafts = jnp.zeros((S, K), jnp.int32).at[:, 0].set(first)
    kv_lens = meta.kv_lens  # each row's length after its catch-up chunk

    def body(i, state):
        kv_pool, last, drafts = state
        # Rows that feed nothing this step have q_len 0 (no token, no write), so the
        # feeding rows' tokens are not at their row index: lay them out as the step does.
        feeds = (i < num_drafts).astype(jnp.int32)
        meta = ragged_metadata(block_tables, kv_lens + i - 1, feeds, S, block_size)
        seq, _, valid = token_layout(meta.cu_q_lens, meta.kv_lens, S)
        logits, kv_pool = forward_step(graphdef, params, kv_pool, jnp.where(valid, last[seq], 0), meta,
                                       attention_impl=attention_impl)
        token = greedy(logits)
        return kv_pool, token, jax.lax.dynamic_update_slice(drafts, token[:, None], (0, i))

    kv_pool, _, drafts = jax.lax.fori_loop(1, K, body, (kv_pool, first, drafts))
    return drafts, kv_pool


@dataclasses.dataclass
class _DraftSeq:
    """One sequence's draft state: its blocks in the draft pool and what they hold."""
    table: BlockTable = dataclasses.field(default_factory=BlockTable)
    fed: list[int] = dataclasses.field(default_factory=list)  # token ids whose K/V is in the pool
    confirmed: int = 0  # fed[:confirmed] were the caller's own token ids (the rest: drafts)


@dataclasses.dataclass
class _Row:
    """One sequence's share of a call: feed token_ids[start:start + num_new], draft num_drafts."""
    index: int        # in the call's requests
    state: _DraftSeq
    token_ids: list[int]
    start: int
    num_new: int
    num_drafts: int   # 0: a partial catch-up, nothing drafted this call


class DraftModelProposer:
    """k greedy draft tokens per sequence from a small model, with its own KV pool.

    `graphdef`, `params`: the draft model (jpaged.models.base.split_model), on
    one device; `model_config` its architecture.  The pool holds `num_blocks`
    blocks of `block_size` tokens in `kv_dtype` (block 0 is the null block).
    A call drafts for at most `max_num_seqs` sequences, feeds at most
    `max_num_batched_tokens` catch-up tokens and drafts at most
    `num_speculative_tokens` tokens per sequence.
    """

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, model_config: ModelConfig, *,
                 num_blocks: int, block_size: int, kv_dtype: Any, attention_impl: str,
                 max_model_len: int, max_num_seqs: int, num_speculative_tokens: int,
                 max_num_batched_tokens: int):
        for name, value in (("num_speculative_tokens", num_speculative_tokens), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("max_model_len", max_model_len)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.params = params
        self.model_config = model_config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.num_speculative_tokens = num_speculative_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.table_width = cdiv(max_model_len, block_size)
        self.allocator = BlockAllocator(num_blocks)
        self._new_pool = functools.partial(create_kv_pool, model_config, num_blocks, block_size, kv_dtype)
        self.kv_pool = self._new_pool()
        self._seqs: dict[int, _DraftSeq] = {}
        # One program per (S, T): graphdef and the ints static, the pool donated (written in place).
        static = dict(num_speculative_tokens=num_speculative_tokens, block_size=block_size,
                      attention_impl=attention_impl)
        self._step = jax.jit(functools.partial(draft_step, graphdef, **static), donate_argnums=(1,))
        self._shapes: set[tuple[int, int]] = set()  # (S, T) of every call so far: one program each

    @property
    def num_compilations(self) -> int:
        """Distinct programs compiled so far (one per (S, T) bucket)."""
        return len(self._shapes)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def release(self, seq_id: int) -> None:
        """Frees the sequence's draft blocks (it finished, was preempted or aborted);
        an unknown id is a no-op."""
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            state.table.release(self.allocator)

    def reset(self) -> None:
        """Forgets every sequence (their blocks return to the free list)."""
        for seq_id in list(self._seqs):
            self.release(seq_id)

    def propose(self, requests: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """requests: (seq_id, all of the sequence's token ids so far (prompt + output,
        all known), k_i <= num_speculative_tokens).  Returns, per request, up to k_i
        draft token ids: fewer or none when the draft pool is full, when the sequence
        nears max_model_len, or when its catch-up did not fit this call's token
        budget (then it is fed in part and continues next call).  A sequence's
        token ids must only grow between calls (drafts the target rejected
        excepted): one that changes otherwise must be released first."""
        self._check(requests)
        rows, budget = [], self.max_num_batched_tokens
        for index, (seq_id, token_ids, k) in enumerate(requests):
            row = self._plan(index, seq_id, token_ids, k, budget)
            if row is not None:
                rows.append(row)
                budget -= row.num_new
        out: list[list[int]] = [[] for _ in requests]
        if not rows:
            return out
        drafts = self._run(rows)
        for r, row in enumerate(rows):
            self._record(row, drafts[r])
            out[row.index] = drafts[r, :row.num_drafts].tolist()
        return out

    # ------------------------------------------------------------------ host
    def _check(self, requests: list[tuple[int, list[int], int]]) -> None:
        """ValueError for a call the engine should never make."""
        if len(requests) > self.max_num_seqs:
            raise ValueError(f"{len(requests)} sequences exceed max_num_seqs={self.max_num_seqs}")
        if len({seq_id for seq_id, _, _ in requests}) != len(requests):
            raise ValueError("a sequence appears twice in one propose() call")
        for seq_id, token_ids, k in requests:
            if not token_ids:
                raise ValueError(f"sequence {seq_id} has no tokens")
            if not 0 <= k <= self.num_speculative_tokens:
                raise ValueError(f"sequence {seq_id}: k={k} is outside [0, {self.num_speculative_tokens}]")

    def _plan(self, index: int, seq_id: int, token_ids: list[int], k: int, budget: int) -> _Row | None:
        """The row's share of this call (its blocks allocated), or None when it runs
        nothing: no draft wanted or possible, no budget or no blocks left."""
        n = len(token_ids)
        k = min(k, self.max_model_len - n)  # the last draft sits at position n + k - 1
        if k <= 0 or budget <= 0:
            return None
        state = self._seqs.setdefault(seq_id, _DraftSeq())
        start = _valid_prefix(state, token_ids)
        if min(token_ids[start:]) < 0:  # e.g. a PLACEHOLDER: the step that samples it has not returned
            raise ValueError(f"sequence {seq_id} has an unknown token (id < 0): drafts need every token")
        num_new = min(n - start, budget)
        if num_new < n - start:  # a partial catch-up drafts nothing until it is done
            k = 0
        k = self._grow(state.table, start + num_new, k)
        if k < 0:
            return None
        return _Row(index, state, token_ids, start, num_new, k)

    def _grow(self, table: BlockTable, fed_len: int, k: int) -> int:
        """Allocates the blocks for fed_len tokens plus the k - 1 drafts fed after
        them, lowering k to what the free blocks hold; the k granted (0 when k is
        0), or -1 (nothing allocated) when not even the catch-up fits."""
        have, free = len(table.block_ids), self.allocator.num_free_blocks
        while k >= 0:
            need = cdiv(fed_len + max(k - 1, 0), self.block_size) - have
            if need <= free:
                table.block_ids += [self.allocator.allocate() for _ in range(max(need, 0))]
                return k
            k = k - 1 if k > 1 else -1  # k = 1 needs what the catch-up alone needs
        return -1

    def _run(self, rows: list[_Row]) -> np.ndarray:
        """One device call for every row: drafts [len(rows), K] on the host."""
        S = next_pow2(len(rows))
        T = max(next_pow2(sum(row.num_new for row in rows)), S)
        tokens = np.zeros(T, np.int32)
        tables = np.zeros((S, self.table_width), np.int32)  # padding rows: the null block only
        context_lens, q_lens, num_drafts = (np.zeros(S, np.int32) for _ in range(3))
        end = 0
        for r, row in enumerate(rows):
            tokens[end:end + row.num_new] = row.token_ids[row.start:row.start + row.num_new]
            end += row.num_new
            tables[r, :len(row.state.table.block_ids)] = row.state.table.block_ids
            context_lens[r], q_lens[r], num_drafts[r] = row.start, row.num_new, row.num_drafts
        self._shapes.add((S, T))
        try:
            drafts, self.kv_pool = self._step(self.params, self.kv_pool, tokens, tables, context_lens,
                                              q_lens, num_drafts)
            return np.asarray(jax.device_get(drafts))[:len(rows)]
        except BaseException:
            if self.kv_pool.is_deleted():  # donated to the failed call: every sequence's K/V is gone
                self.reset()
                self.kv_pool = self._new_pool()
            raise

    @staticmethod
    def _record(row: _Row, drafts: np.ndarray) -> None:
        """What the pool now holds for the row: its catch-up, then the drafts it fed
        (all but the last, which was only sampled)."""
        fed, end = row.state.fed, row.start + row.num_new
        del fed[row.start:]
        fed += row.token_ids[row.start:end]
        fed += drafts[:max(row.num_drafts - 1, 0)].tolist()
        row.state.confirmed = end


def _valid_prefix(state: _DraftSeq, token_ids: list[int]) -> int:
    """How many leading token ids the pool holds K/V for, at most len - 1 (the last
    token is always fed: its logits give the first draft).  Up to `confirmed`
    the ids were the caller's own, so only the last of them is compared (all of
    them when it differs), then the drafts fed after them, one by one."""
    fed, n = state.fed, min(state.confirmed, len(token_ids))
    if n and fed[n - 1] != token_ids[n - 1]:  # not the sequence fed before: compare everything
        n = _common_prefix(fed[:n], token_ids[:n])
    limit = min(len(fed), len(token_ids) - 1)
    while n < limit and fed[n] == token_ids[n]:
        n += 1
    return min(n, len(token_ids) - 1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two equally long lists."""
    differ = np.flatnonzero(np.asarray(a, np.int64) != np.asarray(b, np.int64))
    return int(differ[0]) if differ.size else len(a)

"""Speculative decoding, the engine's side: draft tokens for the running
sequences before each schedule (the scheduler counts what the step accepted).

A decoding sequence with drafts runs them after its decode token in one row
(`ScheduledSeq.drafts`); the step verifies them on the device
(jpaged.runtime.speculative) and the engine keeps the accepted ones plus one
token.  Drafts come from prompt lookup (`ngram`, jpaged.speculative.ngram, on
the host) or from a small draft model (`draft`, jpaged.runtime.draft_model,
with its own KV pool).

Not drafted for: a sequence that samples under a structured-output constraint
(its mask needs each token before the next), one that asks for logprobs (the
step returns them for one token per row), and every sequence while more than
`speculative_disable_by_batch_size` run (a large batch is compute-bound: the
drafts' extra tokens would cost what they save).

Asynchronous scheduling: proposals start from each sequence's last token, so
a step that drafts waits for the step before it (no host/device overlap).
So each sequence backs off: after its second proposal in a row that drafts
nothing (prompt lookup finds no match), it is not drafted for the next 1, then
3, 7, ... (at most MAX_BACKOFF) steps, and a step waits only when some
sequence is due.  A sequence that copies keeps drafting; text that repeats
nothing (most chat answers) keeps the overlap.  A seeded sampled request
draws its tokens from other keys with drafts than without, so the same seed
gives other (equally distributed) tokens when speculation is on.
"""

from __future__ import annotations

import logging
from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np

from jpaged.core.sequence import Sequence, Status
from jpaged.core.config import apply_overrides
from jpaged.core.model_config import ModelConfig
from jpaged.engine.setup import load_model, resolve_attention_impl, resolve_kv_cache_dtype, resolve_layer_loop
from jpaged.loading.weights import read_model_config
from jpaged.runtime.draft_model import DraftModelProposer
from jpaged.speculative import ngram


log = logging.getLogger(__name__)

MAX_BACKOFF = 32


class Speculator:
    """Proposes drafts (method "ngram" or "draft"; "none": never) of at most
    num_speculative_tokens tokens per sequence."""

    def __init__(self, method: str, *, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int, disable_by_batch_size: int, max_model_len: int,
                 draft_model: Any = None):
        if method == "draft" and draft_model is None:
            raise ValueError("speculative_method draft needs a draft model proposer")
        self.method = method
        self.k = num_speculative_tokens
        self.lookup = (prompt_lookup_min, prompt_lookup_max)
        self.disable_by_batch_size = disable_by_batch_size
        self.max_model_len = max_model_len
        self.draft_model = draft_model
        # Per seq_id: proposals in a row that drafted nothing, and steps left to skip.
        self._empty: dict[int, int] = {}
        self._skip: dict[int, int] = {}

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def active(self, running: list[Sequence]) -> bool:
        """Whether the next step drafts (off above the batch size limit)."""
        return self.enabled and (not self.disable_by_batch_size or len(running) <= self.disable_by_batch_size)

    def max_step_tokens(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """The most tokens a step that verifies drafts can hold (0: none ever does)."""
        if not self.enabled:
            return 0
        seqs = min(max_num_seqs, self.disable_by_batch_size or max_num_seqs)
        return min(max_num_batched_tokens, seqs * (1 + self.k))

    def wants_tokens(self, running: list[Sequence]) -> bool:
        """Asynchronous scheduling, once per step: whether the next step proposes
        drafts, for which the step in flight must complete first (True when a
        sequence that may take drafts is not backing off)."""
        for seq_id, skip in self._skip.items():
            self._skip[seq_id] = max(skip - 1, 0)
        return self.active(running) and any(
            self._skip.get(seq.seq_id, 0) == 0 and self._num_drafts(seq, known=False) > 0 for seq in running)

    def propose(self, running: list[Sequence]) -> dict[int, list[int]]:
        """Draft tokens by seq_id for the running sequences that can take them."""
        if not self.active(running):
            return {}
        wanted = [(seq, k) for seq in running if (k := self._num_drafts(seq)) > 0]
        if not wanted:
            return {}
        if self.method == "ngram":
            lo, hi = self.lookup
            drafts = [ngram.propose(np.asarray(seq.token_ids, np.int32), min_n=lo, max_n=hi, k=k).tolist()
                      for seq, k in wanted]
        else:
            try:
                drafts = self.draft_model.propose([(seq.seq_id, seq.token_ids, k) for seq, k in wanted])
            except Exception:  # noqa: BLE001 - drafts are optional: the step runs without them
                log.exception("the draft model failed; this step runs without drafts")
                return {}
        for (seq, _), d in zip(wanted, drafts):
            empty = self._empty[seq.seq_id] = 0 if d else self._empty.get(seq.seq_id, 0) + 1
            self._skip[seq.seq_id] = min(2 ** max(empty - 1, 0) - 1, MAX_BACKOFF)
        return {seq.seq_id: d for (seq, _), d in zip(wanted, drafts) if d}

    def _num_drafts(self, seq: Sequence, known: bool = True) -> int:
        """How many drafts seq may take: none unless it is decoding (with every
        token `known`), unconstrained and without logprobs; never past max_tokens
        or max_model_len (the row emits its accepted drafts plus one token)."""
        if (seq.status is not Status.DECODING or seq.awaits_last_token or seq.grammar is not None
                or seq.params.logprobs is not None or (known and seq.num_known_tokens != seq.num_tokens)):
            return 0
        left = min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens)
        return max(0, min(self.k, left - 1))

    def release(self, seq: Sequence) -> None:
        """seq is finished: its backoff is forgotten, and the draft model frees its blocks."""
        self._empty.pop(seq.seq_id, None)
        self._skip.pop(seq.seq_id, None)
        if self.draft_model is not None:
            self.draft_model.release(seq.seq_id)


def build_speculator(cfg: Any, model_config: Any, tokenizer: Any, num_blocks: int) -> Speculator:
    """The engine's speculator from its config (`draft`: the draft model loads here)."""
    draft_model = None
    if cfg.speculative_method == "draft":
        draft_model = load_draft_proposer(cfg, model_config, tokenizer, num_blocks=num_blocks)
    return Speculator(cfg.speculative_method, num_speculative_tokens=cfg.num_speculative_tokens,
                      prompt_lookup_min=cfg.prompt_lookup_min, prompt_lookup_max=cfg.prompt_lookup_max,
                      disable_by_batch_size=cfg.speculative_disable_by_batch_size,
                      max_model_len=cfg.max_model_len, draft_model=draft_model)


def load_draft_proposer(cfg: ml_collections.ConfigDict, target_config: ModelConfig, target_tokenizer: Any, *,
                        num_blocks: int) -> DraftModelProposer:
    """The proposer for cfg.speculative_model (a .gguf file or a HF checkpoint
    directory, load format "auto") drafting cfg.num_speculative_tokens tokens,
    with a pool of `num_blocks` blocks and the engine's block size, lengths,
    dtype, KV dtype and attention.  ValueError naming the draft model when it
    cannot draft for the target: another vocab_size (checked from its metadata,
    before any weight loads) or, when both have tokenizers, another token-to-id
    vocabulary.  The draft runs on the default device, unsharded."""
    draft = cfg.speculative_model
    vocab = read_model_config(draft, "auto").vocab_size
    if vocab != target_config.vocab_size:
        raise ValueError(f"speculative_model {draft!r} has vocab_size {vocab}, the target model "
                         f"{target_config.vocab_size}: a draft model must share the target's vocabulary")
    # The draft's own load: its path and format; its pool size (checked against memory), never swapped.
    draft_cfg = apply_overrides(cfg, model=draft, load_format="auto", num_blocks=num_blocks,
                                preemption_mode="recompute")
    model = load_model(draft_cfg, None, resolve_layer_loop(cfg.layer_loop))
    _check_tokenizers(draft, model.tokenizer, target_tokenizer)
    return DraftModelProposer(
        model.graphdef, model.params, model.model_config, num_blocks=num_blocks, block_size=cfg.block_size,
        kv_dtype=resolve_kv_cache_dtype(cfg.kv_cache_dtype, jnp.dtype(cfg.dtype)),
        attention_impl=resolve_attention_impl(cfg.attention_impl)[0], max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs, num_speculative_tokens=cfg.num_speculative_tokens,
        max_num_batched_tokens=cfg.max_num_batched_tokens)


def _check_tokenizers(draft: str, draft_tokenizer: Any, target_tokenizer: Any) -> None:
    """ValueError when both tokenizers are known and map some token to other ids."""
    backends = [getattr(t, "backend", None) for t in (draft_tokenizer, target_tokenizer)]
    if None in backends:
        return  # a model without a tokenizer: vocab_size is all there is to compare
    ours, theirs = (b.get_vocab() for b in backends)
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=str)
        raise ValueError(f"speculative_model {draft!r} has another tokenizer than the target model "
                         f"({len(ours)} vs {len(theirs)} tokens, {len(differ)} (token, id) pairs differ, "
                         f"e.g. {differ[0]!r}): a draft model must share the target's vocabulary")

"""The step-input seam: everything the jitted step consumes, built in one place.

One step's inputs are one pytree, `StepInputs`, built by one host function,
`build_step_inputs(scheduled, ...)`, from the scheduler's sequences (numpy
only: no jax work happens here).  The jitted step (`jpaged.runtime.step.run_step`)
takes `(params, kv_pool, inputs)` and returns `(StepResult, kv_pool)`; every
per-request control flows in through `inputs` and every per-request result out
through the `StepResult`.  Nothing else between the scheduler and the device
knows the fields: `ModelRunner` keys its compiled programs on the pytree's
structure, replicates it whole on a mesh (one sharding, a pytree prefix),
broadcasts it whole to the other processes of a multi-process run (it pickles:
numpy arrays in registered dataclasses) and hands it whole to the step.

Variants: an optional field left as None is absent from the pytree, so its
structure (`jax.tree.structure(inputs)`) differs and picks a compiled variant
of its own; static fields (`logprobs`) are part of the structure too.  Today:

    sampling=None         every row greedy: the step skips sampling entirely
    sampling.top_k=None   no row filters: no top-k / top-p threshold search
    logprobs=True         a row wants logprobs: the step also returns them
    prompt_targets        a prefilling row owes prompt logprobs: the LM head runs
                          on every token (implies logprobs=True)
    prev_rows/prev_tokens asynchronous scheduling: some tokens were sampled by the
                          step still on the device (host PLACEHOLDERs); the step
                          reads them from that step's token buffer

Programs are keyed (T, S, structure), so every field's shape must be a function
of the bucket: T tokens, S sequences (or fixed, like the block tables' width).

    logit_mask            a row samples under a structured-output constraint: the
                          step masks its logits with the grammar's bitmask
    draft_tokens          speculative decoding: a row verifies draft tokens; its
                          logits at each of them come out too (logits_indices
                          is then [S * (K + 1)]) and the step returns the
                          accepted drafts plus one token

Adding a feature adds a field (the logit mask went in this way):

  1. here: a field on StepInputs whose shape is a function of the bucket, filled
     in `build_step_inputs` and left None when no scheduled row needs it (so the
     other steps keep their programs);
  2. in `jpaged.runtime.step.run_step`: `if inputs.<field> is not None:` consume it;
  3. nothing else: the runner's jit, program keys, shardings, the broadcast and
     `follow` take the new field as they take the others.
LoRA adapter slots ([S] int32, None when no row uses an adapter) went in the
same three steps; a new result (like the number of draft tokens accepted) is a
field of StepResult.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jpaged.core.scheduler import ScheduledSeq
from jpaged.core.sequence import PLACEHOLDER
from jpaged.models.base import StepMetadata
from jpaged.runtime.sampling import SamplingArrays, TokenLogprobs


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Everything one step consumes besides the weights and the pool.

    tokens[T]          int32, the flat ragged tokens (prefill chunks and decode
                       tokens back to back, then padding)
    meta               where each token goes and which token of each sequence samples
    sampling           per-sequence [S] controls; None: every row is greedy
    prompt_targets[T]  int32, the token after each flat token, when a prefilling
                       row owes prompt logprobs; else None
    prev_rows[T]       int32, asynchronous scheduling only: for a token the
                       previous step samples, its row there (-1: tokens[t] is it)
    prev_tokens[P]     int32, the previous step's StepResult.token_buffer (the
                       runner attaches it: a device array, never on the host)
    logit_mask[S, W]   int32 bitmask, W = ceil(vocab / 32): bit j of word w allows
                       token 32 w + j at the row's sample (a constrained row's
                       grammar wrote it; every other row all ones); None when
                       no scheduled row is constrained
    draft_tokens[S, K] int32, speculative decoding: row s verifies
                       draft_tokens[s, :num_drafts[s]] (also in `tokens`, after
                       its decode token); K is the config's
                       num_speculative_tokens.  None when no row has drafts
    num_drafts[S]      int32, with draft_tokens
    lora_slots[S]      int32, each row's LoRA adapter slot (-1: the base model);
                       None when no scheduled row uses an adapter (jpaged.layers.lora)
    logprobs           static: the step also returns the sampled tokens' logprobs
    capture_routes     static: a row asked for its routed experts (SamplingParams.
                       capture_routes; a MoE model): the step returns every token's
                       routed experts too
    """

    tokens: np.ndarray | jax.Array
    meta: StepMetadata
    sampling: SamplingArrays | None = None
    prompt_targets: np.ndarray | jax.Array | None = None
    prev_rows: np.ndarray | jax.Array | None = None
    prev_tokens: jax.Array | None = None
    logit_mask: np.ndarray | jax.Array | None = None
    draft_tokens: np.ndarray | jax.Array | None = None
    num_drafts: np.ndarray | jax.Array | None = None
    lora_slots: np.ndarray | jax.Array | None = None
    logprobs: bool = False
    capture_routes: bool = False

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.meta.kv_lens.shape[0]


jax.tree_util.register_dataclass(StepInputs, data_fields=["tokens", "meta", "sampling", "prompt_targets",
                                                          "prev_rows", "prev_tokens", "logit_mask",
                                                          "draft_tokens", "num_drafts", "lora_slots"],
                                 meta_fields=["logprobs", "capture_routes"])


@dataclasses.dataclass
class StepResult:
    """What one step computed: a row per scheduled sequence, and for prompt logprobs
    a row per flat token (None when no sequence asked).  Device arrays out of the
    step, numpy after `ModelRunner.collect`."""

    tokens: np.ndarray | jax.Array  # [S]; [S, K + 1] when drafts were verified
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    nan_rows: np.ndarray | jax.Array | None = None  # [S] bool: the row's logits hold a NaN
    # Speculative decoding: row s emits tokens[s, :num_accepted[s] + 1], its
    # accepted drafts and the token after them.
    num_accepted: np.ndarray | jax.Array | None = None
    # Asynchronous scheduling: `tokens` padded to the runner's largest S, which the
    # next step reads on the device (never fetched to the host).
    token_buffer: jax.Array | None = None
    # A MoE model: tokens routed to each expert [L_moe, E] (padding not counted),
    # and with StepInputs.capture_routes each flat token's experts [T, L_moe, k].
    expert_load: np.ndarray | jax.Array | None = None
    routed_experts: np.ndarray | jax.Array | None = None


jax.tree_util.register_dataclass(StepResult, data_fields=["tokens", "logprobs", "prompt_logprobs", "nan_rows",
                                                          "num_accepted", "token_buffer", "expert_load",
                                                          "routed_experts"],
                                 meta_fields=[])


def build_step_inputs(scheduled: list[ScheduledSeq], *, num_tokens: int, num_seqs: int,
                      block_size: int, table_width: int, vocab_size: int, chained: bool = False,
                      num_speculative_tokens: int = 0, kv_groups: int = 1) -> StepInputs:
    """The step's inputs (numpy) for the scheduled sequences, padded to the bucket:
    num_tokens (T) flat tokens, num_seqs (S) sequences, block tables
    table_width wide, logit masks vocab_size wide, drafts num_speculative_tokens
    wide.  `chained` (asynchronous scheduling): the step may read tokens the
    previous step samples (prev_rows; the runner attaches prev_tokens).
    `kv_groups` > 1: the hybrid KV layout's other groups get tables and write
    blocks of their own (StepMetadata.group_block_tables)."""
    tokens, meta = _tokens_and_metadata(scheduled, num_tokens, num_seqs, block_size, table_width, kv_groups)
    logprobs = any(s.seq.params.logprobs is not None or s.seq.params.prompt_logprobs is not None
                   for s in scheduled)
    inputs = StepInputs(tokens=tokens, meta=meta, sampling=_sampling_arrays(scheduled, num_seqs),
                        prompt_targets=_prompt_targets(scheduled, num_tokens) if logprobs else None,
                        prev_rows=_prev_rows(scheduled, tokens) if chained else None,
                        logit_mask=_logit_mask(scheduled, num_seqs, vocab_size),
                        lora_slots=_lora_slots(scheduled, num_seqs), logprobs=logprobs,
                        capture_routes=any(s.seq.params.capture_routes for s in scheduled))
    if not any(s.drafts for s in scheduled):
        return inputs
    return _with_drafts(inputs, scheduled, num_seqs, num_speculative_tokens)


def _with_drafts(inputs: StepInputs, scheduled: list[ScheduledSeq], S: int, K: int) -> StepInputs:
    """Draft verification: each row's drafts [S, K], and logits at every position
    of a row that has them (logits_indices [S * (K + 1)]: row s's j-th entry is
    its token j, the last one repeated past its end; column 0 is where a row
    without drafts samples, its last token)."""
    drafts, num_drafts = np.zeros((S, K), np.int32), np.zeros(S, np.int32)
    indices = np.zeros((S, K + 1), np.int32)
    for i, s in enumerate(scheduled):
        if len(s.drafts) > K:
            raise ValueError(f"{len(s.drafts)} drafts exceed num_speculative_tokens={K}")
        drafts[i, :len(s.drafts)], num_drafts[i] = s.drafts, len(s.drafts)
        last = inputs.meta.logits_indices[i]
        first = last - len(s.drafts)
        indices[i] = np.minimum(first + np.arange(K + 1), last)
    meta = dataclasses.replace(inputs.meta, logits_indices=indices.reshape(-1))
    return dataclasses.replace(inputs, meta=meta, draft_tokens=drafts, num_drafts=num_drafts)


def padding_step_inputs(num_tokens: int, num_seqs: int, table_width: int, chained: bool = False,
                        num_speculative_tokens: int = 0, kv_groups: int = 1, lora: bool = False) -> StepInputs:
    """A greedy step of nothing but padding (all zeros): what precompile traces.
    `chained`: with prev_rows (all -1; the runner attaches prev_tokens);
    `num_speculative_tokens` K > 0: the variant that verifies drafts; `lora`:
    the variant that applies adapters (every row's slot -1)."""
    def zeros(*shape):
        return np.zeros(shape, np.int32)
    groups = kv_groups > 1
    meta = StepMetadata(positions=zeros(num_tokens), write_blocks=zeros(num_tokens),
                        write_offsets=zeros(num_tokens), block_tables=zeros(num_seqs, table_width),
                        kv_lens=zeros(num_seqs), cu_q_lens=zeros(num_seqs + 1),
                        logits_indices=zeros(num_seqs),
                        group_block_tables=zeros(kv_groups - 1, num_seqs, table_width) if groups else None,
                        group_write_blocks=zeros(kv_groups - 1, num_tokens) if groups else None)
    prev_rows = np.full(num_tokens, -1, np.int32) if chained else None
    inputs = StepInputs(tokens=zeros(num_tokens), meta=meta, prev_rows=prev_rows,
                        lora_slots=np.full(num_seqs, -1, np.int32) if lora else None)
    if not num_speculative_tokens:
        return inputs
    K = num_speculative_tokens
    return dataclasses.replace(inputs, meta=dataclasses.replace(meta, logits_indices=zeros(num_seqs * (K + 1))),
                               draft_tokens=zeros(num_seqs, K), num_drafts=zeros(num_seqs))


def _lora_slots(scheduled: list[ScheduledSeq], S: int) -> np.ndarray | None:
    """[S] int32: each row's adapter slot (-1: the base model, and padding rows); None
    when every row runs the base model (that step keeps the base program)."""
    slots = [s.seq.lora_slot for s in scheduled]
    if all(slot < 0 for slot in slots):
        return None
    out = np.full(S, -1, np.int32)
    out[:len(slots)] = slots
    return out


def _logit_mask(scheduled: list[ScheduledSeq], S: int, vocab_size: int) -> np.ndarray | None:
    """[S, ceil(vocab / 32)] int32: each constrained row that samples in this step
    gets its grammar's bitmask, every other row all ones (-1); None when no row
    samples under a constraint.  A row samples when its chunk reaches the end of
    its tokens (a prefill chunk short of it samples nothing)."""
    rows = [(i, s.seq.grammar) for i, s in enumerate(scheduled)
            if s.seq.grammar is not None and s.start + s.num_new == s.seq.num_tokens]
    if not rows:
        return None
    mask = np.full((S, (vocab_size + 31) // 32), -1, np.int32)
    for i, grammar in rows:
        grammar.fill(mask, i)
    return mask


def _prev_rows(scheduled: list[ScheduledSeq], tokens: np.ndarray) -> np.ndarray:
    """For each flat token still a PLACEHOLDER (a sequence's last token, sampled by
    the step on the device), the row that samples it there; -1 elsewhere.  The
    placeholder itself becomes 0 in `tokens` (any id is fine: the step replaces it)."""
    rows = np.full(tokens.shape[0], -1, np.int32)
    end = 0
    for s in scheduled:
        end += s.num_new
        if tokens[end - 1] == PLACEHOLDER:
            rows[end - 1] = s.seq.sample_row
            tokens[end - 1] = 0
    return rows


def _tokens_and_metadata(scheduled: list[ScheduledSeq], T: int, S: int, block_size: int,
                         table_width: int, kv_groups: int = 1) -> tuple[np.ndarray, StepMetadata]:
    """The step's flat host arrays: each token's id, position and (block, offset)."""
    n = sum(s.num_new for s in scheduled)
    if n > T or len(scheduled) > S:
        raise ValueError(f"{len(scheduled)} sequences of {n} tokens exceed the bucket ({S}, {T})")
    bs = block_size
    tokens, positions = np.zeros(T, np.int32), np.zeros(T, np.int32)
    write_blocks, write_offsets = np.zeros((kv_groups, T), np.int32), np.zeros(T, np.int32)
    block_tables = np.zeros((kv_groups, S, table_width), np.int32)
    kv_lens, cu_q_lens = np.zeros(S, np.int32), np.full(S + 1, n, np.int32)
    logits_indices = np.zeros(S, np.int32)
    end = 0
    for i, s in enumerate(scheduled):
        seq, start, k = s.seq, s.start, s.num_new
        for g, table in enumerate([seq.block_table, *seq.group_tables[:kv_groups - 1]]):
            block_tables[g, i, :len(table.block_ids)] = table.block_ids
        pos = np.arange(start, start + k, dtype=np.int32)
        tokens[end:end + k] = seq.token_slice(start, start + k - len(s.drafts)) + s.drafts
        positions[end:end + k] = pos
        write_blocks[:, end:end + k] = block_tables[:, i, pos // bs]
        write_offsets[end:end + k] = pos % bs
        cu_q_lens[i] = end
        end += k
        kv_lens[i] = start + k
        logits_indices[i] = end - 1
    groups = kv_groups > 1
    meta = StepMetadata(positions=positions, write_blocks=write_blocks[0],
                        write_offsets=write_offsets, block_tables=block_tables[0],
                        kv_lens=kv_lens, cu_q_lens=cu_q_lens, logits_indices=logits_indices,
                        group_block_tables=block_tables[1:] if groups else None,
                        group_write_blocks=write_blocks[1:] if groups else None)
    return tokens, meta


def _sampling_arrays(scheduled: list[ScheduledSeq], S: int) -> SamplingArrays | None:
    """None when every sequence is greedy: that step skips sampling entirely."""
    params = [s.seq.params for s in scheduled]
    if all(p.temperature == 0 for p in params):
        return None

    def column(values, dtype):
        out = np.zeros(S, dtype)
        out[:len(values)] = values
        return out
    filtered = any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params)
    return SamplingArrays(
        temperature=column([p.temperature for p in params], np.float32),
        seed=column([s.seq.seed & 0xFFFFFFFF for s in scheduled], np.uint32),
        step=column([len(s.seq.output_token_ids) for s in scheduled], np.int32),
        top_k=column([p.top_k for p in params], np.int32) if filtered else None,
        top_p=column([p.top_p for p in params], np.float32) if filtered else None)


def _prompt_targets(scheduled: list[ScheduledSeq], T: int) -> np.ndarray | None:
    """The token after each flat token, when a prefilling sequence owes prompt
    logprobs (else None: the LM head runs only on the last tokens)."""
    if not any(s.seq.needs_prompt_logprobs for s in scheduled):
        return None
    targets, end = np.zeros(T, np.int32), 0
    for s in scheduled:
        seq, start = s.seq, s.start
        nxt = seq.token_slice(start + 1, start + s.num_new + 1)
        targets[end:end + len(nxt)] = nxt  # (a PLACEHOLDER here is past the prompt: never read)
        end += s.num_new
    return np.maximum(targets, 0)

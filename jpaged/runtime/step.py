"""The engine's step as pure functions: metadata for one flat ragged batch, the
forward, sampling (with its logit mask), logprobs and `run_step`, the one
forward + sample over a `StepInputs` pytree (jpaged.runtime.step_inputs) that
`ModelRunner` compiles per bucket.  jpaged.decode re-exports the public ones
for JAX programs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.core.block_manager import NULL_BLOCK
from jpaged.core.sequence import MAX_LOGPROBS
from jpaged.models.base import StepMetadata, forward
from jpaged.models.moe_common import expert_load
from jpaged.layers import batch_invariant
from jpaged.layers.lora import LoraBatch, LoraWeights, token_slots
from jpaged.runtime.sampling import (RowSum, SamplingArrays, greedy, processed_logits,
                                     sample_processed, token_logprobs)
from jpaged.runtime.sampling import sample as _sample
from jpaged.runtime.speculative import verify
from jpaged.runtime.step_inputs import StepInputs, StepResult
from pallas_kernels.reference import token_layout


def ragged_metadata(block_tables: jax.Array, context_lens: jax.Array, q_lens: jax.Array,
                    num_tokens: int, block_size: int) -> StepMetadata:
    """Step metadata for S sequences whose new tokens are packed back to back.

    Sequence s has context_lens[s] tokens in the pool already and q_lens[s] new
    ones (positions context_lens[s] .. + q_lens[s] - 1); tokens[T] holds them in
    sequence order, then padding up to num_tokens (static).  Computed on the
    device; the engine builds the same arrays on the host instead.
    """
    q_lens = jnp.asarray(q_lens, jnp.int32)
    cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
    kv_lens = jnp.asarray(context_lens, jnp.int32) + q_lens
    seq, pos, valid = token_layout(cu_q_lens, kv_lens, num_tokens)
    logical = jnp.minimum(pos // block_size, block_tables.shape[1] - 1)
    blocks = jnp.where(valid, block_tables[seq, jnp.maximum(logical, 0)], NULL_BLOCK)
    return StepMetadata(positions=jnp.where(valid, pos, 0), write_blocks=blocks,
                        write_offsets=jnp.where(valid, pos % block_size, 0),
                        block_tables=block_tables, kv_lens=kv_lens, cu_q_lens=cu_q_lens,
                        logits_indices=jnp.maximum(cu_q_lens[1:] - 1, 0))


def forward_step(graphdef: nnx.GraphDef, params: nnx.State, kv_pool: jax.Array,
                 tokens: jax.Array, meta: StepMetadata, *, attention_impl: str = "reference",
                 logits: str = "last", lora: LoraBatch | None = None, aux: bool = False
                 ) -> tuple[jax.Array, ...]:
    """Runs the flat tokens[T] (prefill chunks and decode tokens mixed) through the model.

    Returns (logits, new kv_pool): logits [S, vocab] of each sequence's last
    new token, or [T, vocab] with logits="all".  `lora`: adapter slots and each
    token's slot (jpaged.layers.lora), None for the base model alone.  `aux=True`:
    also what the layers recorded (a MoE model's routed experts, see
    `jpaged.models.base.Decoder.__call__`).
    """
    return forward(graphdef, params, tokens, meta, kv_pool, attention_impl=attention_impl,
                   logits=logits, lora=lora, aux=aux)


def sample(logits: jax.Array, sampling: SamplingArrays | None) -> jax.Array:
    """Next tokens [S]; `None` means greedy for every sequence."""
    return greedy(logits) if sampling is None else _sample(logits, sampling)


def apply_logit_mask(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    """logits[S, vocab] with -inf where the row's bitmask mask[S, ceil(vocab / 32)]
    (int32, bit j of word w allows token 32 w + j) forbids the token; None: unchanged."""
    if mask is None:
        return logits
    vocab = logits.shape[-1]
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(mask.shape[0], -1)[:, :vocab].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def _generate_step_with_logprobs(graphdef, params, kv_pool, tokens, meta, sampling, prompt_targets, *,
                                 num_logprobs, logprobs_mode, attention_impl, logit_mask=None, num_seqs=None,
                                 lora=None):
    """generate_step_with_logprobs, also returning the logits at logits_indices
    (raw: before `logit_mask`, which only what is sampled and processed logprobs
    see): [S, vocab], or [S * (k + 1), vocab] when the step verifies drafts
    (`num_seqs` S given: each row samples from its column 0), and the layers'
    records (`forward_step`'s aux)."""
    if logprobs_mode not in ("raw", "processed"):
        raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
    every = prompt_targets is not None
    row_sum = _logprob_row_sum(nnx.merge(graphdef, params))
    logits, kv_pool, recorded = forward_step(graphdef, params, kv_pool, tokens, meta, attention_impl=attention_impl,
                                             logits="all" if every else "last", lora=lora, aux=True)
    at_indices = logits[meta.logits_indices] if every else logits
    last = _sampling_rows(at_indices, num_seqs or at_indices.shape[0])
    allowed = apply_logit_mask(last, logit_mask)
    if sampling is None:
        next_tokens, processed = greedy(allowed), allowed
    else:  # the processed logits serve both the draw and "processed" logprobs
        processed = processed_logits(allowed, sampling)
        next_tokens = sample_processed(processed, sampling)
    source = processed if logprobs_mode == "processed" else last
    prompt = token_logprobs(logits, prompt_targets, num_logprobs, row_sum) if every else None
    return (next_tokens, token_logprobs(source, next_tokens, num_logprobs, row_sum), prompt, kv_pool, at_indices,
            recorded)


def _logprob_row_sum(model: nnx.Module) -> RowSum | None:
    """How logprobs sum over the vocabulary for `model`: batch_invariant.row_sum
    in that mode (jnp's [1, vocab] sum differs from its [M, vocab] one), else jnp.sum."""
    return batch_invariant.row_sum if model.batch_invariant else None


def run_step(graphdef: nnx.GraphDef, params: nnx.State, kv_pool: jax.Array, inputs: StepInputs, *,
             attention_impl: str = "reference", num_logprobs: int = MAX_LOGPROBS,
             logprobs_mode: str = "raw", lora: LoraWeights | None = None) -> tuple[StepResult, jax.Array]:
    """The engine's step: one forward + sample over `inputs` (a `StepInputs`, see
    jpaged.runtime.step_inputs), returning (StepResult, new kv_pool).

    What it computes follows the structure of `inputs` (static under jit, so
    each structure is a program of its own): `generate_step` when no row wants
    logprobs, else `generate_step_with_logprobs` (top `num_logprobs`, in
    `logprobs_mode`), over every token's logits when `inputs.prompt_targets` is
    given.  A feature that adds a field to StepInputs consumes it here.
    `StepResult.nan_rows` flags the rows whose logits hold a NaN (one reduction).
    With `inputs.prev_rows` (asynchronous scheduling) some tokens come from the
    previous step's `token_buffer`, and the step returns its own.  With
    `inputs.logit_mask` (structured outputs) each row samples among the tokens
    its bitmask allows (raw logprobs stay the model's; processed ones are masked).
    With `inputs.lora_slots` each row's tokens get its adapter's update from the
    slots in `lora` (jpaged.layers.lora).
    A MoE model's step also returns its expert load (`StepResult.expert_load`,
    padding not counted) and, with `inputs.capture_routes`, every token's routed
    experts (`StepResult.routed_experts`); a dense model's leaves both None.
    """
    batch = None
    if inputs.lora_slots is not None:
        batch = LoraBatch(lora, token_slots(inputs.lora_slots, inputs.meta.cu_q_lens, inputs.num_tokens))
    if inputs.prev_rows is not None:  # tokens the previous step sampled, still on the device
        prev = inputs.prev_tokens[jnp.maximum(inputs.prev_rows, 0)]
        inputs = dataclasses.replace(inputs, tokens=jnp.where(inputs.prev_rows >= 0, prev, inputs.tokens))
    if inputs.logprobs or inputs.prompt_targets is not None:
        tokens, logprobs, prompt, kv_pool, logits, recorded = _generate_step_with_logprobs(
            graphdef, params, kv_pool, inputs.tokens, inputs.meta, inputs.sampling,
            inputs.prompt_targets, num_logprobs=num_logprobs, logprobs_mode=logprobs_mode,
            attention_impl=attention_impl, logit_mask=inputs.logit_mask, num_seqs=inputs.num_seqs, lora=batch)
        result = StepResult(tokens, logprobs, prompt)
    else:
        logits, kv_pool, recorded = forward_step(graphdef, params, kv_pool, inputs.tokens, inputs.meta,
                                                 attention_impl=attention_impl, lora=batch, aux=True)
        last = _sampling_rows(logits, inputs.num_seqs)
        result = StepResult(sample(apply_logit_mask(last, inputs.logit_mask), inputs.sampling))
    if inputs.draft_tokens is not None:  # speculative decoding
        rows = logits.reshape(inputs.num_seqs, -1, logits.shape[-1])
        result.tokens, result.num_accepted = verify(rows, inputs.draft_tokens, inputs.num_drafts,
                                                    inputs.sampling, result.tokens)
    if "experts" in recorded:  # a MoE model: [L_moe, T, k]
        experts = recorded["experts"]
        valid = jnp.arange(inputs.num_tokens) < inputs.meta.cu_q_lens[-1]  # padding comes last
        result.expert_load = expert_load(experts, valid, nnx.merge(graphdef, params).cfg.num_experts)
        if inputs.capture_routes:
            result.routed_experts = jnp.swapaxes(experts, 0, 1)  # [T, L_moe, k]
    # A row's logits: [vocab], or [(k + 1) * vocab] when it verified drafts.
    result.nan_rows = jnp.isnan(logits.reshape(inputs.num_seqs, -1)).any(axis=-1)
    if inputs.prev_tokens is not None:  # the next step's prev_tokens: one fixed shape for every bucket
        last_token = (result.tokens if result.num_accepted is None else
                      jnp.take_along_axis(result.tokens, result.num_accepted[:, None], axis=1)[:, 0])
        result.token_buffer = jax.lax.dynamic_update_slice(jnp.zeros_like(inputs.prev_tokens),
                                                           last_token.astype(jnp.int32), (0,))
    return result, kv_pool


def _sampling_rows(logits: jax.Array, num_seqs: int) -> jax.Array:
    """Each row's logits at its last token [S, vocab], out of the step's
    logits at logits_indices: [S, vocab], or [S * (k + 1), vocab] when drafts
    are verified (a row's column 0 is then where it samples without drafts)."""
    return logits if logits.shape[0] == num_seqs else logits.reshape(num_seqs, -1, logits.shape[-1])[:, 0]

"""The functional API: pure, jit-able pieces for use inside other JAX programs.

Nothing here holds state.  A caller owns the KV pool (an array it threads
through every call and should donate), the block tables (int32 arrays it builds
with any allocator it likes) and the lengths.  A step is one flat ragged batch:
the new tokens of S sequences packed back to back into tokens[T].

    pool = create_kv_pool(cfg, num_blocks=64, block_size=16, dtype=jnp.float32)
    meta = ragged_metadata(block_tables, context_lens=jnp.array([0]), q_lens=jnp.array([n]),
                           num_tokens=n, block_size=16)
    logits, pool = forward_step(graphdef, params, pool, prompt, meta)
    token = sample(logits, None)            # greedy; or SamplingArrays per sequence

See docs/rl.md, "Using jpaged.decode", for a whole loop.  `generate` (a whole
generation loop) and `score` (log-probabilities of given tokens, with dense
attention and no pool) need no pool from the caller.  `run_step` is the
engine's own step: the same forward + sample over one `StepInputs` pytree
(jpaged.runtime.step_inputs), logprobs included when its structure asks.

`params` is whatever tree `jpaged.models.build_model` made: the separate
wq/wk/wv, w_gate/w_up by default, or wqkv / w_gate_up when built with
`merge_projections=True` (an engine with config merge_projections hands out
that one); every function here runs either with its own graphdef.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models.base import StepMetadata, forward
from jpaged.layers.dense_attention import DENSE
from jpaged.runtime.kv_pool import create_kv_pool
from jpaged.layers.lora import LoraBatch, LoraWeights
from jpaged.runtime.sampling import SamplingArrays, TokenLogprobs, chosen_logprobs, greedy
from jpaged.runtime.sampling import sample as _sample
from jpaged.runtime.step import (_generate_step_with_logprobs, _logprob_row_sum, apply_logit_mask, forward_step,
                                 ragged_metadata, run_step, sample)
from jpaged.runtime.step_inputs import StepInputs, StepResult
from pallas_kernels.reference import token_layout


def generate_step(graphdef: nnx.GraphDef, params: nnx.State, kv_pool: jax.Array,
                  tokens: jax.Array, meta: StepMetadata, sampling: SamplingArrays | None, *,
                  attention_impl: str = "reference") -> tuple[jax.Array, jax.Array]:
    """forward_step + sample: one engine step, (next token of each sequence [S], new kv_pool)."""
    logits, kv_pool = forward_step(graphdef, params, kv_pool, tokens, meta,
                                   attention_impl=attention_impl)
    return sample(logits, sampling), kv_pool


def generate_step_with_logprobs(
        graphdef: nnx.GraphDef, params: nnx.State, kv_pool: jax.Array, tokens: jax.Array,
        meta: StepMetadata, sampling: SamplingArrays | None, prompt_targets: jax.Array | None, *,
        num_logprobs: int, logprobs_mode: str = "raw", attention_impl: str = "reference"
        ) -> tuple[jax.Array, TokenLogprobs, TokenLogprobs | None, jax.Array]:
    """generate_step that also returns log-probabilities (fp32, from the same logits
    the tokens are sampled from): (next tokens [S], their logprobs and top
    `num_logprobs` [S], prompt logprobs [T] or None, new kv_pool).

    `logprobs_mode` "raw": log_softmax of the model's logits; "processed": of the
    logits each row samples from (temperature, top-k / top-p applied; greedy
    rows raw).  With `prompt_targets[T]` (the token that follows each flat token
    in its sequence), the LM head runs on every token and the prompt logprobs
    are those of the targets (always raw: nothing is sampled there).
    """
    *out, _, _ = _generate_step_with_logprobs(graphdef, params, kv_pool, tokens, meta, sampling, prompt_targets,
                                              num_logprobs=num_logprobs, logprobs_mode=logprobs_mode,
                                              attention_impl=attention_impl)
    return tuple(out)


def score(graphdef: nnx.GraphDef, params: nnx.State, token_ids: jax.Array, lengths: jax.Array,
          *, lora: LoraWeights | None = None, lora_slots: jax.Array | None = None,
          return_routes: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Log-probability [B, L - 1] of each next token: entry [b, t] is log p(token_ids[b, t + 1] |
    token_ids[b, :t + 1]) in fp32, 0 where t + 1 >= lengths[b].

    `return_routes=True` (a mixture-of-experts model): (logprobs, routes), routes
    [B, L, L_moe, k] int32 the experts each token was routed to in each MoE layer
    (-1 at padding); what a trainer replays, or checks against the rollout's
    routes (SamplingParams.capture_routes).  ValueError for a dense model.

    Pure and jittable, and differentiable in `params` (put it inside a loss under
    jax.grad).  No pool: the engine's own model code runs the B * L tokens in
    one pass with dense causal attention (`DENSE`), a masked [B, heads, L, L]
    softmax in fp32 with each layer's sliding window and the attention soft cap
    of the config, so its numbers are the engine's raw logprobs (to fp32
    rounding), and its gradient is a plain transformer's: no K/V gather through
    block tables, no pool scatter.  Tokens at or past
    lengths[b] are padding: causality keeps them out of the real ones.

    Checked (ValueError naming the argument): token_ids is [B, L] with B >= 1 and
    L >= 1, lengths is [B]; when the arrays are concrete (not traced), every
    1 <= lengths[b] <= L and every token before lengths[b] is in [0, vocab_size).
    Under jit / grad only the shapes are checked: an id outside the vocabulary is
    then clamped by the embedding gather, and a length outside [1, L] masks
    nothing or everything, silently.

    With `lora` (adapter slots, e.g. `LLM.lora_weights()` or a trainer's own, see
    jpaged.layers.lora) and `lora_slots` [B] (each row's slot, -1: the base
    model), rows score under their adapters, differentiably in `lora` too.

    With the graphdef of an engine in `batch_invariant` mode (jpaged.layers.batch_invariant)
    the pass runs the engine's own kernels, and its logprobs equal the engine's bit
    for bit (for a KV cache of the model's dtype), whatever the other rows, when
    score runs under jit as the engine's step does (run op by op, eagerly, XLA
    fuses no multiply-add, and some elementwise results round differently).
    """
    if (lora is None) != (lora_slots is None):
        raise ValueError("score: pass lora and lora_slots together")
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    check_batch(token_ids, lengths, cfg.vocab_size, ids_name="token_ids", lens_name="lengths")
    B, L = token_ids.shape
    zeros = jnp.zeros(B * L, jnp.int32)
    meta = StepMetadata(positions=jnp.tile(jnp.arange(L, dtype=jnp.int32), B), write_blocks=zeros,
                        write_offsets=zeros, block_tables=jnp.zeros((B, 1), jnp.int32),
                        kv_lens=jnp.full(B, L, jnp.int32), cu_q_lens=L * jnp.arange(B + 1, dtype=jnp.int32),
                        logits_indices=L * jnp.arange(1, B + 1, dtype=jnp.int32) - 1)
    kv = jnp.zeros((2, B * L, cfg.num_kv_heads, cfg.head_dim), jnp.float32)  # never read: see DENSE
    batch = None if lora is None else LoraBatch(lora, jnp.repeat(jnp.asarray(lora_slots, jnp.int32), L))
    if return_routes and not cfg.num_experts:
        raise ValueError(f"score: return_routes needs a mixture-of-experts model; {cfg.architecture} has no experts")
    logits, _, recorded = forward(graphdef, params, token_ids.reshape(-1).astype(jnp.int32), meta, kv,
                                  attention_impl=DENSE, logits="all", lora=batch, aux=True)
    chosen = chosen_logprobs(logits.reshape(B, L, -1)[:, :-1], token_ids[:, 1:], _logprob_row_sum(model))
    real = jnp.arange(L)[None, :] < jnp.asarray(lengths)[:, None]  # [B, L]
    logprobs = jnp.where(real[:, 1:], chosen, 0.0)
    if not return_routes:
        return logprobs
    experts = recorded["experts"]  # [L_moe, B * L, k]
    routes = jnp.swapaxes(experts, 0, 1).reshape(B, L, *experts.shape[::2])
    return logprobs, jnp.where(real[:, :, None, None], routes, -1)


def check_batch(ids: Any, lengths: Any, vocab_size: int, *, ids_name: str, lens_name: str) -> None:
    """ValueError (naming `ids_name` / `lens_name`) for a batch of right-padded
    rows ids [B, L] with lengths [B] that is malformed: wrong ranks or sizes,
    no rows or columns, and, for concrete (untraced) arrays, a length outside
    [1, L] or a token before its row's length outside [0, vocab_size)."""
    shape, lens_shape = np.shape(ids), np.shape(lengths)
    if len(shape) != 2:
        raise ValueError(f"{ids_name} must be [batch, length], got shape {tuple(shape)}")
    B, L = shape
    if B < 1 or L < 1:
        raise ValueError(f"{ids_name} is empty (shape {tuple(shape)}): at least one row of one token is needed")
    if tuple(lens_shape) != (B,):
        raise ValueError(f"{lens_name} must be [{B}] (one length per row of {ids_name}), got shape "
                         f"{tuple(lens_shape)}")
    for name, x in ((ids_name, ids), (lens_name, lengths)):
        dtype = getattr(x, "dtype", None) or np.asarray(x).dtype
        if not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(f"{name} must hold integers, got {dtype}")
    if isinstance(ids, jax.core.Tracer) or isinstance(lengths, jax.core.Tracer):
        return  # traced: values unknown until run (see the callers' docstrings)
    ids, lengths = np.asarray(ids), np.asarray(lengths)
    bad = np.flatnonzero((lengths < 1) | (lengths > L))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"{lens_name}[{b}] = {int(lengths[b])} is outside [1, {L}] ({ids_name} has {L} columns)")
    real = np.arange(L)[None, :] < lengths[:, None]
    out = real & ((ids < 0) | (ids >= vocab_size))
    if out.any():
        b, t = map(int, np.argwhere(out)[0])
        raise ValueError(f"{ids_name}[{b}, {t}] = {int(ids[b, t])} is outside the vocabulary [0, {vocab_size})")


def generate(graphdef: nnx.GraphDef, params: nnx.State, prompts: jax.Array, prompt_lens: jax.Array,
             *, max_new_tokens: int, sampling: SamplingArrays | None = None,
             rng: jax.Array | None = None, eos_token_id: int | None = None, block_size: int = 16,
             attention_impl: str = "reference", kv_dtype: jnp.dtype | None = None
             ) -> tuple[jax.Array, jax.Array]:
    """Generates max_new_tokens tokens for each of B prompts, all on the device:
    (tokens [B, max_new_tokens] int32, lengths [B] int32).

    `prompts` int32 [B, P] is right-padded; prompt b is prompts[b, :prompt_lens[b]]
    (1 <= prompt_lens[b] <= P).  Pure and jittable, with no host scheduler: jit it
    with graphdef and the keyword ints / strings static, e.g.

        gen = jax.jit(generate, static_argnums=0,
                      static_argnames=("max_new_tokens", "eos_token_id", "block_size",
                                       "attention_impl", "kv_dtype"))
        tokens, lengths = gen(graphdef, params, prompts, prompt_lens, max_new_tokens=32,
                              sampling=None, rng=None)

    It creates its own paged pool with a static block assignment: sequence b owns
    blocks 1 + b * W .. (b + 1) * W, W = cdiv(P + max_new_tokens, block_size)
    (block 0 is the null block), in `kv_dtype` (default: the params' dtype).  One
    prefill forward over the B * P flat tokens (the prompts packed back to back)
    samples each sequence's first token; a `lax.while_loop` then runs
    max_new_tokens - 1 decode steps of B tokens, one per sequence.  Nothing is
    donated: the caller passes no pool.

    Sampling: `sampling=None` is greedy.  Otherwise a `SamplingArrays` of [B]
    rows (temperature, seed, top_k / top_p or None) drawn exactly as the engine
    draws them: token i of row b uses the key fold_in(key(seed[b]), i), i = the
    number of tokens generated before it, so row b with seed s produces the
    engine's tokens for a request with SamplingParams(seed=s) and the same
    temperature / top_k / top_p.  `sampling.step` is ignored (the loop sets it).
    `rng`: None to use sampling.seed as given; a PRNG key to replace the seeds by
    fresh ones, seed = jax.random.bits(rng, (B,), uint32) (for a loop that wants
    new samples every round without managing seeds).  It is ignored when
    `sampling` is None (greedy draws nothing).

    Stop: with `eos_token_id` (a static int) a sequence is finished at its first
    eos; lengths[b] counts its tokens up to and including that eos (else
    max_new_tokens), and tokens[b, lengths[b]:] are filled with eos_token_id.
    The loop exits early once every sequence has finished.  Without it,
    lengths is max_new_tokens everywhere.

    Checked (ValueError naming the argument): prompts is [B, P] with B >= 1 and
    P >= 1, prompt_lens is [B], eos_token_id is in the vocabulary; when prompts
    and prompt_lens are concrete (not traced), every 1 <= prompt_lens[b] <= P and
    every prompt token before prompt_lens[b] is in [0, vocab_size).  Under jit
    only the shapes are checked: out-of-range ids or lengths then give garbage
    tokens, not an error.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    model = nnx.merge(graphdef, params)  # for its config and dtype (static)
    check_batch(prompts, prompt_lens, model.cfg.vocab_size, ids_name="prompts", lens_name="prompt_lens")
    if eos_token_id is not None and not 0 <= eos_token_id < model.cfg.vocab_size:
        raise ValueError(f"eos_token_id={eos_token_id} is outside the vocabulary [0, {model.cfg.vocab_size})")
    prompts = jnp.asarray(prompts, jnp.int32)
    prompt_lens = jnp.asarray(prompt_lens, jnp.int32)
    B, P = prompts.shape
    N = max_new_tokens
    width = -(-(P + N) // block_size)
    pool = create_kv_pool(model.cfg, num_blocks=1 + B * width, block_size=block_size,
                          dtype=model.embed[...].dtype if kv_dtype is None else kv_dtype)
    tables = 1 + jnp.arange(B * width, dtype=jnp.int32).reshape(B, width)

    if sampling is not None and rng is not None:
        sampling = SamplingArrays(sampling.temperature, jax.random.bits(rng, (B,), jnp.uint32),
                                  sampling.step, sampling.top_k, sampling.top_p)

    def draw(logits: jax.Array, step: jax.Array) -> jax.Array:
        if sampling is None:
            return greedy(logits)
        return _sample(logits, SamplingArrays(sampling.temperature, sampling.seed,
                                              jnp.full(B, step, jnp.int32), sampling.top_k,
                                              sampling.top_p))

    # Prefill: the prompts packed back to back, padding after the last one.
    meta = ragged_metadata(tables, jnp.zeros(B, jnp.int32), prompt_lens, B * P, block_size)
    seq, pos, valid = token_layout(meta.cu_q_lens, meta.kv_lens, B * P)
    flat = jnp.where(valid, prompts[seq, jnp.clip(pos, 0, P - 1)], 0)
    logits, pool = forward_step(graphdef, params, pool, flat, meta, attention_impl=attention_impl)
    first = draw(logits, 0)
    fill = 0 if eos_token_id is None else eos_token_id
    out = jnp.full((B, N), fill, jnp.int32).at[:, 0].set(first)
    done = jnp.zeros(B, bool) if eos_token_id is None else first == eos_token_id
    ones = jnp.ones(B, jnp.int32)

    def cond(state):
        i, _, _, _, done = state
        return (i < N) & ~jnp.all(done)

    def body(state):
        # Token i: feed token i - 1 at position prompt_len + i - 1.
        i, pool, last, out, done = state
        meta = ragged_metadata(tables, prompt_lens + i - 1, ones, B, block_size)
        logits, pool = forward_step(graphdef, params, pool, last, meta, attention_impl=attention_impl)
        token = draw(logits, i)
        if eos_token_id is not None:
            token = jnp.where(done, eos_token_id, token)
            done = done | (token == eos_token_id)
        out = jax.lax.dynamic_update_slice(out, token[:, None], (0, i))
        return i + 1, pool, token, out, done

    _, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), pool, first, out, done))
    if eos_token_id is None:
        return out, jnp.full(B, N, jnp.int32)
    is_eos = out == eos_token_id
    lengths = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, N).astype(jnp.int32)
    return out, lengths


__all__ = ["create_kv_pool", "ragged_metadata", "forward_step", "sample", "apply_logit_mask", "generate_step",
           "generate_step_with_logprobs", "run_step", "score", "generate", "SamplingArrays",
           "StepInputs", "StepMetadata", "StepResult", "TokenLogprobs"]

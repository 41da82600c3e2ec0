"""Ragged paged attention and the K/V write, one backend per implementation.

Importable on its own (no dependency on jpaged).  A step's new tokens are one
flat ragged batch: `q[T, H, D]`, where sequence s owns tokens
`cu_q_lens[s]:cu_q_lens[s + 1]` (a prefill chunk, or one decode token), as in
vLLM V1 and tpu-inference.  Every implementation takes that contract:

* "reference": jnp gather + masked dense attention in fp32 (the oracle).
* "pallas_gpu": Pallas/Triton kernels (`gpu.py`).
* "pallas_tpu": Pallas/Mosaic TPU kernel (`tpu.py`): pool in HBM, pages DMA'd to VMEM.
* "cpu": C++ XLA FFI custom calls (`cpu.py`, built with g++ on first use) that
  read K/V through the block table for decode and prefill alike; when the
  kernel cannot be built (`cpu.available()` False, reason logged once), for
  queries other than float32 / bfloat16 or pools other than float32 /
  bfloat16 / int8 / float8_e4m3fn it falls back to the reference.

Every implementation reads quantized pools (int8, float8_e4m3fn: rows of
head_dim values and a one-byte scale code, `reference.quantize_rows`)
and writes them through `quantize_rows`.

Every implementation also takes Gemma's two attention variants, as static
options: `sliding_window` (local attention over the last W positions) and
`soft_cap` (logit soft-capping); None (the default) is the plain causal
attention, with the same program as before the options existed.

Each backend owns both halves of a layer's cache traffic: `attention` (read)
and `write_kv` (scatter the new tokens' K/V into the pool, in place when the
pool is donated).  `get_backend(impl)` is resolved while tracing from the impl
name alone; nothing consults a process-wide default inside a step.  These names
(`IMPLS`) are also jpaged's config values of `attention_impl` (plus "auto", which
the engine resolves with `default_impl()`).

Off their backend the Pallas kernels run in interpret mode automatically
(Triton kernels with `interpret=True`, TPU kernels in TPU interpret mode),
which is how they are tested on CPU.  `default_impl()` picks by
`jax.default_backend()` ("pallas_gpu" on GPU, "pallas_tpu" on TPU, "cpu" on the
CPU backend when the CPU kernel builds, else "reference")
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from pallas_kernels.reference import paged_attention_reference, write_kv_reference

# Every backend's name: what get_backend takes, default_impl returns and Backend.name holds.
IMPLS = ("reference", "cpu", "pallas_gpu", "pallas_tpu")


@dataclasses.dataclass(frozen=True)
class Backend:
    """attention(q, kv_pool, layer, block_tables, kv_lens, cu_q_lens, *, sm_scale=None,
              sliding_window=None, soft_cap=None) -> out
    write_kv(kv_pool, layer, k, v, blocks, offsets) -> kv_pool"""

    name: str
    attention: Callable[..., jax.Array]
    write_kv: Callable[..., jax.Array]


def get_backend(impl: str) -> Backend:
    """The attention read and K/V write of `impl` (one of IMPLS)."""
    if impl == "reference":
        return Backend("reference", paged_attention_reference, write_kv_reference)
    if impl == "pallas_gpu":
        from pallas_kernels import gpu
        return Backend("pallas_gpu", gpu.paged_attention_gpu, write_kv_reference)
    if impl == "pallas_tpu":
        from pallas_kernels import tpu
        return Backend("pallas_tpu", tpu.paged_attention_tpu, write_kv_reference)
    if impl == "cpu":
        from pallas_kernels import cpu
        return Backend("cpu", cpu.paged_attention_or_reference, cpu.write_kv_or_reference)
    raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")


def default_impl() -> str:
    """"pallas_gpu" on a GPU backend, "pallas_tpu" on TPU, "cpu" on CPU if its kernel
    builds, else "reference"."""
    backend = jax.default_backend()
    if backend in ("gpu", "tpu"):
        return f"pallas_{backend}"
    if backend == "cpu":
        from pallas_kernels import cpu
        if cpu.available():
            return "cpu"
    return "reference"


def paged_attention(q: jax.Array, kv_pool: jax.Array, layer: jax.Array | int,
                    block_tables: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array,
                    *, impl: str = "reference", sm_scale: float | None = None,
                    sliding_window: int | None = None, soft_cap: float | None = None
                    ) -> jax.Array:
    """Attention of a flat ragged batch of new query tokens over their sequences' paged K/V.

    Args:
      q: [T, num_heads, head_dim] queries.  Sequence s owns tokens
        cu_q_lens[s] .. cu_q_lens[s + 1] - 1 (its q_len new tokens, in order);
        tokens at or past cu_q_lens[S] are padding.
      kv_pool: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim];
        axis 2 is (K, V).  Block 0 is the null block that padded block-table
        entries point at; its contents are never read unmasked.
      layer: which layer's K/V to read (a Python int or a traced scalar).
      block_tables: [S, W] int32, physical block of logical block j of sequence s.
      kv_lens: [S] int32, tokens of sequence s in the pool, its new ones included
        (their K/V are written before attention).  0 for padding sequences.
      cu_q_lens: [S + 1] int32, non-decreasing, cu_q_lens[0] == 0.  Padding
        sequences have q_len 0 (cu_q_lens[s + 1] == cu_q_lens[s]).  New token
        i of sequence s sits at position kv_lens[s] - q_len + i and attends
        causally to keys 0 .. that position.
      impl: one of IMPLS (see get_backend / default_impl).  The kernels never
        gather or slice-copy the pool: they read blocks of `layer` through
        the block table.
      sm_scale: softmax scale, default head_dim ** -0.5.
      sliding_window: None (global causal attention) or a static int W >= 1:
        the token at position p sees keys at positions k with
        p - W < k <= p, the last W positions including its own (Hugging
        Face's `kv_idx > q_idx - sliding_window`, as in Gemma 2/3 and
        Mistral).  K/V rows before the window of a sequence's first new
        token never affect its output (they may hold anything, NaN
        included), and block-table entries of blocks wholly before that
        window may point at any block of the pool (the null block, say, once
        the engine frees them).  The kernels start each query tile's key loop
        at the block holding its first token's window start, so the cost
        follows W, not kv_len.
      soft_cap: None or a static finite float c > 0: scores
        s = (q . k) * sm_scale become c * tanh(s / c) before the causal /
        window mask and the softmax (Gemma 2's attn_logit_softcapping,
        applied as in Hugging Face's eager attention).

    Returns:
      [T, num_heads, head_dim] in q's dtype; padding tokens are exactly zero.
      num_heads must be a multiple of num_kv_heads (GQA; query head h reads KV
      head h // (num_heads // num_kv_heads)).

    Blocks a sequence does not own (block 0 included) may hold anything, NaN
    included; they never affect its output.  Softmax and accumulation are fp32
    in every impl; kernels match the reference to ~1e-5 relative (fp32 K/V) and
    ~2e-2 (bf16 K/V and queries).  Invalid sliding_window / soft_cap values
    raise ValueError in every impl (`reference.attention_options`).
    """
    return get_backend(impl).attention(q, kv_pool, layer, block_tables, kv_lens, cu_q_lens,
                                       sm_scale=sm_scale, sliding_window=sliding_window,
                                       soft_cap=soft_cap)


def write_kv(kv_pool: jax.Array, layer: jax.Array | int, k: jax.Array, v: jax.Array,
             blocks: jax.Array, offsets: jax.Array, *, impl: str = "reference") -> jax.Array:
    """kv_pool with k, v [T, num_kv_heads, head_dim] written at row offsets[t] of block
    blocks[t] of `layer`.  Padding tokens carry block 0 (the null block)."""
    return get_backend(impl).write_kv(kv_pool, layer, k, v, blocks, offsets)


__all__ = ["paged_attention", "write_kv", "get_backend", "Backend", "paged_attention_reference",
           "write_kv_reference", "IMPLS", "default_impl"]

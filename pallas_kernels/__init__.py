"""Paged-attention kernels: a jnp reference and Pallas kernels for GPU and TPU.

Importable on its own (no dependency on jpaged).  One public entry point,
`paged_attention`, dispatches by `impl`:

* "reference": jnp gather + masked dense attention in fp32 (the oracle).
* "gpu": Pallas/Triton.  Q == 1 -> `gpu.paged_decode_gpu` (flash-decoding over
  `num_partitions` partitions + jnp combine); Q > 1 -> `gpu.paged_ragged_gpu`
  (ragged prefill / mixed batches, causal, tiles over Q and KV blocks).
* "tpu": Pallas/Mosaic TPU, `tpu.paged_attention_tpu`: one kernel for decode
  and ragged prefill; pool stays in HBM, pages DMA'd double-buffered to VMEM.
* "cpu": Q == 1 -> `cpu.paged_decode_cpu`, a C++ XLA FFI custom call (built
  with g++ on first use) that reads K/V through the block table instead of
  gathering them; Q > 1 (prefill is compute bound), a kernel that could not be
  built (`cpu.available()` False, reason logged once) or dtypes other than
  float32 / bfloat16 fall back to the reference.

Shape limits: "gpu" needs power-of-two block_size and head_dim (Triton
tensors); any GQA ratio works.  "tpu" on real hardware wants head_dim a
multiple of 128 (64 works) and block_size a multiple of 8 (fp32) / 16 (bf16).

Off their backend the kernels run in interpret mode automatically (Triton
kernels with `interpret=True`, TPU kernels in TPU interpret mode), which is
how they are tested on CPU.  `default_impl()` picks by `jax.default_backend()`
("cpu" on the CPU backend when the CPU kernel builds, else "reference").
"""

from __future__ import annotations

import jax

from pallas_kernels.reference import paged_attention_reference

IMPLS = ("reference", "gpu", "tpu", "cpu")


def default_impl() -> str:
    """"gpu" on a GPU backend, "tpu" on TPU, "cpu" on CPU if its kernel builds, else "reference"."""
    backend = jax.default_backend()
    if backend in ("gpu", "tpu"):
        return backend
    if backend == "cpu":
        from pallas_kernels import cpu
        if cpu.available():
            return "cpu"
    return "reference"


def paged_attention(q: jax.Array, kv_pool: jax.Array, layer: jax.Array | int,
                    block_tables: jax.Array, kv_lens: jax.Array, q_lens: jax.Array,
                    *, impl: str = "reference", sm_scale: float | None = None) -> jax.Array:
    """Attention of new query tokens over their sequence's paged K/V.

    Args:
      q: [B, Q, num_heads, head_dim] queries of the new tokens of B sequences,
        each row padded to Q tokens.  Decode is Q == 1; prefill chunks and mixed
        batches use Q > 1 with ragged `q_lens`.
      kv_pool: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim];
        axis 2 is (K, V).  Block 0 is the null block that padded block-table
        entries point at; its contents are never read unmasked.
      layer: which layer's K/V to read (a scalar, traced inside the layer scan).
      block_tables: [B, W] int32, physical block of logical block j of sequence b.
      kv_lens: [B] int32, tokens of sequence b in the pool, the new ones included
        (their K/V are written before attention).  0 for padding rows.
      q_lens: [B] int32, valid new tokens of row b (<= Q; 0 for padding rows).
        New token i of row b sits at position kv_lens[b] - q_lens[b] + i and
        attends causally to keys 0..that position.
      impl: "reference" (jnp), "gpu" (Pallas Triton), "tpu" (Pallas Mosaic) or
        "cpu" (C++ FFI decode kernel, reference for Q > 1),
        see IMPLS / default_impl().  The kernels never gather or slice-copy the
        pool: they read blocks of `layer` through the block table.
      sm_scale: softmax scale, default head_dim ** -0.5.

    Returns:
      [B, Q, num_heads, head_dim] in q's dtype; rows beyond q_lens are zero.
      num_heads must be a multiple of num_kv_heads (GQA; query head h reads KV
      head h // (num_heads // num_kv_heads)).

    Blocks a sequence does not own (block 0 included) may hold anything, NaN
    included; they never affect its output.  Rows with q_lens == 0 or
    kv_lens == 0 are exactly zero.  Softmax and accumulation are fp32 in every
    impl; kernels match the reference to ~1e-5 relative (fp32 K/V) and ~2e-2
    (bf16 K/V and queries: probabilities are rounded to bf16 before the P.V
    dot, as in any flash kernel).
    """
    if impl == "reference":
        return paged_attention_reference(q, kv_pool, layer, block_tables, kv_lens, q_lens,
                                         sm_scale=sm_scale)
    if impl == "gpu":
        from pallas_kernels import gpu
        fn = gpu.paged_decode_gpu if q.shape[1] == 1 else gpu.paged_ragged_gpu
        return fn(q, kv_pool, layer, block_tables, kv_lens, q_lens, sm_scale=sm_scale)
    if impl == "tpu":
        from pallas_kernels import tpu
        return tpu.paged_attention_tpu(q, kv_pool, layer, block_tables, kv_lens, q_lens,
                                       sm_scale=sm_scale)
    if impl == "cpu":
        from pallas_kernels import cpu
        if cpu.supports(q, kv_pool):
            return cpu.paged_decode_cpu(q, kv_pool, layer, block_tables, kv_lens, q_lens,
                                        sm_scale=sm_scale)
        return paged_attention_reference(q, kv_pool, layer, block_tables, kv_lens, q_lens,
                                         sm_scale=sm_scale)
    raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")


__all__ = ["paged_attention", "paged_attention_reference", "IMPLS", "default_impl"]

"""Batch-invariant numerics: a token's logits, bit for bit, whatever else is in its step.

On XLA:CPU these make a token's result depend on the batch around it
(measured by benchmarks/bench_batch_invariant.py, "probe"):

* `x @ W`: XLA's dot changes its blocking with the number of rows M (rows
  computed at M = 1, 2, 3, 7, 8 or 16 differ from the same rows at M = 1024,
  by up to 4.8e-6 on SmolLM2's shapes);
* row sums: RMSNorm's mean of squares (reduced differently for different M),
  and log_softmax's sum over the vocabulary (a [1, vocab] sum differs from
  [M, vocab] ones);
* the CPU attention kernel: a work item is a tile of up to 48 / G tokens, and
  items of one decode token take another path (dot products over head_dim);
* fusion: XLA contracts a multiply into a following add (one FMA) only where
  both land in one fusion, which differs between programs: Gemma's final
  logit cap fused into the logprob ops in one program and not in another.

Everything else is elementwise, computed alike in every step.  In
batch_invariant mode the model takes its matmuls, its RMSNorm sums and the
logprobs' sums from `matmul` / `row_sum` (C++, each element's order fixed by
K alone: pallas_kernels.cpu.matmul_cpu, which also applies the final logit
cap), and its attention from the CPU kernel with one token per work item
(`attention_backend`).  decode.score runs the same kernel over its dense
K/V, so under jit its logprobs equal the engine's bit for bit.  Gradients
(score under jax.grad) go through ordinary XLA ops: they need not be invariant.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jpaged.layers.dense_attention import dense_causal_attention
from pallas_kernels import Backend, cpu


def check_available() -> None:
    """RuntimeError unless the C++ CPU kernels the mode runs on are built."""
    if not cpu.available():
        raise RuntimeError("batch_invariant needs jpaged's C++ CPU kernels, which are unavailable: "
                           f"{cpu.unavailable_reason()}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul_2d(x: jax.Array, w: jax.Array, transpose_w: bool, soft_cap: float | None) -> jax.Array:
    return cpu.matmul_cpu(x, w, transpose_b=transpose_w, soft_cap=soft_cap)


def _matmul_fwd(x, w, transpose_w, soft_cap):
    y = _matmul_2d(x, w, transpose_w, soft_cap)
    return y, (x, w, y)


def _matmul_bwd(transpose_w, soft_cap, res, g):
    x, w, y = res
    if soft_cap is not None:  # d/dz cap * tanh(z / cap) = 1 - tanh^2
        g = g * (1 - jnp.square(y / soft_cap))
    w_kn = w.T if transpose_w else w
    dw = x.T @ g
    return g @ w_kn.T, dw.T if transpose_w else dw


_matmul_2d.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, soft_cap: float | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] (w [N, K] used as w.T with `transpose_w`), each row's
    result independent of the other rows; computed in float32, returned in x's dtype.
    `soft_cap`: soft_cap * tanh(result / soft_cap), applied by the kernel."""
    n = w.shape[0 if transpose_w else 1]
    y = _matmul_2d(x.reshape(-1, x.shape[-1]).astype(jnp.float32), w.astype(jnp.float32), transpose_w, soft_cap)
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)


def row_sum(x: jax.Array) -> jax.Array:
    """sum(x) over the last axis (keepdims) in float32, each row on its own."""
    return matmul(x.astype(jnp.float32), jnp.ones((x.shape[-1], 1), jnp.float32))


def mean_square(x: jax.Array) -> jax.Array:
    """mean(x * x) over the last axis (keepdims), in float32, each row on its own."""
    x32 = x.astype(jnp.float32)
    return row_sum(x32 * x32) / x.shape[-1]


def attention_backend(backend: Backend) -> Backend:
    """The batch-invariant form of `backend`: the CPU kernel with one token per
    work item ("cpu"), or that kernel over decode.score's dense K/V ("dense")."""
    if backend.name == "cpu":
        return Backend("cpu", functools.partial(cpu.paged_attention_cpu, token_tile=1), cpu.write_kv_cpu)
    if backend.name == "dense":
        return Backend("dense", _dense_attention, backend.write_kv)
    raise ValueError(f"batch_invariant runs on the CPU attention kernel; attention_impl={backend.name!r} "
                     "has no batch-invariant form (use 'cpu' or 'auto' on a CPU)")


def _dense_attention(q: jax.Array, kv: jax.Array, layer, block_tables, kv_lens, cu_q_lens, *,
                     sm_scale=None, sliding_window=None, soft_cap=None) -> jax.Array:
    """decode.score's causal attention over B rows of L tokens (kv [2, B * L, KVH, D],
    this layer's own), computed by the engine's kernel: each row's K/V become one
    pool block of L slots, so every query sees the keys, in the order, the engine's
    step gives it."""
    opts = (kv_lens.shape[0], sm_scale, sliding_window, soft_cap)
    return _dense_kernel(q, kv, opts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dense_kernel(q: jax.Array, kv: jax.Array, opts: tuple) -> jax.Array:
    B, sm_scale, sliding_window, soft_cap = opts
    _, T, KVH, D = kv.shape
    L = T // B
    pool = kv.reshape(2, B, L, KVH, D).transpose(1, 0, 3, 2, 4)[:, None]   # [B, 1, 2, KVH, L, D]
    cu_q_lens = L * jnp.arange(B + 1, dtype=jnp.int32)
    return cpu.paged_attention_cpu(q, pool.astype(q.dtype), 0, jnp.arange(B, dtype=jnp.int32)[:, None],
                                   jnp.full(B, L, jnp.int32), cu_q_lens, sm_scale=sm_scale,
                                   sliding_window=sliding_window, soft_cap=soft_cap, token_tile=1)


def _dense_fwd(q, kv, opts):
    return _dense_kernel(q, kv, opts), (q, kv)


def _dense_bwd(opts, res, g):
    B, sm_scale, sliding_window, soft_cap = opts
    q, kv = res
    lengths = jnp.zeros(B, jnp.int32)  # only its shape is read

    def attend(q, kv):  # the jnp form of the same attention
        return dense_causal_attention(q, kv, 0, None, lengths, None, sm_scale=sm_scale,
                                      sliding_window=sliding_window, soft_cap=soft_cap)

    return jax.vjp(attend, q, kv)[1](g)


_dense_kernel.defvjp(_dense_fwd, _dense_bwd)

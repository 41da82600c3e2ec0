"""The weight matmuls of a CPU decode step: C++ that reads each weight matrix once.

A decode step multiplies a few token rows (one per running sequence) by every
weight matrix of the model, so on the CPU it is bound by reading the weights.
XLA:CPU's dot runs such a product the way it runs a large one and costs several
passes over the weights: on the 2-core AVX2 VM, SmolLM2's 30 MLPs took 2.5x
one row's time at 4 rows and 3x at 8 (benchmarks/README.md, "Skinny matmul").
`pallas_kernels.cpu.skinny_matmul_cpu` streams the weights once for a few
rows, also in the transposed form of a tied LM head.  The model
(`jpaged.models.base.Decoder`, config `matmul_impl`) sends it the 2-D float32
products of steps of at most `STEP_MAX_TOKENS` tokens; larger steps (prefill,
wide decode batches) keep XLA's dot.  Gradients (decode.score
under jax.grad) go through XLA's dots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import cpu
from pallas_kernels.cpu import SKINNY_MAX_ROWS

__all__ = ["STEP_MAX_TOKENS", "applies", "grouped_applies", "grouped_matmul", "matmul"]

# The most tokens of a step whose weight matmuls go to the kernels (at most the
# kernels' SKINNY_MAX_ROWS).  SmolLM2 engine steps on the 2-core CPU: 0.87x XLA's
# time at 4 and 8 rows, level at 16, 1.06-1.19x at 32 (benchmarks/results/skinny_matmul.md).
STEP_MAX_TOKENS = 16
assert STEP_MAX_TOKENS <= SKINNY_MAX_ROWS


def applies(x: jax.Array, w: jax.Array, transpose_w: bool = False) -> bool:
    """Whether x @ w (w.T with `transpose_w`) goes to the kernel: x [M <=
    STEP_MAX_TOKENS, K] and w [K, N] ([N, K] transposed), both float32."""
    return (x.ndim == 2 and w.ndim == 2 and x.shape[0] <= STEP_MAX_TOKENS
            and x.shape[1] == w.shape[1 if transpose_w else 0]
            and x.dtype == jnp.float32 and w.dtype == jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x: jax.Array, w: jax.Array, transpose_w: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] (w [N, K] and w.T with `transpose_w`: a tied LM head) by
    the C++ kernel (`applies(x, w, transpose_w)` must hold)."""
    return cpu.skinny_matmul_cpu(x, w, transpose_b=transpose_w)


def _matmul_fwd(x: jax.Array, w: jax.Array, transpose_w: bool) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return matmul(x, w, transpose_w), (x, w)


def _matmul_bwd(transpose_w: bool, res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    if transpose_w:  # y = x @ w.T
        return g @ w, g.T @ x
    return g @ w.T, x.T @ g


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def grouped_applies(x: jax.Array, w: jax.Array) -> bool:
    """Whether the grouped kernel takes the experts w [E, K, N] of a step of x [T,
    K] tokens: a decode step's (T <= STEP_MAX_TOKENS), both float32."""
    return (x.ndim == 2 and w.ndim == 3 and x.shape[0] <= STEP_MAX_TOKENS
            and x.dtype == jnp.float32 and w.dtype == jnp.float32)


@jax.custom_vjp
def grouped_matmul(xs: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot(xs, w, group_sizes)` (rows xs [R, K] sorted by group, w
    [E, K, N]) by the C++ grouped kernel: each group's matrix read once."""
    return cpu.grouped_skinny_matmul_cpu(xs, group_sizes, w)


def _grouped_fwd(xs: jax.Array, w: jax.Array, group_sizes: jax.Array) -> tuple[jax.Array, tuple]:
    return grouped_matmul(xs, w, group_sizes), (xs, w, group_sizes)


def _grouped_bwd(res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array, None]:
    xs, w, group_sizes = res
    _, vjp = jax.vjp(lambda xs, w: jax.lax.ragged_dot(xs, w, group_sizes), xs, w)
    return (*vjp(g), None)


grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)

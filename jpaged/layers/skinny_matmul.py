"""The weight matmuls of a CPU decode step: C++ that reads each weight matrix once.

A decode step multiplies a few token rows (one per running sequence) by every
weight matrix of the model, so on the CPU it is bound by reading the weights.
XLA:CPU's dot runs such a product the way it runs a large one and costs several
passes over the weights: on the 2-core AVX2 VM, SmolLM2's 30 MLPs took 2.5x
one row's time at 4 rows and 3x at 8 (benchmarks/README.md, "Skinny matmul").
`pallas_kernels.cpu.skinny_matmul_cpu` streams the weights once for up to
`SKINNY_MAX_ROWS` rows.  The model (`jpaged.models.base.Decoder`, config
`matmul_impl`) sends it the 2-D float32 products of steps of at most that
many tokens; larger steps (prefill) keep XLA's dot.  Gradients (decode.score
under jax.grad) go through XLA's dots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu
from pallas_kernels.cpu import SKINNY_MAX_ROWS

__all__ = ["SKINNY_MAX_ROWS", "applies", "matmul"]


def applies(x: jax.Array, w: jax.Array) -> bool:
    """Whether x @ w is one the kernel takes: x [M <= SKINNY_MAX_ROWS, K] and w [K, N], both float32."""
    return (x.ndim == 2 and w.ndim == 2 and x.shape[0] <= SKINNY_MAX_ROWS
            and x.dtype == jnp.float32 and w.dtype == jnp.float32)


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] by the C++ kernel (`applies(x, w)` must hold)."""
    return cpu.skinny_matmul_cpu(x, w)


def _matmul_fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return matmul(x, w), (x, w)


def _matmul_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    return g @ w.T, x.T @ g


matmul.defvjp(_matmul_fwd, _matmul_bwd)

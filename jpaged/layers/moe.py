"""A dropless mixture-of-experts MLP (Qwen3-MoE, Mixtral) over one flat batch of tokens.

Routing: each token's router logits in fp32, a softmax over all experts, the
top-k experts by probability, and (Mixtral always, Qwen3-MoE with
norm_topk_prob) their probabilities renormalised to sum to 1, as transformers'
Qwen3MoeTopKRouter and MixtralTopKRouter compute them.

Dispatch: the T * k (token, expert) pairs are sorted by expert, so that each
expert's rows are contiguous; three grouped matmuls (`jax.lax.ragged_dot`, the
SwiGLU expert's gate, up and down projections) run every expert over its own
rows; the rows are put back in (token, slot) order and summed with their
routing weights.  On the CPU, where XLA expands `ragged_dot` into one masked
dense matmul per expert, the grouped matmuls run as tiles of one expert each
(`tiled_swiglu_experts`), chosen when the program is lowered.  Every shape is static: always T * k rows, whatever the
routing (no capacity factor, no token dropped), so routing never compiles a
new program; only the group sizes (data) change.

`moe_mlp_dense` runs every expert on every token and weights the results by a
one-hot combine matrix: E / k times the work, kept as the test oracle.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def route(x: jax.Array, router: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] fp32, experts [T, k] int32) of x [T, d] by router [d, E]."""
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def expert_load(experts: jax.Array, num_experts: int) -> jax.Array:
    """Rows routed to each expert [E] (int32) from experts [T, k]."""
    return jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.int32)


def swiglu_experts(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   group_sizes: jax.Array) -> jax.Array:
    """Rows xs [R, d] sorted by expert (group_sizes [E] rows each) through their
    experts' SwiGLU MLP (w_gate, w_up [E, d, f], w_down [E, f, d]): [R, d]."""
    gate = jax.lax.ragged_dot(xs, w_gate, group_sizes)
    up = jax.lax.ragged_dot(xs, w_up, group_sizes)
    return jax.lax.ragged_dot((jax.nn.silu(gate) * up).astype(xs.dtype), w_down, group_sizes)


def tile_rows(num_rows: int, num_experts: int) -> int:
    """The tile of `tiled_swiglu_experts` for num_rows rows over num_experts experts:
    about one tile per expert's even share, a power of two in 8..128 (static)."""
    share = -(-num_rows // num_experts)
    return min(128, max(8, 1 << (share - 1).bit_length()))


def tiled_swiglu_experts(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                         group_sizes: jax.Array) -> jax.Array:
    """`swiglu_experts` as tiles of one expert each: every expert's rows start a new
    tile (of `tile_rows` rows, zero-padded), and a scan runs each used tile through
    its expert's whole MLP (unused tiles are skipped by a cond).  At most R / tile + E
    tiles (static), so the work is about R rows plus a tile's padding per expert.
    XLA:CPU lowers `ragged_dot` to E masked dense matmuls over all R rows (E times
    the work); this is what the CPU runs instead (benchmarks/bench_moe.py)."""
    R, d = xs.shape
    E = group_sizes.shape[0]
    tile = tile_rows(R, E)
    num_tiles = -(-R // tile) + E
    ends = jnp.cumsum(group_sizes)
    padded = (group_sizes + tile - 1) // tile * tile
    padded_ends = jnp.cumsum(padded)
    expert = jnp.searchsorted(ends, jnp.arange(R), side="right")        # each sorted row's expert
    dest = (padded_ends - padded)[expert] + jnp.arange(R) - (ends - group_sizes)[expert]
    tiles = jnp.zeros((num_tiles * tile, d), xs.dtype).at[dest].set(xs, unique_indices=True)
    tile_expert = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(num_tiles) * tile, side="right"), E - 1)
    used = padded_ends[-1] // tile

    def one_tile(_: None, inputs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        i, x, e = inputs

        def mlp(x: jax.Array) -> jax.Array:
            h = jax.nn.silu(x @ w_gate[e]) * (x @ w_up[e])
            return (h.astype(x.dtype) @ w_down[e]).astype(x.dtype)
        return None, jax.lax.cond(i < used, mlp, lambda x: jnp.zeros((tile, w_down.shape[-1]), x.dtype), x)

    _, ys = jax.lax.scan(one_tile, None, (jnp.arange(num_tiles), tiles.reshape(num_tiles, tile, d), tile_expert))
    return ys.reshape(num_tiles * tile, -1)[dest]


def grouped_swiglu_experts(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                           group_sizes: jax.Array) -> jax.Array:
    """The grouped expert MLP for the platform the program is lowered for: tiles on
    the CPU, `ragged_dot` elsewhere (TPU's native grouped matmul, GPU's lowering)."""
    args = (xs, w_gate, w_up, w_down, group_sizes)
    return jax.lax.platform_dependent(*args, cpu=tiled_swiglu_experts, default=swiglu_experts)


def moe_mlp(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
            *, top_k: int, renormalize: bool, grouped: Callable[..., jax.Array] = grouped_swiglu_experts,
            routing: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """The MoE MLP of x [T, d]: router [d, E], experts w_gate / w_up [E, d, f],
    w_down [E, f, d].  Dropless grouped matmuls (see the module docstring);
    `grouped`: which (tests and benchmarks pick `swiglu_experts` or `tiled_swiglu_experts`);
    `routing`: `route`'s (weights, experts) when the caller computed them already."""
    T, E = x.shape[0], router.shape[-1]
    weights, experts = route(x, router, top_k, renormalize) if routing is None else routing
    flat = experts.reshape(-1)                        # [T * k], (token, slot) order
    order = jnp.argsort(flat, stable=True)            # rows sorted by expert
    rows = grouped(x[order // top_k], w_gate, w_up, w_down, expert_load(experts, E))
    unsorted = jnp.zeros_like(rows).at[order].set(rows, unique_indices=True).reshape(T, top_k, -1)
    out = jnp.einsum("tkd,tk->td", unsorted.astype(jnp.float32), weights)
    return out.astype(x.dtype)


def moe_mlp_dense(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                  *, top_k: int, renormalize: bool) -> jax.Array:
    """The same MoE MLP with every expert run on every token, combined by a one-hot
    [T, E] matrix of routing weights: the oracle `moe_mlp` is tested against."""
    E = router.shape[-1]
    weights, experts = route(x, router, top_k, renormalize)
    combine = jnp.einsum("tke,tk->te", jax.nn.one_hot(experts, E, dtype=jnp.float32), weights)
    hi = jax.lax.Precision.HIGHEST
    gate = jnp.einsum("td,edf->tef", x, w_gate, precision=hi)
    up = jnp.einsum("td,edf->tef", x, w_up, precision=hi)
    y = jnp.einsum("tef,efd->ted", (jax.nn.silu(gate) * up).astype(x.dtype), w_down, precision=hi)
    return jnp.einsum("ted,te->td", y.astype(jnp.float32), combine).astype(x.dtype)

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
(`tiled_swiglu_experts`), chosen when the program is lowered; in steps of at
most STEP_MAX_TOKENS tokens with matmul_impl "cpu" (the model decides:
jpaged.models.moe_common) they run as the C++ grouped skinny matmul
(`skinny_swiglu_experts`), which reads each used expert's weights once.  Every
shape is static: always T * k rows, whatever the routing (no capacity factor,
no token dropped), so routing never compiles a new program; only the group
sizes (data) change.  At a single token (T <=
CPU_ALL_EXPERTS_MAX_TOKENS, static per step bucket) the CPU skips the sort and
runs every expert on every token as one batched matmul, weighted by a combine
matrix that is zero for the experts a token was not routed to
(`all_experts_routed`): each expert's weights are read once, where the tiles
copy a slice of them per tile (benchmarks/results/moe_cpu.md).

Under tensor parallelism (a mesh with a 'model' axis) the layer runs under
`jax.shard_map`, as `expert_split` says: whole experts per device (expert
parallelism) or every expert's units split.  Tokens and routes are replicated
over the devices; each runs its own experts' rows (or its own units) and one
all-reduce of the [T, d] partial sums combines them.

`moe_mlp_dense` runs every expert on every token and weights the results by a
one-hot combine matrix: E / k times the work, kept as the test oracle.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from pallas_kernels.grouped_matmul import tile_layout, to_tiles

from jpaged.layers import skinny_matmul


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


def skinny_swiglu_experts(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                          group_sizes: jax.Array) -> jax.Array:
    """`swiglu_experts` by the C++ grouped skinny matmul (jpaged.layers.skinny_matmul,
    config matmul_impl): a decode step's experts on the CPU, each expert with rows
    reading its weights once."""
    gate = skinny_matmul.grouped_matmul(xs, w_gate, group_sizes)
    up = skinny_matmul.grouped_matmul(xs, w_up, group_sizes)
    return skinny_matmul.grouped_matmul((jax.nn.silu(gate) * up).astype(xs.dtype), w_down, group_sizes)


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
    # The Pallas grouped matmul's layout (rows past the groups' total land in unused tiles).
    dest, tile_expert, used = tile_layout(group_sizes, R, tile)
    tiles = to_tiles(xs, dest, num_tiles, tile)
    used = used[0]

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


# How a MoE layer's experts lie over the 'model' mesh axis (jpaged.layers.sharding follows it).
EXPERTS, UNITS, REPLICATED = "experts", "units", "replicated"
EXPERT_SPECS: dict[str, tuple[P, P, P]] = {  # (w_gate, w_up, w_down) of one layer, [E, d, f] / [E, f, d]
    EXPERTS: (P("model", None, None),) * 3,
    UNITS: (P(None, None, "model"), P(None, None, "model"), P(None, "model", None)),
    REPLICATED: (P(), P(), P()),
}


def expert_split(num_experts: int, moe_intermediate_size: int, tp: int, expert_parallel: bool) -> str:
    """How tp devices share a MoE layer: EXPERTS (expert parallelism: each holds
    num_experts / tp whole experts), UNITS (tensor parallelism within the experts:
    every expert's MLP units split, as a dense MLP's are), or REPLICATED (one
    device, or a width tp does not divide: every device runs every expert)."""
    if tp == 1:
        return REPLICATED
    if expert_parallel:
        if num_experts % tp:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {tp} devices")
        return EXPERTS
    return UNITS if moe_intermediate_size % tp == 0 else REPLICATED


# At most this many tokens (a static step bucket), the CPU runs `all_experts_routed`:
# measured faster than the tiles at 1 token (~1.4-1.8x) in every run; at 2-4 tokens
# it won some runs and lost others on the loaded VM, slower from 8 on (SmolLM2
# widths, 8 experts, top-2, weights as arguments; benchmarks/results/moe_cpu.md).
CPU_ALL_EXPERTS_MAX_TOKENS = 1


def all_experts_routed(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                       w_down: jax.Array, *, num_experts: int) -> jax.Array:
    """`routed_experts` without the sort: every expert of `w_gate` ... on every token
    (one batched matmul over the experts, T * E rows), combined by a [T, E] matrix
    of routing weights that is zero where a token was not routed (fp32 [T, d]).
    Under expert parallelism the experts are this device's slice: routes to the
    others' experts fall outside it and weigh nothing."""
    here_count = w_gate.shape[0]
    first = 0 if here_count == num_experts else jax.lax.axis_index("model") * here_count
    combine = jnp.einsum("tke,tk->te", jax.nn.one_hot(experts - first, here_count, dtype=jnp.float32), weights)
    xs = jnp.broadcast_to(x, (here_count, *x.shape))  # batched over the experts: no transpose of the weights
    h = jax.nn.silu(jnp.einsum("etd,edf->etf", xs, w_gate)) * jnp.einsum("etd,edf->etf", xs, w_up)
    y = jnp.einsum("etf,efd->etd", h.astype(x.dtype), w_down)
    return jnp.einsum("etd,te->td", y.astype(jnp.float32), combine)


def moe_mlp(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
            *, top_k: int, renormalize: bool, grouped: Callable[..., jax.Array] | None = None,
            routing: tuple[jax.Array, jax.Array] | None = None, expert_parallel: bool = False) -> jax.Array:
    """The MoE MLP of x [T, d]: router [d, E], experts w_gate / w_up [E, d, f],
    w_down [E, f, d].  Dropless grouped matmuls (see the module docstring);
    `grouped`: which grouped matmuls (tests and benchmarks pick `swiglu_experts`,
    `tiled_swiglu_experts` or the Pallas kernels' `pallas_kernels.grouped_matmul.
    gmm_swiglu_experts`); None: the platform's choice (`platform_routed_experts`);
    `routing`: `route`'s (weights, experts) when the caller computed them already.
    Under a mesh with a 'model' axis (tensor parallelism), the experts are split as
    `expert_split` says (`expert_parallel`: whole experts per device)."""
    E = router.shape[-1]
    weights, experts = route(x, router, top_k, renormalize) if routing is None else routing
    mesh = jax.sharding.get_abstract_mesh()
    tp = 1 if mesh.empty else mesh.shape.get("model", 1)
    split = expert_split(E, w_gate.shape[-1], tp, expert_parallel)
    mlp = functools.partial(routed_experts, top_k=top_k, num_experts=E, grouped=grouped)
    if split == REPLICATED:
        return mlp(x, weights, experts, w_gate, w_up, w_down).astype(x.dtype)

    # Tokens and routes are replicated over 'model' (as attention leaves them): each
    # device runs its own share of the experts over them, and one all-reduce of the
    # [T, d] partial sums combines the devices.  shard_map keeps XLA from gathering
    # the experts: the grouped matmuls see only this device's slices.
    def per_device(*args: jax.Array) -> jax.Array:
        return jax.lax.psum(mlp(*args), "model")
    out = jax.shard_map(per_device, mesh=mesh, check_vma=False, in_specs=(P(), P(), P(), *EXPERT_SPECS[split]),
                        out_specs=P())(x, weights, experts, w_gate, w_up, w_down)
    return out.astype(x.dtype)


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, *, top_k: int, num_experts: int, grouped: Callable[..., jax.Array] | None
                   ) -> jax.Array:
    """Each token's routing-weighted sum over the experts of `w_gate` ... (fp32 [T, d]):
    `sorted_routed_experts` with `grouped`, or (None) `platform_routed_experts`."""
    args = (x, weights, experts, w_gate, w_up, w_down)
    if grouped is None:
        return platform_routed_experts(*args, top_k=top_k, num_experts=num_experts)
    return sorted_routed_experts(*args, top_k=top_k, num_experts=num_experts, grouped=grouped)


def platform_routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array,
                            w_up: jax.Array, w_down: jax.Array, *, top_k: int, num_experts: int) -> jax.Array:
    """The routed experts for the platform the program is lowered for: on the CPU,
    `all_experts_routed` at <= CPU_ALL_EXPERTS_MAX_TOKENS tokens (T is static) and
    the tiles above; elsewhere the sort and `ragged_dot`."""
    if x.shape[0] <= CPU_ALL_EXPERTS_MAX_TOKENS:
        cpu = functools.partial(all_experts_routed, num_experts=num_experts)
    else:
        cpu = functools.partial(sorted_routed_experts, top_k=top_k, num_experts=num_experts,
                                grouped=tiled_swiglu_experts)
    # ragged_dot stays the default off the CPU until a GPU measures the Pallas grouped
    # matmul (gmm_swiglu_experts, gpu_probe.py part 8) faster: it has only run interpreted.
    default = functools.partial(sorted_routed_experts, top_k=top_k, num_experts=num_experts, grouped=swiglu_experts)
    return jax.lax.platform_dependent(x, weights, experts, w_gate, w_up, w_down, cpu=cpu, default=default)


def sorted_routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array,
                          w_up: jax.Array, w_down: jax.Array, *, top_k: int, num_experts: int,
                          grouped: Callable[..., jax.Array]) -> jax.Array:
    """`routed_experts` through the sort and the grouped matmuls `grouped`.
    With fewer than num_experts of them (expert parallelism, under shard_map), they
    are this device's slice: its rows sort first, the others' rows sort last and
    are left out of the grouped matmuls (zeros), so every shape stays T * k rows."""
    T, here_count = x.shape[0], w_gate.shape[0]
    if here_count == num_experts:
        key, group_sizes = experts.reshape(-1), expert_load(experts, num_experts)
    else:
        local = experts - jax.lax.axis_index("model") * here_count
        local = jnp.where((local >= 0) & (local < here_count), local, here_count)  # elsewhere: one group last
        key, group_sizes = local.reshape(-1), expert_load(local, here_count + 1)[:here_count]
    order = jnp.argsort(key, stable=True)             # rows sorted by expert, (token, slot) order within
    rows = grouped(x[order // top_k], w_gate, w_up, w_down, group_sizes)
    if here_count < num_experts:                     # rows past the groups: other devices' experts
        rows = jnp.where((jnp.arange(rows.shape[0]) < jnp.sum(group_sizes))[:, None], rows, 0)
    unsorted = jnp.zeros_like(rows).at[order].set(rows, unique_indices=True).reshape(T, top_k, -1)
    return jnp.einsum("tkd,tk->td", unsorted.astype(jnp.float32), weights)


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

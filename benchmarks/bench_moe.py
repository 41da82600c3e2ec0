"""The MoE MLP alone (jpaged.layers.moe), jitted: its three dropless grouped forms
(tiles of one expert, what the CPU runs above CPU_ALL_EXPERTS_MAX_TOKENS;
`jax.lax.ragged_dot`, what other platforms run; the Pallas grouped matmul
`pallas_kernels.grouped_matmul.gmm_swiglu_experts`, which off a GPU / TPU runs
in interpret mode: that column is then a code-path figure, not a kernel speed,
and it is timed only up to --pallas_max_tokens), the all-experts form (every
expert on every token, one batched matmul: what the CPU runs at a few tokens),
the default (the platform's choice), and on a CPU with the C++ kernels the
grouped skinny matmul (`skinny_swiglu_experts`: what a decode step of an engine
with matmul_impl "cpu" runs, up to SKINNY_MAX_ROWS tokens), against the dense
one-hot oracle and against a dense SwiGLU MLP with the same active parameters
(k experts' width; by XLA's dot, and by the skinny kernel), at several token
counts.  The weights are arguments of the jitted functions, as in
the engine (closed over, XLA would fold them as constants: pre-transposed
weights that favour the dense forms).

    python benchmarks/bench_moe.py [--tokens=1,4,16,64,256,1024] [--hidden=576] [--expert_width=768]
                                   [--experts=8] [--top_k=2] [--dtype=float32] [--iters=20] [--split]
                                   [--pallas_max_tokens=1024]

--split: instead, the default layer's pieces jitted one by one (router; sort and
dispatch: group sizes, argsort, the gather of the rows; the grouped matmuls;
combine: the rows put back and weighted), each timed alone.

Defaults: SmolLM2-135M's hidden size with 8 experts, top-2, each expert half its MLP
width (768), so the active MLP parameters equal SmolLM2's (2 x 768 = 1536).  Random
weights (std 0.02) and inputs; routing is whatever the random router gives.  Prints
the fastest of --iters calls (ms; after one untimed call) of each variant, the
variants interleaved call by call so that a loaded machine weighs on all alike.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.layers import skinny_matmul
from jpaged.layers.moe import (CPU_ALL_EXPERTS_MAX_TOKENS, all_experts_routed, expert_load, moe_mlp, moe_mlp_dense,
                               route, skinny_swiglu_experts, swiglu_experts, tile_rows, tiled_swiglu_experts)
from pallas_kernels import cpu
from pallas_kernels.cpu import SKINNY_MAX_ROWS
from pallas_kernels.grouped_matmul import gmm_swiglu_experts

SKINNY, SKINNY_DENSE = "grouped skinny (C++)", "dense MLP, skinny (C++)"


def fastest_ms(fns: list, args: list[tuple], iters: int) -> list[float]:
    """The fastest of `iters` calls of each fn (ms), interleaved call by call."""
    for fn, a in zip(fns, args):
        jax.block_until_ready(fn(*a))
    best = [float("inf")] * len(fns)
    for _ in range(iters):
        for i, (fn, a) in enumerate(zip(fns, args)):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            best[i] = min(best[i], time.perf_counter() - t0)
    return [1e3 * b for b in best]


def split_fns(k: int, E: int) -> dict:
    """The default layer's pieces on the CPU above CPU_ALL_EXPERTS_MAX_TOKENS, each a
    function of the previous pieces' outputs (see --split)."""
    def dispatch(x, experts):
        order = jnp.argsort(experts.reshape(-1), stable=True)
        return x[order // k], expert_load(experts, E), order

    def combine(rows, order, weights):
        unsorted = jnp.zeros_like(rows).at[order].set(rows, unique_indices=True).reshape(weights.shape[0], k, -1)
        return jnp.einsum("tkd,tk->td", unsorted.astype(jnp.float32), weights)
    return {"router": jax.jit(lambda x, r: route(x, r, k, True)), "sort/dispatch": jax.jit(dispatch),
            "grouped matmuls (tiles)": jax.jit(tiled_swiglu_experts), "combine": jax.jit(combine)}


def print_split(tokens: list[int], w: tuple, k: int, iters: int, draw) -> None:
    router, gate, up, down = w
    E = router.shape[-1]
    pieces = split_fns(k, E)
    layer = jax.jit(lambda x, *w: moe_mlp(x, *w, top_k=k, renormalize=True, grouped=tiled_swiglu_experts))
    print(f"| tokens | {' | '.join(pieces)} | sum | whole layer (tiles) | tile rows |")
    print("|---:" * (len(pieces) + 4) + "|")
    for T in tokens:
        x = draw(T, router.shape[0]) * 50
        weights, experts = pieces["router"](x, router)
        xs, sizes, order = pieces["sort/dispatch"](x, experts)
        rows = pieces["grouped matmuls (tiles)"](xs, gate, up, down, sizes)
        args = [(x, router), (x, experts), (xs, gate, up, down, sizes), (rows, order, weights), (x, *w)]
        ms = fastest_ms([*pieces.values(), layer], args, iters)
        print(f"| {T} | {' | '.join(f'{m:.2f}' for m in ms[:-1])} | {sum(ms[:-1]):.2f} | {ms[-1]:.2f} | "
              f"{tile_rows(T * k, E)} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,16,64,256,1024")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--expert_width", type=int, default=768)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top_k", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--split", action="store_true", help="time the default layer's pieces one by one")
    ap.add_argument("--pallas_max_tokens", type=int, default=1024,
                    help="time the Pallas column only up to this many tokens (interpret mode is slow)")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if min(tokens) < 1 or args.iters < 1:
        ap.error("--tokens and --iters must be >= 1")
    d, f, E, k, dtype = args.hidden, args.expert_width, args.experts, args.top_k, jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)

    def weights(*shape):
        return jnp.asarray(rng.standard_normal(shape) * 0.02, dtype)

    moe = (weights(d, E), weights(E, d, f), weights(E, d, f), weights(E, f, d))
    dense = (weights(d, k * f), weights(d, k * f), weights(k * f, d))
    print(f"# MoE MLP: d={d}, {E} experts of width {f}, top-{k}, {args.dtype}, {jax.devices()[0].platform}; "
          f"fastest ms of {args.iters} calls")
    if args.split:
        return print_split(tokens, moe, k, args.iters, weights)

    def all_experts(x, router, *w):
        return all_experts_routed(x, *route(x, router, k, True), *w, num_experts=E)
    variants = {
        "tiles": jax.jit(lambda x, *w: moe_mlp(x, *w, top_k=k, renormalize=True, grouped=tiled_swiglu_experts)),
        "ragged_dot": jax.jit(lambda x, *w: moe_mlp(x, *w, top_k=k, renormalize=True, grouped=swiglu_experts)),
        "all experts": jax.jit(all_experts),
        "default": jax.jit(lambda x, *w: moe_mlp(x, *w, top_k=k, renormalize=True)),
        "one-hot dense": jax.jit(lambda x, *w: moe_mlp_dense(x, *w, top_k=k, renormalize=True)),
    }
    on_device = jax.devices()[0].platform in ("gpu", "tpu")
    pallas = "Pallas gmm" + ("" if on_device else " (interpret mode)")
    variants[pallas] = jax.jit(lambda x, *w: moe_mlp(x, *w, top_k=k, renormalize=True, grouped=gmm_swiglu_experts))
    # What an engine with matmul_impl "cpu" runs in steps of <= SKINNY_MAX_ROWS tokens.
    skinny = cpu.available() and dtype == jnp.float32
    if skinny:
        variants[SKINNY] = jax.jit(lambda x, *w: moe_mlp(x, *w, top_k=k, renormalize=True,
                                                         grouped=skinny_swiglu_experts))
    dense_mlps = {"dense MLP": lambda x, w: x @ w}
    if skinny:
        dense_mlps[SKINNY_DENSE] = skinny_matmul.matmul
    mlps = {name: jax.jit(lambda x, g, u, dn, mm=mm: mm(jax.nn.silu(mm(x, g)) * mm(x, u), dn))
            for name, mm in dense_mlps.items()}
    print(f"(default: all experts at <= {CPU_ALL_EXPERTS_MAX_TOKENS} token(s) on the CPU, tiles above"
          + ("" if on_device else f"; {pallas}: not a kernel speed, - above {args.pallas_max_tokens} tokens")
          + (f"; the C++ skinny forms: - above {SKINNY_MAX_ROWS} tokens" if skinny else "") + ")")
    ratios = ["default / dense MLP"] + ([f"{SKINNY} / {SKINNY_DENSE}"] if skinny else [])
    columns = [*variants, *mlps]
    print(f"| tokens | {' | '.join(columns)} | {' | '.join(ratios)} |")
    print("|---:" * (len(columns) + len(ratios) + 1) + "|")
    for T in tokens:
        x = weights(T, d) * 50
        fns = {**variants, **mlps}
        runs = {name: fn for name, fn in fns.items()
                if (name != pallas or T <= args.pallas_max_tokens)
                and (name not in (SKINNY, SKINNY_DENSE) or T <= SKINNY_MAX_ROWS)}
        ms = dict(zip(runs, fastest_ms(list(runs.values()),
                                       [(x, *(dense if name in mlps else moe)) for name in runs], args.iters)))
        cells = [f"{ms[c]:.2f}" if c in ms else "-" for c in columns]
        cells.append(f"{ms['default'] / ms['dense MLP']:.2f}")
        if skinny:
            cells.append(f"{ms[SKINNY] / ms[SKINNY_DENSE]:.2f}" if SKINNY in ms else "-")
        print(f"| {T} | {' | '.join(cells)} |", flush=True)

if __name__ == "__main__":
    main()

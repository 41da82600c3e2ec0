"""The MoE MLP alone (jpaged.layers.moe), jitted: its two dropless grouped forms
(tiles of one expert, what the CPU runs; `jax.lax.ragged_dot`, what other
platforms run) against the dense one-hot oracle and against a dense SwiGLU MLP
with the same active parameters (k experts' width), at several token counts.

    python benchmarks/bench_moe.py [--tokens=16,64,256,1024] [--hidden=576] [--expert_width=768]
                                   [--experts=8] [--top_k=2] [--dtype=float32] [--iters=20]

Defaults: SmolLM2-135M's hidden size with 8 experts, top-2, each expert half its MLP
width (768), so the active MLP parameters equal SmolLM2's (2 x 768 = 1536).  Random
weights (std 0.02) and inputs; routing is whatever the random router gives.  Prints
the median ms per call of each variant (after one untimed call) and the ratios;
timings depend on the machine's load: run it idle.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.layers.moe import moe_mlp, moe_mlp_dense, swiglu_experts, tiled_swiglu_experts


def _median_ms(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="16,64,256,1024")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--expert_width", type=int, default=768)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top_k", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    d, f, E, k, dtype = args.hidden, args.expert_width, args.experts, args.top_k, jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)

    def weights(*shape):
        return jnp.asarray(rng.standard_normal(shape) * 0.02, dtype)

    router, gate, up, down = weights(d, E), weights(E, d, f), weights(E, d, f), weights(E, f, d)
    dense_gate, dense_up, dense_down = weights(d, k * f), weights(d, k * f), weights(k * f, d)
    variants = {
        "tiles": jax.jit(lambda x: moe_mlp(x, router, gate, up, down, top_k=k, renormalize=True,
                                           grouped=tiled_swiglu_experts)),
        "ragged_dot": jax.jit(lambda x: moe_mlp(x, router, gate, up, down, top_k=k, renormalize=True,
                                                grouped=swiglu_experts)),
        "one-hot dense": jax.jit(lambda x: moe_mlp_dense(x, router, gate, up, down, top_k=k, renormalize=True)),
        "dense MLP, same active params": jax.jit(
            lambda x: (jax.nn.silu(x @ dense_gate) * (x @ dense_up)) @ dense_down),
    }
    print(f"# MoE MLP: d={d}, {E} experts of width {f}, top-{k}, {args.dtype}, {jax.devices()[0].platform}; "
          f"median ms of {args.iters} calls")
    print(f"| tokens | {' | '.join(variants)} | tiles / dense MLP |")
    print("|---:" * (len(variants) + 2) + "|")
    for T in (int(t) for t in args.tokens.split(",")):
        x = weights(T, d) * 50
        ms = [_median_ms(fn, x, iters=args.iters) for fn in variants.values()]
        print(f"| {T} | {' | '.join(f'{m:.2f}' for m in ms)} | {ms[0] / ms[-1]:.2f} |")


if __name__ == "__main__":
    main()

"""The skinny matmul of CPU decode steps (`matmul_impl`, jpaged.layers.skinny_matmul)
against XLA's dot, side by side in one process.

    python benchmarks/bench_skinny_matmul.py [--rows=1,2,4,8,16,32,64] [--batches=1,2,4,8,16,32]

Three parts:

* **matmuls**: SmolLM2-135M's 30 MLPs (x @ gate, x @ up, silu, @ down: [576, 1536]
  and [1536, 576] fp32, each layer its own weights, as arguments of one jitted
  function) on M token rows, by XLA's dot and by the C++ kernel: the median of
  --iters calls each, the two interleaved call by call.  The weights (318 MB) do
  not fit any cache, so one pass over them is the floor at every M.
* **tied head**: SmolLM2's tied LM head, x @ E.T with E [49152, 576] as stored
  (113 MB), by XLA's dot and by the kernel's transposed form, the same way.
* **engine**: two SmolLM2 fp32 engines in one process, `matmul_impl` "xla" and
  "cpu" (everything else the default), B fresh 16-token prompts, 96 greedy tokens
  each (EOS ignored): ms per step (a generate's wall / its steps, the prefill step
  included) over --rounds rounds per batch size, the engines alternating, after two
  untimed generates each; and whether the greedy tokens are equal.

Writes benchmarks/results/skinny_matmul.{csv,md}.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)
from jpaged import LLM, SamplingParams
from jpaged.layers import skinny_matmul
from pallas_kernels.cpu import SKINNY_MAX_ROWS

_ROWS = flags.DEFINE_list("rows", ["1", "2", "4", "8", "16", "32", "64"], "Token rows of the matmuls part.")
_BATCHES = flags.DEFINE_list("batches", ["1", "2", "4", "8", "16", "32"], "Sequences of the engine part (empty: skip).")
_ITERS = flags.DEFINE_integer("iters", 11, "Calls per variant and M (matmuls part).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed generates per engine and batch size (engine part).")

HIDDEN, WIDTH, LAYERS, VOCAB = 576, 1536, 30, 49152  # SmolLM2-135M


def _mlps(matmul):
    def run(x, weights):
        for gate, up, down in weights:
            h = jax.nn.silu(matmul(x, gate)) * matmul(x, up)
            x = x + matmul(h, down)
        return x
    return jax.jit(run)


def _matmul_rows() -> list[dict]:
    rng = np.random.default_rng(0)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)  # noqa: E731
    weights = [(draw(HIDDEN, WIDTH), draw(HIDDEN, WIDTH), draw(WIDTH, HIDDEN)) for _ in range(LAYERS)]
    embedding = draw(VOCAB, HIDDEN)
    # The kernel wherever its contract allows (SKINNY_MAX_ROWS), not only where the model routes it.
    skinny = lambda x, w: skinny_matmul.matmul(x, w) if x.shape[0] <= SKINNY_MAX_ROWS else x @ w  # noqa: E731

    def head(x, e):  # the tied LM head: x @ E.T with E stored [vocab, hidden]
        return skinny_matmul.matmul(x, e, True) if x.shape[0] <= SKINNY_MAX_ROWS else x @ e.T
    parts = {"matmuls": ({"xla": _mlps(jnp.matmul), "cpu": _mlps(skinny)}, weights),
             "tied head": ({"xla": jax.jit(lambda x, e: x @ e.T), "cpu": jax.jit(head)}, embedding)}
    rows = []
    for part, (variants, w) in parts.items():
        for m in map(int, _ROWS.value):
            x = jnp.asarray(rng.standard_normal((m, HIDDEN), np.float32))
            outs = {name: np.asarray(f(x, w)) for name, f in variants.items()}
            times = {name: [] for name in variants}
            for _ in range(_ITERS.value):
                for name, f in variants.items():
                    t0 = time.perf_counter()
                    f(x, w).block_until_ready()
                    times[name].append(time.perf_counter() - t0)
            xla_ms, cpu_ms = (1e3 * float(np.median(times[n])) for n in ("xla", "cpu"))
            rows.append({"part": part, "rows": m, "xla_ms": xla_ms, "cpu_ms": cpu_ms,
                         "cpu_over_xla": cpu_ms / xla_ms,
                         "max_abs_diff": float(np.abs(outs["cpu"] - outs["xla"]).max()),
                         "kernel_used": m <= SKINNY_MAX_ROWS})
            print(rows[-1], flush=True)
    return rows


def _engine_rows() -> list[dict]:
    batches = [int(b) for b in _BATCHES.value]
    if not batches:
        return []
    kw = dict(max_num_seqs=max(batches), max_num_batched_tokens=max(256, 16 * max(batches)),
              enable_prefix_caching=False)
    engines = {impl: LLM(matmul_impl=impl, **kw) for impl in ("xla", "cpu")}
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    rows = []
    for batch in batches:
        prompts = [rng.integers(100, 20000, 16).tolist() for _ in range(batch)]
        tokens, ms = {}, {impl: [] for impl in engines}
        for impl, llm in engines.items():
            tokens[impl] = [o.token_ids for o in llm.generate(prompts, params)]
            llm.runner.wait_for_programs()
            llm.generate(prompts, params)
        for _ in range(_ROUNDS.value):
            for impl, llm in engines.items():
                t0 = time.perf_counter()
                llm.generate(prompts, params)
                ms[impl].append(1e3 * (time.perf_counter() - t0) / llm.stats.steps)
        xla_ms, cpu_ms = (float(np.median(ms[i])) for i in ("xla", "cpu"))
        rows.append({"part": "engine", "rows": batch, "xla_ms": xla_ms, "cpu_ms": cpu_ms,
                     "cpu_over_xla": cpu_ms / xla_ms,
                     "same_tokens": f"{sum(a == b for a, b in zip(tokens['xla'], tokens['cpu']))}/{batch}",
                     "xla_rounds_ms": " ".join(f"{v:.1f}" for v in ms["xla"]),
                     "cpu_rounds_ms": " ".join(f"{v:.1f}" for v in ms["cpu"])})
        print(rows[-1], flush=True)
    return rows


def main(_):
    B.header("skinny matmul vs XLA's dot (SmolLM2 shapes, fp32)")
    rows = _matmul_rows() + _engine_rows()
    columns = ["part", "rows", "xla_ms", "cpu_ms", "cpu_over_xla", "max_abs_diff", "kernel_used", "same_tokens",
               "xla_rounds_ms", "cpu_rounds_ms"]
    B.write_csv("skinny_matmul", rows, columns)
    B.write_markdown("skinny_matmul", (
        f"# Skinny matmul vs XLA's dot ({B.machine()}, {B.today()})\n\n"
        "matmuls: SmolLM2's 30 MLPs on `rows` token rows, median ms of the jitted chain (the C++ kernel "
        f"up to {SKINNY_MAX_ROWS} rows, XLA's dot above). tied head: x @ E.T, E [49152, 576] "
        "as stored, the kernel's transposed form against XLA's dot. engine: SmolLM2 fp32, ms per step "
        "(generate wall / steps; B 16-token prompts, 96 greedy tokens), median of the rounds, "
        "`matmul_impl` xla vs cpu.\n\n" + B.markdown_table(rows, columns) + "\n"))


if __name__ == "__main__":
    app.run(main)

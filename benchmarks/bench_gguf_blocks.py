"""CPU decode steps reading a quantised GGUF's blocks (config `gguf_blocks`) against
reading its float32 params, and against XLA's dot, side by side in one process.

    python benchmarks/bench_gguf_blocks.py [--batches=1,4,8,16] [--rounds=3]

Three SmolLM2-135M engines (the embedded Q4_1 GGUF, float32, the default unrolled
layers): `matmul_impl=xla`; `matmul_impl=cpu` with `gguf_blocks=false` (the C++
skinny matmul on the float32 params); `matmul_impl=cpu` with `gguf_blocks=true`
(the default: the same kernel reading the file's Q4_1 / Q8_0 blocks).  Per batch
size B: the median ms of a step in which exactly B sequences decode
(`harness.time_decode_steps`: device and wall), over --rounds rounds with the
engines alternating; and whether B greedy generates (96 tokens, EOS ignored) give
the same tokens on all three.

Writes benchmarks/results/gguf_blocks.{csv,md}.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)
from jpaged import LLM, SamplingParams
from pallas_kernels import cpu

_BATCHES = flags.DEFINE_list("batches", ["1", "4", "8", "16"], "Decoding sequences per step.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed rounds per engine and batch size.")

ENGINES = {"xla": dict(matmul_impl="xla"), "cpu_float32": dict(matmul_impl="cpu", gguf_blocks=False),
           "cpu_blocks": dict(matmul_impl="cpu", gguf_blocks=True)}


def main(_):
    B.header("GGUF blocks in CPU decode steps (SmolLM2-135M Q4_1, fp32)")
    batches = [int(b) for b in _BATCHES.value]
    kw = dict(max_num_seqs=max(batches), max_num_batched_tokens=max(256, 16 * max(batches)),
              enable_prefix_caching=False)
    engines = {name: LLM(**kw, **extra) for name, extra in ENGINES.items()}
    registered = engines["cpu_blocks"].runner.registered_blocks
    print(f"cpu_blocks: {0 if registered is None else len(registered)} matrices read as blocks", flush=True)
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    rows = []
    for batch in batches:
        prompts = [rng.integers(100, 20000, 16).tolist() for _ in range(batch)]
        tokens = {name: [o.token_ids for o in llm.generate(prompts, greedy)] for name, llm in engines.items()}
        ms: dict[str, list[float]] = {name: [] for name in engines}
        calls = cpu.block_matmul_calls()
        for _ in range(_ROUNDS.value):
            for name, llm in engines.items():
                ms[name].append(B.time_decode_steps(llm, batch, 48)["step_ms"])
        row = {"batch": batch, **{f"{name}_ms": float(np.median(v)) for name, v in ms.items()}}
        row["blocks_over_float32"] = row["cpu_blocks_ms"] / row["cpu_float32_ms"]
        row["blocks_over_xla"] = row["cpu_blocks_ms"] / row["xla_ms"]
        row["same_tokens"] = (f"{sum(a == b == c for a, b, c in zip(*tokens.values()))}/{batch}")
        row["block_calls"] = cpu.block_matmul_calls() - calls
        row["rounds_ms"] = "; ".join(f"{n}: " + " ".join(f"{v:.1f}" for v in ms[n]) for n in engines)
        rows.append(row)
        print(row, flush=True)
    columns = ["batch", "xla_ms", "cpu_float32_ms", "cpu_blocks_ms", "blocks_over_float32", "blocks_over_xla",
               "same_tokens", "block_calls", "rounds_ms"]
    B.write_csv("gguf_blocks", rows, columns)
    B.write_markdown("gguf_blocks", (
        f"# GGUF blocks in CPU decode steps ({B.machine()}, {B.today()})\n\n"
        "SmolLM2-135M (the embedded Q4_1 GGUF; float32 params, unrolled layers), median ms of a step in which "
        "`batch` sequences decode (harness.time_decode_steps, 48 tokens each), over the rounds, engines "
        "alternating: XLA's dot; the C++ skinny matmul on the float32 params (`gguf_blocks=false`); the same "
        "kernel reading the file's blocks (`gguf_blocks=true`, the default). same_tokens: greedy generates of "
        "96 tokens equal on all three.\n\n" + B.markdown_table(rows, columns) + "\n"))


if __name__ == "__main__":
    app.run(main)

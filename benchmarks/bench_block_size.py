"""Block-size ablation: the same workload at block sizes 1..256: throughput and KV waste.

    python benchmarks/bench_block_size.py [--block_sizes=1,2,4,...,256 --max_tokens=64]

kv_waste_pct is the engine's own step-averaged share of allocated KV slots not
holding a token (EngineStats.kv_waste); final_frag_pct is the unused tail of each
request's last block at its end, over all its slots.
"""

from __future__ import annotations

import math

from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)
from jpaged.entrypoints.metrics import summarize

_SIZES = flags.DEFINE_list("block_sizes", ["1", "2", "4", "8", "16", "32", "64", "128", "256"], "Block sizes.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Max new tokens per request.")
_N = flags.DEFINE_integer("num_requests", 16, "Requests (mixed short / long answers).")
_MAX_RUNNING = flags.DEFINE_integer("max_running", 16, "Sequences running at once.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Run once untimed per block size first (compiles).")


def main(argv):
    del argv
    B.header("block size")
    prompts, params = B.chat(B.mixed_prompts(_N.value)), B.greedy(_MAX_TOKENS.value)
    rows = []
    for bs in (int(x) for x in _SIZES.value):
        llm = B.make_llm(block_size=bs, max_num_seqs=_MAX_RUNNING.value, max_model_len=512)
        if _WARMUP.value:
            B.timed_generate(llm, prompts, params)
        outs, wall = B.timed_generate(llm, prompts, params)
        s = summarize(outs, llm, wall)
        toks = [len(o.prompt_token_ids) + len(o.token_ids) for o in outs]
        slots = sum(math.ceil(n / bs) * bs for n in toks)
        rows.append({"block_size": bs, "tok_per_s": s["output_tok_per_s"], "ms_per_tok": s["ms_per_tok"],
                     "kv_waste_pct": s["kv_waste_pct"], "final_frag_pct": 100 * (1 - sum(toks) / slots),
                     "peak_kv_blocks": s["peak_kv_blocks"], "host_pct": s["host_pct"],
                     "compilations": s["compilations"]})
        print(f"block {bs}: {s['output_tok_per_s']:.1f} tok/s", flush=True)
        del llm
    B.report("block_size", rows, formats={"tok_per_s": ".1f", "ms_per_tok": ".2f", "kv_waste_pct": ".1f",
                                          "final_frag_pct": ".1f", "host_pct": ".1f"},
             title=f"Block-size ablation: {_N.value} requests, <= {_MAX_TOKENS.value} new tokens, "
                   f"<= {_MAX_RUNNING.value} running")
    fig, (a1, a2) = B.figure(2)
    x = [r["block_size"] for r in rows]
    a1.plot(x, [r["tok_per_s"] for r in rows], "o-"); a1.set_ylabel("output tok/s")
    a2.plot(x, [r["kv_waste_pct"] for r in rows], "o-", label="step-averaged KV waste")
    a2.plot(x, [r["final_frag_pct"] for r in rows], "s-", label="final last-block waste")
    a2.set_ylabel("%"); a2.legend()
    for a in (a1, a2):
        a.set_xscale("log", base=2); a.set_xlabel("block size (tokens)")
    B.save_figure("block_size", fig, "Block-size ablation")


if __name__ == "__main__":
    app.run(main)

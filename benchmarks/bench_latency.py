"""Static vs continuous batching on a queue of short- and long-answer prompts,
at most --max_running at once: per-request latency and speedup.

    python benchmarks/bench_latency.py [--max_running=4 --max_tokens=128]

A static batch's requests complete together, when its longest member is done.
"""

from __future__ import annotations

from absl import app, flags
import numpy as np

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)

_MAX_RUNNING = flags.DEFINE_integer("max_running", 4, "Sequences running at once.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "Max new tokens per request.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Run each policy once untimed first (compiles).")


def main(argv):
    del argv
    B.header("latency")
    prompts, params = B.chat(B.DEFAULT_PROMPTS), B.greedy(_MAX_TOKENS.value)
    res = {}
    for policy in ("static", "continuous"):
        llm = B.make_llm(scheduler=policy, max_num_seqs=_MAX_RUNNING.value)
        if _WARMUP.value:
            B.timed_generate(llm, prompts, params)
        outs, wall = B.timed_generate(llm, prompts, params)
        res[policy] = (outs, wall)
        print(f"{policy}: {wall:.1f} s, {llm.stats.steps} steps", flush=True)
        del llm
    rows = []
    for i, p in enumerate(B.DEFAULT_PROMPTS):
        s, c = res["static"][0][i], res["continuous"][0][i]
        rows.append({"seq": i, "prompt": p[:36], "static_ms": s.latency_ms, "cont_ms": c.latency_ms,
                     "tokens": len(c.token_ids), "speedup": s.latency_ms / c.latency_ms})
    rows.append({"seq": "all", "prompt": "mean latency / wall", "static_ms": np.mean([r["static_ms"] for r in rows]),
                 "cont_ms": np.mean([r["cont_ms"] for r in rows]), "tokens": sum(r["tokens"] for r in rows),
                 "speedup": res["static"][1] / res["continuous"][1]})
    B.report("latency", rows, formats={"static_ms": ".0f", "cont_ms": ".0f", "speedup": ".2f"},
             title=f"Latency: {len(prompts)} requests, <= {_MAX_RUNNING.value} running, "
                   f"<= {_MAX_TOKENS.value} new tokens (last row: mean latency; speedup = wall-time ratio)")
    fig, (ax,) = B.figure(1, 8)
    x = np.arange(len(prompts))
    ax.bar(x - 0.2, [r["static_ms"] for r in rows[:-1]], 0.4, label="static")
    ax.bar(x + 0.2, [r["cont_ms"] for r in rows[:-1]], 0.4, label="continuous")
    ax.set_xticks(x, [f"{i}: {p[:14]}" for i, p in enumerate(B.DEFAULT_PROMPTS)], rotation=30, fontsize=7)
    ax.set_ylabel("request latency (ms)"); ax.legend()
    B.save_figure("latency", fig, "Static vs continuous batching")


if __name__ == "__main__":
    app.run(main)

"""Batch-size sweep: N copies of one prompt, 128 new tokens each (EOS ignored).

    python benchmarks/bench_sweep.py [--batch_sizes=1,2,4,8,16,32,64 --max_tokens=128]

Per batch: total tok/s, ms/tok per sequence (latency / tokens, TTFT included),
TTFT, and memory: `kv_mb` = KV bytes in use at the peak (blocks x bytes_per_block),
`kv+weights_mb` = that plus the weights, and `peak_rss_mb` = the process's peak
RSS so far (monotonic over the run: the largest batch dominates it).
"""

from __future__ import annotations

from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)
from jpaged.runtime.kv_pool import bytes_per_block
from jpaged.entrypoints.metrics import summarize

_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16", "32", "64"], "Batch sizes.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "New tokens per sequence.")
_PROMPT = flags.DEFINE_string("prompt", B.SWEEP_PROMPT, "The prompt (raw text, no chat template).")
_WARMUP = flags.DEFINE_bool("warmup", True, "Run each batch once untimed first (compiles its shapes).")


def main(argv):
    del argv
    B.header("sweep")
    sizes = [int(b) for b in _BATCHES.value]
    llm = B.make_llm(max_num_seqs=max(sizes), max_num_batched_tokens=4096)
    params = B.greedy(_MAX_TOKENS.value, ignore_eos=True)
    bpb = bytes_per_block(llm.model_config, llm.config.block_size, llm.kv_dtype)
    wmb = B.weight_bytes(llm) / 2**20
    rows = []
    for n in sizes:
        prompts = [_PROMPT.value] * n
        if _WARMUP.value:
            B.timed_generate(llm, prompts, params)
        outs, wall = B.timed_generate(llm, prompts, params)
        s = summarize(outs, llm, wall)
        kv_mb = s["peak_kv_blocks"] * bpb / 2**20
        rows.append({"batch_size": n, "total_tok_per_s": s["output_tok_per_s"], "ms_per_tok": s["ms_per_tok"],
                     "ttft_ms": s["ttft_mean_ms"], "kv_mb": kv_mb, "kv+weights_mb": kv_mb + wmb,
                     "peak_rss_mb": B.peak_rss_mb(), "host_pct": s["host_pct"]})
        print(f"batch {n}: {s['output_tok_per_s']:.1f} tok/s", flush=True)
    B.report("sweep", rows, formats={"total_tok_per_s": ".1f", "ms_per_tok": ".2f", "ttft_ms": ".1f",
                                     "kv_mb": ".1f", "kv+weights_mb": ".1f", "peak_rss_mb": ".0f",
                                     "host_pct": ".1f"},
             title=f"Sweep: '{_PROMPT.value}' x batch, {_MAX_TOKENS.value} new tokens "
                   f"(memory: KV bytes in use + weights; peak RSS of the process shown too)")
    fig, (a1, a2, a3) = B.figure(3, 4.5)
    x = [r["batch_size"] for r in rows]
    a1.plot(x, [r["total_tok_per_s"] for r in rows], "o-"); a1.set_ylabel("total tok/s")
    a2.plot(x, [r["ms_per_tok"] for r in rows], "o-", label="ms/tok per seq")
    a2.plot(x, [r["ttft_ms"] for r in rows], "s-", label="TTFT ms"); a2.legend()
    a3.plot(x, [r["kv+weights_mb"] for r in rows], "o-", label="KV in use + weights")
    a3.plot(x, [r["peak_rss_mb"] for r in rows], "s-", label="peak RSS"); a3.set_ylabel("MB"); a3.legend()
    for a in (a1, a2, a3):
        a.set_xscale("log", base=2); a.set_xlabel("batch size")
    B.save_figure("sweep", fig, "Batch sweep")


if __name__ == "__main__":
    app.run(main)

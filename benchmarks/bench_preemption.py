"""Oversubscribed KV pool: throughput vs pool size, recompute vs swap, by block size.

    python benchmarks/bench_preemption.py [--fractions=0.25,0.5,1.0 --block_sizes=16,32 ...]

The workload (cf. the vLLM paper's recompute-vs-swap study, section 7.x): n
requests of random token-id prompts and random output lengths (greedy,
ignore_eos), all submitted at once with max_num_seqs = n, so admission
oversubscribes the pool and sequences are preempted as they grow.  "Need" is
the blocks all requests would hold at once at their final length; the pool is
sized to a fraction of it (at least one longest sequence).

One engine per block size serves every (pool, mode) run: its device pool is
allocated for the largest pool, and each run installs a fresh BlockManager of
the run's size (`LLM.install_pool`; blocks past it are never handed out), so every run shares the
compiled steps.  Each block size does untimed warm-ups (the full pool, and the smallest
pool in each mode: they compile most shapes), then one timed run per
(fraction, mode); a new_compiles column shows where a timed run still compiled.  Every run's tokens are checked against the full-pool run.
Writes benchmarks/results/preemption.{csv,md,png}.
"""

from __future__ import annotations

import math
import time

import numpy as np
from absl import app, flags

import harness as bench  # benchmarks/harness.py (the script's own directory is on sys.path)
from jpaged.engine.llm import LLM
from jpaged.entrypoints.metrics import summarize
from jpaged.core.sequence import SamplingParams

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (default: the embedded SmolLM2-135M).")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Weights / KV dtype.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 32, "Requests (all submitted at once).")
_PROMPT_LEN = flags.DEFINE_list("prompt_len", ["16", "64"], "Prompt length range [lo, hi].")
_MAX_TOKENS = flags.DEFINE_list("max_tokens", ["32", "64"], "Output length range [lo, hi].")
_FRACTIONS = flags.DEFINE_list("fractions", ["0.25", "0.5", "1.0"], "Pool sizes, as fractions of the need.")
_BLOCK_SIZES = flags.DEFINE_list("block_sizes", ["16", "32"], "Block sizes.")
_MODES = flags.DEFINE_list("modes", ["recompute", "swap"], "Preemption modes.")
_SWAP_GB = flags.DEFINE_float("swap_space_gb", 4.0, "Host swap space.")
_PREFIX_CACHING = flags.DEFINE_bool("prefix_caching", False,
                                    "Prefix caching (on, recompute victims may find their blocks still cached).")
_MAX_TOKEN_ID = flags.DEFINE_integer("max_token_id", 10000, "Prompt token ids are drawn from [100, this).")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")
_OUT = flags.DEFINE_string("out", "preemption", "Output name under benchmarks/results/.")


def workload(vocab: int):
    rng = np.random.default_rng(_SEED.value)
    lo, hi = map(int, _PROMPT_LEN.value)
    tlo, thi = map(int, _MAX_TOKENS.value)
    n = _NUM_REQUESTS.value
    prompts = [rng.integers(100, vocab, int(k)).tolist() for k in rng.integers(lo, hi + 1, n)]
    params = [SamplingParams(max_tokens=int(t), ignore_eos=True) for t in rng.integers(tlo, thi + 1, n)]
    return prompts, params


def run(llm, prompts, params, num_blocks, mode):
    llm.install_pool(num_blocks, mode)
    compiles = llm.num_compilations
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    s = summarize(outs, llm, wall)
    st = llm.stats
    s.update(swapped_out_blocks=st.swapped_out_blocks, prefill_steps=st.prefill_steps,
             prompt_tok_computed=st.prompt_tokens - st.cached_prompt_tokens,
             new_compiles=llm.num_compilations - compiles)
    return s, [o.token_ids for o in outs]


def main(argv):
    del argv
    bench.header("bench_preemption")
    fractions = [float(f) for f in _FRACTIONS.value]
    rows = []
    t_start = time.perf_counter()
    for bs in map(int, _BLOCK_SIZES.value):
        prompts, params = workload(_MAX_TOKEN_ID.value)
        need = sum(math.ceil((len(p) + q.max_tokens) / bs) for p, q in zip(prompts, params))
        llm = LLM(model=_MODEL.value, dtype=_DTYPE.value, block_size=bs, num_blocks=need + 2,
                  max_num_seqs=_NUM_REQUESTS.value, max_num_batched_tokens=1024, max_model_len=512,
                  enable_prefix_caching=_PREFIX_CACHING.value, swap_space_gb=_SWAP_GB.value)
        longest = max(math.ceil((len(p) + q.max_tokens) / bs) for p, q in zip(prompts, params))
        pools = sorted({max(longest + 1, int(round(f * need))) for f in fractions})
        print(f"block {bs}: need {need} blocks ({need * bs} tokens) for {len(prompts)} requests; "
              f"pools {pools}", flush=True)
        # Warm-up (untimed): the full pool, and the smallest in each mode, compile most
        # shapes; new_compiles says where a timed run still compiled something.
        run(llm, prompts, params, pools[-1] + 1, _MODES.value[0])
        for mode in _MODES.value:
            run(llm, prompts, params, pools[0] + 1, mode)
        ref_tokens = None
        for num_blocks in sorted(pools, reverse=True):
            for mode in _MODES.value:
                s, toks = run(llm, prompts, params, num_blocks + 1, mode)
                if ref_tokens is None:
                    ref_tokens = toks
                same = sum(a == b for a, b in zip(toks, ref_tokens))
                row = dict(block_size=bs, mode=mode, pool_blocks=num_blocks, pool_frac=num_blocks / need,
                           wall_s=s["wall_s"], out_tok_s=s["output_tok_per_s"], preemptions=s["preemptions"],
                           swap_fallbacks=s["swap_fallbacks"], swapped_mib=s["swapped_out_mib"],
                           swap_s=s["swap_s"], prefill_steps=s["prefill_steps"], steps=s["steps"],
                           prompt_tok_computed=s["prompt_tok_computed"], peak_blocks=s["peak_kv_blocks"],
                           same_tokens=f"{same}/{len(toks)}", errors=s["errors"],
                           new_compiles=s["new_compiles"])
                rows.append(row)
                print(f"  bs {bs:3d} pool {num_blocks:4d} ({row['pool_frac']:.2f}) {mode:9s}: "
                      f"{row['wall_s']:6.1f} s {row['out_tok_s']:6.1f} tok/s  preempt {row['preemptions']:3d}  "
                      f"swapped {row['swapped_mib']:6.1f} MiB ({row['swap_s']:.2f} s)  "
                      f"prompt tok computed {row['prompt_tok_computed']}  same {row['same_tokens']}", flush=True)
        del llm
    total = time.perf_counter() - t_start

    formats = {"pool_frac": ".2f", "wall_s": ".1f", "out_tok_s": ".1f", "swapped_mib": ".1f", "swap_s": ".2f"}
    bench.report(_OUT.value, rows, formats=formats, title="throughput vs pool size, recompute vs swap")
    cols = list(rows[0])
    md = [f"# Preemption: recompute vs swap ({_MODEL.value}, {_DTYPE.value})", "",
          f"{bench.machine()}, {bench.today()}; {_NUM_REQUESTS.value} requests, prompts "
          f"{'-'.join(_PROMPT_LEN.value)} tokens, {'-'.join(_MAX_TOKENS.value)} new tokens (greedy, ignore_eos), "
          f"max_num_seqs {_NUM_REQUESTS.value}, prefix caching {'on' if _PREFIX_CACHING.value else 'off'}; "
          f"one timed run per cell after a warm-up ({total:.0f} s in all).  A shared, noisy CPU: "
          "differences under ~10 % are within run-to-run noise.", "",
          "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        md.append("| " + " | ".join(format(r[c], formats[c]) if c in formats else str(r[c]) for c in cols) + " |")
    path = bench.RESULTS / f"{_OUT.value}.md"
    path.write_text("\n".join(md) + "\n")
    print(f"[wrote {path.relative_to(bench.REPO)}]")

    fig, axes = bench.figure(2, width=5.5)
    for bs in sorted({r["block_size"] for r in rows}):
        for mode, style in (("recompute", "-o"), ("swap", "--s")):
            rs = sorted((r for r in rows if r["block_size"] == bs and r["mode"] == mode), key=lambda r: r["pool_frac"])
            if not rs:
                continue
            x = [r["pool_frac"] for r in rs]
            axes[0].plot(x, [r["out_tok_s"] for r in rs], style, label=f"{mode}, block {bs}")
            axes[1].plot(x, [r["preemptions"] for r in rs], style, label=f"{mode}, block {bs}")
    axes[0].set_ylabel("output tokens / s")
    axes[1].set_ylabel("preemptions")
    for ax in axes:
        ax.set_xlabel("KV pool / blocks needed by all requests at once")
        ax.legend(fontsize=8)
    bench.save_figure(_OUT.value, fig, f"Preemption: recompute vs swap, {_MODEL.value} {_DTYPE.value}")


if __name__ == "__main__":
    app.run(main)

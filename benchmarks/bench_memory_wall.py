"""The memory wall: KV bytes reserved by a contiguous max-length cache, a growing
(dynamic) cache and the paged pool, for concurrency 1..32; and how many sequences
fit a fixed KV budget, contiguous vs paged, per KV pool dtype.

    python benchmarks/bench_memory_wall.py [--max_tokens=512 --max_model_len=2048 --budget_gib=1 \
        --kv_dtypes=float32,bfloat16,int8,fp8_e4m3]

Sequence lengths (prompt + answer) are real: the 8 demo prompts are run through
jpaged first; concurrency c takes the first c of them, cycling.  Bytes come
from jpaged.runtime.kv_pool.bytes_per_block.  `contiguous` reserves max_model_len slots
per sequence (HF StaticCache); `dynamic` holds exactly the tokens (HF
DynamicCache, before its grow-by-copy transients); `paged` holds ceil(len /
block_size) blocks.  wasted % = reserved slots not holding a token.  The
reservation table is for the engine's pool dtype (kv_cache_dtype auto = the
float32 weights' dtype); the fit table has one row per --kv_dtypes pool dtype,
its bytes from bytes_per_block(cfg, block_size, dtype) (int8 / fp8 rows carry
their scale codes: one more row per page).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)
from jpaged.engine.setup import resolve_kv_cache_dtype
from jpaged.runtime.kv_pool import bytes_per_block

_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 512, "Max new tokens of the real answers.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 2048, "Contiguous reservation per sequence.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Paged block size.")
_BUDGET = flags.DEFINE_float("budget_gib", 1.0, "Fixed KV budget for the fit test.")
_CONCURRENCY = flags.DEFINE_list("concurrency", ["1", "2", "4", "8", "16", "32"], "Concurrency levels.")
_KV_DTYPES = flags.DEFINE_list("kv_dtypes", ["float32", "bfloat16", "int8", "fp8_e4m3"],
                               "KV pool dtypes (kv_cache_dtype values) of the fit table.")


def main(argv):
    del argv
    B.header("memory wall")
    bs, L = _BLOCK_SIZE.value, _MAX_MODEL_LEN.value
    llm = B.make_llm(max_num_seqs=len(B.DEFAULT_PROMPTS), block_size=bs, max_model_len=L)
    outs, wall = B.timed_generate(llm, B.chat(B.DEFAULT_PROMPTS), B.greedy(_MAX_TOKENS.value))
    lens = [len(o.prompt_token_ids) + len(o.token_ids) for o in outs]
    print(f"real lengths (prompt + answer, {wall:.0f} s run): {lens}")
    per_tok = bytes_per_block(llm.model_config, 1, llm.kv_dtype)
    per_blk = bytes_per_block(llm.model_config, bs, llm.kv_dtype)
    print(f"KV bytes per token {per_tok} ({per_tok / 1024:.0f} KiB); per {bs}-token block {per_blk / 2**20:.2f} MiB")
    G = 2**30
    rows = []
    for c in (int(x) for x in _CONCURRENCY.value):
        seqs = list(itertools.islice(itertools.cycle(lens), c))
        toks = sum(seqs)
        contiguous = c * L * per_tok
        dynamic = toks * per_tok
        blocks = sum(math.ceil(n / bs) for n in seqs)
        paged = blocks * per_blk
        rows.append({"concurrency": c, "avg_tokens": toks / c, "contiguous_gib": contiguous / G,
                     "dynamic_gib": dynamic / G, "paged_gib": paged / G,
                     "contiguous_waste_pct": 100 * (1 - toks / (c * L)), "dynamic_waste_pct": 0.0,
                     "paged_waste_pct": 100 * (1 - toks / (blocks * bs))})
    B.report("memory_wall", rows, formats={"avg_tokens": ".1f", "contiguous_gib": ".3f", "dynamic_gib": ".3f",
                                           "paged_gib": ".3f", "contiguous_waste_pct": ".1f",
                                           "dynamic_waste_pct": ".1f", "paged_waste_pct": ".1f"},
             title=f"KV reserved, max_model_len {L}, block_size {bs}")
    budget = int(_BUDGET.value * G)
    fit = []
    for name in _KV_DTYPES.value:
        dt = resolve_kv_cache_dtype(name, llm.dtype)
        tok_b, blk_b = bytes_per_block(llm.model_config, 1, dt), bytes_per_block(llm.model_config, bs, dt)
        fit_contig = budget // (L * tok_b)
        used, fit_paged = 0, 0
        for n in itertools.cycle(lens):
            need = math.ceil(n / bs) * blk_b
            if used + need > budget:
                break
            used += need
            fit_paged += 1
        fit.append({"kv_dtype": name, "kv_budget_gib": _BUDGET.value, "bytes_per_token": tok_b,
                    "contiguous_mib_per_seq": L * tok_b / 2**20,
                    "paged_mib_per_seq": sum(math.ceil(n / bs) for n in lens) * blk_b / len(lens) / 2**20,
                    "contiguous_seqs": fit_contig, "paged_seqs": fit_paged,
                    "paged_over_contiguous": fit_paged / max(fit_contig, 1)})
    base = next((r for r in fit if r["kv_dtype"] == "float32"), fit[0])
    for r in fit:
        r["paged_vs_fp32_paged"] = r["paged_seqs"] / max(base["paged_seqs"], 1)
        r["paged_vs_fp32_contiguous"] = r["paged_seqs"] / max(base["contiguous_seqs"], 1)
    B.report("memory_wall_fit", fit, formats={"contiguous_mib_per_seq": ".1f", "paged_mib_per_seq": ".2f",
                                              "paged_over_contiguous": ".1f", "paged_vs_fp32_paged": ".2f",
                                              "paged_vs_fp32_contiguous": ".1f"},
             title="Sequences that fit a fixed KV budget (real length mix, cycled), per KV pool dtype")
    fig, (a1, a2) = B.figure(2)
    x = [r["concurrency"] for r in rows]
    for k, lab in (("contiguous_gib", "contiguous (max len)"), ("dynamic_gib", "dynamic (exact)"),
                   ("paged_gib", f"paged (block {bs})")):
        a1.plot(x, [r[k] for r in rows], "o-", label=lab)
    a1.set_xscale("log", base=2); a1.set_xlabel("concurrent sequences"); a1.set_ylabel("KV GiB"); a1.legend()
    xs = np.arange(len(fit))
    a2.bar(xs - 0.2, [r["contiguous_seqs"] for r in fit], 0.4, label=f"contiguous ({L} slots)")
    a2.bar(xs + 0.2, [r["paged_seqs"] for r in fit], 0.4, label=f"paged (block {bs})")
    for xi, r in zip(xs, fit):
        a2.annotate(str(r["paged_seqs"]), (xi + 0.2, r["paged_seqs"]), ha="center", va="bottom", fontsize=8)
    a2.set_xticks(xs, [r["kv_dtype"] for r in fit])
    a2.set_ylabel(f"sequences in {_BUDGET.value:g} GiB KV"); a2.legend()
    B.save_figure("memory_wall", fig, "The memory wall")


if __name__ == "__main__":
    app.run(main)

"""Static batching waste: 4 prompts with very different answer lengths in one
static batch; decode steps each needed vs steps it sat as padding.

    python benchmarks/bench_waste.py [--max_tokens=200]
"""

from __future__ import annotations

from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)

_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 200, "Max new tokens per request.")


def main(argv):
    del argv
    B.header("waste")
    llm = B.make_llm(scheduler="static", max_num_seqs=len(B.WASTE_PROMPTS))
    outs, wall = B.timed_generate(llm, B.chat(B.WASTE_PROMPTS), B.greedy(_MAX_TOKENS.value))
    total = max(len(o.token_ids) for o in outs)  # the batch decodes until its longest member is done
    print(f"batch ran for {total} decode steps total ({llm.stats.steps} engine steps incl. prefill, "
          f"{wall:.1f} s)")
    rows = []
    for p, o in zip(B.WASTE_PROMPTS, outs):
        need = len(o.token_ids)
        rows.append({"prompt": p[:40], "finish": o.finish_reason, "steps_needed": need,
                     "steps_wasted": total - need, "waste_pct": 100 * (total - need) / total})
    rows.append({"prompt": "TOTAL", "finish": "", "steps_needed": sum(r["steps_needed"] for r in rows),
                 "steps_wasted": sum(r["steps_wasted"] for r in rows),
                 "waste_pct": 100 * sum(r["steps_wasted"] for r in rows) / (total * len(outs))})
    B.report("waste", rows, formats={"waste_pct": ".1f"},
             title=f"Static batch of {len(outs)}, max {_MAX_TOKENS.value} new tokens")
    fig, (ax,) = B.figure(1, 7)
    labels = [r["prompt"][:28] for r in rows[:-1]]
    ax.barh(labels, [r["steps_needed"] for r in rows[:-1]], label="needed")
    ax.barh(labels, [r["steps_wasted"] for r in rows[:-1]], left=[r["steps_needed"] for r in rows[:-1]],
            label="wasted (padding)", color="lightgray")
    ax.set_xlabel("decode steps"); ax.invert_yaxis(); ax.legend()
    B.save_figure("waste", fig, "Static batching: decode steps needed vs wasted")


if __name__ == "__main__":
    app.run(main)

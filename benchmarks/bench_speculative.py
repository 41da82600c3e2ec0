"""Speculative decoding end to end: `scripts/serve_batch.py` with and without
drafts, as a user runs it (one process per run: start-up and compiles in its
whole-run wall, the generate wall beside it).

    python benchmarks/bench_speculative.py [--reps=2 --methods=none,ngram --num_speculative_tokens=4]

Workloads:
  copy     16 copy-heavy chat requests: repeat, quote or lightly edit a
           60-200-token passage (~100 new tokens each, greedy), at
           max_num_seqs=1 and 4
  mixed    the 64-request mixed workload (harness.mixed_prompts: short answers
           and long ones, 128 new tokens) at max_num_seqs=64, where speculation
           switches itself off (speculative_disable_by_batch_size)

Each (workload, max_num_seqs, method) runs --reps times, methods interleaved;
the first run of each starts from an empty cache directory (weights converted,
every program compiled: the cold figure), the others find it warm (programs
loaded from disk), and their median is the warm figure.  Per run: generate wall, whole-run
wall, output tokens per step, draft acceptance and mean accepted length (from
--summary_json), and whether the greedy tokens equal those of `none` (from
--output).  Writes benchmarks/results/speculative.{csv,md}.

Extra serve_batch flags go after `--`, e.g. `-- --config.speculative_method=draft
--config.speculative_model=/path/draft.gguf` (then name the method `draft`).
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

import harness as B  # benchmarks/harness.py

_REPS = flags.DEFINE_integer("reps", 3, "Runs of each configuration (the first one warms the caches).")
_METHODS = flags.DEFINE_list("methods", ["none", "ngram"], "speculative_method values to compare.")
_K = flags.DEFINE_integer("num_speculative_tokens", 4, "Draft tokens per step.")
_WORKLOADS = flags.DEFINE_list("workloads", ["copy", "mixed"], "copy and/or mixed.")

ROOT = pathlib.Path(__file__).resolve().parent.parent
COLUMNS = ["workload", "max_num_seqs", "method", "generate_s", "generate_cold_s", "whole_run_s",
           "whole_run_cold_s", "speedup", "tokens_per_step", "acceptance_pct", "mean_accepted_len",
           "programs", "padding", "same_tokens"]

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for more than a century. Sailors trusted its beam on "
    "stormy nights, and the keeper, a quiet man named Thomas, climbed its hundred steps every evening to light "
    "the lamp. When the town finally installed an automatic light, Thomas kept climbing anyway, because he "
    "said the sea still deserved someone who was watching.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and wait until the "
    "power light turns solid green. Then press and hold the reset button on the back for ten seconds, until "
    "all the lights blink at once. The router will restart with its factory settings, and the default "
    "network name and password are printed on the label underneath.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. Inside the "
    "chloroplasts, chlorophyll absorbs sunlight and uses its energy to split water molecules, releasing "
    "oxygen. The energy is stored in molecules that the plant then uses to build sugars from carbon dioxide. "
    "Almost every food chain on Earth begins with this process.",
    "Maria opened the bakery at five every morning. She mixed the dough for the bread first, then the "
    "pastries, and by seven the whole street smelled of cinnamon and butter. Her customers were mostly "
    "neighbours who had known her for years. On Sundays she gave the leftover loaves to the shelter on the "
    "corner, and she never once told anyone that she did.",
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, the "
    "members agreed to increase funding for the children's section and to delay the renovation of the "
    "parking lot until next year. The final proposal will be presented to the city council at its next "
    "public meeting, where residents may comment before the vote.",
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be "
    "positive')\n    result = []\n    total = 0.0\n    for i, value in enumerate(values):\n        total += "
    "value\n        if i >= window:\n            total -= values[i - window]\n        if i >= window - 1:\n"
    "            result.append(total / window)\n    return result\n",
    "Our hiking group left the trailhead just after sunrise. The path climbed steadily through pine forest "
    "for the first two hours, then opened onto a rocky ridge with views of three lakes below. We ate lunch "
    "near the summit marker, watched a pair of hawks circling overhead, and started down before the "
    "afternoon clouds rolled in from the west.",
    "The museum's new exhibit traces the history of timekeeping, from sundials and water clocks to the "
    "atomic clocks that define the second today. Visitors can handle replicas of early pocket watches, "
    "listen to the ticking of a restored tower clock, and see how sailors once used precise clocks to find "
    "their longitude at sea.",
]
EDITS = [("Thomas", "Henry"), ("thirty seconds", "one minute"), ("green plants", "plants and algae"),
         ("Maria", "Elena"), ("Tuesday", "Thursday"), ("moving_average", "rolling_mean"),
         ("three lakes", "two lakes"), ("museum's", "gallery's")]


def copy_requests() -> list[dict]:
    """16 requests: each passage repeated exactly, and quoted or lightly edited."""
    out = []
    for i, (text, (old, new)) in enumerate(zip(PASSAGES, EDITS)):
        out.append({"prompt": f"Repeat the following text exactly, word for word:\n\n{text}"})
        second = (f"Rewrite the following text, changing \"{old}\" to \"{new}\" and nothing else:\n\n{text}"
                  if i % 2 else f"Quote the following passage in full, inside quotation marks:\n\n{text}")
        out.append({"prompt": second})
    return [{**r, "max_tokens": 100, "temperature": 0.0} for r in out]


def mixed_requests() -> list[dict]:
    return [{"prompt": p, "max_tokens": 128, "temperature": 0.0} for p in B.mixed_prompts(64)]


def serve_batch(requests_path: pathlib.Path, tmp: pathlib.Path, overrides: dict, extra: list[str]) -> dict:
    """One `scripts/serve_batch.py` process; its summary, whole-run wall and tokens."""
    summary, output = tmp / "summary.json", tmp / "out.jsonl"
    output.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "scripts/serve_batch.py"), "--config", str(ROOT / "configs/smollm2_135m.py"),
           "--prompts", str(requests_path), "--output", str(output), "--summary_json", str(summary),
           *[f"--config.{k}={v}" for k, v in overrides.items()], *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"serve_batch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(summary.read_text())
    records = [json.loads(line) for line in output.read_text().splitlines()]
    result["tokens"] = {r["index"]: r.get("token_ids") for r in records}
    result["whole_run"] = wall
    return result


def run_workload(name: str, requests: list[dict], max_num_seqs: int, extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d)
        path = tmp / "requests.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in requests))
        runs: dict[str, list[dict]] = {m: [] for m in _METHODS.value}
        for _ in range(_REPS.value):
            for method in _METHODS.value:
                # A cache directory per method, empty at its first run (cold), warm after.
                cache = tmp / f"cache-{method}"
                overrides = dict(max_num_seqs=max_num_seqs, speculative_method=method,
                                 num_speculative_tokens=_K.value, cache_dir=cache)
                runs[method].append(serve_batch(path, tmp, overrides, extra if method == "draft" else []))
                r = runs[method][-1]
                print(f"  {name} seqs={max_num_seqs} {method}: generate {r['wall_s']:.2f} s, "
                      f"whole run {r['whole_run']:.1f} s", flush=True)
    base_tokens = runs[_METHODS.value[0]][0]["tokens"]
    base_wall = None
    rows = []
    for method, rs in runs.items():
        warm = rs[1:] or rs
        gen = statistics.median(r["wall_s"] for r in warm)
        base_wall = base_wall or gen
        last = warm[-1]
        rows.append(dict(workload=name, max_num_seqs=max_num_seqs, method=method, generate_s=gen,
                         generate_cold_s=rs[0]["wall_s"], whole_run_s=statistics.median(r["whole_run"] for r in warm),
                         whole_run_cold_s=rs[0]["whole_run"], speedup=base_wall / gen,
                         tokens_per_step=last["output_tokens"] / max(1, last["steps"]),
                         acceptance_pct=last.get("draft_acceptance_pct", 0.0),
                         mean_accepted_len=last.get("mean_accepted_length", 1.0),
                         programs=last["compilations"], padding=last["padding_ratio"],
                         same_tokens=all(r["tokens"] == base_tokens for r in rs)))
    return rows


def main(argv: list[str]) -> None:
    extra = argv[1:]
    B.header("speculative decoding through scripts/serve_batch.py (SmolLM2-135M fp32)")
    rows = []
    if "copy" in _WORKLOADS.value:
        for seqs in (1, 4):
            rows += run_workload("copy", copy_requests(), seqs, extra)
    if "mixed" in _WORKLOADS.value:
        rows += run_workload("mixed", mixed_requests(), 64, extra)
    B.report("speculative", rows, COLUMNS)
    B.write_markdown("speculative", B.markdown_table(rows, COLUMNS))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    app.run(main)

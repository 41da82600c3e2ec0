"""What structured outputs cost: the grammar mask per row per step, and a batch
where half the rows are constrained against the same batch unconstrained.

    python benchmarks/bench_structured.py [--batch=32 --max_tokens=64 --reps=3]

SmolLM2-135M fp32 on the engine's defaults (async scheduling on), one engine for
every run.  Every row generates exactly --max_tokens tokens in every run, so the
runs compare like for like: unconstrained rows ignore EOS, and a constrained row
follows a constraint that cannot complete within --max_tokens (a JSON array of
at least 1000 strings, or a regex of at least 2000 letters), so it never stops
early and it always has many allowed tokens to choose among.

Runs (each --reps times, interleaved, after one untimed warm-up of each):
  free           no row constrained
  half_json      every other row under the JSON-array schema
  half_regex     every other row under the regex
  all_json       every row under the JSON-array schema
Per run: generate wall (median), output tokens/s, ms per step, and the
slowdown against `free` measured in the same process.  The mask cost is timed
in place: `Grammar.fill` (one row's bitmask for one step) is wrapped on the
engine's rows, giving microseconds per row per step; the step's whole mask
(`_logit_mask`: allocation plus every row) per step.

Writes benchmarks/results/structured.{csv,md} (structured_sync.* with
--noasync_scheduling).  About 3 minutes on an idle 2-core
machine with the defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any

from absl import app, flags

import harness as B  # benchmarks/harness.py
from jpaged.core.sequence import SamplingParams
from jpaged.runtime import step_inputs
from jpaged.structured.grammar import Grammar
from jpaged.structured.spec import StructuredOutputs

_BATCH = flags.DEFINE_integer("batch", 32, "Requests in the batch (all decode together).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "New tokens per request.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed runs per configuration (median).")
_ASYNC = flags.DEFINE_bool("async_scheduling", True, "The engine's async_scheduling (false: the ablation, "
                           "where every step runs one at a time, constrained or not).")

LONG_JSON = StructuredOutputs(json={"type": "array", "items": {"type": "string"}, "minItems": 1000})
LONG_REGEX = StructuredOutputs(regex=r"[a-z ]{2000,}")
RUNS = {"free": (None, 0), "half_json": (LONG_JSON, 2), "half_regex": (LONG_REGEX, 2), "all_json": (LONG_JSON, 1)}
COLUMNS = ["run", "async", "constrained_rows", "generate_s", "tok_per_s", "ms_per_step", "slowdown",
           "fill_us_per_row_step", "mask_ms_per_step"]


class MaskClock:
    """Time inside Grammar.fill (per row) and step_inputs._logit_mask (per step)."""

    def __init__(self):
        self.fill_s = self.mask_s = 0.0
        self.fills = self.masks = 0
        fill, mask = Grammar.fill, step_inputs._logit_mask

        @functools.wraps(fill)
        def timed_fill(grammar, *args):
            t0 = time.perf_counter()
            fill(grammar, *args)
            self.fill_s += time.perf_counter() - t0
            self.fills += 1

        @functools.wraps(mask)
        def timed_mask(*args):
            t0 = time.perf_counter()
            out = mask(*args)
            if out is not None:
                self.mask_s += time.perf_counter() - t0
                self.masks += 1
            return out
        Grammar.fill, step_inputs._logit_mask = timed_fill, timed_mask

    def take(self) -> dict[str, float]:
        out = {"fill_us_per_row_step": 1e6 * self.fill_s / self.fills if self.fills else 0.0,
               "mask_ms_per_step": 1e3 * self.mask_s / self.masks if self.masks else 0.0}
        self.fill_s = self.mask_s = 0.0
        self.fills = self.masks = 0
        return out


def params_for(run: str) -> list[SamplingParams]:
    spec, every = RUNS[run]
    free = SamplingParams(max_tokens=_MAX_TOKENS.value, ignore_eos=True)
    return [dataclasses.replace(free, structured=spec) if spec is not None and i % every == 0 else free
            for i in range(_BATCH.value)]


def timed_run(llm: Any, prompts: list, run: str, clock: MaskClock) -> dict:
    params = params_for(run)
    steps0 = llm.totals.steps
    outputs, seconds = B.timed_generate(llm, prompts, params)
    tokens = sum(len(o.token_ids) for o in outputs)
    if tokens != _BATCH.value * _MAX_TOKENS.value or any(o.finish_reason != "length" for o in outputs):
        raise RuntimeError(f"{run}: every row should generate exactly {_MAX_TOKENS.value} tokens "
                           f"(got {tokens} in all, reasons {sorted({o.finish_reason for o in outputs})})")
    return {"generate_s": seconds, "tok_per_s": tokens / seconds,
            "ms_per_step": 1e3 * seconds / max(1, llm.totals.steps - steps0), **clock.take()}


def main(argv):
    del argv
    B.header("bench_structured")
    llm = B.make_llm(max_num_seqs=_BATCH.value, max_num_batched_tokens=max(512, 16 * _BATCH.value),
                     async_scheduling=_ASYNC.value)
    prompts = B.chat(B.mixed_prompts(_BATCH.value))
    clock = MaskClock()
    for run in RUNS:  # compile every bucket and variant once, untimed
        timed_run(llm, prompts, run, clock)
    samples: dict[str, list[dict]] = {run: [] for run in RUNS}
    for _ in range(_REPS.value):
        for run in RUNS:
            samples[run].append(timed_run(llm, prompts, run, clock))
    rows = []
    for run, spec_every in RUNS.items():
        median = {k: statistics.median(s[k] for s in samples[run]) for k in samples[run][0]}
        spec, every = spec_every
        constrained = 0 if spec is None else len(range(0, _BATCH.value, every))
        rows.append({"run": run, "async": _ASYNC.value, "constrained_rows": constrained, **median})
    free = rows[0]["generate_s"]
    for row in rows:
        row["slowdown"] = row["generate_s"] / free
    name = "structured" if _ASYNC.value else "structured_sync"
    B.report(name, rows, COLUMNS)
    B.write_markdown(name, f"# Structured outputs' cost ({B.machine()}, {B.today()})\n\n"
                     f"batch {_BATCH.value}, {_MAX_TOKENS.value} tokens per row, median of {_REPS.value}\n\n"
                     + B.markdown_table(rows, COLUMNS))


if __name__ == "__main__":
    app.run(main)

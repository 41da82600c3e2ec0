"""Soak: thousands of mixed requests, a tenth of them bad, through an engine
whose pool is small enough to preempt, in both preemption modes.

    python benchmarks/soak.py [--num_requests=2000 --waves=10 --modes=recompute,swap]

Request lines are generated as JSON (seeded): chat prompts over 8 shared system
prompts (prefix caching), random sampling settings (greedy and sampled, top-k,
top-p, seeds, n = 1..3, cache salts) and about 10% bad lines (not JSON, not an
object, wrong field types, values out of the device's range, non-string salts,
prompts longer than max_model_len, bad UTF-8).  They go through the same path as
serve_batch.py: `read_request_file`, then the good ones through `LLM.generate`
in waves on one engine (its prefix cache and swap space persist across waves).

Per mode it checks, and the table reports:
  * every line got exactly one result, the bad ones an error naming their line;
  * every good request's samples equal those of a second, fresh engine that ran
    only the good lines (same waves);
  * zero blocks held and zero host swap slots used after every wave;
  * resident memory after each wave (flat: the last wave vs the second).
Writes benchmarks/results/soak.{csv,md}.
"""

from __future__ import annotations

import json
import pathlib
import random
import tempfile
import time

from absl import app, flags

import harness as bench  # benchmarks/harness.py (the script's own directory is on sys.path)
from jpaged.engine.llm import LLM
from jpaged.entrypoints.batch_requests import ParsedRequest, read_request_file

_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 2000, "Request lines in all.")
_BAD_FRACTION = flags.DEFINE_float("bad_fraction", 0.1, "Share of bad lines.")
_WAVES = flags.DEFINE_integer("waves", 10, "generate() calls the lines are split into.")
_MODES = flags.DEFINE_list("modes", ["recompute", "swap"], "Preemption modes to soak.")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 20, "KV pool blocks (small: preemption).")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 16, "Sequences running at once.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 8, "Longest answer of a good request.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")

MAX_MODEL_LEN = 320
SYSTEMS = [f"You are assistant number {i}. " + "Answer briefly, politely and accurately. " * (1 + i % 3)
           for i in range(8)]
QUESTIONS = ["What is the capital of {}?", "Name an animal that lives in {}.", "Spell {} backwards.",
             "Write one sentence about {}.", "What language is spoken in {}?"]
PLACES = ["France", "Japan", "Peru", "Kenya", "Norway", "India", "Chile", "Egypt", "Canada", "Italy"]


def good_request(rng: random.Random) -> dict:
    r = {"messages": [{"role": "system", "content": rng.choice(SYSTEMS)},
                      {"role": "user", "content": rng.choice(QUESTIONS).format(rng.choice(PLACES))}],
         "max_tokens": rng.randint(1, _MAX_TOKENS.value)}
    if rng.random() < 0.5:
        r.update(temperature=rng.choice([0.5, 0.8, 1.0, 1.3]), top_p=rng.choice([1.0, 0.9, 0.5]),
                 top_k=rng.choice([0, 0, 5, 50]))
        if rng.random() < 0.8:
            r["seed"] = rng.randrange(2**31)
    r["n"] = rng.choice([1, 1, 1, 1, 2, 3])
    if rng.random() < 0.2:
        r["cache_salt"] = rng.choice(["tenant-a", "tenant-b"])
    if rng.random() < 0.3:
        r["ignore_eos"] = True
    return r


def bad_line(rng: random.Random) -> bytes:
    base = good_request(rng)
    kind = rng.randrange(12)
    if kind == 0:
        return b'{"messages": [{"role": "user", "content": "unterminated'
    if kind == 1:
        return json.dumps([base]).encode()
    if kind == 2:
        return b'{"prompt": "caf\xe9"}'
    field, value = [("temperature", "hot"), ("temperature", float("nan")), ("top_k", 2**40),
                    ("seed", -5), ("seed", 2**32), ("max_tokens", True), ("n", 0),
                    ("cache_salt", 12345), ("messages", [])][kind - 3]
    base[field] = value
    if kind == 11:  # also: a prompt longer than max_model_len (fails inside the engine)
        base = {"prompt": "word " * (2 * MAX_MODEL_LEN), "max_tokens": 4}
    return json.dumps(base, allow_nan=True).encode()


def workload(n: int, bad_fraction: float, seed: int) -> tuple[list[bytes], set[int]]:
    """n request lines and the indices of the bad ones."""
    rng = random.Random(seed)
    lines, bad = [], set()
    for i in range(n):
        if rng.random() < bad_fraction:
            bad.add(i)
            lines.append(bad_line(rng))
        else:
            lines.append(json.dumps(good_request(rng)).encode())
    return lines, bad


def rss_mb() -> float:
    """Resident memory now (not the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def run_lines(llm: LLM, lines: list[bytes], waves: int) -> tuple[dict[int, dict], list[dict]]:
    """Results by line index, and per-wave health (time, RSS, blocks held)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "requests.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        requests = read_request_file(path, llm.default_sampling_params())
    results: dict[int, dict] = {r.index: {"error": r.error} for r in requests if r.error}
    good: list[ParsedRequest] = [r for r in requests if not r.error]
    per_wave = -(-len(good) // waves)
    health = []
    for w in range(waves):
        chunk = good[w * per_wave:(w + 1) * per_wave]
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt for r in chunk], [r.params for r in chunk])
        for r, o in zip(chunk, outs):
            results[r.index] = {"error": o.error, "samples": [s["token_ids"] for s in o.samples]}
        s = llm.stats
        health.append(dict(wave=w, seconds=time.perf_counter() - t0, rss_mb=rss_mb(),
                           blocks_held=llm.block_manager.num_used_blocks,
                           swap_slots_used=llm.swap_space.num_used_blocks,
                           preemptions=s.preemptions, cache_hit_pct=100 * s.cache_hit_rate,
                           errors=sum(o.finish_reason == "error" for o in outs)))
        h = health[-1]
        print(f"  [{llm.config.preemption_mode}] wave {w}: {h['seconds']:.1f} s, RSS {h['rss_mb']:.0f} MiB, "
              f"blocks held {h['blocks_held']}, swap slots {h['swap_slots_used']}, "
              f"preemptions {h['preemptions']}, errors {h['errors']}", flush=True)
    return results, health


def make_llm(mode: str) -> LLM:
    return LLM(max_model_len=MAX_MODEL_LEN, num_blocks=_NUM_BLOCKS.value, max_num_seqs=_MAX_NUM_SEQS.value,
               max_num_batched_tokens=256, preemption_mode=mode, swap_space_gb=0.05,
               max_tokens=_MAX_TOKENS.value)


def soak(mode: str, lines: list[bytes], bad: set[int]) -> dict:
    t0 = time.perf_counter()
    llm = make_llm(mode)
    mixed, health = run_lines(llm, lines, _WAVES.value)
    mixed_seconds = time.perf_counter() - t0
    good_idx = [i for i in range(len(lines)) if i not in bad]
    alone, _ = run_lines(make_llm(mode), [lines[i] for i in good_idx], _WAVES.value)
    alone = {good_idx[i]: r for i, r in alone.items()}  # back to the mixed file's line numbers
    bad_errors = [mixed[i]["error"] for i in bad]
    engine_errors = [i for i in good_idx if mixed[i]["error"]]
    mismatches = [i for i in good_idx if mixed[i] != alone[i]]
    rss = [h["rss_mb"] for h in health]
    return dict(
        mode=mode, lines=len(lines), bad_lines=len(bad),
        one_result_per_line=len(mixed) == len(lines),
        bad_lines_failed=sum(e is not None for e in bad_errors),
        good_lines_failed=len(engine_errors),
        good_equal_to_clean_run=f"{len(good_idx) - len(mismatches)}/{len(good_idx)}",
        samples=sum(len(mixed[i].get("samples", [])) for i in good_idx),
        preemptions=sum(h["preemptions"] for h in health),
        max_blocks_held_after_wave=max(h["blocks_held"] for h in health),
        max_swap_slots_after_wave=max(h["swap_slots_used"] for h in health),
        rss_wave2_mb=rss[min(1, len(rss) - 1)], rss_last_mb=rss[-1],
        mixed_run_s=mixed_seconds)


def main(argv: list[str]) -> None:
    del argv
    bench.header("soak")
    lines, bad = workload(_NUM_REQUESTS.value, _BAD_FRACTION.value, _SEED.value)
    rows = [soak(mode, lines, bad) for mode in _MODES.value]
    bench.report("soak", rows)
    bench.write_markdown("soak", f"Soak, {bench.machine()}, {bench.today()}: {len(lines)} lines "
                         f"({len(bad)} bad), {_WAVES.value} waves, pool {_NUM_BLOCKS.value} blocks, "
                         f"max_num_seqs {_MAX_NUM_SEQS.value}.\n\n" + bench.markdown_table(rows))
    failed = [r["mode"] for r in rows
              if not (r["one_result_per_line"] and r["bad_lines_failed"] == r["bad_lines"]
                      and r["max_blocks_held_after_wave"] == 0 and r["max_swap_slots_after_wave"] == 0)]
    if failed:
        raise SystemExit(f"soak failed in mode(s) {failed}")


if __name__ == "__main__":
    app.run(main)

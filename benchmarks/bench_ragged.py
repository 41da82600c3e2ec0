r"""The ragged step's targets, side by side in one run on this machine.

    python benchmarks/bench_ragged.py                      # everything, full size (tens of minutes on 2 cores)
    python benchmarks/bench_ragged.py --parts=e2e --workloads=shared --num_requests_scale=0.25 \
        --cold=false --engine_overrides=attention_impl=reference      # smoke test

Parts (--parts):
  e2e      End to end through the CLI vs transformers.  Each workload is written as a
           JSONL file and run as `scripts/serve_batch.py --config <config_file> ...
           --prompts X --output Y --summary_json Z` in a subprocess, timed from the
           outside (process start, imports, weight load and compiles included: what a
           user waits for).  warm: the identical command runs twice, the second is
           timed; cold (--cold): once with an empty --config.cache_dir (weights
           converted + every step program compiled).  Then transformers' static
           generate() runs in-process on exactly the same prompt token ids (the
           engine's chat template) with the workload's batch size; greedy tokens are
           compared with Y's token_ids.  Workloads (greedy, EOS honoured):
             mixed   64 mixed short/long chat prompts, <= 128 new tokens, max_num_seqs 64;
                     HF static batches of 32.  Target: jpaged >= 2x HF.
             long    24 "summarize" requests of 200-900 prompt tokens (generated English
                     text, seeded), 32 new tokens, max_num_seqs 8, prefix caching off;
                     HF batches of 8.  Target >= 1.5x.
             shared  16 questions after one ~500-token system prompt, 32 new tokens,
                     max_num_seqs 4, prefix caching on; HF batches of 4.  Target >= 3x.
  serve    Cold start of `make serve`'s command (serve_batch.py --config <config_file>,
           the 8 default prompts) with an empty cache dir: subprocess wall, compile
           seconds (summary json) and the compile share of the wall (target <= 25 %);
           and the same command warm (second of two runs).
  layer_loop  In-process, unrolled layers vs lax.scan: compile seconds per program
           (no persistent cache) and step times (a 2x512 prefill, a batch-32 decode).
  prefill  In-process: LLM(max_num_seqs=8, max_num_batched_tokens=T=1024, prefix caching
           off); prefill shapes 1x1024, 2x512, 8x128 random prompt tokens, max_tokens=1
           (one step of exactly T tokens): compiled once, then --prefill_iters timed
           runs; the step's device time (llm.stats.device_seconds) against a jitted
           function of only the 7 projection matmuls of every layer over T tokens.
           Target: prefill tokens/s >= 85 % of the floor's.
  decode   Decode-only step time at batch 32 and 64 (median of the steps in which
           exactly `batch` sequences decode) and the matmul floor at that batch
           (projections + lm_head over `batch` rows).  Reported, no target.
The padding ratio (token slots computed / real tokens) of every CLI run is
tabled too; target <= 1.15 each.

Writes benchmarks/results/<out>_{e2e,serve_start,prefill,decode,padding,targets}.csv
and <out>.md (default out: ragged).  Run it on a quiet machine: every number
here is a wall-clock time.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)

_PARTS = flags.DEFINE_list("parts", ["e2e", "serve", "prefill", "decode", "layer_loop"],
                           "Parts to run: e2e, serve, prefill, decode, layer_loop.")
_WORKLOADS = flags.DEFINE_list("workloads", ["mixed", "long", "shared"],
                               "End-to-end workloads (part e2e): mixed, long, shared.")
_COLD = flags.DEFINE_bool("cold", True, "Also run every CLI command once with an empty cache dir.")
_HF = flags.DEFINE_bool("hf", True, "Run the transformers static-generate peer (part e2e).")
_CONFIG_FILE = flags.DEFINE_string("config_file", "configs/smollm2_135m.py",
                                   "Config file of every serve_batch run (make serve's).")
_ENGINE_OVERRIDES = flags.DEFINE_list(
    "engine_overrides", [],
    "key=value config overrides for every jpaged run, CLI (--config.key=value) and in-process "
    "(e.g. attention_impl=reference).")
_CACHE_DIR = flags.DEFINE_string("cache_dir", "",
                                 "Cache dir of the warm runs ('': the engine default, "
                                 "$JPAGED_CACHE_DIR or ~/.cache/jpaged).")
_COLD_KERNEL = flags.DEFINE_bool(
    "cold_kernel_build", False,
    "Cold runs also set JPAGED_CACHE_DIR to the empty dir, so the C++ attention kernel is "
    "rebuilt as on a fresh machine (default: only --config.cache_dir, as the issue states).")
_PRECOMPILE = flags.DEFINE_bool("precompile", False, "Pass --precompile to every serve_batch run.")
_SCALE = flags.DEFINE_float("num_requests_scale", 1.0,
                            "Scales the request count of every e2e workload (smoke tests).")
_TOKENS_SCALE = flags.DEFINE_float("max_tokens_scale", 1.0,
                                   "Scales max new tokens of every e2e workload (smoke tests).")
_LONG_TOKENS = flags.DEFINE_list("long_prompt_tokens", ["200", "900"],
                                 "Prompt length range (rendered tokens) of the long workload.")
_SYSTEM_TOKENS = flags.DEFINE_integer("system_tokens", 500, "System prompt tokens of the shared workload.")
_PREFILL_SHAPES = flags.DEFINE_list("prefill_shapes", ["1x1024", "2x512", "8x128"],
                                    "Prefill shapes NxL (N prompts of L tokens); every N*L must be "
                                    "the same T (= the engine's max_num_batched_tokens).")
_PREFILL_ITERS = flags.DEFINE_integer("prefill_iters", 3, "Timed prefill runs per shape (median).")
_FLOOR_ITERS = flags.DEFINE_integer("floor_iters", 5, "Timed calls of the matmul floor (median).")
_DECODE_BATCHES = flags.DEFINE_list("decode_batches", ["32", "64"], "Decode-step batch sizes.")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 32, "Tokens per request of the decode-step test.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the generated prompts.")
_WORK_DIR = flags.DEFINE_string("work_dir", None,
                                "Where request / output / summary / log files go (default: a new "
                                "temp dir, kept).")
_OUT = flags.DEFINE_string("out", "ragged", "Results name prefix under benchmarks/results/.")

COLD_LABEL = "cold (empty cache dir: weights converted + compiled)"
WARM_LABEL = "warm (2nd of 2 identical runs)"

# name: requests, max new tokens, serve_batch overrides, HF static batch, target speed-up
WORKLOADS = {
    "mixed": dict(n=64, max_tokens=128, config={"max_num_seqs": 64}, hf_batch=32, target=2.0),
    "long": dict(n=24, max_tokens=32, config={"max_num_seqs": 8, "enable_prefix_caching": False},
                 hf_batch=8, target=1.5),
    "shared": dict(n=16, max_tokens=32, config={"max_num_seqs": 4}, hf_batch=4, target=3.0),
}


# ------------------------------------------------------------------ generated text
# Each long document opens with its own town, so no two prompts share more than
# the chat template and the instruction (checked on token ids in long_requests).
_TOWNS = ["Ashford", "Brindle", "Calloway", "Dunmore", "Elderton", "Fairhaven", "Glenrock",
          "Hollowmere", "Ivybridge", "Juniper", "Kestrel", "Larkspur", "Moorfield", "Northgate",
          "Oakhurst", "Pinecrest", "Quarry", "Ravensworth", "Stonebury", "Thornwick", "Umberleigh",
          "Valemont", "Westbrook", "Yarrow", "Zennor", "Bramley", "Cobalt", "Driftwood", "Ember",
          "Foxley", "Granite", "Heathcote"]
_ADJ = ["quiet", "busy", "historic", "modest", "crowded", "remote", "prosperous", "windy", "colourful",
        "ambitious", "careful", "surprising", "unusual", "generous", "practical", "fragile", "steady"]
_KIND = ["market town", "fishing village", "river port", "mountain town", "university town",
         "farming community", "coastal resort", "mining town", "railway junction"]
_PRODUCT = ["wool", "cheese", "glassware", "clocks", "apple cider", "pottery", "timber", "lace",
            "bicycles", "honey", "printed maps", "violins", "slate roofs", "sailcloth"]
_ORG = ["town council", "historical society", "school board", "chamber of commerce",
        "harbour authority", "library committee", "water company", "football club", "art museum"]
_THING = ["bridge", "footpath", "bus route", "community garden", "concert hall", "flood barrier",
          "bakery", "solar farm", "clock tower", "swimming pool", "weekly market", "night school",
          "ferry service", "bicycle lane", "public archive", "observatory"]
_LANDMARK = ["old mill", "river bend", "north pier", "chapel hill", "railway viaduct", "castle ruins",
             "town square", "eastern cliffs", "canal lock", "botanical garden"]
_PEOPLE = ["shopkeepers", "farmers", "students", "retired teachers", "fishermen", "young families",
           "nurses", "commuters", "musicians", "volunteers", "engineers"]
_JOB = ["baker", "carpenter", "nurse", "teacher", "ferry captain", "librarian", "beekeeper",
        "engineer", "postwoman", "bookseller", "painter", "mechanic"]
_NAMES = ["Alice Grant", "Tomas Ruiz", "Mei Lin", "Oskar Berg", "Fatima Noor", "Liam Walsh",
          "Priya Shah", "Jonas Weber", "Elena Rossi", "Samuel Okafor", "Hana Sato", "Marta Nowak"]
_SEASON = ["spring", "summer", "autumn", "winter", "the harvest festival", "the school holidays"]
_MONTH = ["January", "March", "May", "July", "September", "November"]
_EFFECT = ["brought more visitors", "reduced traffic in the centre", "divided opinion",
           "raised rents slightly", "created dozens of jobs", "made mornings noisier",
           "helped small shops survive", "changed how children get to school"]
_CLAIM = ["the project was rushed", "the money could have been spent on housing",
          "the old building deserved protection", "young people finally have somewhere to go",
          "the river has become cleaner", "tourists rarely stay longer than a day",
          "prices at the market have doubled", "the town needs a second doctor"]
_EVIDENCE = ["rising membership numbers", "a recent survey of residents", "lower energy bills",
             "the return of otters to the river", "fuller trains at weekends",
             "a record number of school applications"]
_ACTIVITY = ["walk their dogs", "sketch the boats", "buy fresh bread", "watch the sunset",
             "photograph the birds", "listen to street musicians", "rent small rowing boats"]
_WEATHER = ["kept most visitors away", "flooded the lower streets twice", "delayed the building work",
            "brought an early crop of strawberries", "froze the canal for a week"]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _sentence(r: random.Random, town: str) -> str:
    c = r.choice
    templates = [
        lambda: f"In {r.randint(1890, 2024)}, the {c(_ORG)} of {town} opened {_a(c(_ADJ))} {c(_THING)} "
                f"near the {c(_LANDMARK)}.",
        lambda: f"Local {c(_PEOPLE)} say that the {c(_THING)} has {c(_EFFECT)} since it was built.",
        lambda: f"{c(_NAMES)}, {_a(c(_JOB))} who has lived there for {r.randint(2, 60)} years, believes "
                f"that {c(_CLAIM)}.",
        lambda: f"The {c(_ORG)} plans to rebuild the {c(_THING)} before {c(_SEASON)}, at a cost of "
                f"about {r.randint(2, 90) * 10000:,} pounds.",
        lambda: f"Critics argue that {c(_CLAIM)}, while supporters point to {c(_EVIDENCE)}.",
        lambda: f"Visitors often {c(_ACTIVITY)} along the {c(_LANDMARK)} during {c(_SEASON)}.",
        lambda: f"According to the {c(_ORG)}, {r.randint(3, 97)} percent of {c(_PEOPLE)} use the "
                f"{c(_THING)} at least once a week.",
        lambda: f"The {c(_ADJ)} weather in {c(_MONTH)} {c(_WEATHER)}.",
        lambda: f"Meanwhile, {c(_PEOPLE)} from a nearby village have started {_a(c(_ADJ))} {c(_THING)} "
                f"of their own.",
        lambda: f"Many {c(_PEOPLE)} still remember when the town was famous mainly for its {c(_PRODUCT)}.",
        lambda: f"{_a(c(_ADJ)).capitalize()} report published in {c(_MONTH)} found that {c(_CLAIM)}.",
    ]
    return c(templates)()


def document(r: random.Random, town: str) -> list[str]:
    """Sentences about one town, opening with its name."""
    first = f"{town} is {_a(r.choice(_ADJ))} {r.choice(_KIND)} known for its {r.choice(_PRODUCT)}."
    return [first] + [_sentence(r, town) for _ in range(200)]


SUMMARIZE = "Summarize the following text in two sentences.\n\n"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def long_requests(llm: Any, n: int, lo: int, hi: int, max_tokens: int, seed: int) -> list[dict]:
    """n summarize requests whose rendered prompts are lo..hi tokens (lengths evenly
    spread, shuffled); each document is its own seeded text about its own town."""
    if n > len(_TOWNS):
        raise ValueError(f"at most {len(_TOWNS)} long requests (one town each), got {n}")
    r = random.Random(seed)
    targets = [int(round(x)) for x in np.linspace(lo, hi - 40, n)] if n > 1 else [lo]
    r.shuffle(targets)
    reqs, ids = [], []
    for i, target in enumerate(targets):
        sentences, text = document(r, _TOWNS[i]), ""
        for s in sentences:
            cand = f"{text} {s}".strip()
            cand_len = len(B.token_ids(llm, [{"prompt": SUMMARIZE + cand}])[0])
            if cand_len > hi:
                break
            text = cand
            if cand_len >= target:
                break
        req = {"prompt": SUMMARIZE + text, "max_tokens": max_tokens}
        reqs.append(req)
        ids.append(B.token_ids(llm, [req])[0])
    # Nothing shared beyond the template and the instruction.
    base = common_prefix(*B.token_ids(llm, [{"prompt": SUMMARIZE + "Apple."},
                                            {"prompt": SUMMARIZE + "Zebra."}]))
    worst = max((common_prefix(a, b) for i, a in enumerate(ids) for b in ids[i + 1:]), default=0)
    if worst > base:
        raise RuntimeError(f"long prompts share {worst} tokens, more than the instruction's {base}")
    return reqs


_LIB_RULES = [
    lambda r: f"Members may borrow up to {r.randint(4, 20)} items at a time for {r.choice([7, 14, 21, 28])} days.",
    lambda r: f"The {r.choice(['reading room', 'children corner', 'music room', 'study hall', 'map room'])} "
              f"is open from {r.randint(7, 10)} in the morning until {r.randint(5, 9)} in the evening, "
              f"except on {r.choice(['Mondays', 'public holidays', 'the first Sunday of the month'])}.",
    lambda r: f"Late returns cost {r.randint(5, 50)} pence per day, capped at {r.randint(2, 9)} pounds "
              f"per item; {r.choice(_PEOPLE)} are exempt.",
    lambda r: f"Printing costs {r.randint(5, 30)} pence per page in black and white and "
              f"{r.randint(30, 90)} pence in colour.",
    lambda r: f"Study rooms for up to {r.randint(2, 12)} people can be booked {r.randint(1, 14)} days "
              f"ahead at the front desk or online.",
    lambda r: f"The {r.choice(_THING)} workshop meets every {r.choice(['Tuesday', 'Thursday', 'Saturday'])} "
              f"at {r.randint(1, 7)} pm and is free for members.",
    lambda r: f"Lost cards are replaced for {r.randint(1, 5)} pounds; bring a photo identity document.",
    lambda r: f"Food is not allowed in the {r.choice(['archive', 'rare books room', 'computer lab'])}, "
              f"but covered drinks are fine everywhere else.",
    lambda r: f"Wireless internet is free; the network name is {r.choice(_TOWNS)}Library and sessions "
              f"last {r.randint(1, 4)} hours.",
    lambda r: f"Volunteers who help with the {r.choice(['book sale', 'reading club', 'local history project'])} "
              f"receive a {r.randint(10, 50)} percent discount at the cafe.",
]
SHARED_QUESTIONS = [
    "How many items can I borrow at once?", "What happens if I return a book late?",
    "How much does colour printing cost?", "Can I book a study room for my group of six?",
    "When is the reading room open?", "I lost my library card. What should I do?",
    "Can I eat my lunch in the computer lab?", "How long does a wireless internet session last?",
    "Are there any free workshops?", "What discount do volunteers get?",
    "Do children pay late fees?", "How far ahead can I book a study room?",
    "Is the library open on public holidays?", "What is the name of the wireless network?",
    "Can I bring coffee into the archive?", "How do I join the local history project?",
]


def shared_requests(llm: Any, n: int, system_tokens: int, max_tokens: int, seed: int) -> list[dict]:
    """n distinct questions after one ~system_tokens system prompt (a library handbook)."""
    r = random.Random(seed + 1)
    text = ("You are the help desk assistant of the Millbrook public library. Answer visitors' "
            "questions briefly, using only the handbook below.\n\nHandbook:")
    while len(llm.tokenizer.encode(text, add_special_tokens=False)) < system_tokens:
        text += " " + r.choice(_LIB_RULES)(r)
    questions = SHARED_QUESTIONS + [f"{q} (asked again by visitor {k})" for k in range(1, 64)
                                    for q in SHARED_QUESTIONS]
    return [{"messages": [{"role": "system", "content": text}, {"role": "user", "content": q}],
             "max_tokens": max_tokens} for q in questions[:n]]


# ------------------------------------------------------------------ helpers
def parse_overrides(items: list[str]) -> dict[str, Any]:
    """key=value strings, typed by jpaged.core.config.default_config()."""
    from jpaged.core.config import default_config
    defaults, out = default_config(), {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in defaults:
            raise ValueError(f"bad --engine_overrides item {item!r} (key=value, key a config field)")
        kind = type(defaults[key])
        out[key] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
    return out


def cli_value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


class Runner:
    """Runs serve_batch.py as a subprocess and collects its files."""

    def __init__(self, work: pathlib.Path, overrides: dict[str, Any]):
        self.work, self.overrides = work, overrides
        self.commands: list[tuple[str, str]] = []  # (label, shell command)

    def command(self, name: str, config: dict[str, Any], prompts: pathlib.Path | None,
                cache_dir: str) -> tuple[list[str], pathlib.Path, pathlib.Path]:
        cfg = {**self.overrides, **config}
        if cache_dir:
            cfg["cache_dir"] = cache_dir
        out, summary = self.work / f"{name}.out.jsonl", self.work / f"{name}.summary.json"
        cmd = [sys.executable, "scripts/serve_batch.py", "--config", _CONFIG_FILE.value]
        cmd += [f"--config.{k}={cli_value(v)}" for k, v in cfg.items()]
        if prompts is not None:
            cmd += ["--prompts", str(prompts)]
        cmd += ["--output", str(out), "--summary_json", str(summary)]
        if _PRECOMPILE.value:
            cmd.append("--precompile")
        return cmd, out, summary

    def run(self, name: str, label: str, config: dict[str, Any], prompts: pathlib.Path | None,
            cold: bool) -> dict:
        cache_dir = tempfile.mkdtemp(prefix="jpaged_cold_") if cold else _CACHE_DIR.value
        env = dict(os.environ)
        if cold and _COLD_KERNEL.value:
            env["JPAGED_CACHE_DIR"] = cache_dir
        try:
            cmd, out, summary = self.command(name, config, prompts, cache_dir)
            for p in (out, summary):
                p.unlink(missing_ok=True)
            log = self.work / f"{name}.log"
            shown = shlex.join(cmd).replace(cache_dir, "$(mktemp -d)") if cold else shlex.join(cmd)
            if cold and _COLD_KERNEL.value:
                shown = "JPAGED_CACHE_DIR=<same empty dir> " + shown
            self.commands.append((f"{name} [{label}]", shown))
            print(f"  $ {shown}", flush=True)
            t0 = time.perf_counter()
            with open(log, "w") as f:
                rc = subprocess.run(cmd, cwd=B.REPO, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
            wall = time.perf_counter() - t0
            if rc:
                tail = log.read_text()[-4000:]
                raise RuntimeError(f"serve_batch exited with {rc} ({log}):\n{tail}")
        finally:
            if cold:
                shutil.rmtree(cache_dir, ignore_errors=True)
        s = json.loads(summary.read_text())
        outputs = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        outputs.sort(key=lambda o: o["index"])  # the CLI writes each result as it finishes
        print(f"  -> {wall:.1f} s subprocess, generate {s['wall_s']:.1f} s, {s['output_tokens']} tokens, "
              f"{s['compilations']} programs ({s['compile_s']:.1f} s compiling), padding "
              f"{s['padding_ratio']:.3f}", flush=True)
        return {"cli_wall_s": wall, "summary": s, "outputs": outputs, "log": str(log)}

    def warm(self, name: str, config: dict[str, Any], prompts: pathlib.Path | None) -> dict:
        """The identical command twice; the second is the measurement."""
        self.run(f"{name}_warmup", "warm-up of the warm run", config, prompts, cold=False)
        return self.run(f"{name}_warm", WARM_LABEL, config, prompts, cold=False)


def write_jsonl(path: pathlib.Path, requests: list[dict]) -> pathlib.Path:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")
    return path


def engine_prompts(requests: list[dict]) -> list[dict]:
    """What serve_batch hands to generate(): the prompt / messages of each line."""
    return [{k: r[k] for k in ("prompt", "messages") if k in r} for r in requests]


# ------------------------------------------------------------------ report
class Report:
    def __init__(self, name: str):
        self.name, self.sections, self.targets = name, [], []
        self.started = time.perf_counter()

    def table(self, part: str, rows: list[dict], columns: list[str], formats: dict[str, str],
              title: str, note: str = "") -> None:
        B.report(f"{self.name}_{part}", rows, columns, formats, title=title)
        self.sections.append((title, note, B.markdown_table(rows, columns, formats)))

    def target(self, target: str, ok: bool | None, measured: str) -> None:
        self.targets.append({"target": target, "met": "-" if ok is None else ("met" if ok else "NOT met"),
                             "measured": measured})

    def write(self, commands: list[tuple[str, str]], final: bool = False) -> None:
        lines = [f"# Ragged step: the issue's targets ({B.machine()}, {B.today()})", "",
                 "`" + shlex.join(["python", "benchmarks/bench_ragged.py", *sys.argv[1:]]) + "`"
                 + (f"; {time.perf_counter() - self.started:.0f} s in all." if final else
                    " (partial: still running or stopped early)."), ""]
        if self.targets:
            lines += ["## Targets", "", B.markdown_table(self.targets, ["target", "met", "measured"]), ""]
        for title, note, md in self.sections:
            lines += [f"## {title}", ""] + ([note, ""] if note else []) + [md, ""]
        if commands:
            lines += ["## serve_batch commands", ""]
            lines += [f"- {label}: `{cmd}`" for label, cmd in commands] + [""]
        B.write_markdown(self.name, "\n".join(lines))


# ------------------------------------------------------------------ parts
def part_e2e(llm: Any, runner: Runner, rep: Report, work: pathlib.Path) -> list[dict]:
    """Returns the padding rows of its runs."""
    lo, hi = (int(x) for x in _LONG_TOKENS.value)
    model = None
    if _HF.value:
        t0 = time.perf_counter()
        model = B.hf_model(llm)
        warm = B.token_ids(llm, B.chat(B.DEFAULT_PROMPTS[:2]))
        B.hf_static(model, llm, warm, 4, 2)
        print(f"transformers model (same weights) built and warmed in {time.perf_counter() - t0:.1f} s",
              flush=True)
    rows, padding = [], []
    for name in _WORKLOADS.value:
        w = WORKLOADS[name]
        n = max(1, round(w["n"] * _SCALE.value))
        T = max(1, round(w["max_tokens"] * _TOKENS_SCALE.value))
        if name == "mixed":
            requests = [{"prompt": p, "max_tokens": T} for p in B.mixed_prompts(n)]
        elif name == "long":
            requests = long_requests(llm, n, lo, hi, T, _SEED.value)
        else:
            requests = shared_requests(llm, n, _SYSTEM_TOKENS.value, T, _SEED.value)
        path = write_jsonl(work / f"{name}.jsonl", requests)
        ids = B.token_ids(llm, engine_prompts(requests))
        lens = [len(x) for x in ids]
        print(f"\n[{name}] {n} requests, prompts {min(lens)}-{max(lens)} tokens (mean {np.mean(lens):.0f}), "
              f"<= {T} new tokens, config {w['config']}; {path}", flush=True)
        runs = []
        if _COLD.value:
            runs.append((COLD_LABEL, runner.run(f"{name}_cold", COLD_LABEL, w["config"], path, cold=True)))
        runs.append((WARM_LABEL, runner.warm(name, w["config"], path)))
        hf_toks, hf_wall = None, None
        if model is not None:
            hf_toks, hf_wall, _ = B.hf_static(model, llm, ids, T, w["hf_batch"])
            print(f"  HF static generate, batches of {w['hf_batch']}: {sum(map(len, hf_toks))} tokens in "
                  f"{hf_wall:.1f} s", flush=True)
        for label, r in runs:
            s, outs = r["summary"], r["outputs"]
            same_prompts = sum(o["prompt_token_ids"] == x for o, x in zip(outs, ids))
            jp_toks = [o["token_ids"] for o in outs]
            row = {"workload": name, "run": label, "requests": n, "prompt_tokens": sum(lens),
                   "output_tokens": s["output_tokens"], "cli_wall_s": r["cli_wall_s"],
                   "generate_wall_s": s["wall_s"], "process_wall_s": s.get("process_wall_s"),
                   "compilations": s["compilations"], "compile_s": s["compile_s"],
                   "padding_ratio": s["padding_ratio"], "ttft_p50_ms": s["ttft_p50_ms"],
                   "cli_tok_per_s": s["output_tokens"] / r["cli_wall_s"],
                   "same_prompt_ids": f"{same_prompts}/{n}", "hf_batch": w["hf_batch"]}
            if hf_toks is not None:
                hf_n = sum(map(len, hf_toks))
                row.update(hf_wall_s=hf_wall, hf_output_tokens=hf_n, hf_tok_per_s=hf_n / hf_wall,
                           speedup_wall=hf_wall / r["cli_wall_s"],
                           speedup_tok_s=row["cli_tok_per_s"] / (hf_n / hf_wall),
                           tokens_match=f"{sum(a == b for a, b in zip(jp_toks, hf_toks))}/{n}")
            rows.append(row)
            padding.append({"run": f"e2e {name}", "label": label, "padding_ratio": s["padding_ratio"],
                            "steps": s["steps"]})
            if label == WARM_LABEL:
                rep.target(f"{name}: jpaged CLI (warm, whole subprocess) >= {w['target']:g}x HF static "
                           f"generate (batches of {w['hf_batch']}), wall",
                           None if hf_toks is None else row["speedup_wall"] >= w["target"],
                           "no HF run" if hf_toks is None else
                           f"{row['speedup_wall']:.2f}x wall ({row['cli_wall_s']:.1f} s vs "
                           f"{hf_wall:.1f} s), {row['speedup_tok_s']:.2f}x tok/s; tokens "
                           f"{row['tokens_match']} identical")
    cols = ["workload", "run", "requests", "prompt_tokens", "output_tokens", "cli_wall_s", "generate_wall_s",
            "compilations", "compile_s", "padding_ratio", "cli_tok_per_s", "hf_batch", "hf_wall_s",
            "hf_output_tokens", "hf_tok_per_s", "speedup_wall", "speedup_tok_s", "tokens_match",
            "same_prompt_ids"]
    rep.table("e2e", rows, cols,
              {"cli_wall_s": ".1f", "generate_wall_s": ".1f", "compile_s": ".1f", "padding_ratio": ".3f",
               "cli_tok_per_s": ".1f", "hf_wall_s": ".1f", "hf_tok_per_s": ".1f", "speedup_wall": ".2f",
               "speedup_tok_s": ".2f"},
              "End to end: serve_batch.py subprocess vs transformers static generate()",
              "cli_wall_s: the whole serve_batch.py subprocess timed from outside (process start, imports, "
              "weight load, compiles, generate, writing outputs); generate_wall_s: generate() alone (its "
              "summary). compilations: step programs built (compiled, or read from the XLA cache when "
              "warm). HF: transformers generate() in this process on the same prompt token ids, "
              "left-padded static batches, model already built and warmed. speedup_wall = hf_wall_s / "
              "cli_wall_s; speedup_tok_s = cli_tok_per_s / hf_tok_per_s.")
    del model
    gc.collect()
    return padding


def part_serve(runner: Runner, rep: Report) -> list[dict]:
    rows, padding = [], []
    print("\n[serve] make serve's command (the 8 default prompts)", flush=True)
    for label, r in ((COLD_LABEL, runner.run("serve_cold", COLD_LABEL, {}, None, cold=True)),
                     (WARM_LABEL, runner.warm("serve", {}, None))):
        s = r["summary"]
        share = s["compile_s"] / r["cli_wall_s"]
        rows.append({"run": label, "cli_wall_s": r["cli_wall_s"], "generate_wall_s": s["wall_s"],
                     "compile_s": s["compile_s"], "compile_share_pct": 100 * share,
                     "compilations": s["compilations"], "output_tokens": s["output_tokens"],
                     "padding_ratio": s["padding_ratio"]})
        padding.append({"run": "serve (8 default prompts)", "label": label,
                        "padding_ratio": s["padding_ratio"], "steps": s["steps"]})
        if label == COLD_LABEL:
            rep.target("cold start of make serve's command: compile time <= 25 % of the wall",
                       share <= 0.25, f"{100 * share:.1f} % ({s['compile_s']:.1f} s of "
                                      f"{r['cli_wall_s']:.1f} s)")
        else:
            rep.target("same, warm cache (info)", None,
                       f"{100 * share:.1f} % ({s['compile_s']:.1f} s of {r['cli_wall_s']:.1f} s)")
    rep.table("serve_start", rows, list(rows[0]),
              {"cli_wall_s": ".1f", "generate_wall_s": ".1f", "compile_s": ".1f", "compile_share_pct": ".1f",
               "padding_ratio": ".3f"},
              f"Start-up: serve_batch.py --config {_CONFIG_FILE.value} (make serve)",
              "compile_s: seconds building step programs (the runner's compile_seconds; reading a "
              "program back from the XLA cache counts here too); compile_share_pct = compile_s / "
              "cli_wall_s.")
    return padding


def parse_shapes() -> tuple[list[tuple[int, int]], int]:
    shapes = []
    for s in _PREFILL_SHAPES.value:
        n, _, length = s.lower().partition("x")
        shapes.append((int(n), int(length)))
    totals = {n * length for n, length in shapes}
    if len(totals) != 1:
        raise ValueError(f"every prefill shape must have the same N*L, got {_PREFILL_SHAPES.value}")
    return shapes, totals.pop()


def part_prefill(llm: Any, rep: Report) -> None:
    from jpaged.core.sequence import SamplingParams
    shapes, T = parse_shapes()
    print(f"\n[prefill] one step of {T} prompt tokens; attention {llm.attention_impl}", flush=True)
    floor = B.time_matmuls(llm, T, _FLOOR_ITERS.value, head=False)
    floor_tps = T / floor
    print(f"  matmul floor (7 projections x {llm.model_config.num_layers} layers, {T} tokens): "
          f"{1000 * floor:.1f} ms = {floor_tps:.0f} tok/s", flush=True)
    rng = np.random.default_rng(_SEED.value)
    vocab = llm.model_config.vocab_size
    params = SamplingParams(max_tokens=1)
    rows = []
    for n, length in shapes:
        devs, walls, steps, slots = [], [], set(), set()
        for i in range(1 + _PREFILL_ITERS.value):  # the first compiles
            prompts = [rng.integers(1000, vocab, length).tolist() for _ in range(n)]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            if any(o.finish_reason == "error" for o in outs):
                raise RuntimeError(f"prefill {n}x{length}: {[o.error for o in outs if o.error]}")
            st = llm.stats
            if i:
                devs.append(st.device_seconds)
                walls.append(wall)
                steps.add(st.steps)
                slots.add(st.token_slots)
        dev = float(np.median(devs))
        row = {"shape": f"{n}x{length}", "tokens": n * length, "steps": "/".join(map(str, sorted(steps))),
               "token_slots": "/".join(map(str, sorted(slots))), "device_ms": 1000 * dev,
               "device_ms_min": 1000 * min(devs), "generate_ms": 1000 * float(np.median(walls)),
               "prefill_tok_per_s": n * length / dev, "floor_ms": 1000 * floor, "floor_tok_per_s": floor_tps,
               "pct_of_floor": 100 * (n * length / dev) / floor_tps}
        rows.append(row)
        print(f"  {row['shape']}: {row['device_ms']:.1f} ms device ({row['prefill_tok_per_s']:.0f} tok/s, "
              f"{row['pct_of_floor']:.1f} % of the floor), steps {row['steps']}", flush=True)
        rep.target(f"prefill {row['shape']}: tok/s >= 85 % of the matmul floor's", row["pct_of_floor"] >= 85,
                   f"{row['pct_of_floor']:.1f} % ({row['prefill_tok_per_s']:.0f} vs {floor_tps:.0f} tok/s)"
                   + ("" if row["steps"] == "1" else f"; {row['steps']} steps, not one"))
    rep.table("prefill", rows, list(rows[0]),
              {"device_ms": ".1f", "device_ms_min": ".1f", "generate_ms": ".1f", "prefill_tok_per_s": ".0f",
               "floor_ms": ".1f", "floor_tok_per_s": ".0f", "pct_of_floor": ".1f"},
              f"Prefill step vs the matmul floor ({T} tokens, in-process)",
              f"LLM(max_num_seqs=8, max_num_batched_tokens={T}, enable_prefix_caching=False), attention "
              f"{llm.attention_impl}; random prompt token ids, max_tokens=1: one step of exactly {T} "
              f"tokens (steps / token_slots columns check it). device_ms: median of {_PREFILL_ITERS.value} "
              f"runs of llm.stats.device_seconds (forward + sample + copy of the sampled tokens), after "
              f"one compiling run. floor: a jitted function of only the 7 projection matmuls of every "
              f"layer over the same {T} tokens (no attention, norms, RoPE, lm_head), median of "
              f"{_FLOOR_ITERS.value} calls.")


def part_decode(rep: Report, overrides: dict[str, Any], prompt_len: int) -> None:
    batches = [int(b) for b in _DECODE_BATCHES.value]
    steps = _DECODE_STEPS.value
    bs = overrides.get("block_size", 16)
    num_blocks = max(batches) * -(-(prompt_len + steps + 1) // bs) + 16
    llm = B.make_llm(**{**overrides, "max_num_seqs": max(batches), "num_blocks": num_blocks})
    print(f"\n[decode] batches {batches}, {steps} tokens each; attention {llm.attention_impl}, "
          f"max_num_batched_tokens {llm.config.max_num_batched_tokens}, {num_blocks} blocks", flush=True)
    rows = []
    for b in batches:
        d = B.time_decode_steps(llm, b, steps)
        mm = 1000 * B.time_matmuls(llm, b, 20)
        rows.append({"batch": b, "step_ms": d["step_ms"], "device_ms": d["device_ms"],
                     "matmul_floor_ms": mm, "step_over_floor": d["step_ms"] / mm,
                     "steps_timed": d["steps_timed"]})
        print(f"  batch {b}: {d['step_ms']:.1f} ms/step (device {d['device_ms']:.1f}), floor {mm:.1f} ms",
              flush=True)
        rep.target(f"decode step at batch {b} vs the matmul floor (info)", None,
                   f"{d['step_ms']:.1f} ms vs {mm:.1f} ms = {d['step_ms'] / mm:.2f}x")
    rep.table("decode", rows, list(rows[0]),
              {"step_ms": ".2f", "device_ms": ".2f", "matmul_floor_ms": ".2f", "step_over_floor": ".2f"},
              "Decode-only step vs the matmul floor (in-process)",
              f"Median of the steps in which exactly `batch` sequences decode (no prompt tokens), "
              f"{steps} tokens per request, ignore_eos; step_ms is the wall of llm.step(), device_ms "
              f"its llm.stats.device_seconds. floor: the 7 projections of every layer + lm_head over "
              f"`batch` rows.")
    del llm
    gc.collect()


def part_layer_loop(rep: Report, overrides: dict[str, Any]) -> None:
    """Unrolled layers vs lax.scan over stacked layers: compile time (no persistent
    cache) and step time, on one engine each, back to back."""
    from jpaged.core.sequence import SamplingParams
    print("\n[layer_loop] unroll vs scan", flush=True)
    rows = []
    rng = np.random.default_rng(_SEED.value)
    for loop in ("unroll", "scan"):
        llm = B.make_llm(**{**overrides, "layer_loop": loop, "compilation_cache": False,
                            "max_num_seqs": 64, "max_num_batched_tokens": 1024, "num_blocks": 1024,
                            "enable_prefix_caching": False})
        compile_s = []
        for T in (64, 1024):  # the first call compiles 8..64, the second 128..1024
            c0 = llm.compile_seconds
            n = llm.precompile(T)
            compile_s.append((llm.compile_seconds - c0) / n)
        prompts = [rng.integers(1000, llm.model_config.vocab_size, 512).tolist() for _ in range(2)]
        devs = []
        for _ in range(3):
            llm.generate(prompts, SamplingParams(max_tokens=1))
            devs.append(llm.stats.device_seconds)
        d = B.time_decode_steps(llm, 32, 16)
        rows.append({"layer_loop": loop, "compile_s_per_program_small": compile_s[0],
                     "compile_s_per_program_large": compile_s[1],
                     "prefill_2x512_ms": 1000 * float(np.median(devs)), "decode_b32_step_ms": d["step_ms"]})
        print(f"  {rows[-1]}", flush=True)
        del llm
        gc.collect()
    rep.table("layer_loop", rows, list(rows[0]),
              {"compile_s_per_program_small": ".2f", "compile_s_per_program_large": ".2f",
               "prefill_2x512_ms": ".1f", "decode_b32_step_ms": ".1f"},
              "Layer loop: unrolled vs lax.scan (compile: trace + lower + XLA, no persistent cache)",
              "compile_s_per_program_small: mean over the buckets 8..64 tokens; _large: 128..1024. "
              "prefill: device time of one 1024-token step (median of 3); decode: median step with "
              "32 sequences decoding.")


def main(argv):
    del argv
    B.header(_OUT.value)
    parts = set(_PARTS.value)
    unknown = parts - {"e2e", "serve", "prefill", "decode", "layer_loop"} or set(_WORKLOADS.value) - set(WORKLOADS)
    if unknown:
        raise app.UsageError(f"unknown parts / workloads: {sorted(unknown)}")
    overrides = parse_overrides(_ENGINE_OVERRIDES.value)
    in_process = dict(overrides)
    if _CACHE_DIR.value:
        in_process["cache_dir"] = _CACHE_DIR.value
    work = pathlib.Path(_WORK_DIR.value or tempfile.mkdtemp(prefix="bench_ragged_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work dir (requests, outputs, summaries, logs): {work}", flush=True)
    runner, rep = Runner(work, overrides), Report(_OUT.value)
    padding: list[dict] = []
    done = False

    # One in-process engine: the tokenizer (chat template) for the workloads and the
    # transformers peer, and the prefill part's engine.
    shapes, T = parse_shapes()
    bs = in_process.get("block_size", 16)
    num_blocks = max(n * -(-(length + 1) // bs) for n, length in shapes) + 2
    llm = B.make_llm(**{**in_process, "max_num_seqs": 8, "max_num_batched_tokens": T,
                        "enable_prefix_caching": False, "num_blocks": num_blocks})
    decode_prompt_len = max(map(len, B.token_ids(llm, B.chat(B.DEFAULT_PROMPTS))))
    try:
        if "e2e" in parts and _WORKLOADS.value:
            padding += part_e2e(llm, runner, rep, work)
            rep.write(runner.commands)
        if "serve" in parts:
            padding += part_serve(runner, rep)
            rep.write(runner.commands)
        if "prefill" in parts:
            part_prefill(llm, rep)
            rep.write(runner.commands)
        del llm
        gc.collect()
        if "decode" in parts:
            part_decode(rep, in_process, decode_prompt_len)
        if "layer_loop" in parts:
            part_layer_loop(rep, in_process)
        if padding:
            for p in padding:
                rep.target(f"padding ratio <= 1.15: {p['run']}, {p['label']}", p["padding_ratio"] <= 1.15,
                           f"{p['padding_ratio']:.3f}")
            rep.table("padding", padding, ["run", "label", "padding_ratio", "steps"],
                      {"padding_ratio": ".3f"}, "Padding: token slots computed / real tokens, every CLI run")
        if rep.targets:
            B.report(f"{_OUT.value}_targets", rep.targets, ["target", "met", "measured"], title="Targets")
        done = True
    finally:
        rep.write(runner.commands, final=done)


if __name__ == "__main__":
    app.run(main)

"""Where a live `jpaged serve` spends its time under load: py-spy samples of the
server process, by thread and by what the thread was doing.

`bench_http_serving.py --profile` records each closed-loop level of the jpaged
server twice at once (py-spy attached without pausing the process):

- every sample, idle ones included: each thread's busy share, and what the busy
  part was (the engine thread: the step's device wait, scheduling, input
  preparation, output processing and detokenizing; the event loop thread:
  HTTP protocol, request parsing, templating and tokenizing, SSE encoding, and
  its idle time, in select() or in uvloop);
- only the samples that hold the GIL: who holds it, and for what.

Samples are classified by the first rule (below) whose marker appears in the
stack, innermost frame first; a stack no rule matches counts as "other".
XLA's own threads run no Python and are not sampled: the engine thread's
"device wait" is where Python waits for them.
"""

from __future__ import annotations

import collections
import pathlib
import signal
import subprocess
import sys
from typing import Any

# (category, markers): a frame matches when one marker is a substring of it.
# Innermost frames are tried first, so a detokenize inside output processing
# counts as detokenizing.
ENGINE_RULES: list[tuple[str, tuple[str, ...]]] = [
    ("waiting for work", ("Condition.wait", "_wait_for_work")),
    ("detokenizing", ("detokeniz", "SampleText", "decode (", "incremental")),
    ("device wait", ("block_until_ready", "_single_device_array_to_np_array", "__array__", "device_get",
                     "_value (", "copy_to_host", "wait_for_step")),
    ("dispatch", ("pjit", "_cpp_pjit", "cache_miss", "__call__ (jax", "call_wrapped", "ExecuteReplicated")),
    ("scheduling", ("scheduler.py", "block_allocator", "block_table", "block_pool", "prefix_hit")),
    ("input preparation", ("step_inputs", "input_processor", "model_runner.py")),
    ("output processing", ("output_processor", "request_output", "finish_step", "_deliver", "sampling")),
    ("metrics", ("metrics.py", "_publish", "snapshot")),
]
LOOP_RULES: list[tuple[str, tuple[str, ...]]] = [
    ("templating", ("chat_template", "jinja", "render")),
    ("tokenizing", ("encode (", "tokenizer")),
    ("SSE encoding", ("responses.py", "answers.py", "json.dumps", "dumps (", "model_dump_json", "serialize")),
    ("request parsing", ("protocol.py", "request_fields", "sampling_fields", "model_validate", "pydantic")),
    ("HTTP protocol", ("h11", "httptools", "uvicorn", "starlette", "fastapi", "sse_starlette")),
    ("engine hand-off", ("async_engine.py", "queue", "Queue")),
]
BUILDER_RULES: list[tuple[str, tuple[str, ...]]] = [
    ("program cache write", ("_save (", "serialize", "_cache_write", "put_executable")),
    ("XLA compile", ("backend_compile", "compile_or_get_cached")),
    ("lowering", ("lower_jaxpr", "lowering", "FuncOp")),
    ("tracing", ("DynamicJaxprTrace", "trace_to_jaxpr", "Primitive.bind", "_infer_params")),
]
# A stack whose innermost frame is one of these is a thread waiting: the event loop in
# select() (asyncio) or in uvloop's C loop (its innermost Python frame is the runner).
# A pool worker blocked on its work queue shows its `_worker` frame innermost.
IDLE_LEAVES = ("select (", "poll (", "Runner.run (", "run_forever (", "run_until_complete (", "_run_once (",
               "_worker (")
# Thread name prefixes -> what the rows call them (the rest: "other threads").
THREADS = {"jpaged-engine": "engine thread", "MainThread": "event loop thread",
           "jpaged-programs": "program builder", "jpaged-host": "host workers"}


def thread_kind(name: str) -> str:
    return next((kind for prefix, kind in THREADS.items() if name.startswith(prefix)), "other threads")


def rules_of(thread: str) -> list[tuple[str, tuple[str, ...]]]:
    return {"engine thread": ENGINE_RULES, "program builder": BUILDER_RULES}.get(thread, LOOP_RULES)


class Recording:
    """Two py-spy recorders attached to `pid` (all samples; GIL holders), stopped by stop()."""

    def __init__(self, pid: int, out_dir: pathlib.Path, label: str, rate: int = 200):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.paths = {kind: out_dir / f"pyspy_{label}_{kind}.txt" for kind in ("all", "gil")}
        exe = str(pathlib.Path(sys.executable).with_name("py-spy"))
        base = [exe, "record", "--pid", str(pid), "--threads", "--nonblocking", "--rate", str(rate),
                "--format", "raw", "--duration", "100000"]
        self.procs = [subprocess.Popen(base + ["--idle", "-o", str(self.paths["all"])],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                      subprocess.Popen(base + ["--gil", "-o", str(self.paths["gil"])],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]

    def stop(self) -> dict[str, pathlib.Path]:
        for p in self.procs:  # py-spy writes its file on SIGINT
            p.send_signal(signal.SIGINT)
        for p in self.procs:
            p.wait(timeout=60)
        return self.paths


def read_raw(path: pathlib.Path) -> list[tuple[str, list[str], int]]:
    """py-spy raw lines `thread (tid): name;frame;...;frame count` -> (thread name, frames, count)."""
    out = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        first, *frames = stack.split(";")
        head, sep, name = first.partition(": ")
        if not (head.startswith("thread (") and sep):
            name, frames = "?", [first, *frames]
        out.append((name, frames, int(count)))
    return out


def classify(frames: list[str], rules: list[tuple[str, tuple[str, ...]]]) -> str:
    if frames and frames[-1].startswith(IDLE_LEAVES):
        return "idle"
    for frame in reversed(frames):
        for category, markers in rules:
            if any(m in frame for m in markers):
                return category
    return "other"


def summarize(paths: dict[str, pathlib.Path], label: str) -> list[dict[str, Any]]:
    """Rows (label, thread, category, share of that thread's samples, share of GIL samples)."""
    shares: dict[tuple[str, str], float] = collections.Counter()
    totals: dict[str, int] = collections.Counter()
    per_thread: dict[str, int] = collections.Counter()
    for name, frames, count in read_raw(paths["all"]):
        per_thread[name] += count
        thread = thread_kind(name)
        rules = rules_of(thread)
        shares[(thread, classify(frames, rules))] += count
        totals[thread] += count
    gil: dict[tuple[str, str], int] = collections.Counter()
    gil_total = 0
    for name, frames, count in read_raw(paths["gil"]):
        thread = thread_kind(name)
        rules = rules_of(thread)
        gil[(thread, classify(frames, rules))] += count
        gil_total += count
    keys = sorted(set(shares) | set(gil), key=lambda k: (k[0], -shares.get(k, 0)))
    rows = [{"level": label, "thread": t, "what": c,
             "pct_of_thread": 100 * shares.get((t, c), 0) / max(1, totals.get(t, 0)),
             "pct_of_gil_samples": 100 * gil.get((t, c), 0) / max(1, gil_total)} for t, c in keys]
    ticks = max(per_thread.values(), default=0)  # with --idle every thread is sampled at every tick
    # Both recorders sample at the same rate over (nearly) the same span: GIL samples /
    # ticks is the share of the time some Python thread held the GIL (their start and
    # stop differ by a few samples, hence the cap).
    rows.append({"level": label, "thread": "GIL", "what": "held by any thread",
                 "pct_of_thread": min(100.0, 100 * gil_total / max(1, ticks)), "pct_of_gil_samples": 100.0})
    return rows


COLUMNS = ["level", "thread", "what", "pct_of_thread", "pct_of_gil_samples"]
FORMATS = {"pct_of_thread": ".1f", "pct_of_gil_samples": ".1f"}

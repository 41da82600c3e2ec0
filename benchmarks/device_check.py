"""`make device-check`: what a short loan of a GPU should measure, in one command.

A session lent an NVIDIA H100/H200 for minutes must spend them measuring, not
preparing: this runs, in order, each part timed and guarded (a failing part is
reported with its error and the rest still run; the exit status is 1 if any
part failed):

  1. environment   jax / jaxlib versions, backend, device kind and memory, the
                   device's nominal HBM bandwidth (spec sheet; unknown devices:
                   none) and a measured device-to-device copy bandwidth.
  2. kernel_tests  the tests of pallas_kernels' GPU path (tests/kernels/test_gpu.py
                   and the engine's pallas_gpu greedy test), natively, as a
                   subprocess with a time cap.  On a CPU: skipped (there they run
                   in interpret mode, inside `make test`).
  3. kernel_bench  benchmarks/bench_kernels.py on a small decode grid (ours vs jax's
                   own Pallas paged attention `jax_ops` vs contiguous attention),
                   bandwidth as a fraction of the nominal and the copy bandwidth;
                   then ours alone on int8 and float8_e4m3fn pools (--kv_dtype, bf16
                   q; one short run each, at batch 32 and 128), against the bf16 pool.
                   On a CPU: one smoke-sized point in interpret mode (code path only;
                   of the quantized pools, int8 only).
  4. serve_batch   scripts/serve_batch.py on SmolLM2 with attention_impl=pallas_gpu
                   and =reference: greedy token ids compared request by request,
                   wall and generate tok/s of each; then pallas_gpu with an int8 KV
                   pool (--config.kv_cache_dtype=int8), its ids against the reference's.
                   On a CPU: skipped (pallas_gpu needs a GPU; reference vs cpu takes
                   20-40 s here, over this mode's budget; --serve_batch_on_cpu runs it
                   anyway).
  5. dummy_decode  a Llama-3-8B-shaped model with random weights (load_format=dummy)
                   in bfloat16 through jpaged.LLM: decode tok/s and median step
                   time at batch 1, 32, 128, each timed in its own bucket's program
                   (benchmarks/decode_timing.py: a row that ran padded is marked
                   invalid), against the time to read what a step reads (weights
                   but the embedding table, and the K/V) at the device's bandwidth,
                   and split into the program's device time and the host's share.
                   On a CPU: a tiny Llama shape at batch 1 and 4 (labelled as
                   such), so CI runs the code path.

The quantized-pool runs of parts 3 and 4 are extras: each starts only if it can
finish without eating into what later parts need (--dummy_decode_reserve_s for
part 5, and part 4's two caps for part 3's), else it is reported as skipped.

Writes benchmarks/results/device/device_check_<device>_<YYYYmmdd-HHMM>.md and
.json (same numbers), plus the parts' logs and bench_kernels' own .md/.csv
beside them, and prints the report's path.  Only measured numbers are written;
the nominal bandwidth is the one number from a spec sheet, and says so.

    python benchmarks/device_check.py                    # ~8 min on an H100/H200
    python benchmarks/device_check.py --parts=environment,dummy_decode
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib.metadata
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from absl import app, flags, logging

REPO = pathlib.Path(__file__).resolve().parents[1]
PARTS = ("environment", "kernel_tests", "kernel_bench", "serve_batch", "dummy_decode")
TITLES = {"environment": "1. Environment", "kernel_tests": "2. GPU kernel tests",
          "kernel_bench": "3. Kernel benchmark (decode)",
          "serve_batch": "4. serve_batch on SmolLM2: kernel vs reference",
          "dummy_decode": "5. Decode on a dummy Llama (bfloat16)"}

_PARTS = flags.DEFINE_list("parts", list(PARTS), f"Parts to run, of {', '.join(PARTS)}.")
_OUT_DIR = flags.DEFINE_string("out_dir", str(REPO / "benchmarks" / "results" / "device"),
                               "Where the report, its .json and the parts' logs go.")
_BUDGET = flags.DEFINE_float("budget_s", 470.0, "Whole run's deadline (s): a part that would start "
                             "after it is skipped, subprocess caps shrink to fit it.")
_TESTS = flags.DEFINE_list("kernel_tests", ["tests/kernels/test_gpu.py",
                                            "tests/runtime/test_engine_kernels.py::"
                                            "test_greedy_tokens_match_reference[pallas_gpu]"],
                           "pytest targets of part 2 (run with -n 0: one GPU).")
_TESTS_CAP = flags.DEFINE_float("kernel_tests_timeout_s", 100.0, "Time cap of part 2 (s).")
_BENCH_CAP = flags.DEFINE_float("kernel_bench_timeout_s", 100.0, "Time cap of part 3 (s).")
_BENCH_BATCHES = flags.DEFINE_list("kernel_batch_sizes", ["1", "32", "128"], "Part 3's batch sizes (GPU).")
_BENCH_CONTEXTS = flags.DEFINE_list("kernel_context_lens", ["4096"], "Part 3's context lengths (GPU).")
_BENCH_KV = flags.DEFINE_list("kernel_kv_dtypes", ["int8", "float8_e4m3fn"], "Quantized pools part 3 "
                              "also times, ours only ('' = none; on a CPU the first only).")
_BENCH_KV_BATCHES = flags.DEFINE_list("kernel_kv_batch_sizes", ["32", "128"], "Their batch sizes (GPU).")
_BENCH_KV_CAP = flags.DEFINE_float("kernel_kv_timeout_s", 45.0,
                                   "Time cap of each quantized run of part 3 (s).")
_SERVE_CAP = flags.DEFINE_float("serve_timeout_s", 60.0, "Time cap of each serve_batch run (s).")
_SERVE_KV = flags.DEFINE_enum("serve_kv_cache_dtype", "int8", ["none", "int8", "fp8_e4m3"],
                              "kv_cache_dtype of part 4's third run (the kernel on a quantized pool).")
_RESERVE = flags.DEFINE_float("dummy_decode_reserve_s", 120.0, "Budget (s) the quantized-pool runs of parts "
                              "3 and 4 leave to part 5 (part 3's also leave part 4's two serve caps).")
_SERVE_TOKENS = flags.DEFINE_integer("serve_max_tokens", 128, "max_tokens of part 4's requests (GPU).")
_SERVE_ON_CPU = flags.DEFINE_bool("serve_batch_on_cpu", False, "On a CPU, run part 4 as reference vs "
                                  "cpu on 2 prompts of 8 tokens (20-40 s) instead of skipping it.")
_DUMMY_SHAPE = flags.DEFINE_enum("dummy_shape", "auto", ["auto", "8b", "tiny"],
                                 "Part 5's model: auto = 8b on a GPU, tiny on a CPU.")
_DUMMY_BATCHES = flags.DEFINE_list("dummy_batches", [], "Part 5's batch sizes (default: 1,32,128 for "
                                   "8b, 1,4 for tiny).")
_DUMMY_STEPS = flags.DEFINE_integer("dummy_steps", 0, "Decode steps timed per batch (0: 32 for 8b, 8 for tiny).")
_DUMMY_PROMPT = flags.DEFINE_integer("dummy_prompt_len", 16, "Prompt tokens per sequence in part 5.")
# scan compiles one layer: unrolled, each of the 8B's step programs compiles 32
# layers, which would spend the loan compiling.  The report names the choice.
_DUMMY_LOOP = flags.DEFINE_enum("dummy_layer_loop", "scan", ["auto", "scan", "unroll"],
                                "Part 5's layer_loop.")
_COPY_MB = flags.DEFINE_float("copy_bandwidth_mb", 0.0, "Copy-bandwidth buffer (MiB; 0: 1024 on an accelerator, "
                              "64 on a CPU).")

# Nominal HBM bandwidth (TB/s, spec sheets) by device kind: (a regex over jax's
# device_kind, TB/s), first match wins.  The SXM H100 is "NVIDIA H100 80GB HBM3";
# whole words, so a GH200 or an H100 NVL (other bandwidths) match nothing and get
# the measured copy bandwidth only.
NOMINAL_TBPS = ((r"\bH200\b", 4.8), (r"\bH100\b.*\bPCIe\b", 2.0), (r"\bH100\b.*\b(SXM\d*|HBM3)\b", 3.35))

# Llama-3-8B's shapes (meta-llama/Meta-Llama-3-8B config.json) and a tiny Llama
# that runs in seconds on a CPU.
LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                 max_position_embeddings=8192)
LLAMA_TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, vocab_size=512, rope_theta=500000.0, max_position_embeddings=512)


# ------------------------------------------------------------------ parts
class Skip(Exception):
    """A part that cannot run here: the message says why."""


@dataclasses.dataclass
class Part:
    """One part's outcome: status ok | failed | skipped, and what it measured."""

    name: str
    status: str = "not run"
    reason: str = ""          # why it was skipped, or its error
    seconds: float = 0.0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)   # key -> value table
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Context:
    """What the parts share: the run's files, deadline and part 1's findings."""

    out_dir: pathlib.Path
    stem: str
    deadline: float
    on_gpu: bool
    device_kind: str
    child_env: dict[str, str] = dataclasses.field(default_factory=lambda: dict(os.environ))
    nominal_gbps: float | None = None
    copy_gbps: float | None = None

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def path(self, suffix: str) -> pathlib.Path:
        return self.out_dir / f"{self.stem}{suffix}"


def run_part(name: str, fn: Callable[[Any, Part], None], ctx: Any, titles: dict[str, str] = TITLES) -> Part:
    """Runs one part, timed; a Skip or any exception is recorded, never raised.
    `ctx`: anything with remaining() (this script's Context, gpu_probe's Probe)."""
    part = Part(name)
    t0 = time.perf_counter()
    print(f"== {titles[name]}", flush=True)
    try:
        if ctx.remaining() <= 5:
            raise Skip("time budget (--budget_s) spent by the parts before it")
        fn(ctx, part)
        part.status = "ok"
    except Skip as e:
        part.status, part.reason = "skipped", str(e)
    except Exception as e:  # noqa: BLE001 - one part's failure must not stop the others
        part.status, part.reason = "failed", f"{type(e).__name__}: {e}".strip()
        part.notes.append("traceback (last lines): " + " | ".join(traceback.format_exc().splitlines()[-6:]))
    part.seconds = time.perf_counter() - t0
    print(f"   {part.status} in {part.seconds:.1f} s{': ' + part.reason if part.reason else ''}", flush=True)
    gc.collect()  # the dummy model's host and device buffers go before the next part
    return part


# ------------------------------------------------------------ subprocesses
def run_logged(cmd: list[str], log: pathlib.Path, cap: float, ctx: Context) -> tuple[int, float, str]:
    """Runs cmd from the repo root, output to `log`, killed (its process group) after
    min(cap, time left); returns (exit status, seconds, last lines).  A timeout raises."""
    if ctx.remaining() <= 5:
        raise Skip(f"time budget (--budget_s={_BUDGET.value:g}) spent")
    timeout = min(cap, ctx.remaining())
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=ctx.child_env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own child's group: pytest has no other
            proc.wait()
            raise TimeoutError(f"{pathlib.Path(cmd[1]).name if len(cmd) > 1 else cmd[0]} ran past "
                               f"{timeout:.0f} s (log: {log.name}; last lines: {tail(log, 3)})") from None
    return rc, time.perf_counter() - t0, tail(log, 8)


def tail(log: pathlib.Path, n: int) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-n:])


# ------------------------------------------------------------ 1. environment
def nominal_gbps(device_kind: str) -> float | None:
    """The device's nominal HBM bandwidth (GB/s) from NOMINAL_TBPS, or None."""
    for pattern, tbps in NOMINAL_TBPS:
        if re.search(pattern, device_kind, re.IGNORECASE):
            return tbps * 1000
    return None


def copy_gbps(mb: float) -> float:
    """Device-to-device copy bandwidth (GB/s, bytes read + written): the slope between
    programs of 5 and 10 chained x + 1 over an mb-MiB buffer (bench_kernels.py's
    method; not imported from it, which would define its flags here)."""
    import jax
    import jax.numpy as jnp
    x = jnp.arange(int(mb * 2**20) // 4, dtype=jnp.float32)

    def seconds(iters: int) -> float:
        def chain(x):
            for _ in range(iters):
                x = jax.lax.optimization_barrier(x + 1.0)   # one read, one write; no fusion
            return x
        f = jax.jit(chain)
        jax.block_until_ready(f(x))
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    t5, t10 = seconds(5), seconds(10)
    per_copy = (t10 - t5) / 5 if t10 > t5 else t10 / 10   # noise on a loaded CPU: an upper bound
    return 2 * x.nbytes / per_copy / 1e9


def versions() -> dict[str, str]:
    """Versions of what the numbers depend on (installed ones only)."""
    import jax
    import jaxlib
    out = {"python": sys.version.split()[0], "jax": jax.__version__, "jaxlib": jaxlib.__version__}
    for pkg in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "triton", "flax"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def nvidia_smi() -> str | None:
    """The driver's view of the GPU (name, memory, driver, max memory clock), or None."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.memory",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None


def part_environment(ctx: Context, part: Part) -> None:
    import jax
    import harness
    dev = jax.devices()[0]
    info = part.info
    info.update(versions())
    info.update({"machine": harness.machine(), "backend": jax.default_backend(),
                 "devices": f"{jax.device_count()} x {dev.device_kind}",
                 "platform_version": dev.client.platform_version})
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
        info["device memory for jax (GiB)"] = round(stats["bytes_limit"] / 2**30, 2)
    else:
        info["device memory for jax"] = "not reported by this backend"
    smi = nvidia_smi()
    if smi:
        info["nvidia-smi"] = smi
    nominal = nominal_gbps(dev.device_kind) if ctx.on_gpu else None
    info["nominal HBM bandwidth (spec sheet, GB/s)"] = nominal if nominal else "unknown for this device"
    mb = _COPY_MB.value or (64.0 if jax.default_backend() == "cpu" else 1024.0)
    measured = copy_gbps(mb)
    info[f"measured copy bandwidth (GB/s, read+write of {mb:g} MiB)"] = round(measured, 1)
    if nominal:
        info["copy / nominal"] = f"{100 * measured / nominal:.1f} %"
    ctx.nominal_gbps, ctx.copy_gbps = nominal, measured


def extra_cap(ctx: Context, cap: float, keep: float) -> float:
    """Time cap of an optional run: `cap`, cut to leave `keep` s of the budget to
    the parts after it; Skip when under 15 s would be left for it."""
    left = ctx.remaining() - keep
    if left < 15:
        raise Skip(f"time budget: {ctx.remaining():.0f} s left, {keep:.0f} s of it kept for later parts")
    return min(cap, left)


# ------------------------------------------------------------ 2. kernel tests
PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def pytest_counts(text: str) -> dict[str, int]:
    """{"passed": n, ...} from pytest's summary line (the last line that has counts)."""
    lines = [line for line in text.splitlines() if PYTEST_COUNTS.search(line) and " in " in line]
    return {k.rstrip("s") if k.startswith("error") else k: int(n)
            for n, k in PYTEST_COUNTS.findall(lines[-1])} if lines else {}


def part_kernel_tests(ctx: Context, part: Part) -> None:
    if not ctx.on_gpu:
        raise Skip("needs a GPU (on a CPU these tests run the kernels in interpret mode, in `make test`)")
    log = ctx.path("_kernel_tests.log")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-n", "0", *_TESTS.value]
    rc, secs, last = run_logged(cmd, log, _TESTS_CAP.value, ctx)
    counts = pytest_counts(log.read_text(errors="replace"))
    part.info.update({"command": " ".join(cmd[1:]), "exit status": rc, "seconds": round(secs, 1),
                      **counts, "log": log.name})
    if rc != 0:
        raise RuntimeError(f"pytest exited {rc} ({counts or 'no summary'}): {last}")


# ------------------------------------------------------------ 3. kernel bench
# On a CPU, one point of --smoke's shapes: the code path in ~8 s (--smoke's 4 points take ~19).
CPU_BENCH_FLAGS = ["--impl=pallas_gpu", "--batch_sizes=2", "--context_lens=64", "--head_dim=64",
                   "--num_kv_heads=2", "--gqa=4", "--iters=2", "--reps=2", "--copy_mb=16",
                   "--rotate_mb=1", "--max_sets=2", "--variants=ours,reference"]


def bench_flags(on_gpu: bool) -> list[str]:
    if not on_gpu:
        return CPU_BENCH_FLAGS
    return [f"--batch_sizes={','.join(_BENCH_BATCHES.value)}",
            f"--context_lens={','.join(_BENCH_CONTEXTS.value)}",
            "--variants=ours,jax_ops,contig", "--iters=10", "--reps=5"]


def number(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def bench_row(raw: dict[str, str], nominal: float | None) -> dict[str, Any]:
    """One bench_kernels CSV row, with the fraction of nominal bandwidth and ours vs jax_ops."""
    row = {k: v for k, v in raw.items() if v != ""}
    gbps, ours, theirs = number(row.get("ours_GBps")), number(row.get("ours_us")), number(row.get("jax_ops_us"))
    if gbps is not None and nominal:
        row["ours_pct_nominal"] = round(100 * gbps / nominal, 1)
    if number(row.get("jax_ops_GBps")) is not None and nominal:
        row["jax_ops_pct_nominal"] = round(100 * number(row["jax_ops_GBps"]) / nominal, 1)
    if ours and theirs:
        row["jax_ops_us / ours_us"] = round(theirs / ours, 2)
    return row


BENCH_COLUMNS = ["kv_dtype", "batch", "context", "kv_mb", "ours_us", "ours_GBps", "ours_pct_copy",
                 "ours_pct_nominal", "jax_ops_us", "jax_ops_GBps", "jax_ops_pct_nominal", "jax_ops_us / ours_us",
                 "bf16_us / ours_us", "reference_us", "contig_us", "paging_overhead_pct", "note"]


def quant_bench_flags(on_gpu: bool) -> list[str]:
    if not on_gpu:
        return [f for f in CPU_BENCH_FLAGS if not f.startswith("--variants=")] + ["--variants=ours"]
    return [f"--batch_sizes={','.join(_BENCH_KV_BATCHES.value)}",
            f"--context_lens={','.join(_BENCH_CONTEXTS.value)}", "--variants=ours", "--iters=10", "--reps=5",
            "--copy_mb=256"]


def bench_run(ctx: Context, kv_dtype: str, flags_: list[str], cap: float) -> tuple[list[str], float, list]:
    """One bench_kernels.py subprocess (bf16 q): (its command, seconds, CSV rows)."""
    import csv
    suffix = "" if kv_dtype == "bfloat16" else f"_kv{kv_dtype}"
    prefix = ctx.path(f"_kernels{suffix}")
    cmd = [sys.executable, "benchmarks/bench_kernels.py", f"--out={prefix}", "--dtype=bfloat16",
           *([f"--kv_dtype={kv_dtype}"] if suffix else []), *flags_]
    rc, secs, last = run_logged(cmd, ctx.path(f"_kernel_bench{suffix}.log"), cap, ctx)
    if rc != 0:
        raise RuntimeError(f"bench_kernels.py --kv_dtype={kv_dtype} exited {rc}: {last}")
    with open(f"{prefix}.csv") as f:
        return cmd, secs, [{"kv_dtype": kv_dtype, **r} for r in csv.DictReader(f)]


def part_kernel_bench(ctx: Context, part: Part) -> None:
    cmd, secs, raw = bench_run(ctx, "bfloat16", bench_flags(ctx.on_gpu), _BENCH_CAP.value)
    part.rows = [bench_row(r, ctx.nominal_gbps) for r in raw]
    prefix = ctx.path("_kernels")
    part.info.update({"command": " ".join(cmd[1:]), "seconds": round(secs, 1),
                      "bench_kernels' own report": f"{prefix.name}.md, {prefix.name}.csv"})
    bf16_us = {(r.get("batch"), r.get("context")): number(r.get("ours_us")) for r in part.rows}
    keep = _RESERVE.value + 2 * _SERVE_CAP.value
    errors = []
    kv_dtypes = _BENCH_KV.value if ctx.on_gpu else _BENCH_KV.value[:1]
    for kv in kv_dtypes:
        try:
            cmd, secs, raw = bench_run(ctx, kv, quant_bench_flags(ctx.on_gpu),
                                       extra_cap(ctx, _BENCH_KV_CAP.value, keep))
        except Skip as e:
            part.rows.append({"kv_dtype": kv, "note": f"skipped: {e}"})
            continue
        except Exception as e:  # noqa: BLE001 - the other pool still runs; the part fails below
            errors.append(f"kv_dtype={kv}: {type(e).__name__}: {e}")
            part.rows.append({"kv_dtype": kv, "note": "failed (see the part's error)"})
            continue
        for r in (bench_row(r, ctx.nominal_gbps) for r in raw):
            base, ours = bf16_us.get((r.get("batch"), r.get("context"))), number(r.get("ours_us"))
            if base and ours:
                r["bf16_us / ours_us"] = round(base / ours, 2)
            part.rows.append(r)
        part.info[f"{kv}: seconds"] = round(secs, 1)
    if kv_dtypes:
        part.info["quantized pools: command"] = " ".join(["benchmarks/bench_kernels.py --dtype=bfloat16 "
                                                         "--kv_dtype=<pool>", *quant_bench_flags(ctx.on_gpu)])
    if not ctx.on_gpu:
        part.notes.append("CPU: one smoke-sized point in interpret mode; the times say nothing about "
                          "kernel speed (jax_ops runs on a GPU only).")
    part.notes.append("GB/s = K/V bytes / time; pct_copy: of bench_kernels' own copy bandwidth; "
                      "pct_nominal: of the spec sheet's HBM bandwidth; jax_ops_us / ours_us > 1: ours faster. "
                      "Quantized pools (int8, float8_e4m3fn: head_dim-byte rows, a code row per page) with bf16 q, ours "
                      "only; bf16_us / ours_us > 1: faster than on the bf16 pool at that batch and context.")
    if errors:
        raise RuntimeError("; ".join(errors))


# ------------------------------------------------------------ 4. serve_batch
CPU_SERVE_PROMPTS = ["What is the capital of France?", "Write a haiku about rain."]


def read_outputs(path: pathlib.Path) -> dict[int, list[int]]:
    """serve_batch's --output: request index -> generated token ids."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            out[int(record["index"])] = list(record.get("token_ids") or [])
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def compare_tokens(ours: dict[int, list[int]], ref: dict[int, list[int]]) -> dict[str, Any]:
    """Request-by-request equality of two runs' greedy token ids; a request missing
    from either run counts as unequal."""
    indices = sorted(set(ours) | set(ref))
    equal = [i for i in indices if i in ours and i in ref and ours[i] == ref[i]]
    diverged = {i: common_prefix(ours.get(i, []), ref.get(i, [])) for i in indices if i not in equal}
    return {"equal": len(equal), "total": len(indices), "first_divergence": diverged}


def serve_run(ctx: Context, impl: str, prompts: pathlib.Path | None, max_tokens: int,
              kv_cache_dtype: str = "auto", cap: float | None = None) -> dict[str, Any]:
    """One serve_batch subprocess: its summary numbers and its outputs' token ids."""
    name = impl if kv_cache_dtype == "auto" else f"{impl}_{kv_cache_dtype}"
    out, summary = ctx.path(f"_serve_{name}.jsonl"), ctx.path(f"_serve_{name}_summary.json")
    cmd = [sys.executable, "scripts/serve_batch.py", "--config", "configs/smollm2_135m.py",
           f"--config.attention_impl={impl}", f"--config.max_tokens={max_tokens}",
           *([f"--config.kv_cache_dtype={kv_cache_dtype}"] if kv_cache_dtype != "auto" else []),
           f"--output={out}", f"--summary_json={summary}"] + ([f"--prompts={prompts}"] if prompts else [])
    rc, secs, last = run_logged(cmd, ctx.path(f"_serve_{name}.log"), cap or _SERVE_CAP.value, ctx)
    if rc != 0:
        raise RuntimeError(f"serve_batch.py with attention_impl={impl} kv_cache_dtype={kv_cache_dtype} "
                           f"exited {rc}: {last}")
    s = json.loads(summary.read_text())
    return {"attention_impl": impl, "kv_cache_dtype": kv_cache_dtype, "requests": s["requests"],
            "errors": s["errors"],
            "output_tokens": s["output_tokens"], "process_wall_s": round(secs, 2),
            "generate_wall_s": round(s["wall_s"], 2), "generate_tok_per_s": round(s["output_tok_per_s"], 1),
            "compilations": s["compilations"], "compile_s": round(s["compile_s"], 1),
            "_tokens": read_outputs(out)}


def part_serve_batch(ctx: Context, part: Part) -> None:
    if not ctx.on_gpu and not _SERVE_ON_CPU.value:
        raise Skip("pallas_gpu needs a GPU; the reference-vs-cpu comparison takes 20-40 s on this "
                   "CPU (two SmolLM2 processes compiling), over this mode's budget "
                   "(--serve_batch_on_cpu runs it)")
    impls, prompts, max_tokens = ("pallas_gpu", "reference"), None, _SERVE_TOKENS.value
    if not ctx.on_gpu:
        impls, max_tokens = ("cpu", "reference"), 8
        prompts = ctx.path("_serve_prompts.jsonl")
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CPU_SERVE_PROMPTS))
    runs = [serve_run(ctx, impl, prompts, max_tokens) for impl in impls]
    ref_tokens = runs[1].pop("_tokens")
    cmp = compare_tokens(runs[0].pop("_tokens"), ref_tokens)
    part.rows = runs
    part.info.update({"prompts": "the 8 demo prompts" if prompts is None else f"{len(CPU_SERVE_PROMPTS)} "
                      "short prompts", "max_tokens": max_tokens, "greedy token ids equal (requests)":
                      f"{cmp['equal']}/{cmp['total']}"})
    if cmp["first_divergence"]:
        part.info["unequal requests: index -> tokens equal before the first difference"] = (
            ", ".join(f"{i} -> {n}" for i, n in cmp["first_divergence"].items()))
    part.notes.append(f"{impls[0]} vs {impls[1]}, SmolLM2-135M fp32, greedy; process_wall_s includes "
                      "loading and compiling, generate_* is the batch alone.")
    kv = _SERVE_KV.value
    if kv == "none":
        return
    try:
        run = serve_run(ctx, impls[0], prompts, max_tokens, kv,
                        cap=extra_cap(ctx, _SERVE_CAP.value, _RESERVE.value))
    except Skip as e:
        part.rows.append({"attention_impl": impls[0], "kv_cache_dtype": kv, "note": f"skipped: {e}"})
        return
    qcmp = compare_tokens(run.pop("_tokens"), ref_tokens)
    part.rows.append(run)
    part.info[f"{impls[0]} with kv_cache_dtype={kv} vs {impls[1]}: greedy token ids equal (requests)"] = (
        f"{qcmp['equal']}/{qcmp['total']}")
    if qcmp["first_divergence"]:
        part.info[f"{kv}: unequal requests: index -> tokens equal before the first difference"] = (
            ", ".join(f"{i} -> {n}" for i, n in qcmp["first_divergence"].items()))
    part.notes.append(f"kv_cache_dtype={kv}: K/V stored quantized (a scale per row: 2**(c/4) for int8, "
                      "2**c for fp8), so "
                      "greedy ids may part from the fp32 reference's after a near tie; the kernel's "
                      "exactness on quantized pools is part 2's to check.")


# ------------------------------------------------------------ 5. dummy decode
def dummy_shape(on_gpu: bool) -> str:
    return _DUMMY_SHAPE.value if _DUMMY_SHAPE.value != "auto" else ("8b" if on_gpu else "tiny")


def write_llama_config(directory: pathlib.Path, shape: dict[str, Any]) -> pathlib.Path:
    """A Llama config.json (load_format=dummy reads only this) with `shape`."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False,
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", **shape}
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory


def make_dummy_llm(directory: pathlib.Path, batches: list[int], steps: int) -> Any:
    """jpaged.LLM on random weights, a pool just big enough for the largest batch."""
    from jpaged import LLM
    block_size, prompt = 16, _DUMMY_PROMPT.value
    max_len = prompt + steps + 8
    num_blocks = 1 + max(batches) * -(-max_len // block_size) + 8
    # Every prompt of the largest batch prefills in one step: with smaller chunks the
    # first sequences would finish before the last ones started decoding, and no
    # step would have the whole batch decoding.  Each batch compiles two step sizes.
    return LLM(model=str(directory), load_format="dummy", dtype="bfloat16", attention_impl="auto",
               max_num_seqs=max(batches), max_num_batched_tokens=max(batches) * prompt,
               max_model_len=max_len, block_size=block_size, num_blocks=num_blocks,
               enable_prefix_caching=False, layer_loop=_DUMMY_LOOP.value)


def part_dummy_decode(ctx: Context, part: Part) -> None:
    from decode_timing import measure_decode, step_bytes
    shape_name = dummy_shape(ctx.on_gpu)
    batches = [int(b) for b in _DUMMY_BATCHES.value] or ([1, 32, 128] if shape_name == "8b" else [1, 4])
    steps = _DUMMY_STEPS.value or (32 if shape_name == "8b" else 8)
    with tempfile.TemporaryDirectory(prefix="jpaged_dummy_") as tmp:
        write_llama_config(pathlib.Path(tmp), LLAMA3_8B if shape_name == "8b" else LLAMA_TINY)
        t0 = time.perf_counter()
        llm = make_dummy_llm(pathlib.Path(tmp), batches, steps)
        ready = time.perf_counter() - t0
    weight_bytes = sum(w for w, _ in llm.memory_per_device().values())
    part.info.update({"model": "Llama-3-8B shape" if shape_name == "8b" else
                      "TINY Llama shape (CI code path; not a benchmark)",
                      "shape": json.dumps(LLAMA3_8B if shape_name == "8b" else LLAMA_TINY),
                      "dtype": "bfloat16", "attention": llm.attention_impl, "layer_loop": _DUMMY_LOOP.value,
                      "weights (GB)": round(weight_bytes / 1e9, 3),
                      "weights a step reads (GB)": round(step_bytes(llm, 0, 0) / 1e9, 3),
                      "random weights drawn (s)": round(llm.loaded.load_seconds, 2),
                      "engine ready (s)": round(ready, 1), "prompt tokens": _DUMMY_PROMPT.value,
                      "decode steps per batch": steps})
    for batch in batches:
        if ctx.remaining() <= 5:
            part.rows.append({"batch": batch, "note": "skipped: time budget spent"})
            continue
        part.rows.append(measure_decode(llm, batch, steps, _DUMMY_PROMPT.value, nominal_gbps=ctx.nominal_gbps,
                                        copy_gbps=ctx.copy_gbps))
        print(f"   {part.rows[-1]}", flush=True)
    part.info["compilations"] = llm.num_compilations
    part.info["compile (s)"] = round(llm.compile_seconds, 1)
    part.notes += [
        "Each batch: a warm-up pass, the programs built in the background awaited, a second warm-up, then the "
        "timed pass. decode tok/s = batch x timed steps / their wall time; a timed step has every sequence "
        "decoding, no prompt token and no program built during it. context: the mean K/V length of the timed "
        "steps.",
        "bucket: the batch's own step bucket (token slots); buckets_run: those its timed steps ran in. "
        "bucket_ok is false, and `invalid` says so, when any timed step ran padded into a larger bucket (its "
        "own was not built yet): such a row times another program, not this batch's.",
        "floor_ms = step_GB / the nominal bandwidth (floor_ms@copy: / the measured copy bandwidth): step_GB is "
        "what a decode step must read, every weight but the embedding table (gathered, not read; kept when "
        "tied, as the LM head) plus the K/V of `batch` sequences at `context` tokens. step / floor: how far "
        "above it the median step is.",
        "device_ms: the step's program alone, called back to back with one timed step's exact inputs (the "
        "donated pool fed back, one block at the end), per call; host_ms = median_step_ms - device_ms, what "
        "the engine adds around it; dispatch_us: how long one call takes to return, before blocking."]
    del llm


PART_FNS = {"environment": part_environment, "kernel_tests": part_kernel_tests,
            "kernel_bench": part_kernel_bench, "serve_batch": part_serve_batch,
            "dummy_decode": part_dummy_decode}


# ------------------------------------------------------------------ report
def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def md_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> list[str]:
    """Markdown table of the columns some row has (in `columns` order, else first seen)."""
    cols = [c for c in (columns or []) if any(c in r for r in rows)]
    cols += [c for r in rows for c in r if c not in cols]
    cols = list(dict.fromkeys(cols))
    return (["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows])


def report_lines(parts: list[Part], header: dict[str, Any]) -> list[str]:
    lines = [f"# Device check: {header['device']} ({header['date']})", ""]
    lines += [f"- **{k}**: {fmt(v)}" for k, v in header.items() if k not in ("device", "date")]
    lines += ["", "| part | status | seconds | reason / error |", "|---|---|---|---|"]
    lines += [f"| {TITLES[p.name]} | {p.status} | {p.seconds:.1f} | {fmt(p.reason)} |" for p in parts]
    skipped = [p for p in parts if p.status == "skipped"]
    if skipped:
        lines += ["", "Skipped (reasons above): " + ", ".join(TITLES[p.name] for p in skipped)]
    for p in parts:
        lines += ["", f"## {TITLES[p.name]}: {p.status}", ""]
        if p.reason:
            lines += [f"{p.status}: {p.reason}", ""]
        if p.info:
            lines += md_table([{"what": k, "value": v} for k, v in p.info.items()]) + [""]
        if p.rows:
            lines += md_table(p.rows, BENCH_COLUMNS if p.name == "kernel_bench" else None) + [""]
        lines += [f"_{n}_" if not n.startswith("traceback") else f"`{n}`" for n in p.notes]
    return lines


def write_report(ctx: Context, parts: list[Part], header: dict[str, Any]) -> pathlib.Path:
    md = ctx.path(".md")
    md.write_text("\n".join(report_lines(parts, header)) + "\n")
    data = {"header": header, "parts": [dataclasses.asdict(p) for p in parts]}
    ctx.path(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    return md


# -------------------------------------------------------------------- main
def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_").lower()


def make_context(t_start: float) -> Context:
    # The parent keeps on the device only what it uses (a copy buffer, later the
    # 8B model), so the subprocesses of parts 2-4, preallocating as usual, find
    # its memory free.  Set before jax initialises its backend (imported below).
    child_env = dict(os.environ)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    on_gpu = jax.default_backend() == "gpu"
    kind = jax.devices()[0].device_kind if jax.default_backend() != "cpu" else "cpu"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    out_dir = pathlib.Path(_OUT_DIR.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    return Context(out_dir, f"device_check_{slug(kind)}_{stamp}", t_start + _BUDGET.value, on_gpu, kind,
                   child_env)


def main(argv: list[str]) -> None:
    del argv
    t_start = time.perf_counter()
    logging.set_verbosity(logging.WARNING)
    unknown = set(_PARTS.value) - set(PARTS)
    if unknown:
        raise app.UsageError(f"--parts: unknown {sorted(unknown)}; of {', '.join(PARTS)}")
    sys.path.insert(0, str(REPO / "benchmarks"))  # harness.py, when imported as a module
    ctx = make_context(t_start)
    print(f"device check on {ctx.device_kind}: report {ctx.path('.md')}", flush=True)
    parts = [run_part(name, PART_FNS[name], ctx) for name in PARTS if name in _PARTS.value]
    not_run = [Part(n, "skipped", "not in --parts") for n in PARTS if n not in _PARTS.value]
    parts = sorted(parts + not_run, key=lambda p: PARTS.index(p.name))
    header = {"device": ctx.device_kind, "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
              "command": " ".join(sys.argv), "total seconds": round(time.perf_counter() - t_start, 1),
              "failed parts": ", ".join(p.name for p in parts if p.status == "failed") or "none"}
    import harness
    import jax
    header.update({"machine": harness.machine(), "backend": jax.default_backend(), **versions()})
    print(f"report: {write_report(ctx, parts, header)}", flush=True)
    sys.exit(1 if any(p.status == "failed" for p in parts) else 0)


if __name__ == "__main__":
    app.run(main)

"""`make gpu-probe`: the one prepared script a session runs FIRST on a lent H100/H200.

Issue 38's experiments (../shared/gpu-plan.md, sections 4 and 7.2) in one command,
fitting ~7 minutes of a 15-minute loan so a failed part can be rerun with
`--parts=` in the same window.  Each part is timed and guarded (a failing part is
reported with its error, the others still run; exit status 1 if any failed), and
every variant runs in its own subprocess: XLA_FLAGS differ per variant and must be
set before jax initialises.  A subprocess writes its rows as it goes, so one killed
at its time cap still reports what it measured.

  1. environment      device_check's part 1 (versions, device, nominal and measured
                      copy bandwidth) plus the device's target config (GPU only).
  2. gemm_chain       the Llama-3-8B's 32 layers x 7 weight GEMMs + the LM head at
                      M = 8/32/128, weights drawn on the device (bf16): per-layer
                      arrays unrolled; lax.scan over stacked arrays; scan with
                      dynamic-slice fusion; unrolled with Triton GEMMs off; merged
                      wqkv / w_gate_up (4 GEMMs a layer).  ms of 20 back-to-back calls,
                      GB/s of the weight bytes, % of copy bandwidth, XLA temp bytes.
  3. anatomy          jpaged.LLM (load_format=dummy, bf16) per variant (scan; unroll;
                      scan + dynamic-slice fusion) at batch 1/32/128, short context,
                      through benchmarks/decode_timing.py's measure_decode (bucket, step
                      ms, device ms, host ms, dispatch µs, floor), plus compile s and
                      the decode executable's memory_analysis(); then one batch-1 point
                      of the best variant on a pool sized by the default
                      kv_memory_fraction (the donated pool is never copied: step ms as
                      on the small pool, alias bytes >= pool bytes).
  4. trace            a jax.profiler trace of 5 steps and the optimized HLO of the best
                      variant's decode program at batch 1 and 128 (gzipped), summed by
                      kernel class with benchmarks/summarize_gpu_trace.py.
  5. command_buffers  the best variant with --xla_gpu_enable_command_buffer=+WHILE,
                      +CONDITIONAL (scan) or --xla_gpu_graph_min_graph_size=1
                      (unrolled), batch 1, device ms against part 3's.
  6. attention_sweep  pallas_kernels.gpu.paged_attention_gpu at context 4k in one
                      process: batch 1 over partitions x stages x warps x block_k,
                      batch 32 over partitions; µs, GB/s, % of copy bandwidth.
  7. quantized_pools  int8 and float8_e4m3fn pools against bf16 at batch 32/128,
                      context 4k, the kernel's default tuning.
  8. moe_grouped      the MoE layer's grouped matmuls (jpaged.layers.moe.swiglu_experts:
                      three jax.lax.ragged_dot, bf16; beside them the Pallas grouped
                      matmul, pallas_kernels.grouped_matmul) at decode token counts 1..64 on
                      one layer of Qwen3-30B-A3B (128 experts, top-8) and Mixtral-8x7B
                      (8 experts, top-2) shapes, random routing: µs, GB/s of the bytes
                      of the experts the tokens were routed to (what a grouped matmul
                      must read) and of all the layer's experts, % of copy bandwidth;
                      and the whole MoE MLP (router, sort, ragged_dot, combine).

On a CPU (CI) everything runs with a tiny Llama shape and tiny kernel points, in
interpret mode for the kernels: the numbers are code-path only and the report says
so.  The best variant of parts 4-5 is part 3's (lowest batch-1 device ms); when
part 3 is not run, --best_variant.

Writes benchmarks/results/device/gpu_probe_<device>_<YYYYmmdd-HHMM>.md and .json,
the traces, HLO texts, target config and a tarball of the subprocess logs and XLA
autotune results beside them (at most 8 files), and copies those to $OUT when that
variable is set (the device tool brings back 8 files of <= 16 MiB).

    python benchmarks/gpu_probe.py                          # ~7 min on an H100/H200
    python benchmarks/gpu_probe.py --parts=environment,trace,command_buffers --best_variant=unroll
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gzip
import inspect
import json
import math
import os
import pathlib
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
import traceback
from typing import Any, Callable

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]

from absl import flags as absl_flags  # noqa: E402

import device_check as dc  # noqa: E402

# device_check's helpers read its (absl) flags' defaults; this script has its own
# argparse options, so the absl flags are never parsed from the command line.
absl_flags.FLAGS.mark_as_parsed()

PARTS = ("environment", "gemm_chain", "anatomy", "trace", "command_buffers", "attention_sweep",
         "quantized_pools", "moe_grouped")
TITLES = {"environment": "1. Environment", "gemm_chain": "2. GEMM chain (8B weight GEMMs + LM head)",
          "anatomy": "3. Engine anatomy (decode per layer-loop variant)",
          "trace": "4. Profiler trace and optimized HLO", "command_buffers": "5. XLA command buffers",
          "attention_sweep": "6. Attention sweep (context 4k)",
          "quantized_pools": "7. Quantized pools vs bf16",
          "moe_grouped": "8. MoE grouped matmuls (ragged_dot, Pallas gmm) at decode"}

DSF = "--xla_gpu_enable_dynamic_slice_fusion=true"
# Engine variants: layer_loop and the XLA flags of their process.
VARIANTS = {"scan": ("scan", []), "unroll": ("unroll", []), "scan_dsf": ("scan", [DSF])}
# What turns the whole step into command buffers (CUDA graphs), by layer loop.
COMMAND_BUFFER_FLAGS = {"scan": ["--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"],
                        "unroll": ["--xla_gpu_graph_min_graph_size=1"]}
# GEMM-chain variants: weight layout and XLA flags (one process per set of flags).
GEMM_VARIANTS = {"unrolled": ("unrolled", []), "scan": ("stacked", []), "scan_dsf": ("stacked", [DSF]),
                 "unrolled_no_triton": ("unrolled", ["--xla_gpu_enable_triton_gemm=false"]),
                 "merged": ("merged", [])}

CPU_NOTE = "CPU: tiny shapes, code path only; these times say nothing about a GPU."


@dataclasses.dataclass
class Plan:
    """Sizes of one run: the 8B shape on a GPU, tiny ones on a CPU."""

    shape_name: str
    shape: dict[str, Any]
    gemm_ms: tuple[int, ...] = (8, 32, 128)
    gemm_calls: int = 20
    batches: tuple[int, ...] = (1, 128, 32)  # if a variant's cap cuts it short, batch 32 goes
    trace_batches: tuple[int, ...] = (1, 128)
    decode_steps: int = 32
    prompt_len: int = 4
    trace_steps: int = 5
    context: int = 4096
    sweep_b1: tuple[dict[str, int], ...] = ()
    sweep_b32: tuple[dict[str, int], ...] = ()
    quant_batches: tuple[int, ...] = (32, 128)
    quant_dtypes: tuple[str, ...] = ("int8", "float8_e4m3fn")
    kernel_iters: int = 8          # chained attention calls per program
    kernel_programs: int = 20      # programs timed back to back
    kernel_reps: int = 3
    kernel_dims: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"num_kv_heads": 8, "gqa": 4, "head_dim": 128, "block_size": 16})
    # MoE layer shapes of part 8: name -> (hidden d, expert width f, experts E, top-k).
    moe_shapes: dict[str, tuple[int, int, int, int]] = dataclasses.field(default_factory=lambda: {
        "qwen3_30b_a3b": (2048, 768, 128, 8), "mixtral_8x7b": (4096, 14336, 8, 2)})
    moe_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    caps: dict[str, float] = dataclasses.field(default_factory=dict)


def gpu_plan() -> Plan:
    sweep_b1 = tuple({"batch": 1, "num_partitions": p, "num_stages": s, "num_warps": w, "block_k": k}
                     for p in (16, 32, 64, 128) for s in (2, 3, 4) for w in (4, 8) for k in (32, 64))
    sweep_b32 = tuple({"batch": 32, "num_partitions": p} for p in (1, 2, 4))
    # Time caps (s) per subprocess (gemm: per variant), about the plan's (gpu-plan.md 7.2);
    # the parts run in its rank order and --budget_s cuts the tail, rerun with --parts=.
    caps = {"gemm": 30, "anatomy": 70, "large_pool": 45, "trace": 60, "command_buffers": 45,
            "attention_sweep": 60, "quantized_pools": 45, "moe_grouped": 70}  # moe: + the Pallas gmm's compiles
    return Plan("8b", dc.LLAMA3_8B, sweep_b1=sweep_b1, sweep_b32=sweep_b32, caps=caps)


def cpu_plan() -> Plan:
    caps = {"gemm": 60, "anatomy": 90, "large_pool": 60, "trace": 90, "command_buffers": 60,
            "attention_sweep": 90, "quantized_pools": 90, "moe_grouped": 60}
    one = {"batch": 1, "num_partitions": 2, "num_stages": 2, "num_warps": 4, "block_k": 32}
    return Plan("tiny", dc.LLAMA_TINY, gemm_ms=(8,), gemm_calls=2, batches=(1,), trace_batches=(1,),
                decode_steps=3, trace_steps=2, context=64, sweep_b1=(one,), sweep_b32=(),
                quant_batches=(2,), quant_dtypes=("int8",), kernel_iters=1, kernel_programs=1, kernel_reps=1,
                kernel_dims={"num_kv_heads": 2, "gqa": 4, "head_dim": 64, "block_size": 16},
                moe_shapes={"tiny": (64, 32, 8, 2)}, moe_tokens=(1, 4), caps=caps)


# ------------------------------------------------------------------ context
@dataclasses.dataclass
class Probe(dc.Context):
    """device_check's Context plus what this script's parts share."""

    plan: Plan | None = None
    work: pathlib.Path | None = None      # subprocess specs, results, logs
    engine_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    autotune_results: pathlib.Path | None = None  # the last complete XLA autotune dump
    best_variant: str = "unroll"
    best_source: str = "--best_variant"
    anatomy_rows: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    trace_files: dict[str, dict[str, dict[str, str]]] = dataclasses.field(default_factory=dict)
    artifacts: list[pathlib.Path] = dataclasses.field(default_factory=list)


def xla_flags(ctx: Probe, extra: list[str], label: str) -> str:
    """XLA_FLAGS of one subprocess: the caller's, the variant's, and on a GPU the dump
    of its autotune results (bundled with the logs), starting from the last process's
    dump: the variants share GEMM shapes, and autotuning each again in every process
    would spend the window compiling."""
    out = [os.environ.get("XLA_FLAGS", "").strip(), *extra]
    if ctx.on_gpu:
        if ctx.autotune_results:  # from a process that exited cleanly: a complete file
            out.append(f"--xla_gpu_load_autotune_results_from={ctx.autotune_results}")
        out.append(f"--xla_gpu_dump_autotune_results_to={ctx.work / f'autotune_{label}.txt'}")
    return " ".join(f for f in out if f)


def run_worker(ctx: Probe, task: str, label: str, spec: dict[str, Any], flags_: list[str],
               cap: float) -> dict[str, Any]:
    """One subprocess `gpu_probe.py --worker=task`: its result (rows, info, notes),
    partial if it died or hit its cap (then `error` says how)."""
    if ctx.remaining() <= 5:
        raise dc.Skip("time budget (--budget_s) spent")
    spec_path, result_path = ctx.work / f"{label}_spec.json", ctx.work / f"{label}_result.json"
    spec = {**spec, "label": label, "deadline_s": min(cap, ctx.remaining()) - 3,
            "plan": dataclasses.asdict(ctx.plan),
            "nominal_gbps": ctx.nominal_gbps, "copy_gbps": ctx.copy_gbps, "work": str(ctx.work),
            "engine_options": ctx.engine_options,
            "on_gpu": ctx.on_gpu}
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path.unlink(missing_ok=True)
    env = {**ctx.child_env, "XLA_FLAGS": xla_flags(ctx, flags_, label), "PYTHONUNBUFFERED": "1"}
    child = dataclasses.replace(ctx, child_env=env)
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), f"--worker={task}", f"--spec={spec_path}",
           f"--result={result_path}"]
    error = None
    try:
        rc, _, last = dc.run_logged(cmd, ctx.work / f"{label}.log", cap, child)
        if rc != 0:
            error = f"{label} exited {rc}: {last}"
    except TimeoutError as e:
        error = str(e)
    dump = ctx.work / f"autotune_{label}.txt"
    if error is None and dump.exists() and dump.stat().st_size:
        ctx.autotune_results = dump
    result = json.loads(result_path.read_text()) if result_path.exists() else {"rows": [], "info": {}}
    if error or result.get("error"):
        result["error"] = "; ".join(x for x in (result.get("error"), error) if x)
    return result


def take(part: dc.Part, result: dict[str, Any], label: str, errors: list[str],
         info_prefix: bool = True) -> list[dict[str, Any]]:
    """A worker's rows into the part (each labelled, unless the worker did), its info
    (under `label: `, or as it is) and notes, and its error."""
    rows = [{"variant": label, **r} for r in result.get("rows", [])]
    part.rows += rows
    part.notes += [n for n in result.get("notes", []) if n not in part.notes]
    for k, v in result.get("info", {}).items():
        part.info[f"{label}: {k}" if info_prefix else k] = v
    if str(result.get("error", "")).startswith("skipped: "):
        raise dc.Skip(f"{label}: {result['error'][len('skipped: '):]}")
    if result.get("error"):
        errors.append(f"{label}: {result['error']}")
        part.rows.append({"variant": label, "note": "failed or cut short (see the part's error)"})
    return rows


# ------------------------------------------------------------ 1. environment
def target_config() -> bytes | None:
    """The device's target config (serialized proto), which later CPU runs can compile
    against (deviceless AOT); None where this jax/jaxlib has no such attribute."""
    import jax
    try:
        from jax._src.lib import xla_client as xc
        topo = xc.get_topology_for_devices(jax.devices())
    except Exception:  # noqa: BLE001 - private API, differs between versions
        return None
    cfg = getattr(topo, "target_config", None)
    if cfg is None:
        return None
    return cfg if isinstance(cfg, bytes) else getattr(cfg, "SerializeToString", lambda: str(cfg).encode())()


def part_environment(ctx: Probe, part: dc.Part) -> None:
    dc.part_environment(ctx, part)
    cfg = target_config() if ctx.on_gpu else None
    if cfg:
        path = ctx.path("_target_config.pb")
        path.write_bytes(cfg)
        ctx.artifacts.append(path)
        part.info["target config"] = f"{path.name} ({len(cfg)} bytes)"
    else:
        part.info["target config"] = ("not available on a CPU" if not ctx.on_gpu
                                      else "not exposed by this jaxlib (get_topology_for_devices)")
    if not ctx.on_gpu:
        part.notes.append(CPU_NOTE)


def pct(gbps: float | None, of: float | None) -> float | None:
    return round(100 * gbps / of, 1) if gbps and of else None


# ------------------------------------------------------------ 2. GEMM chain
def part_gemm_chain(ctx: Probe, part: dc.Part) -> None:
    errors: list[str] = []
    groups: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for label, (layout, flags_) in GEMM_VARIANTS.items():
        groups.setdefault(tuple(flags_), []).append((label, layout))
    for flags_, variants in groups.items():
        name = "gemm_" + "_".join(label for label, _ in variants)
        result = run_worker(ctx, "gemm", name, {"variants": variants}, list(flags_),
                            ctx.plan.caps["gemm"] * len(variants))
        for r in take(part, result, name, errors, info_prefix=False):
            r["flags"] = " ".join(flags_) or "default"
            r["pct_copy"] = pct(r.get("GB_s"), ctx.copy_gbps)
            r["pct_nominal"] = pct(r.get("GB_s"), ctx.nominal_gbps)
    by = {(r["variant"], r.get("M")): r for r in part.rows if "ms" in r}
    for m in ctx.plan.gemm_ms:
        base = by.get(("unrolled", m))
        for label in GEMM_VARIANTS:
            if base and label != "unrolled" and (label, m) in by:
                part.info[f"M={m}: {label} ms / unrolled ms"] = round(by[(label, m)]["ms"] / base["ms"], 2)
    part.notes.append("One call = the model's weight GEMMs (7 a layer, 4 merged) + the LM head at M tokens, "
                      f"a residual RMS-norm between them; ms = wall of {ctx.plan.gemm_calls} back-to-back calls "
                      "/ their number (one block at the end); GB/s = weight bytes read / ms; temp_bytes = "
                      "XLA's temp buffer (scan's per-layer weight copies show up here).")
    if not ctx.on_gpu:
        part.notes.append(CPU_NOTE)
    if errors:
        raise RuntimeError("; ".join(errors))


def gemm_dims(shape: dict[str, Any]) -> dict[str, int]:
    d, heads, kvh = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = d // heads
    return {"d": d, "q": heads * head_dim, "kv": kvh * head_dim, "f": shape["intermediate_size"],
            "vocab": shape["vocab_size"], "layers": shape["num_hidden_layers"]}


def layer_shapes(dims: dict[str, int], merged: bool) -> dict[str, tuple[int, int]]:
    d, q, kv, f = dims["d"], dims["q"], dims["kv"], dims["f"]
    if merged:
        return {"wqkv": (d, q + 2 * kv), "wo": (q, d), "w_gate_up": (d, 2 * f), "w_down": (f, d)}
    return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "w_gate": (d, f), "w_up": (d, f),
            "w_down": (f, d)}


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, Any]:
    """bf16 arrays drawn on the device (nothing on the host), one program per shape."""
    import jax.numpy as jnp
    return {name: uniform_draw(shape)(jnp.uint32(seed * 1000 + i)) for i, (name, shape) in enumerate(shapes.items())}


@functools.lru_cache(maxsize=None)
def uniform_draw(shape: tuple[int, ...]) -> Callable:
    """jit of a bf16 draw of `shape`, uniform in +-1/sqrt(fan_in): a multiplicative hash
    of the element index and the seed (one elementwise kernel; threefry's program
    takes seconds to compile per shape, and the values only need to be varied)."""
    import jax
    import jax.numpy as jnp
    scale = 1.0 / math.sqrt(shape[-2])

    def draw(seed):
        i = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
        h = (i ^ seed) * jnp.uint32(2654435761)
        h = (h ^ (h >> 15)) * jnp.uint32(2246822519)
        u = (h >> 8).astype(jnp.float32) * (1.0 / 2**24)
        return ((2 * u - 1) * scale).astype(jnp.bfloat16)
    return jax.jit(draw)


def gemm_layer(h, w: dict[str, Any], dims: dict[str, int]):
    """One layer's weight GEMMs with a residual stream and an RMS norm; the attention
    is a stand-in (q + the tiled k + v) that keeps every GEMM's output used."""
    import jax
    import jax.numpy as jnp
    q_dim, kv, f = dims["q"], dims["kv"], dims["f"]
    x = h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True) + 1e-5).astype(h.dtype)
    if "wqkv" in w:
        qkv = x @ w["wqkv"]
        q, k, v = qkv[:, :q_dim], qkv[:, q_dim:q_dim + kv], qkv[:, q_dim + kv:]
    else:
        q, k, v = x @ w["wq"], x @ w["wk"], x @ w["wv"]
    h = h + (q + jnp.tile(k + v, (1, q_dim // kv))) @ w["wo"]
    x = h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True) + 1e-5).astype(h.dtype)
    if "w_gate_up" in w:
        gu = x @ w["w_gate_up"]
        g, u = gu[:, :f], gu[:, f:]
    else:
        g, u = x @ w["w_gate"], x @ w["w_up"]
    return h + (jax.nn.silu(g) * u) @ w["w_down"]


def gemm_program(layout: str, dims: dict[str, int]) -> Callable:
    import jax

    def unrolled(x, layers, lm_head):
        for w in layers:
            x = gemm_layer(x, w, dims)
        return x @ lm_head

    def stacked(x, layers, lm_head):
        x, _ = jax.lax.scan(lambda h, w: (gemm_layer(h, w, dims), None), x, layers)
        return x @ lm_head

    return stacked if layout == "stacked" else unrolled


def gemm_weights(layout: str, dims: dict[str, int]) -> tuple[Any, Any]:
    shapes = layer_shapes(dims, merged=layout == "merged")
    L = dims["layers"]
    if layout == "stacked":
        layers = random_weights({k: (L, *s) for k, s in shapes.items()}, seed=1)
    else:
        layers = [random_weights(shapes, seed=1 + i) for i in range(L)]
    lm_head = random_weights({"lm_head": (dims["d"], dims["vocab"])}, seed=999)["lm_head"]
    return layers, lm_head


def worker_gemm(spec: dict[str, Any], out: "Results") -> None:
    """Each (label, layout) of spec["variants"] in turn, its weights freed before the next."""
    import gc

    import jax
    plan = spec["plan"]
    dims = gemm_dims(plan["shape"])
    for label, layout in spec["variants"]:
        t0 = time.perf_counter()
        layers, lm_head = gemm_weights(layout, dims)
        jax.block_until_ready((layers, lm_head))
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves((layers, lm_head)))
        out.info.update({f"{label}: weights drawn on the device (s)": round(time.perf_counter() - t0, 2),
                         f"{label}: weight GB": round(weight_bytes / 1e9, 3),
                         f"{label}: GEMMs per layer": len(layer_shapes(dims, layout == "merged"))})
        for m in plan["gemm_ms"]:
            if out.remaining() < 5:
                out.rows.append({"variant": label, "M": m, "note": "skipped: time cap"})
                continue
            out.add({"variant": label, "M": m, **time_gemm_chain(layout, dims, m, layers, lm_head, weight_bytes,
                                                                 plan["gemm_calls"])})
        del layers, lm_head
        gc.collect()


def time_gemm_chain(layout: str, dims: dict[str, int], m: int, layers: Any, lm_head: Any, weight_bytes: int,
                    calls: int) -> dict[str, Any]:
    """ms of one call of the chain at M = m: `calls` calls back to back, one block."""
    import jax
    import jax.numpy as jnp
    x = jax.random.normal(jax.random.key(m), (m, dims["d"]), jnp.bfloat16)
    t0 = time.perf_counter()
    exe = jax.jit(gemm_program(layout, dims)).lower(x, layers, lm_head).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(exe(x, layers, lm_head))
    t0 = time.perf_counter()
    outs = [exe(x, layers, lm_head) for _ in range(calls)]
    jax.block_until_ready(outs)
    ms = 1000 * (time.perf_counter() - t0) / calls
    return {"ms": round(ms, 3), "GB_s": round(weight_bytes / (ms / 1000) / 1e9, 1),
            "compile_s": round(compile_s, 2), **memory_bytes(exe)}


def memory_bytes(exe: Any) -> dict[str, Any]:
    """memory_analysis() of a compiled executable: temp / alias / argument bytes."""
    try:
        m = exe.memory_analysis()
    except Exception as e:  # noqa: BLE001 - not every backend implements it
        return {"memory_analysis": f"unavailable: {type(e).__name__}"}
    if m is None:
        return {"memory_analysis": "unavailable"}
    return {"temp_bytes": m.temp_size_in_bytes, "alias_bytes": m.alias_size_in_bytes,
            "argument_bytes": m.argument_size_in_bytes}


# ------------------------------------------------------------ 3. anatomy
def part_anatomy(ctx: Probe, part: dc.Part) -> None:
    errors: list[str] = []
    for label, (loop, flags_) in VARIANTS.items():
        # Each variant also traces its batches of part 4 at its end (the programs are
        # built by then): part 4 keeps the best variant's files, no rebuild.
        result = run_worker(ctx, "engine", f"anatomy_{label}", {"layer_loop": loop, "pool": "small",
                            "batches": list(ctx.plan.batches), "trace_batches": list(ctx.plan.trace_batches)},
                            flags_, ctx.plan.caps["anatomy"])
        ctx.trace_files[label] = result.get("info", {}).pop("trace files", {})
        for r in take(part, result, label, errors):
            if r.get("batch") == 1 and "device_ms" in r:
                ctx.anatomy_rows[label] = r
    if ctx.anatomy_rows:
        # Rows timed in their own bucket first (a padded one times another program).
        ctx.best_variant = min(ctx.anatomy_rows, key=lambda v: (not ctx.anatomy_rows[v].get("bucket_ok"),
                                                                ctx.anatomy_rows[v]["device_ms"]))
        ctx.best_source = "part 3 (lowest batch-1 device ms)"
        part.info["best variant (batch-1 device ms)"] = ctx.best_variant
        large_pool_point(ctx, part, errors)
    part.notes.append("Rows: benchmarks/decode_timing.measure_decode (bucket = the step program the timed "
                      "steps ran in, bucket_ok false = some ran padded; device_ms = chained executable "
                      "calls, no host; host_ms = step - device; floor = bytes a step reads / nominal "
                      "bandwidth), plus the decode executable's memory_analysis() and the seconds this "
                      "batch's programs took to compile.")
    if not ctx.on_gpu:
        part.notes.append(CPU_NOTE)
    if errors:
        raise RuntimeError("; ".join(errors))


def large_pool_point(ctx: Probe, part: dc.Part, errors: list[str]) -> None:
    """Batch 1 of the best variant on a pool sized by the default kv_memory_fraction:
    a donated pool is updated in place, so the step costs what it costs on a small pool."""
    loop, flags_ = VARIANTS[ctx.best_variant]
    result = run_worker(ctx, "engine", "anatomy_large_pool", {"layer_loop": loop, "pool": "large",
                        "batches": [1], "ladder_batches": list(ctx.plan.batches)}, flags_,
                        ctx.plan.caps["large_pool"])
    rows = take(part, result, f"{ctx.best_variant} (large pool)", errors)
    small = ctx.anatomy_rows.get(ctx.best_variant, {})
    if rows and "device_ms" in rows[0] and small.get("device_ms"):
        big = rows[0]
        part.info["large pool: device ms / small pool's"] = round(big["device_ms"] / small["device_ms"], 3)
        part.info["large pool: same step size as the small pool's"] = big.get("bucket") == small.get("bucket")
        if big.get("alias_bytes") is not None and big.get("pool_bytes"):
            part.info["large pool: alias bytes >= pool bytes"] = big["alias_bytes"] >= big["pool_bytes"]


def engine_config(spec: dict[str, Any]) -> dict[str, Any]:
    """jpaged.LLM arguments: a pool just big enough for the largest batch ("small"), or
    sized by the default kv_memory_fraction ("large": a max_num_seqs and max_model_len
    whose useful blocks exceed the fraction's, so the fraction decides)."""
    plan = spec["plan"]
    batches, prompt = spec["batches"], plan["prompt_len"]
    block_size = 16
    max_len = prompt + plan["decode_steps"] + plan["trace_steps"] + 64
    largest = max(spec.get("ladder_batches") or batches)  # the step-size ladder of part 3's small pool
    # Every prompt of the largest batch prefills in one step (with smaller chunks the
    # first sequences of a 3-token warm-up would finish before the last ones started
    # decoding, and the batch's decode program would first be built while timing):
    # short prompts keep that step small (batch 128 x 4 tokens: a 512-token program).
    cfg = dict(load_format="dummy", dtype="bfloat16", attention_impl="auto", layer_loop=spec["layer_loop"],
               max_num_seqs=largest, max_num_batched_tokens=largest * prompt,
               max_model_len=max_len, block_size=block_size, enable_prefix_caching=False)
    if spec["pool"] == "large":
        # Sequences of the model's whole context: more blocks than the fraction holds
        # (as many sequences as the small pool's engine, so the same step sizes; at
        # least 64, for a tiny shape's short context).
        seqs = max(largest, 64)
        cfg.update(max_num_seqs=seqs, max_num_batched_tokens=max(seqs, cfg["max_num_batched_tokens"]),
                   max_model_len=plan["shape"]["max_position_embeddings"], num_blocks=0)
    else:
        cfg["num_blocks"] = 1 + largest * -(-max_len // block_size) + 8
    return {**cfg, **spec.get("engine_options", {})}


def decode_program(llm: Any, bucket: Any) -> Any:
    """The compiled step program the timed decode steps ran in (key (T, S, structure))."""
    llm.runner.wait_for_programs()
    programs = llm.runner.programs
    match = [exe for key, exe in programs.items() if key[0] == bucket]
    return match[0] if match else None


def worker_engine(spec: dict[str, Any], out: "Results") -> None:
    try:
        import decode_timing
    except ImportError as e:
        raise dc.Skip(f"benchmarks/decode_timing.py (measure_decode) is not importable: {e}") from None
    from jpaged import LLM
    plan = spec["plan"]
    with tempfile.TemporaryDirectory(prefix="jpaged_probe_") as tmp:
        dc.write_llama_config(pathlib.Path(tmp), plan["shape"])
        t0 = time.perf_counter()
        llm = LLM(model=tmp, **engine_config(spec))
        ready = time.perf_counter() - t0
    weights, pool = (sum(x) for x in zip(*llm.memory_per_device().values()))
    out.info.update({"layer_loop": spec["layer_loop"], "attention": llm.attention_impl,
                     "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "engine ready (s)": round(ready, 1),
                     "weights GB": round(weights / 1e9, 3), "pool GB": round(pool / 1e9, 3)})
    programs = {}
    for batch in spec["batches"]:
        if out.remaining() < 10:
            out.rows.append({"batch": batch, "note": "skipped: time cap"})
            continue
        compile0, programs0 = llm.compile_seconds, llm.num_compilations
        row = decode_timing.measure_decode(llm, batch, plan["decode_steps"], plan["prompt_len"],
                                           nominal_gbps=spec["nominal_gbps"], copy_gbps=spec["copy_gbps"])
        programs[batch] = decode_program(llm, row.get("bucket"))
        row.update(memory_bytes(programs[batch]) if programs[batch] is not None
                   else {"memory_analysis": "program not found"})
        row.update({"compile_s": round(llm.compile_seconds - compile0, 2),
                    "programs_built": llm.num_compilations - programs0, "pool_bytes": pool})
        out.add(row)
    # Traced after every timed row: the profiler stays out of the timings.
    for batch in spec.get("trace_batches", []):
        if batch in programs and out.remaining() > 15:
            try:
                trace_batch(llm, batch, plan, programs[batch], out)
            except Exception as e:  # noqa: BLE001 - part 4 reports the missing files; the rows stand
                out.info[f"batch {batch} trace error"] = f"{type(e).__name__}: {e}"
                out.save()


# ------------------------------------------------------------ 4. trace
def trace_batch(llm: Any, batch: int, plan: dict[str, Any], exe: Any, out: "Results") -> None:
    """A jax.profiler trace of `trace_steps` decode steps of `batch` sequences, and the
    decode program's optimized HLO, both gzipped into the work folder."""
    import jax
    import numpy as np
    from jpaged import SamplingParams
    work, label = pathlib.Path(out.spec["work"]), out.spec["label"]
    params = SamplingParams(max_tokens=plan["trace_steps"] + 4, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(batch)
    for ids in rng.integers(3, llm.model_config.vocab_size, (batch, plan["prompt_len"])):
        llm.add_request(ids.tolist(), params)
    llm.step()   # the prefill
    llm.step()   # one decode step outside the trace
    trace_dir = work / f"{label}_profile_b{batch}"
    options = {}
    if (hasattr(jax.profiler, "ProfileOptions")  # no Python function tracing: kernels and XLA ops only
            and "profiler_options" in inspect.signature(jax.profiler.trace).parameters):
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
        options["profiler_options"] = opts
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True, **options):
        for _ in range(plan["trace_steps"]):
            llm.step()
    while llm.has_unfinished_requests():
        llm.step()
    found = sorted(trace_dir.rglob("perfetto_trace.json.gz")) or sorted(trace_dir.rglob("*.trace.json.gz"))
    files = {}
    if found:
        files["trace"] = f"{label}_trace_b{batch}.json.gz"
        shutil.copy(found[-1], work / files["trace"])
    if exe is not None:
        files["hlo"] = f"{label}_hlo_b{batch}.txt.gz"
        with gzip.open(work / files["hlo"], "wt") as f:
            f.write(exe.as_text())
    out.info.setdefault("trace files", {})[str(batch)] = files
    out.save()


def part_trace(ctx: Probe, part: dc.Part) -> None:
    import summarize_gpu_trace as sgt
    loop, flags_ = VARIANTS[ctx.best_variant]
    part.info["variant"] = f"{ctx.best_variant} (from {ctx.best_source})"
    errors: list[str] = []
    batches = list(ctx.plan.trace_batches)
    traced = ctx.trace_files.get(ctx.best_variant)
    if traced:
        part.info["traced by"] = f"part 3's {ctx.best_variant} process, after its timed rows"
    else:  # part 3 did not run (or traced nothing) in this call: a process of its own
        result = run_worker(ctx, "engine", f"trace_{ctx.best_variant}", {"layer_loop": loop, "pool": "small",
                            "batches": batches, "trace_batches": batches, "ladder_batches": list(ctx.plan.batches)},
                            flags_, ctx.plan.caps["trace"])
        traced = result.get("info", {}).pop("trace files", {})
        take(part, result, ctx.best_variant, errors)
    for batch in batches:
        files = traced.get(str(batch), {})
        for kind in ("trace", "hlo"):
            src = ctx.work / files[kind] if kind in files else None
            if src is None or not src.exists():
                errors.append(f"batch {batch}: no {kind} file")
                continue
            dst = ctx.path(f"_{kind}_b{batch}" + ("".join(src.suffixes)))
            if src.stat().st_size > 16 * 2**20:
                part.notes.append(f"{src.name}: {src.stat().st_size / 2**20:.1f} MiB, over the 16 MiB a file "
                                  "may take back; kept in the logs folder only")
                continue
            shutil.copy(src, dst)
            ctx.artifacts.append(dst)
            try:
                summary = sgt.summarize_file(dst, ctx.plan.trace_steps)
            except sgt.NoKernels as e:
                if ctx.on_gpu:
                    raise
                summary = {"kernels": f"none: {e}"}
            for k, v in summary.items():
                part.info[f"b{batch} {kind}: {k}"] = v
    part.notes.append(f"Summaries by benchmarks/summarize_gpu_trace.py (rerun it on the files: "
                      f"python benchmarks/summarize_gpu_trace.py --steps={ctx.plan.trace_steps} FILE...). "
                      "A profiler trace runs without command buffers (XLA disables them while "
                      "profiling): per-kernel times hold, launch gaps are those of a graph-less step.")
    if not ctx.on_gpu:
        part.notes.append(CPU_NOTE + " A CPU trace has no device kernels: only the HLO summary counts.")
    if errors:
        raise RuntimeError("; ".join(errors))


# ------------------------------------------------------------ 5. command buffers
def part_command_buffers(ctx: Probe, part: dc.Part) -> None:
    loop, flags_ = VARIANTS[ctx.best_variant]
    cb = COMMAND_BUFFER_FLAGS[loop]
    part.info.update({"variant": f"{ctx.best_variant} (from {ctx.best_source})", "flags": " ".join(flags_ + cb)})
    errors: list[str] = []
    result = run_worker(ctx, "engine", "command_buffers", {"layer_loop": loop, "pool": "small",
                        "batches": [1], "ladder_batches": list(ctx.plan.batches)}, flags_ + cb,
                        ctx.plan.caps["command_buffers"])
    rows = take(part, result, f"{ctx.best_variant} + command buffers", errors)
    base = ctx.anatomy_rows.get(ctx.best_variant)
    if base:
        part.rows.append({"variant": f"{ctx.best_variant} (part 3)", **base})
        if rows and rows[0].get("device_ms"):
            part.info["device ms: command buffers / part 3"] = round(rows[0]["device_ms"] / base["device_ms"], 3)
    else:
        part.notes.append("part 3 did not run in this call: compare with its batch-1 row by hand")
    if not ctx.on_gpu:
        part.notes.append(CPU_NOTE + " (XLA:CPU ignores the GPU flags.)")
    if errors:
        raise RuntimeError("; ".join(errors))


# ------------------------------------------------------------ 6-7. kernels
def part_attention_sweep(ctx: Probe, part: dc.Part) -> None:
    points = [*ctx.plan.sweep_b32, *ctx.plan.sweep_b1]  # batch 32 first: 3 points, always in the time cap
    errors: list[str] = []
    result = run_worker(ctx, "kernel", "attention_sweep", {"points": points}, [],
                        ctx.plan.caps["attention_sweep"])
    take(part, result, "paged_attention_gpu", errors)
    finish_kernel_rows(ctx, part)
    for batch in sorted({p["batch"] for p in points}):
        timed = [r for r in part.rows if r.get("batch") == batch and r.get("us")]
        if timed:
            best = min(timed, key=lambda r: r["us"])
            part.info[f"best at batch {batch}"] = ", ".join(f"{k}={best[k]}" for k in (
                "num_partitions", "num_stages", "num_warps", "block_k", "us", "GB_s") if k in best)
    part.notes.append(f"Context {ctx.plan.context}, bf16 pool and q; us = wall of {ctx.plan.kernel_programs} "
                      f"programs back to back / their {ctx.plan.kernel_iters} chained calls each, over "
                      f"rotating input sets (median of {ctx.plan.kernel_reps}); GB/s = K/V bytes of the pool "
                      "blocks read / time; unset tuning = the kernel's default.")
    if not ctx.on_gpu:
        part.notes.append(CPU_NOTE + " One point, in interpret mode.")
    if errors:
        raise RuntimeError("; ".join(errors))


def part_quantized_pools(ctx: Probe, part: dc.Part) -> None:
    points = [{"batch": b, "kv_dtype": kv} for b in ctx.plan.quant_batches
              for kv in ("bfloat16", *ctx.plan.quant_dtypes)]
    errors: list[str] = []
    result = run_worker(ctx, "kernel", "quantized_pools", {"points": points}, [],
                        ctx.plan.caps["quantized_pools"])
    take(part, result, "paged_attention_gpu", errors)
    finish_kernel_rows(ctx, part)
    bf16 = {r["batch"]: r["us"] for r in part.rows if r.get("kv_dtype") == "bfloat16" and r.get("us")}
    for r in part.rows:
        if r.get("us") and bf16.get(r.get("batch")):
            r["bf16_us / us"] = round(bf16[r["batch"]] / r["us"], 2)
    part.notes.append(f"Context {ctx.plan.context}, bf16 q, the kernel's default tuning; pools made by the "
                      "pallas_kernels pool helpers (their row layout, whatever it is); bf16_us / us > 1: "
                      "faster than the bf16 pool at that batch. GB/s counts the bytes of the pool blocks "
                      "read (scales included).")
    if not ctx.on_gpu:
        part.notes.append(CPU_NOTE + " int8 only, in interpret mode.")
    if errors:
        raise RuntimeError("; ".join(errors))


def finish_kernel_rows(ctx: Probe, part: dc.Part) -> None:
    for r in part.rows:
        if r.get("GB_s") is not None:
            r["pct_copy"] = pct(r["GB_s"], ctx.copy_gbps)
            r["pct_nominal"] = pct(r["GB_s"], ctx.nominal_gbps)


def kernel_pool(key: Any, batch: int, context: int, n_sets: int, dims: dict[str, int], kv_dtype: str):
    """(pool, block tables [n_sets, B, W], q [n_sets, B, H, D]) drawn on the device;
    quantized pools through the pool helper that owns the page layout
    (pallas_kernels.reference.quantize_pages; quantize_rows before it existed)."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels import reference
    quantize = getattr(reference, "quantize_pages", None) or reference.quantize_rows
    KVH, D, BS = dims["num_kv_heads"], dims["head_dim"], dims["block_size"]
    H, W = KVH * dims["gqa"], -(-context // BS)
    nb = 1 + n_sets * batch * W
    kp, kb, kq = jax.random.split(key, 3)

    @jax.jit
    def make_pool(k):
        x = jax.random.normal(k, (nb, 1, 2, KVH, BS, D), jnp.float32)
        return quantize(x, kv_dtype) if reference.is_quantized(kv_dtype) else x.astype(kv_dtype)

    pool = make_pool(kp)
    tables = (1 + jax.random.permutation(kb, nb - 1)).reshape(n_sets, batch, W).astype(jnp.int32)
    qs = jax.random.normal(kq, (n_sets, batch, H, D), jnp.bfloat16)
    return pool, tables, qs


def kernel_seconds(fn: Callable, args: tuple, programs: int, reps: int) -> float:
    """Seconds per program: `programs` calls of fn back to back, one block at the end
    (the host queues the next program while the device runs one, so its dispatch is
    hidden), median of `reps`."""
    import jax
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(programs)])
        ts.append((time.perf_counter() - t0) / programs)
    return statistics.median(ts)


def chained_calls(tuning: dict[str, int], iters: int, n_sets: int) -> Callable:
    """jit of `iters` attention calls over rotating input sets, each depending on the
    last (an int 0 XLA cannot prove is 0), so none is hoisted or CSE'd."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.gpu import paged_attention_gpu

    def run(qs, pool, tables, kv_lens, cu):
        acc = jnp.zeros((), jnp.float32)
        for i in range(iters):
            s = i % n_sets
            dep = jnp.where(acc == 1.2345e-30, 1, 0).astype(jnp.int32)
            out = paged_attention_gpu(qs[s] + dep.astype(qs.dtype), pool, 0, tables[s] + dep, kv_lens, cu,
                                      **tuning)
            acc = acc + out.reshape(-1)[0].astype(jnp.float32)
        return acc
    return jax.jit(run)


def worker_kernel(spec: dict[str, Any], out: "Results") -> None:
    import jax
    import jax.numpy as jnp
    plan = spec["plan"]
    dims, context, iters = plan["kernel_dims"], plan["context"], plan["kernel_iters"]
    made: dict[tuple, tuple] = {}
    for point in spec["points"]:
        if out.remaining() < 5:
            out.rows.append({**point, "note": "skipped: time cap"})
            continue
        batch, kv_dtype = point["batch"], point.get("kv_dtype", "bfloat16")
        if (batch, kv_dtype) not in made:
            made.clear()  # one pool on the device at a time
            kv_bytes_one_set = batch * context * dims["num_kv_heads"] * dims["head_dim"] * 2 * 2
            n_sets = max(1, min(8, math.ceil(256 * 2**20 / kv_bytes_one_set))) if spec["on_gpu"] else 1
            n_sets = min(n_sets, iters)
            pool, tables, qs = kernel_pool(jax.random.key(batch), batch, context, n_sets, dims, kv_dtype)
            made[(batch, kv_dtype)] = (pool, tables, qs, n_sets)
        pool, tables, qs, n_sets = made[(batch, kv_dtype)]
        tuning = {k: point[k] for k in ("num_partitions", "num_stages", "num_warps", "block_k") if k in point}
        kv_lens = jnp.full((batch,), context, jnp.int32)
        cu = jnp.arange(batch + 1, dtype=jnp.int32)
        row = {**point, "context": context}
        try:
            secs = kernel_seconds(chained_calls(tuning, iters, n_sets), (qs, pool, tables, kv_lens, cu),
                                  plan["kernel_programs"], plan["kernel_reps"]) / iters
        except Exception as e:  # noqa: BLE001 - a tuning the kernel rejects is a row, not the end
            row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            out.add(row)
            continue
        read = pool.nbytes * tables.shape[1] * tables.shape[2] / pool.shape[0]  # the blocks one call reads
        row.update({"kv_MB": round(read / 1e6, 2), "us": round(1e6 * secs, 2),
                    "GB_s": round(read / secs / 1e9, 1)})
        out.add(row)


# ------------------------------------------------------------ 8. MoE
def part_moe_grouped(ctx: Probe, part: dc.Part) -> None:
    errors: list[str] = []
    result = run_worker(ctx, "moe", "moe_grouped", {}, [], ctx.plan.caps["moe_grouped"])
    take(part, result, "moe", errors, info_prefix=False)
    finish_kernel_rows(ctx, part)
    for shape in ctx.plan.moe_shapes:
        timed = [r for r in part.rows if r.get("shape") == shape and r.get("variant") == "ragged_dot" and r.get("us")]
        if timed:
            best = max(timed, key=lambda r: r["GB_s"])
            part.info[f"{shape}: best ragged_dot GB/s (routed experts' bytes)"] = \
                f"{best['GB_s']} at {best['tokens']} tokens ({best['pct_copy']}% of copy)"
        us = {(r["variant"], r["tokens"]): r["us"] for r in part.rows if r.get("shape") == shape and r.get("us")}
        ratios = [f"{t}: {us[('pallas_gmm', t)] / us[('ragged_dot', t)]:.2f}" for t in ctx.plan.moe_tokens
                  if ("pallas_gmm", t) in us and ("ragged_dot", t) in us]
        if ratios:
            part.info[f"{shape}: pallas_gmm us / ragged_dot us, by tokens"] = ", ".join(ratios)
    part.notes.append(f"Per shape, one MoE layer's experts in bf16 (w_gate, w_up [E, d, f], w_down [E, f, d]) "
                      f"and T tokens (bf16) routed by a random router (top-k of a softmax); ragged_dot = "
                      f"jpaged.layers.moe.swiglu_experts on the rows sorted by expert (the three grouped "
                      f"matmuls alone); pallas_gmm = pallas_kernels.grouped_matmul.gmm_swiglu_experts on "
                      f"the same rows (the Pallas grouped matmul: gate and up fused, then down; its row says "
                      f"its max abs difference from ragged_dot's output); moe_mlp = the whole layer (fp32 router, sort, grouped matmuls, "
                      f"combine). us = wall of {ctx.plan.kernel_programs} programs back to back (median of "
                      f"{ctx.plan.kernel_reps}); GB_s = bytes of the experts the tokens were routed to "
                      "(experts_touched x 3 d f x 2 B) / time; GB_s_all = all E experts' bytes / time "
                      "(what a lowering that reads every expert moves).")
    if not ctx.on_gpu:
        part.notes.append(CPU_NOTE + " (XLA:CPU expands ragged_dot into one masked matmul per expert.)")
    if errors:
        raise RuntimeError("; ".join(errors))


def moe_weights(key: Any, shape: tuple[int, int, int, int]) -> dict[str, Any]:
    """One MoE layer's router and experts (bf16, std 0.02), drawn on the device."""
    import jax
    import jax.numpy as jnp
    d, f, E, _ = shape
    draw = jax.jit(lambda key, s: (jax.random.normal(key, s, jnp.float32) * 0.02).astype(jnp.bfloat16),
                   static_argnums=1)
    kr, kg, ku, kd = jax.random.split(key, 4)
    return {"router": draw(kr, (d, E)), "gate": draw(kg, (E, d, f)), "up": draw(ku, (E, d, f)),
            "down": draw(kd, (E, f, d))}


def moe_tokens(key: Any, w: dict[str, Any], top_k: int, tokens: int) -> tuple[Any, Any, Any, int]:
    """T tokens (bf16) and their routing: (x, rows sorted by expert, group sizes, experts touched)."""
    import jax
    import jax.numpy as jnp
    from jpaged.layers.moe import expert_load, route
    d, E = w["router"].shape
    x = (jax.random.normal(key, (tokens, d), jnp.float32)).astype(jnp.bfloat16)
    _, experts = route(x, w["router"], top_k, True)
    group_sizes = expert_load(experts, E)
    xs = x[jnp.argsort(experts.reshape(-1), stable=True) // top_k]
    return x, xs, group_sizes, int(jnp.sum(group_sizes > 0))


def worker_moe(spec: dict[str, Any], out: "Results") -> None:
    import functools
    import jax
    import jax.numpy as jnp
    from jpaged.layers.moe import moe_mlp, swiglu_experts
    from pallas_kernels.grouped_matmul import gmm_swiglu_experts
    plan = spec["plan"]
    grouped, pallas = jax.jit(swiglu_experts), jax.jit(gmm_swiglu_experts)
    for name, shape in plan["moe_shapes"].items():
        d, f, E, k = shape
        expert_bytes = 3 * d * f * 2
        w = moe_weights(jax.random.key(E), tuple(shape))
        layer = jax.jit(functools.partial(moe_mlp, top_k=k, renormalize=True, grouped=swiglu_experts))
        for T in plan["moe_tokens"]:
            if out.remaining() < 5:
                out.rows.append({"shape": name, "tokens": T, "note": "skipped: time cap"})
                continue
            x, xs, group_sizes, touched = moe_tokens(jax.random.key(T), w, k, T)
            experts_args = (xs, w["gate"], w["up"], w["down"], group_sizes)
            for variant, fn, args in (("ragged_dot", grouped, experts_args), ("pallas_gmm", pallas, experts_args),
                                      ("moe_mlp", layer, (x, w["router"], w["gate"], w["up"], w["down"]))):
                row = {"variant": variant, "shape": name, "tokens": T, "experts_touched": f"{touched}/{E}"}
                try:
                    secs = kernel_seconds(fn, args, plan["kernel_programs"], plan["kernel_reps"])
                except Exception as e:  # the Pallas kernel's first GPU compile: keep the other rows
                    out.add({**row, "note": f"failed: {type(e).__name__}: {str(e)[:300]}"})
                    continue
                read = touched * expert_bytes
                row.update({"MB": round(read / 1e6, 1), "us": round(1e6 * secs, 2), "GB_s": round(read / secs / 1e9, 1),
                            "GB_s_all": round(E * expert_bytes / secs / 1e9, 1)})
                if variant == "pallas_gmm":  # its first runs on a GPU: is it right?
                    diff = (fn(*args).astype(jnp.float32) - grouped(*args).astype(jnp.float32))
                    row["max_abs_diff_vs_ragged_dot"] = float(jnp.max(jnp.abs(diff)))
                out.add(row)
        del w  # one layer's experts on the device at a time


# ------------------------------------------------------------------ workers
@dataclasses.dataclass
class Results:
    """A worker's output, saved to its result file after every row."""

    spec: dict[str, Any]
    path: pathlib.Path
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None

    def remaining(self) -> float:
        return self.spec["deadline_s"] - (time.perf_counter() - self.t0)

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        print(f"   {row}", flush=True)
        self.save()

    def save(self) -> None:
        data = {"rows": self.rows, "info": self.info, "notes": self.notes, "error": self.error}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.path)


WORKERS = {"gemm": worker_gemm, "engine": worker_engine, "kernel": worker_kernel, "moe": worker_moe}


def run_worker_main(task: str, spec_path: str, result_path: str) -> int:
    spec = json.loads(pathlib.Path(spec_path).read_text())
    out = Results(spec, pathlib.Path(result_path))
    try:
        WORKERS[task](spec, out)
    except dc.Skip as e:
        out.error = f"skipped: {e}"
    except Exception as e:  # noqa: BLE001 - reported to the parent through the result file
        out.error = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    out.save()
    return 1 if out.error and not out.error.startswith("skipped") else 0


# ------------------------------------------------------------------ report
PART_FNS = {"environment": part_environment, "gemm_chain": part_gemm_chain, "anatomy": part_anatomy,
            "trace": part_trace, "command_buffers": part_command_buffers,
            "attention_sweep": part_attention_sweep, "quantized_pools": part_quantized_pools,
            "moe_grouped": part_moe_grouped}

COLUMNS = ["variant", "shape", "tokens", "experts_touched", "MB", "M", "batch", "kv_dtype", "context", "bucket",
           "bucket_ok", "ms", "median_step_ms", "device_ms", "host_ms", "dispatch_us", "floor_ms", "decode_tok_per_s",
           "us", "GB_s", "GB_s_all", "pct_copy",
           "pct_nominal", "bf16_us / us", "temp_bytes", "alias_bytes", "argument_bytes", "pool_bytes",
           "compile_s", "note"]


def report_lines(parts: list[dc.Part], header: dict[str, Any]) -> list[str]:
    lines = [f"# GPU probe: {header['device']} ({header['date']})", ""]
    lines += [f"- **{k}**: {dc.fmt(v)}" for k, v in header.items() if k not in ("device", "date")]
    lines += ["", "| part | status | seconds | reason / error |", "|---|---|---|---|"]
    lines += [f"| {TITLES[p.name]} | {p.status} | {p.seconds:.1f} | {dc.fmt(p.reason)} |" for p in parts]
    for p in parts:
        lines += ["", f"## {TITLES[p.name]}: {p.status}", ""]
        if p.reason:
            lines += [f"{p.status}: {p.reason}", ""]
        if p.info:
            lines += dc.md_table([{"what": k, "value": v} for k, v in p.info.items()]) + [""]
        if p.rows:
            lines += dc.md_table(p.rows, COLUMNS) + [""]
        lines += [f"_{n}_" if not n.startswith("traceback") else f"`{n}`" for n in p.notes]
    return lines


def bundle_logs(ctx: Probe) -> pathlib.Path:
    """The subprocess logs, specs, results and autotune dumps in one tarball."""
    path = ctx.path("_logs.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for f in sorted(ctx.work.iterdir()):
            if f.is_file() and f.suffix in (".log", ".json", ".txt"):
                tar.add(f, arcname=f.name)
    return path


def write_outputs(ctx: Probe, parts: list[dc.Part], header: dict[str, Any]) -> pathlib.Path:
    md = ctx.path(".md")
    md.write_text("\n".join(report_lines(parts, header)) + "\n")
    data = {"header": header, "parts": [dataclasses.asdict(p) for p in parts]}
    ctx.path(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    files = [md, ctx.path(".json"), *ctx.artifacts, bundle_logs(ctx)]
    out = os.environ.get("OUT")
    if out:  # the device tool brings back at most 8 files
        for f in files[:8]:
            shutil.copy(f, pathlib.Path(out) / f.name)
    return md


# -------------------------------------------------------------------- main
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--out_dir", default=str(REPO / "benchmarks" / "results" / "device"))
    p.add_argument("--budget_s", type=float, default=420.0, help="whole run's deadline (s)")
    p.add_argument("--shape", choices=("auto", "8b", "tiny"), default="auto",
                   help="auto: 8b on a GPU, tiny on a CPU")
    p.add_argument("--best_variant", choices=tuple(VARIANTS), default="unroll",
                   help="variant of parts 4-5 when part 3 does not run")
    p.add_argument("--engine_options", default="", help="jpaged.LLM fields for every engine of parts 3-5, "
                   "comma-separated key=value (JSON values: true, 0.5, ...), e.g. flat_weights=true")
    p.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; of {', '.join(PARTS)}")
    if args.budget_s <= 0:
        p.error(f"--budget_s must be > 0, got {args.budget_s:g}")
    try:
        args.engine_options = engine_options(args.engine_options)
    except ValueError as e:
        p.error(f"--engine_options: {e}")
    return args


def engine_options(text: str) -> dict[str, Any]:
    """"a=1,b=true,c=scan" -> {"a": 1, "b": True, "c": "scan"} (values JSON, else strings)."""
    out: dict[str, Any] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{item!r} is not key=value")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def make_probe(args: argparse.Namespace, t_start: float) -> Probe:
    child_env = dict(os.environ)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the workers get the GPU's memory
    import jax
    on_gpu = jax.default_backend() == "gpu"
    kind = jax.devices()[0].device_kind if jax.default_backend() != "cpu" else "cpu"
    plan = gpu_plan() if on_gpu else cpu_plan()
    if args.shape != "auto":
        plan.shape_name, plan.shape = args.shape, dc.LLAMA3_8B if args.shape == "8b" else dc.LLAMA_TINY
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_probe_{dc.slug(kind)}_{datetime.datetime.now().strftime('%Y%m%d-%H%M')}"
    work = out_dir / f"{stem}_work"
    work.mkdir(exist_ok=True)
    return Probe(out_dir, stem, t_start + args.budget_s, on_gpu, kind, child_env, plan=plan, work=work,
                 engine_options=args.engine_options, best_variant=args.best_variant)


def make_header(ctx: Probe, parts: list[dc.Part], t_start: float) -> dict[str, Any]:
    import harness
    import jax
    header = {"device": ctx.device_kind, "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
              "command": " ".join(sys.argv), "shape": ctx.plan.shape_name,
              "total seconds": round(time.perf_counter() - t_start, 1),
              "failed parts": ", ".join(p.name for p in parts if p.status == "failed") or "none",
              "machine": harness.machine(), "backend": jax.default_backend(), **dc.versions()}
    if not ctx.on_gpu:
        header["note"] = CPU_NOTE
    return header


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker_main(args.worker, args.spec, args.result)
    t_start = time.perf_counter()
    ctx = make_probe(args, t_start)
    print(f"gpu probe on {ctx.device_kind} ({ctx.plan.shape_name} shape): report {ctx.path('.md')}", flush=True)
    parts = [dc.Part(name, "not run" if name in args.parts else "skipped",
                     "" if name in args.parts else "not in --parts") for name in PARTS]
    for i, name in enumerate(PARTS):
        if name in args.parts:
            parts[i] = dc.run_part(name, PART_FNS[name], ctx, TITLES)
            # The report so far, in $OUT too: a call killed at its limit still brings it back.
            write_outputs(ctx, parts, make_header(ctx, parts, t_start))
    md = write_outputs(ctx, parts, make_header(ctx, parts, t_start))
    shutil.rmtree(ctx.work, ignore_errors=True)  # its files are in the logs tarball
    print(f"report: {md}", flush=True)
    return 1 if any(p.status == "failed" for p in parts) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""benchmarks/gpu_probe.py (`make gpu-probe`) end to end in its CPU mode, and
benchmarks/summarize_gpu_trace.py on traces and HLO texts made here.

The probe is what a session runs first on a lent GPU, so CI runs the same code
path with tiny shapes: every part must report ok or say why it was skipped, and
the report must carry each part's rows.  The summarizer runs on the CPU after a
window; it is checked on a synthetic GPU trace and HLO (the classes, the copies
feeding GEMMs) and on HLO that XLA:CPU produced here, so it cannot silently
return nothing.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_probe.py"
PARTS = ("environment", "gemm_chain", "anatomy", "trace", "command_buffers", "attention_sweep",
         "quantized_pools", "moe_grouped")
GEMM_VARIANTS = ("unrolled", "scan", "scan_dsf", "unrolled_no_triton", "merged")
ENGINE_VARIANTS = ("scan", "unroll", "scan_dsf")


@pytest.fixture(scope="module")
def sgt():
    spec = importlib.util.spec_from_file_location("summarize_gpu_trace", REPO / "benchmarks" /
                                                  "summarize_gpu_trace.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["summarize_gpu_trace"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One CPU-mode run: (exit status, output, report .md, report .json, files in $OUT)."""
    out_dir, device_out = tmp_path_factory.mktemp("probe"), tmp_path_factory.mktemp("OUT")
    env = {**os.environ, "OUT": str(device_out)}
    # A budget no loaded CI machine spends: every part runs (its own caps still hold).
    r = subprocess.run([sys.executable, str(SCRIPT), f"--out_dir={out_dir}", "--budget_s=3000"], cwd=REPO,
                       capture_output=True, text=True, timeout=1800, env=env)
    mds = sorted(out_dir.glob("gpu_probe_cpu_*.md"))
    assert mds, f"no report written; output:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    data = json.loads(mds[-1].with_suffix(".json").read_text())
    return r.returncode, r.stdout + r.stderr, mds[-1].read_text(), data, sorted(device_out.iterdir())


def parts_of(data):
    return {p["name"]: p for p in data["parts"]}


def test_every_part_ok_or_skipped_with_a_reason(cpu_run):
    rc, output, _, data, _ = cpu_run
    parts = parts_of(data)
    assert list(parts) == list(PARTS)
    for name, p in parts.items():
        assert p["status"] in ("ok", "skipped"), f"{name}: {p['status']}: {p['reason']}\n{output[-2000:]}"
        if p["status"] == "skipped":
            assert p["reason"], name
    assert rc == 0, output[-2000:]
    assert data["header"]["backend"] == "cpu" and "code path only" in data["header"]["note"]


def test_report_rows(cpu_run):
    _, _, md, data, _ = cpu_run
    parts = parts_of(data)
    for title in ("1. Environment", "2. GEMM chain", "3. Engine anatomy", "4. Profiler trace",
                  "5. XLA command buffers", "6. Attention sweep", "7. Quantized pools", "8. MoE grouped matmuls"):
        assert f"## {title}" in md
    env = parts["environment"]["info"]
    assert any(k.startswith("measured copy bandwidth") for k in env)
    gemm = {r["variant"]: r for r in parts["gemm_chain"]["rows"]}
    assert set(gemm) == set(GEMM_VARIANTS)
    for r in gemm.values():
        assert r["M"] == 8 and r["ms"] > 0 and r["GB_s"] >= 0 and "temp_bytes" in r
    if parts["anatomy"]["status"] == "ok":
        rows = parts["anatomy"]["rows"]
        assert {r["variant"] for r in rows} >= set(ENGINE_VARIANTS)
        for r in rows:
            for field in ("batch", "bucket", "bucket_ok", "median_step_ms", "device_ms", "host_ms",
                          "dispatch_us", "temp_bytes", "alias_bytes", "argument_bytes", "compile_s"):
                assert field in r, (r["variant"], field)
        large = [r for r in rows if "large pool" in r["variant"]]
        assert large and large[0]["pool_bytes"] > max(r["pool_bytes"] for r in rows if r not in large)
        assert parts["anatomy"]["info"]["large pool: alias bytes >= pool bytes"] is True
    if parts["trace"]["status"] == "ok":
        info = parts["trace"]["info"]
        assert info["b1 hlo: computations"] > 0
        assert "none: no device kernel events" in info["b1 trace: kernels"]  # a CPU trace
    if parts["command_buffers"]["status"] == "ok":
        assert any("command buffers" in r["variant"] and r.get("device_ms") for r in parts["command_buffers"]["rows"])
    sweep = parts["attention_sweep"]["rows"]
    assert len(sweep) == 1 and sweep[0]["us"] > 0 and sweep[0]["num_partitions"] == 2
    quant = {r["kv_dtype"]: r for r in parts["quantized_pools"]["rows"]}
    assert set(quant) == {"bfloat16", "int8"}
    assert quant["int8"]["us"] > 0 and quant["int8"]["bf16_us / us"] > 0
    moe = {(r["variant"], r["tokens"]): r for r in parts["moe_grouped"]["rows"]}
    assert set(moe) == {(v, t) for v in ("ragged_dot", "pallas_gmm", "moe_mlp") for t in (1, 4)}
    for r in moe.values():  # the tiny CPU shape: 8 experts, top-2
        touched, experts = map(int, r["experts_touched"].split("/"))
        assert r["shape"] == "tiny" and experts == 8 and 2 <= touched <= min(8, 2 * r["tokens"])
        assert r["us"] > 0 and r["GB_s_all"] >= r["GB_s"] >= 0
    for t in (1, 4):  # the Pallas grouped matmul (interpret mode here) agrees with ragged_dot (bf16)
        assert moe[("pallas_gmm", t)]["max_abs_diff_vs_ragged_dot"] < 0.05
    assert "pallas_gmm us / ragged_dot us, by tokens" in " ".join(parts["moe_grouped"]["info"])


def test_files_for_the_device_tool(cpu_run):
    """$OUT gets the report, its JSON, the traces / HLO and the logs: at most 8 files."""
    _, _, _, data, files = cpu_run
    names = [f.name for f in files]
    assert 3 <= len(names) <= 8, names
    assert any(n.endswith(".md") for n in names) and any(n.endswith(".json") for n in names)
    assert any(n.endswith("_logs.tar.gz") for n in names)
    if parts_of(data)["trace"]["status"] == "ok":
        assert any(n.endswith("_hlo_b1.txt.gz") for n in names) and any(n.endswith("_trace_b1.json.gz")
                                                                         for n in names)
    assert all(f.stat().st_size <= 16 * 2**20 for f in files)


def test_bad_options_are_refused():
    for flag, words in (("--parts=environment,bogus", "unknown ['bogus']"), ("--budget_s=0", "must be > 0"),
                        ("--best_variant=fast", "invalid choice"), ("--engine_options=oops", "'oops' is not key=value")):
        r = subprocess.run([sys.executable, str(SCRIPT), flag], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and words in r.stderr, (flag, r.stderr)


# ------------------------------------------------------------ summarizer
def synthetic_trace(steps: int) -> dict:
    """A GPU trace as jax.profiler writes it: a device process with a stream thread
    and a derived "XLA Ops" line (same kernels again: must not count twice), and a
    host process."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "tid": 1, "name": "thread_name", "args": {"name": "python"}}]
    kernels = [("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 100.0), ("cutlass_80_tensorop_bf16_s16816gemm", 50.0),
               ("jpaged_decode_gpu", 20.0), ("loop_dynamic_slice_fusion", 30.0), ("copy_fusion_3", 10.0),
               ("loop_add_fusion", 15.0), ("some_kernel", 5.0)]
    events, t = list(meta), 0.0
    for _ in range(steps):
        for name, dur in kernels:
            events.append({"ph": "X", "pid": 1, "tid": 7, "ts": t, "dur": dur, "name": name})
            events.append({"ph": "X", "pid": 1, "tid": 8, "ts": t, "dur": dur, "name": name})
            events.append({"ph": "X", "pid": 2, "tid": 1, "ts": t, "dur": dur, "name": "launch " + name})
            t += dur + 10.0  # a 10 µs gap after each kernel
    return {"displayTimeUnit": "ns", "traceEvents": events}


def test_trace_summed_by_class(sgt):
    s = sgt.summarize_trace(synthetic_trace(steps=5), steps=5)
    assert s["kernels"] == 35 and s["kernels per step"] == 7
    assert s["GEMM: ms per step"] == pytest.approx(0.150)
    assert s["GEMM: kernels per step"] == 2
    assert s["attention: ms per step"] == pytest.approx(0.020)
    assert s["copies / dynamic-slice: ms per step"] == pytest.approx(0.040)
    assert s["fusions: ms per step"] == pytest.approx(0.015)
    assert s["other: ms per step"] == pytest.approx(0.005)
    assert s["kernel ms per step"] == pytest.approx(0.230)
    assert s["GEMM: % of kernel time"] == pytest.approx(65.2, abs=0.1)
    # 230 µs busy and 70 µs of gaps a step, less the last gap of the trace
    assert s["device idle in span (%)"] == pytest.approx(100 * (350 - 10) / (5 * 300 - 10), abs=0.1)
    assert s["top kernels (ms per step)"].startswith("nvjet_tst")


def test_trace_without_device_kernels_says_so(sgt):
    trace = synthetic_trace(steps=1)
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("pid") == 2]
    with pytest.raises(sgt.NoKernels, match="processes: /host:CPU"):
        sgt.summarize_trace(trace, steps=1)


GEMM_CONFIG = 'backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0}}'
SYNTHETIC_HLO = f"""HloModule jit_step, is_scheduled=true

%fused_slice (p0: bf16[32,64,64], p1: s32[]) -> bf16[64,64] {{
  %p0 = bf16[32,64,64]{{2,1,0}} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = bf16[1,64,64]{{2,1,0}} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={{1,64,64}}
  ROOT %b = bf16[64,64]{{1,0}} bitcast(%ds)
}}

%dsf_body (q0: bf16[32,64,64], q1: bf16[8,64], q2: s32[]) -> (bf16[8,64], s8[256]) {{
  %q0 = bf16[32,64,64]{{2,1,0}} parameter(0)
  %q1 = bf16[8,64]{{1,0}} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %sl = bf16[1,64,64]{{2,1,0}} dynamic-slice(%q0, %q2, %z, %z), dynamic_slice_sizes={{1,64,64}}
  %bc = bf16[64,64]{{1,0}} bitcast(%sl)
  ROOT %g = (bf16[8,64]{{1,0}}, s8[256]{{0}}) custom-call(%q1, %bc), custom_call_target="__cublas$gemm", {GEMM_CONFIG}
}}

%triton_dot (t0: bf16[8,64], t1: bf16[64,64]) -> bf16[8,64] {{
  %t0 = bf16[8,64]{{1,0}} parameter(0)
  %t1 = bf16[64,64]{{1,0}} parameter(1)
  ROOT %d = bf16[8,64]{{1,0}} dot(%t0, %t1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%body (arg: (s32[], bf16[8,64], bf16[32,64,64])) -> (s32[], bf16[8,64], bf16[32,64,64]) {{
  %arg = (s32[], bf16[8,64]{{1,0}}, bf16[32,64,64]{{2,1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = bf16[8,64]{{1,0}} get-tuple-element(%arg), index=1
  %w = bf16[32,64,64]{{2,1,0}} get-tuple-element(%arg), index=2
  %zero = s32[] constant(0)
  %dyn = bf16[1,64,64]{{2,1,0}} dynamic-slice(%w, %i, %zero, %zero), dynamic_slice_sizes={{1,64,64}}
  %w1 = bf16[64,64]{{1,0}} bitcast(%dyn)
  %gemm1 = (bf16[8,64]{{1,0}}, s8[256]{{0}}) custom-call(%x, %w1), custom_call_target="__cublas$gemm", {GEMM_CONFIG}
  %y = bf16[8,64]{{1,0}} get-tuple-element(%gemm1), index=0
  %w2 = bf16[64,64]{{1,0}} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %gemm2 = bf16[8,64]{{1,0}} fusion(%y, %w2), kind=kCustom, calls=%triton_dot, backend_config={{"fusion_backend_config":{{"kind":"__triton_gemm"}}}}
  %gemm3 = (bf16[8,64]{{1,0}}, s8[256]{{0}}) fusion(%w, %gemm2, %i), kind=kCustom, calls=%dsf_body,
      backend_config={{"fusion_backend_config":{{"kind":"__custom_fusion","custom_fusion_config":{{"name":"dynamic_address_computation"}}}}}}
  %z2 = bf16[8,64]{{1,0}} get-tuple-element(%gemm3), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[8,64]{{1,0}}, bf16[32,64,64]{{2,1,0}}) tuple(%next, %z2, %w)
}}

%cond (c: (s32[], bf16[8,64], bf16[32,64,64])) -> pred[] {{
  %c = (s32[], bf16[8,64]{{1,0}}, bf16[32,64,64]{{2,1,0}}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(32)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}}

ENTRY %main (x: bf16[8,64], w: bf16[32,64,64], head: bf16[64,128]) -> bf16[8,128] {{
  %x = bf16[8,64]{{1,0}} parameter(0)
  %w = bf16[32,64,64]{{2,1,0}} parameter(1)
  %head = bf16[64,128]{{1,0}} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,64]{{1,0}}, bf16[32,64,64]{{2,1,0}}) tuple(%zero, %x, %w)
  %loop = (s32[], bf16[8,64]{{1,0}}, bf16[32,64,64]{{2,1,0}}) while(%init), condition=%cond, body=%body
  %h = bf16[8,64]{{1,0}} get-tuple-element(%loop), index=1
  %hc = bf16[64,128]{{1,0}} copy(%head)
  %lm = (bf16[8,128]{{1,0}}, s8[256]{{0}}) custom-call(%h, %hc), custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}
  ROOT %out = bf16[8,128]{{1,0}} get-tuple-element(%lm), index=0
}}
"""


def test_hlo_copies_feeding_gemms(sgt):
    s = sgt.summarize_hlo(SYNTHETIC_HLO)
    assert s["computations"] == 6
    assert s["GEMMs"] == 4 and s["cuBLAS custom-calls"] == 3 and s["GEMM fusions (Triton / dot)"] == 1
    assert s["GEMMs in while bodies"] == 2            # gemm1, gemm2 (gemm3's cuBLAS call is in dsf_body)
    assert s["GEMMs in dynamic-slice fusions (in place)"] == 1
    # gemm1 <- dynamic-slice (through a bitcast), gemm2 <- a loop fusion rooted at a
    # dynamic-slice, the LM head <- a copy; the slice inside the DSF body is in place.
    assert s["GEMMs fed by a dynamic-slice/copy"] == 3
    assert s["dynamic-slice/copy ops feeding GEMMs"] == 3
    assert s["while loops"] == 1 and s["copy ops"] == 1


def test_hlo_that_xla_made_here(sgt):
    """The parser reads jax's own optimized HLO text.  XLA:CPU runs the scanned layer's
    matmul as a dot fusion whose weight is a separate dynamic-slice fusion: the
    per-layer weight copy the summary exists to count."""
    import jax
    import jax.numpy as jnp

    def scanned(x, w):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    text = jax.jit(scanned).lower(jnp.ones((4, 8)), jnp.ones((3, 8, 8))).compile().as_text()
    s = sgt.summarize_hlo(text)
    assert s["computations"] >= 3 and s["while loops"] == 1
    assert s["GEMMs"] == 1 and s["GEMMs in while bodies"] == 1 and s["GEMMs fed by a dynamic-slice/copy"] == 1
    with pytest.raises(ValueError, match="no HLO computation"):
        sgt.summarize_hlo("not hlo at all")


def test_cli_on_files(sgt, tmp_path, capsys):
    trace = tmp_path / "t_trace_b1.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump(synthetic_trace(steps=5), f)
    hlo = tmp_path / "t_hlo_b1.txt.gz"
    with gzip.open(hlo, "wt") as f:
        f.write(SYNTHETIC_HLO)
    assert sgt.main(["--steps=5", str(trace), str(hlo)]) == 0
    printed = capsys.readouterr().out
    assert "| kernels per step | 7.0 |" in printed and "| GEMMs fed by a dynamic-slice/copy | 3 |" in printed
    empty = tmp_path / "host.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    assert sgt.main([str(empty)]) == 2
    assert "no device kernel events" in capsys.readouterr().out

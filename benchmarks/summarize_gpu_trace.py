"""Sums a GPU profile by kernel class and reads an optimized HLO for weight copies.

Runs on the CPU after a GPU window, on what benchmarks/gpu_probe.py part 4 brought
back (no jax needed):

* a `jax.profiler` trace (`*.json.gz`, Chrome/Perfetto trace events): the kernels
  of the device's stream threads summed by class (GEMM: cuBLAS / Triton / CUTLASS
  GEMMs; attention: jpaged's Pallas kernels; copies / dynamic-slice; fusions;
  other), per step, with the share of the kernel span the device sat idle;
* an optimized HLO text (`*.txt.gz`, `Compiled.as_text()`): GEMMs (cuBLAS
  custom-calls, fusions running a dot: Triton GEMMs on a GPU, dot fusions on
  XLA:CPU, and dots of their own), how many read an operand that a separate
  dynamic-slice / slice / copy materialised (scan's per-layer weight copies), how
  many read it in place inside a dynamic-slice ("address computation") fusion, and
  how many sit in while-loop bodies.

    python benchmarks/summarize_gpu_trace.py --steps=5 gpu_probe_*_trace_b1.json.gz gpu_probe_*_hlo_b1.txt.gz
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import pathlib
import re
import sys
from collections import Counter, defaultdict
from typing import Any

# Kernel classes, first match wins (a name and its HLO op, lower case).
KERNEL_CLASSES = (
    ("attention", re.compile(r"jpaged|paged_attention")),
    ("GEMM", re.compile(r"gemm|cublas|cutlass|xmma|nvjet|matmul|wgmma|splitk|split_k")),
    ("copies / dynamic-slice", re.compile(r"copy|memcpy|memset|slice|dynamic[_-]?update")),
    ("fusions", re.compile(r"fusion|^loop_|^input_|^wrapped_|reduce|concatenate|transpose|convert|"
                           r"broadcast|select|scatter|gather")),
)
CLASS_ORDER = [name for name, _ in KERNEL_CLASSES] + ["other"]
# Threads of a device process that are derived views of the same kernels, not streams.
DERIVED_LINES = re.compile(r"xla (modules|ops)|tensorflow|framework|source|steps|launch stats|trace ?me",
                           re.IGNORECASE)


class NoKernels(ValueError):
    """The trace holds no device kernel events (a CPU trace, or an empty capture)."""


def load_text(path: str | pathlib.Path) -> str:
    path = pathlib.Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return f.read()
    return path.read_text()


def load_trace(path: str | pathlib.Path) -> dict[str, Any]:
    data = json.loads(load_text(path))
    return data if isinstance(data, dict) else {"traceEvents": data}


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, pattern in KERNEL_CLASSES:
        if pattern.search(low):
            return cls
    return "other"


def kernel_events(trace: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The complete ("X") events on the stream threads of device processes, and the
    names of the processes seen (for the error when there are none)."""
    events = trace.get("traceEvents", [])
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    devices = {pid for pid, name in procs.items() if re.search(r"/device:(GPU|TPU)|\bGPU\b", name)}
    streams = {key for key, name in threads.items() if key[0] in devices and name.lower().startswith("stream")}
    with_streams = {pid for pid, _ in streams}

    def on_stream(e: dict[str, Any]) -> bool:
        key = (e.get("pid"), e.get("tid"))
        if key[0] not in devices:
            return False
        if key[0] in with_streams:
            return key in streams
        return not DERIVED_LINES.search(threads.get(key, ""))

    kernels = [e for e in events if e.get("ph") == "X" and "dur" in e and on_stream(e)]
    return kernels, sorted(set(procs.values()))


def busy_us(kernels: list[dict[str, Any]]) -> float:
    """Time at least one kernel ran (the union of their intervals), µs."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels):
        if start > end:
            busy += stop - start
        elif stop > end:
            busy += stop - end
        end = max(end, stop)
    return busy


def summarize_trace(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Kernel time by class, kernels per step and idle share of a trace of `steps`
    steps; NoKernels when it has no device kernel events."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    kernels, procs = kernel_events(trace)
    if not kernels:
        raise NoKernels(f"no device kernel events in the trace (processes: {', '.join(procs) or 'none'})")
    by_class: dict[str, float] = defaultdict(float)
    count: Counter = Counter()
    by_name: dict[str, float] = defaultdict(float)
    for e in kernels:
        text = f"{e.get('name', '')} {e.get('args', {}).get('hlo_op', '')}"
        cls = kernel_class(text)
        by_class[cls] += float(e["dur"])
        count[cls] += 1
        by_name[str(e.get("name", ""))] += float(e["dur"])
    total = sum(by_class.values())
    span = max(float(e["ts"]) + float(e["dur"]) for e in kernels) - min(float(e["ts"]) for e in kernels)
    busy = busy_us(kernels)
    out: dict[str, Any] = {"steps": steps, "kernels": len(kernels),
                           "kernels per step": round(len(kernels) / steps, 1),
                           "kernel ms per step": round(total / steps / 1000, 4),
                           "span ms per step": round(span / steps / 1000, 4),
                           "device idle in span (%)": round(100 * (1 - busy / span), 1) if span else 0.0}
    for cls in CLASS_ORDER:
        out[f"{cls}: ms per step"] = round(by_class[cls] / steps / 1000, 4)
        out[f"{cls}: % of kernel time"] = round(100 * by_class[cls] / total, 1) if total else 0.0
        out[f"{cls}: kernels per step"] = round(count[cls] / steps, 1)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    out["top kernels (ms per step)"] = "; ".join(f"{n[:60]}: {t / steps / 1000:.4f}" for n, t in top)
    return out


# ------------------------------------------------------------------ HLO
@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    operands: list[str]
    line: str


# name = shape opcode(...): the shape opens with "(" (a tuple) or a type, which keeps
# continued attribute lines (backend_config={...) from reading as instructions.
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*((?:\(|[a-z]+\d*\[|token\b|pred\b).*)$")
OPCODE = re.compile(r"(?<![\w.\-%])([a-z][a-z0-9\-]*)\(")
GEMM_TARGET = re.compile(r'custom_call_target="[^"]*(gemm|matmul)[^"]*"', re.IGNORECASE)
MATERIALIZING = ("dynamic-slice", "slice", "copy")
PASS_THROUGH = ("bitcast", "get-tuple-element")
# Ops a fusion may wrap around a slice and still only move it (XLA:CPU converts a
# bf16 weight slice to fp32 in the fusion that copies it out).
RESHAPING = ("bitcast", "convert", "reshape", "transpose")


def parse_hlo(text: str) -> tuple[dict[str, dict[str, Instr]], dict[str, str]]:
    """{computation: {instruction: Instr}} and {computation: its ROOT's name} of an
    HLO module text (one instruction per line, or continued on the next lines)."""
    comps: dict[str, dict[str, Instr]] = {}
    roots: dict[str, str] = {}
    current: str | None = None
    pending: list[str] = []

    def flush() -> None:
        if current is None or not pending:
            return
        line = " ".join(s.strip() for s in pending)
        pending.clear()
        m = INSTR.match(line)
        op = OPCODE.search(m.group(2)) if m else None
        if not m or not op:
            return
        args = m.group(2)[op.end():]
        depth, end = 1, 0
        for end, ch in enumerate(args):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        operands = [tok.split()[-1].lstrip("%") for tok in args[:end].split(",") if tok.strip()]
        comps[current][m.group(1)] = Instr(m.group(1), op.group(1), operands, line)
        if line.lstrip().startswith("ROOT"):
            roots[current] = m.group(1)

    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith(("HloModule", "//")):
            continue
        if stripped == "}" and not open_braces(pending):
            flush()
            current = None
            continue
        if stripped.endswith("{") and not INSTR.match(stripped) and current is None:
            head = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)", stripped)
            current = head.group(1) if head else stripped
            comps[current] = {}
            continue
        if current is None:
            continue
        if INSTR.match(stripped) and pending:
            flush()
        pending.append(stripped)
    flush()
    return comps, roots


def open_braces(lines: list[str]) -> bool:
    """Whether an instruction continued over lines still has a brace open."""
    text = " ".join(lines)
    return text.count("{") > text.count("}")


def gemm_kind(ins: Instr, comp: str, comps: dict[str, dict[str, Instr]], fused: set[str]) -> str | None:
    """What kind of GEMM `ins` is, or None: a cuBLAS(Lt) custom-call, a fusion that runs
    a dot (a Triton GEMM fusion on a GPU, a dot fusion on XLA:CPU), or a dot of its
    own (outside any fusion's body)."""
    if ins.opcode == "custom-call":
        return "cuBLAS custom-calls" if GEMM_TARGET.search(ins.line) else None
    if ins.opcode == "dot":
        return "dot ops" if comp not in fused else None
    if ins.opcode != "fusion":
        return None
    body = comps.get(called(ins, "calls") or "", {})
    return "GEMM fusions" if "triton_gemm" in ins.line or any(i.opcode == "dot" for i in body.values()) else None


def called(ins: Instr, key: str) -> str | None:
    m = re.search(rf"{key}=%?([\w.\-]+)", ins.line)
    return m.group(1) if m else None


def summarize_hlo(text: str) -> dict[str, Any]:
    """GEMMs of an optimized HLO module and the copies that feed them; ValueError
    when the text holds no computation."""
    comps, roots = parse_hlo(text)
    if not comps:
        raise ValueError("no HLO computation found in the text")
    dsf_bodies, while_bodies, fused = set(), set(), set()
    for instrs in comps.values():
        for ins in instrs.values():
            if ins.opcode == "fusion":
                fused.add(called(ins, "calls"))
            if ins.opcode == "fusion" and "kCustom" in ins.line and "address_computation" in ins.line:
                dsf_bodies.add(called(ins, "calls"))
            if ins.opcode == "while":
                while_bodies.add(called(ins, "body"))

    def producer(comp: str, name: str, through: tuple[str, ...] = PASS_THROUGH) -> Instr | None:
        ins = comps[comp].get(name)
        while ins is not None and ins.opcode in through and ins.operands:
            ins = comps[comp].get(ins.operands[0])
        return ins

    def materializes(comp: str, ins: Instr | None) -> bool:
        """A separate op that writes a slice / copy of its input to memory."""
        if ins is None:
            return False
        if ins.opcode in MATERIALIZING:
            return comp not in dsf_bodies
        if ins.opcode == "fusion" and "kCustom" not in ins.line:
            body = called(ins, "calls")
            root = producer(body, roots.get(body, ""), RESHAPING) if body in comps else None
            return root is not None and root.opcode in MATERIALIZING
        return False

    gemms, fed, copies = Counter(), 0, set()
    for comp, instrs in comps.items():
        for ins in instrs.values():
            kind = gemm_kind(ins, comp, comps, fused)
            if kind is None:
                continue
            gemms[kind] += 1
            gemms["in while bodies"] += comp in while_bodies
            gemms["in dynamic-slice fusions"] += comp in dsf_bodies
            sources = [p for p in (producer(comp, o) for o in ins.operands) if materializes(comp, p)]
            fed += bool(sources)
            copies.update((comp, p.name) for p in sources)
    opcodes = Counter(ins.opcode for instrs in comps.values() for ins in instrs.values())
    return {"computations": len(comps),
            "GEMMs": gemms["cuBLAS custom-calls"] + gemms["GEMM fusions"] + gemms["dot ops"],
            "cuBLAS custom-calls": gemms["cuBLAS custom-calls"],
            "GEMM fusions (Triton / dot)": gemms["GEMM fusions"], "dot ops (unfused)": gemms["dot ops"],
            "GEMMs in while bodies": gemms["in while bodies"],
            "GEMMs in dynamic-slice fusions (in place)": gemms["in dynamic-slice fusions"],
            "GEMMs fed by a dynamic-slice/copy": fed,
            "dynamic-slice/copy ops feeding GEMMs": len(copies),
            "while loops": opcodes["while"], "fusions": opcodes["fusion"],
            "dynamic-slice ops": opcodes["dynamic-slice"], "copy ops": opcodes["copy"]}


# ------------------------------------------------------------------ CLI
def summarize_file(path: pathlib.Path, steps: int) -> dict[str, Any]:
    if re.search(r"\.json(\.gz)?$", path.name):
        return summarize_trace(load_trace(path), steps)
    return summarize_hlo(load_text(path))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", type=pathlib.Path, help="traces (*.json[.gz]) and HLO texts")
    p.add_argument("--steps", type=int, default=5, help="steps the trace holds (gpu_probe: 5)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    status = 0
    for path in args.files:
        print(f"\n## {path.name}\n")
        try:
            summary = summarize_file(path, args.steps)
        except (ValueError, OSError) as e:
            print(f"error: {e}")
            status = 2
            continue
        print("| what | value |\n|---|---|")
        for k, v in summary.items():
            print(f"| {k} | {v} |")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

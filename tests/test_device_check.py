"""benchmarks/device_check.py (`make device-check`) in its CPU mode, end to end, plus its pure helpers.

On a CPU the GPU parts must say they were skipped and why, and the tiny dummy
Llama must decode: CI runs the code path a lent GPU will run (~10 s here).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "device_check.py"
TITLES = ("1. Environment", "2. GPU kernel tests", "3. Kernel benchmark", "4. serve_batch on SmolLM2",
          "5. Decode on a dummy Llama")


@pytest.fixture(scope="module")
def device_check():
    """The script as a module (its absl flags are defined, never parsed, here)."""
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One CPU-mode run: (exit status, stdout, report .md text, report .json)."""
    out = tmp_path_factory.mktemp("device")
    r = subprocess.run([sys.executable, str(SCRIPT), f"--out_dir={out}"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    last = r.stdout.rstrip().splitlines()[-1] if r.stdout.strip() else ""
    assert last.startswith("report: "), f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    report = pathlib.Path(last.removeprefix("report: "))
    assert report.parent == out and report.name.startswith("device_check_cpu_") and report.suffix == ".md"
    data = json.loads(report.with_suffix(".json").read_text())
    return r.returncode, r.stdout, report.read_text(), data


def test_cpu_mode_runs_every_part_and_prints_the_report(cpu_run):
    rc, stdout, md, data = cpu_run
    parts = {p["name"]: p for p in data["parts"]}
    assert rc == 0, {n: (p["status"], p["reason"]) for n, p in parts.items()}
    assert stdout.rstrip().splitlines()[-1].startswith("report: ") and stdout.rstrip().endswith(".md")
    for title in TITLES:
        assert title in md
    assert list(parts) == ["environment", "kernel_tests", "kernel_bench", "serve_batch", "dummy_decode"]
    assert parts["environment"]["status"] == parts["kernel_bench"]["status"] == "ok"
    assert parts["dummy_decode"]["status"] == "ok"


def test_gpu_parts_are_skipped_with_a_reason(cpu_run):
    _, _, md, data = cpu_run
    parts = {p["name"]: p for p in data["parts"]}
    for name in ("kernel_tests", "serve_batch"):
        assert parts[name]["status"] == "skipped" and "needs a GPU" in parts[name]["reason"]
        assert parts[name]["reason"].split(" (")[0] in md
    assert "interpret mode" in " ".join(parts["kernel_bench"]["notes"])  # CPU numbers are labelled


def test_tiny_dummy_decode_measures_positive_throughput(cpu_run):
    _, _, md, data = cpu_run
    dummy = next(p for p in data["parts"] if p["name"] == "dummy_decode")
    assert dummy["info"]["model"].startswith("TINY Llama shape") and "TINY Llama shape" in md
    assert [r["batch"] for r in dummy["rows"]] == [1, 4]
    for row in dummy["rows"]:
        assert row["decode_tok_per_s"] > 0 and row["median_step_ms"] > 0 and row["decode_steps_timed"] == 8
        assert "weights_read_ms@nominal" not in row  # no spec-sheet bandwidth for a CPU


def test_compare_tokens_counts_equal_requests_and_where_others_diverge(device_check):
    ours = {0: [5, 6, 7], 1: [5, 6, 9], 2: [1]}
    ref = {0: [5, 6, 7], 1: [5, 6, 8, 4], 3: [2]}
    assert device_check.compare_tokens(ours, ref) == {
        "equal": 1, "total": 4, "first_divergence": {1: 2, 2: 0, 3: 0}}


def test_read_outputs_maps_request_index_to_token_ids(device_check, tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text(json.dumps({"index": 1, "token_ids": [3, 4]}) + "\n"
                    + json.dumps({"index": 0, "token_ids": []}) + "\n")
    assert device_check.read_outputs(path) == {1: [3, 4], 0: []}


@pytest.mark.parametrize("kind, gbps", [("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0),
                                        ("NVIDIA H200", 4800.0), ("NVIDIA H100 SXM5 80GB", 3350.0),
                                        ("NVIDIA GH200 480GB", None), ("NVIDIA H100 NVL", None),
                                        ("NVIDIA A100-SXM4-80GB", None),
                                        ("cpu", None)])
def test_nominal_bandwidth_table(device_check, kind, gbps):
    assert device_check.nominal_gbps(kind) == gbps


def test_pytest_counts_reads_the_summary_line(device_check):
    text = "....F.s\n=== short test summary ===\nFAILED x\n3 failed, 27 passed, 1 skipped, 2 errors in 81.20s\n"
    assert device_check.pytest_counts(text) == {"failed": 3, "passed": 27, "skipped": 1, "error": 2}
    assert device_check.pytest_counts("killed before the summary") == {}


def test_bench_row_adds_nominal_fraction_and_ratio_only_when_measured(device_check):
    row = device_check.bench_row({"batch": "32", "ours_us": "100", "ours_GBps": "1675", "jax_ops_us": "150",
                                  "jax_ops_GBps": "", "note": ""}, 3350.0)
    assert row["ours_pct_nominal"] == 50.0 and row["jax_ops_us / ours_us"] == 1.5
    assert "jax_ops_GBps" not in row and "jax_ops_pct_nominal" not in row and "note" not in row
    assert "ours_pct_nominal" not in device_check.bench_row({"ours_GBps": "10"}, None)

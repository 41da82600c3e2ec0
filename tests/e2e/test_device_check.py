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

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "device_check.py"
ROW_FIELDS = ("batch", "context", "bucket", "buckets_run", "bucket_ok", "decode_steps_timed", "median_step_ms",
              "decode_tok_per_s", "floor_ms", "floor_ms@copy", "step / floor", "device_ms", "host_ms",
              "dispatch_us")
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
                       text=True, timeout=600)  # ~30 s idle; a loaded 2-core CI machine takes several times that
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
        assert set(ROW_FIELDS) <= set(row), set(ROW_FIELDS) - set(row)
        assert row["bucket_ok"] is True and row["buckets_run"] == [row["bucket"]] and "invalid" not in row
        assert row["floor_ms"] is None and row["step / floor"] is None  # no spec-sheet bandwidth for a CPU
        assert row["floor_ms@copy"] > 0 and row["device_ms"] > 0 and row["dispatch_us"] > 0
        assert row["context"] == 16 + 4.5  # prompt 16, then the 8 timed decode steps' K/V 17..24
    assert "bucket_ok" in md and "floor_ms" in md and "device_ms" in md
    assert any("padded" in n for n in dummy["notes"])


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


# ------------------------------------------------- benchmarks/decode_timing.py
@pytest.fixture(scope="module")
def decode_timing():
    spec = importlib.util.spec_from_file_location("decode_timing", REPO / "benchmarks" / "decode_timing.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["decode_timing"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    """One tiny fp32 Llama engine (random weights) the decode-timing tests share:
    step buckets 4, 8, 16, ..., 32 (the smallest bucket 8, as with the GPU's kernels,
    capped by max_num_seqs); a decode of up to 4 sequences is bucket 4."""
    from jpaged import LLM
    directory = tmp_path_factory.mktemp("tiny_llama")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
           "max_position_embeddings": 256, "torch_dtype": "float32"}
    (directory / "config.json").write_text(json.dumps(cfg))
    return LLM(model=str(directory), load_format="dummy", dtype="float32", max_num_seqs=4,
               max_num_batched_tokens=32, max_model_len=64, block_size=16, num_blocks=20,
               enable_prefix_caching=False, min_step_tokens=8)


def greedy_tokens(llm) -> list[list[int]]:
    from jpaged import SamplingParams
    outs = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


def test_measure_decode_times_the_own_bucket_and_leaves_the_engine_usable(decode_timing, tiny_llm):
    before = greedy_tokens(tiny_llm)
    row = decode_timing.measure_decode(tiny_llm, 3, 4, 8, nominal_gbps=100.0, copy_gbps=50.0, device_calls=3)
    assert set(ROW_FIELDS) <= set(row), set(ROW_FIELDS) - set(row)
    assert row["bucket"] == tiny_llm.runner.token_bucket(3) == 4
    assert row["bucket_ok"] is True and row["buckets_run"] == [4] and "invalid" not in row
    assert row["decode_steps_timed"] == 4 and row["context"] == 8 + 2.5  # K/V of 9..12 tokens
    floor = decode_timing.step_bytes(tiny_llm, 3, 10.5) / 100e9 * 1e3
    assert row["floor_ms"] == pytest.approx(floor, rel=1e-3)
    assert row["floor_ms@copy"] == pytest.approx(2 * floor, rel=1e-3)
    assert row["step / floor"] == pytest.approx(row["median_step_ms"] / floor, rel=1e-2)
    assert row["device_ms"] > 0 and row["dispatch_us"] > 0
    assert row["host_ms"] == pytest.approx(row["median_step_ms"] - row["device_ms"], abs=2e-3)
    # The pool the chained calls donated went back to the runner: the engine still decodes, the same tokens.
    assert not tiny_llm.runner.kv_pool.is_deleted() and not tiny_llm.has_unfinished_requests()
    assert greedy_tokens(tiny_llm) == before


def test_a_step_run_padded_into_a_larger_bucket_makes_the_row_invalid(decode_timing, tiny_llm, monkeypatch):
    """The batch's own bucket (4) is never ready and never built: every decode step
    runs padded into a larger ready bucket (the prefill's 16, or 8), as on a device
    whose own bucket is still building in the background."""
    programs, own = tiny_llm.runner._programs, tiny_llm.runner.token_bucket(2)
    is_ready = programs.is_ready
    monkeypatch.setattr(programs, "is_ready", lambda key: key[0] != own and is_ready(key))
    monkeypatch.setattr(programs, "submit", lambda inputs: False)
    row = decode_timing.measure_decode(tiny_llm, 2, 3, 8, nominal_gbps=None, copy_gbps=None, device_calls=2)
    assert row["bucket"] == own == 4 and row["bucket_ok"] is False
    assert row["buckets_run"] and all(b > own for b in row["buckets_run"])
    assert row["invalid"].startswith("ran padded into bucket(s)") and str(row["buckets_run"][0]) in row["invalid"]
    assert row["floor_ms"] is None and row["floor_ms@copy"] is None and row["step / floor"] is None


def test_step_bytes_reads_every_weight_but_an_untied_embedding_plus_the_kv(decode_timing, tiny_llm):
    import dataclasses
    import types

    import jax.numpy as jnp
    from jpaged.runtime.kv_pool import bytes_per_block
    import jax
    embed = tiny_llm.runner.params["embed"][...].nbytes
    total = sum(x.nbytes for x in jax.tree.leaves(tiny_llm.runner.params))
    assert embed == 256 * 64 * 4
    assert decode_timing.step_bytes(tiny_llm, 0, 0) == total - embed  # untied: gathered, not read
    # K/V: 2 layers x (K, V) x 2 heads x head_dim 16 x 4 bytes per token (fp32 pool), per sequence.
    assert decode_timing.step_bytes(tiny_llm, 3, 10) - (total - embed) == 3 * 10 * 2 * 2 * 2 * 16 * 4
    cfg = tiny_llm.model_config

    def engine(tied: bool, kv_dtype) -> types.SimpleNamespace:
        return types.SimpleNamespace(model_config=dataclasses.replace(cfg, tie_word_embeddings=tied),
                                     runner=tiny_llm.runner, kv_layout=tiny_llm.kv_layout,
                                     config=tiny_llm.config, block_bytes=bytes_per_block(cfg, 16, kv_dtype))
    assert decode_timing.step_bytes(engine(True, jnp.float32), 0, 0) == total  # tied: the LM head reads it
    # An int8 pool's pages carry a row of scale codes: head_dim * (1 + 1 / block_size) bytes per
    # token, head, layer, K or V (17 at head_dim 16, block 16).
    assert decode_timing.step_bytes(engine(False, jnp.int8), 2, 5) - (total - embed) == 2 * 5 * 2 * 2 * 2 * 17

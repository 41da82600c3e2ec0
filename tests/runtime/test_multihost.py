"""Multi-host: scripts/serve_batch.py as 2 processes x 2 CPU devices over loopback
(JAX's distributed runtime, gloo collectives), the tiny Llama at TP = 4 across
both: process 0 schedules and writes, process 1 follows; the tokens must equal
one device's.  Every wait is bounded, so a hang fails the test."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from helpers import TINY_ENGINE, config_flags, free_port
from jpaged.engine.llm import LLM
from jpaged.core.sequence import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = ["hello there", "paged attention splits the cache into blocks", "a", "four devices, two hosts"]
MAX_TOKENS = 12



def test_two_processes_tp4_match_one_device(tiny_llama_tok_dir, tmp_path):
    model = tiny_llama_tok_dir
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True}) + "\n"
                               for p in PROMPTS))
    engine = {**TINY_ENGINE, "model": str(model)}
    overrides = config_flags(engine) + ["--config.tensor_parallel_size=4"]
    port = free_port()
    procs = []
    for pid in range(2):
        cmd = [sys.executable, "scripts/serve_batch.py", "--config", "configs/smollm2_135m.py", *overrides,
               "--prompts", str(prompts), "--output", str(tmp_path / f"out{pid}.jsonl"),
               "--num_processes=2", f"--process_id={pid}", f"--coordinator_address=127.0.0.1:{port}"]
        env = {**os.environ, "JAX_NUM_CPU_DEVICES": "2", "JAX_PLATFORMS": "cpu"}
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    lead, follower = results
    assert "memory on cpu:0" in lead[0] and "memory on cpu:2048" not in lead[0]  # process 0's own devices
    # Only process 0 prints and writes (gloo's own connection lines aside: "[Gloo] Rank 1 is
    # connected to 3 peer ranks. ...", which its C++ stdout sometimes splits over two lines).
    assert "requests (errors)" in lead[0]
    assert [line for line in follower[0].splitlines()
            if not line.startswith("[Gloo]") and "peer ranks" not in line and line.strip()] == []
    assert not (tmp_path / "out1.jsonl").exists()
    records = sorted((json.loads(line) for line in (tmp_path / "out0.jsonl").read_text().splitlines()),
                     key=lambda r: r["index"])
    llm = LLM(**engine)
    want = llm.generate([{"prompt": p} for p in PROMPTS], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [r["token_ids"] for r in records] == [o.token_ids for o in want]


def test_initialize_needs_a_coordinator_for_several_processes():
    from jpaged.runtime.distributed import initialize
    assert initialize(None, 1, 0) is False  # one process: nothing to join
    with pytest.raises(ValueError, match="coordinator address"):
        initialize(None, 2, 0)

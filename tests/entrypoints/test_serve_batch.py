"""scripts/serve_batch.py end to end, and the runtime's independence from torch, transformers,
matplotlib and the benchmark harness."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from helpers import SMOLLM_ENGINE, SMOLLM_FLAGS, cached_compiles_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
REQUESTS = [
    {"prompt": "What is 2 + 2?"},
    {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a color."}],
     "max_tokens": 4, "seed": 5, "temperature": 0.7},
    {"prompt": "Name one fruit.\x1b[31m", "max_tokens": 6, "temprature": 0.3},  # escape, misspelt field
    {"prompt": "Write three short sentences about the sea.", "max_tokens": 48, "stop": ["."]},
]
# The prompts file: a BOM, the requests above, bad lines between them and a blank line.
LINES = [b"\xef\xbb\xbf" + json.dumps(REQUESTS[0]).encode(), b"{not json", json.dumps(REQUESTS[1]).encode(),
         b"[1, 2]", json.dumps({"prompt": "\x1b[2J", "temperature": "hot"}).encode(), b"", b'{"prompt": "caf\xe9"}',
         json.dumps(REQUESTS[2]).encode(), json.dumps(REQUESTS[3]).encode()]
GOOD_LINES = {0: 0, 2: 1, 7: 2, 8: 3}  # line index -> REQUESTS index
BAD_LINES = {1: "not valid JSON", 3: "JSON object", 4: "temperature", 6: "UTF-8"}
FIELDS = {"index", "prompt", "text", "token_ids", "prompt_token_ids", "finish_reason", "error", "ttft_ms",
          "latency_ms"}
# The shapes of the suite's SmolLM2 engine (helpers.SMOLLM_ENGINE): the CLI's step
# programs come from the suite's compilation cache instead of compiling a second set.
SMALL = ["--config.max_tokens=8", *SMOLLM_FLAGS]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    prompts, output = tmp / "prompts.jsonl", tmp / "out.jsonl"
    prompts.write_bytes(b"\n".join(LINES) + b"\n")
    # -X importtime lists every module the script imports (on stderr).  Prompt lookup
    # drafts: the tests compare the answers with the library's, which does not.
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "scripts/serve_batch.py", "--config", "configs/smollm2_135m.py",
         *SMALL, "--config.speculative_method=ngram", f"--prompts={prompts}", f"--output={output}"],
        cwd=ROOT, capture_output=True, text=True, timeout=400, env=cached_compiles_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    by_index = {r["index"]: r for r in records}
    assert len(by_index) == len(records)  # one line per request
    return proc, [by_index[i] for i in sorted(GOOD_LINES)], by_index


def test_every_line_gets_one_result_and_bad_lines_name_their_problem(served):
    _, _, by_index = served
    assert sorted(by_index) == sorted([*GOOD_LINES, *BAD_LINES])  # the blank line 5 is no request
    for i, words in BAD_LINES.items():
        rec = by_index[i]
        assert rec["finish_reason"] == "error" and rec["token_ids"] == []
        assert rec["error"].startswith(f"line {i + 1}: ") and words in rec["error"], rec["error"]


def test_unknown_field_warns_and_escapes_reach_the_terminal_escaped(served):
    proc, _, by_index = served
    assert "'temprature'" in proc.stderr and "did you mean 'temperature'" in proc.stderr
    assert "\x1b" not in proc.stdout
    assert not [ln for ln in proc.stderr.splitlines() if ln.startswith(("warning", "error")) and "\x1b" in ln]
    assert "Name one fruit.\\x1b[31m" in proc.stdout
    assert any("'temprature'" in w for w in by_index[7]["warnings"]) and by_index[0]["warnings"] == []


def test_output_jsonl_fields(served):
    _, lines, _ = served
    assert len(lines) == len(REQUESTS)
    limits = [8, 4, 6, 48]  # config default, then per-request max_tokens
    for rec, limit in zip(lines, limits):
        assert FIELDS <= set(rec), FIELDS - set(rec)
        assert rec["error"] is None and rec["finish_reason"] in ("stop", "length")
        assert 1 <= len(rec["token_ids"]) <= limit
        if rec["finish_reason"] == "length":
            assert len(rec["token_ids"]) == limit
        assert isinstance(rec["text"], str) and rec["text"].strip()
        assert rec["prompt_token_ids"] and all(isinstance(t, int) for t in rec["prompt_token_ids"])
        assert "<|im_start|>" in rec["prompt"]  # rendered with the chat template
        assert 0 < rec["ttft_ms"] <= rec["latency_ms"]
    assert "Be terse." in lines[1]["prompt"]  # the messages request kept its system turn


HEAVY = ("torch", "transformers", "matplotlib")  # the benchmarks' peers and plots, never the runtime's
# The library in a process of its own: LLM.generate's answers to [request, max_tokens] pairs
# (printed as JSON), a plain prompt and a token-id prompt run end to end, and then every
# module the process imported of HEAVY or the benchmark harness.
LIBRARY = f"""
import json, sys
from jpaged.engine.llm import LLM
from jpaged.core.sequence import SamplingParams
engine, requests = json.loads(sys.argv[1])
llm = LLM(**engine)
answers = [llm.generate([request], SamplingParams(max_tokens=n))[0] for request, n in requests]
print('ANSWERS', json.dumps([dict(prompt_token_ids=[int(t) for t in o.prompt_token_ids],
                                  token_ids=[int(t) for t in o.token_ids], text=o.text) for o in answers]))
out = llm.generate([{{'prompt': 'Hi'}}, [1, 2, 3]], SamplingParams(max_tokens=3))
assert all(o.token_ids and o.error is None for o in out), out
print('HEAVY_MODULES', sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}
                              or m in ('harness', 'jpaged.bench')))
"""


@pytest.fixture(scope="module")
def library(served):
    """(the process, its answers): LLM.generate on the suite's SmolLM2 engine
    (helpers.SMOLLM_ENGINE) for REQUESTS[0] (8 tokens) and for REQUESTS[3]'s prompt
    as far as one token past the served answer (the first period's token is the
    served answer's last or the next one), in one process: one engine compiles."""
    _, lines, _ = served
    requests = [[REQUESTS[0], 8], [{"prompt": REQUESTS[3]["prompt"]}, len(lines[3]["token_ids"]) + 1]]
    proc = subprocess.run([sys.executable, "-c", LIBRARY, json.dumps([SMOLLM_ENGINE, requests])], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=cached_compiles_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    [answers] = [json.loads(ln.removeprefix("ANSWERS ")) for ln in proc.stdout.splitlines()
                 if ln.startswith("ANSWERS ")]
    return proc, answers


def test_served_tokens_match_the_library(served, library):
    """The script's greedy answer equals LLM.generate's on the same chat prompt."""
    _, lines, _ = served
    out = library[1][0]
    assert out["prompt_token_ids"] == lines[0]["prompt_token_ids"]
    assert out["token_ids"] == lines[0]["token_ids"] and out["text"] == lines[0]["text"]


def test_a_stop_string_ends_the_answer_at_the_first_period(served, library):
    """The batch file's "stop" field cuts the text where the library's answer has
    its first period (tests/entrypoints/test_server.py checks the same request over HTTP)."""
    _, lines, _ = served
    assert len(lines[3]["token_ids"]) < REQUESTS[3]["max_tokens"]
    whole = library[1][1]
    assert "." in whole["text"]
    assert lines[3]["finish_reason"] == "stop"
    assert lines[3]["text"] == whole["text"][:whole["text"].index(".")]
    assert lines[3]["token_ids"] == whole["token_ids"][:len(lines[3]["token_ids"])]


def test_summary_table_printed(served):
    proc, _, _ = served
    out = proc.stdout
    for row in ("requests (errors)", "output tokens", "wall time", "TTFT mean / p50 / p99",
                "peak KV blocks in use", "compilations", "speculative decoding (ngram)"):
        assert row in out, f"summary row {row!r} missing"
    assert re.search(r"requests \(errors\)\s+8 \(4\)", out)
    assert "KV pool: 96 blocks x 16 tokens" in out


def test_serve_never_imports_torch(served):
    proc, _, _ = served
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "jpaged.engine.llm" in imported  # importtime really listed the imports
    assert not {m for m in imported if m.split(".")[0] in HEAVY or m in ("harness", "jpaged.bench")}


def test_runtime_never_imports_torch(library):
    """The engine, run end to end (`library`'s process), imports none of torch, transformers
    or matplotlib, and no benchmark harness: that lives in benchmarks/harness.py, outside the package."""
    proc, _ = library
    assert "HEAVY_MODULES []" in proc.stdout, proc.stdout


def test_benchmark_harness_is_not_in_the_package():
    import jpaged

    package = pathlib.Path(jpaged.__file__).parent
    assert not (package / "bench.py").exists()
    assert (ROOT / "benchmarks" / "harness.py").exists()
    assert not list((ROOT / "scripts").glob("bench_*.py"))

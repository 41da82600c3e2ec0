"""`jpaged batch`, nothing lost (issue 22): a line that cannot be printed is that
line's problem alone, a full disk on --output is one line saying what was
written, and files that are not regular are refused before anything loads.

The engine runs in this process (batch.run, on the tiny Llama with a byte-level
tokenizer); only the file checks, which run before jax loads, use the CLI."""

from __future__ import annotations

import errno
import io
import json
import os
import sys

import pytest

from helpers import TINY_ENGINE
from jpaged.entrypoints import batch

from test_serve_batch_failures import assert_one_line_error, run as run_cli


@pytest.fixture
def config(tiny_llama_tok_dir):
    # The suite's tiny engine (helpers.TINY_ENGINE): its step programs come from the
    # suite's compilation cache rather than compiling a set of their own.
    return dict(model=tiny_llama_tok_dir, **TINY_ENGINE, max_tokens=3, compilation_cache=False)


@pytest.fixture(autouse=True)
def _signal_handlers_kept(keep_signal_handlers):
    """Every test here runs batch.run."""


def test_a_line_that_cannot_be_printed_is_that_lines_problem(config, tmp_path, monkeypatch, capfd):
    prompts, output = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text('{"prompt": "\\ud800 hi"}\n{"prompt": "Hello"}\n')  # a JSON escape: a lone surrogate
    terminal = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")  # like a UTF-8 terminal
    monkeypatch.setattr(sys, "stdout", terminal)
    status = batch.run(config, batch.Args(prompts=str(prompts), output=str(output)))
    terminal.flush()
    echoed = terminal.buffer.getvalue().decode("utf-8")
    assert status == 0
    results = sorted((json.loads(line) for line in output.read_text().splitlines()), key=lambda r: r["index"])
    assert [r["index"] for r in results] == [0, 1]
    assert results[0]["finish_reason"] == "error"
    assert results[0]["error"] == "prompt is not valid Unicode (lone surrogate '\\ud800' at character 0)"
    assert results[1]["error"] is None and len(results[1]["token_ids"]) == 3
    assert "--- line 1 [error" in echoed and "\\ud800" in echoed and "--- line 2 [length" in echoed


def test_a_full_disk_is_one_line_with_what_was_written(config, tmp_path, monkeypatch, capsys):
    prompts, output = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Count to {i}"}) + "\n" for i in range(4)))
    real_write = batch.write_result
    calls = []

    def write_until_full(f, record):
        calls.append(record["index"])
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(f, record)
    monkeypatch.setattr(batch, "write_result", write_until_full)
    status = batch.run(config, batch.Args(prompts=str(prompts), output=str(output)))
    err = capsys.readouterr().err
    assert status == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: --output: cannot write {output}: No space left on device; 1 result of this run")
    assert "--resume" in last and "Traceback" not in err
    assert len(output.read_text().splitlines()) == 1  # the one written is whole


def test_files_that_are_not_regular_are_refused_before_loading(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for args, prefix in [((f"--prompts={fifo}",), "--prompts: "),  # would block the open
                         (("--prompts=/dev/zero",), "--prompts: /dev/zero is a device"),  # never ends
                         (("--prompts=/proc/version",), "--prompts: /proc/version is a file of the kernel's proc"),
                         ((f"--output={fifo}",), "--output: "),
                         (("--output=/dev/null",), "--output: /dev/null is a device"),
                         ((f"--output={tmp_path}",), "--output: "),
                         (("--summary_json=/proc/version",), "--summary_json: ")]:
        proc = run_cli(*args, timeout=60)
        assert_one_line_error(proc, prefix)
        assert "a regular file is needed" in proc.stderr

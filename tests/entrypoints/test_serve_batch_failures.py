"""serve_batch.py under failure: bad settings fail fast in one line, before
anything loads; results survive a kill and --resume finishes the rest."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time

from helpers import SMOLLM_STEP_XLA, cached_compiles_env, config_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
CMD = [sys.executable, "scripts/serve_batch.py", "--config", "configs/smollm2_135m.py",
       "--config.max_model_len=256", "--config.num_blocks=48", "--config.attention_impl=auto",
       "--config.buckets_per_octave=1", *config_flags(SMOLLM_STEP_XLA)]


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CMD, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, prefix: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {prefix}"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "loaded in" not in proc.stdout  # rejected before the model loaded


def test_bad_config_field_fails_fast_in_one_line():
    assert_one_line_error(run("--config.block_size=0"), "block_size: ")


def test_output_equal_to_prompts_is_refused(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert_one_line_error(run(f"--prompts={prompts}", f"--output={prompts}"), "--output: ")
    assert prompts.read_text() == '{"prompt": "hi"}\n'


def test_unwritable_output_fails_before_loading(tmp_path):
    assert_one_line_error(run(f"--output={tmp_path / 'no-such-dir' / 'out.jsonl'}"), "--output: ")


def test_missing_prompts_file_fails_before_loading_and_keeps_the_output(tmp_path):
    earlier = tmp_path / "out.jsonl"
    earlier.write_text('{"index": 0}\n')
    assert_one_line_error(run(f"--prompts={tmp_path / 'nope.jsonl'}", f"--output={earlier}"), "--prompts: ")
    assert earlier.read_text() == '{"index": 0}\n'  # an earlier run's results are not truncated


def read_results(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_killed_batch_keeps_finished_lines_and_resume_completes_it(tmp_path):
    n = 6
    prompts, output = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Count from 1 to {10 + i}.", "max_tokens": 8 + 2 * i,
                                           "ignore_eos": True}) + "\n" for i in range(n)))
    args = [*CMD, "--config.max_num_seqs=2", f"--prompts={prompts}", f"--output={output}"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cached_compiles_env())
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if output.exists() and output.read_text().count("\n") >= 2:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "interrupted by SIGTERM" in stderr and "--resume" in stderr
    first = read_results(output)
    assert 2 <= len(first) < n
    assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == 8 + 2 * r["index"] for r in first)

    kept = output.read_text()
    with open(output, "a") as f:
        f.write('{"index": 5, "text": "torn by a ki')  # a line cut off mid-write
    resumed = subprocess.run([*args, "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=cached_compiles_env())
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"{len(first)} of {n} requests already in" in resumed.stdout
    assert output.read_text().startswith(kept)  # what finished before is untouched
    final = read_results(output)
    assert sorted(r["index"] for r in final) == list(range(n))
    assert all(len(r["token_ids"]) == 8 + 2 * r["index"] for r in final)


def test_command_line_mistakes_are_one_line_errors():
    assert_one_line_error(run("--config.blok_size=3"), "blok_size: unknown field; did you mean block_size?")
    assert_one_line_error(run("--config.block_size=abc"), "flag --config.block_size=abc")
    assert_one_line_error(run("--config=configs/no_such_config.py"), "--config: cannot load")


# ------------------------------------------------------------ the jpaged command
def jpaged(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """`jpaged ...` as `pip install` makes it (the console script's function)."""
    return subprocess.run([sys.executable, "-c", "from jpaged.entrypoints.main import main; main()", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_jpaged_command_runs_anywhere_with_the_package_default_config(tmp_path):
    """Outside the repository (no configs/ there), `jpaged batch` and `jpaged serve` load
    their default config from the package and check it before anything loads."""
    for command in ("batch", "serve"):
        proc = jpaged(command, "--config.block_size=0", cwd=tmp_path)
        assert_one_line_error(proc, "block_size: 0 is not allowed")
    proc = jpaged("batch", "--help", cwd=tmp_path)
    assert "--prompts" in proc.stdout and "--config" in proc.stdout  # (absl exits 1 after --help)
    assert jpaged("serve", "--help", cwd=tmp_path).stdout.count("--port") == 1
    assert "usage: jpaged <command>" in jpaged(cwd=tmp_path).stdout
    proc = jpaged("frobnicate", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown command 'frobnicate'" in proc.stderr


def test_default_config_is_configs_smollm2_and_the_demo_prompts_ship_in_the_package():
    import importlib.util

    from jpaged.entrypoints import batch, cli, cli_config
    spec = importlib.util.spec_from_file_location("smollm2_config", ROOT / "configs" / "smollm2_135m.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.get_config().to_dict() == cli_config.get_config().to_dict()
    assert pathlib.Path(cli.CONFIG_DEFAULT).resolve() == pathlib.Path(cli_config.__file__).resolve()
    assert len(batch.demo_prompts()) == 8


def test_max_new_tokens_still_works_with_a_deprecation_warning():
    proc = run("--config.max_new_tokens=0")
    assert_one_line_error(proc, "max_tokens: 0 is not allowed")
    assert "warning: --config.max_new_tokens is deprecated: use --config.max_tokens" in proc.stderr

"""Every documented start-up configuration, started as a user starts it: `jpaged
serve` and `jpaged batch` subprocesses with data parallelism, tensor parallelism
(simulated CPU devices), LoRA adapters, an int8 KV pool and (serve) the RL
routes, each asked one request whose answer is checked against the library's.

One row per configuration, on the tiny Llama with a byte-level tokenizer and the
suite's tiny engine shapes (helpers.TINY_ENGINE: the step programs come from the
suite's compilation cache).  Speculative decoding (speculative_method=ngram) is
started this way in tests/entrypoints/test_server.py (scripts/serve.py) and
tests/entrypoints/test_serve_batch.py (scripts/serve_batch.py), the same main() as `jpaged
serve` / `jpaged batch`; `jpaged batch` over two processes (tensor_parallel_size=4) in
tests/runtime/test_multihost.py.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from helpers import TINY_ENGINE, cached_compiles_env, config_flags, free_port, make_peft_adapter
from jpaged.core.sequence import SamplingParams

START_SECONDS = 240  # a cold start (jax, the model, the first step's compile) on a loaded 2-core machine
MAX_TOKENS = 4
PROMPT = "Name a color."
ADAPTER = "a"


@dataclasses.dataclass(frozen=True)
class Start:
    command: str               # serve | batch
    flags: tuple[str, ...]     # besides the tiny engine's --config fields
    lora: str | None = None    # the request names this adapter
    int8: bool = False         # the answer to compare with is the library's on an int8 pool
    rl_routes: bool = False    # serve: the RL routes answer too


CONFIGS = {
    "data parallel": ("--config.data_parallel_size=2",),
    "tensor parallel": ("--config.tensor_parallel_size=2",),
    "lora": ("--config.lora_modules={lora_modules}",),
    "int8 kv": ("--config.kv_cache_dtype=int8",),
}
STARTS = {f"{command}, {name}": Start(command, flags, lora=ADAPTER if name == "lora" else None,
                                      int8=name == "int8 kv")
          for command in ("serve", "batch") for name, flags in CONFIGS.items()}
# The RL routes start with the int8 pool: one server for both (the routes leave the engine's
# config alone), one start fewer.
STARTS["serve, int8 kv, rl routes"] = dataclasses.replace(
    STARTS.pop("serve, int8 kv"), flags=(*CONFIGS["int8 kv"], "--enable_rl_routes"), rl_routes=True)
# docs/batch.md's example (static batching) and docs/speculative-decoding.md's draft model (the
# tiny Llama drafts for itself): the same greedy tokens as the library's default engine.
STARTS["batch, static scheduler"] = Start("batch", ("--config.scheduler=static", "--config.block_size=32",
                                                    "--config.max_num_seqs=4"))
STARTS["batch, draft model"] = Start("batch", ("--config.speculative_method=draft",
                                               "--config.speculative_model={model}"))


def jpaged_command(command: str) -> list[str]:
    """`jpaged <command>` as `pip install` makes it (the console script's function)."""
    return [sys.executable, "-c", "from jpaged.entrypoints.main import main; main()", command]


def engine_flags(model: str) -> list[str]:
    """The tiny engine as --config fields (tiny lengths, a small pool, few step programs)."""
    return config_flags({**TINY_ENGINE, "model": model, "max_tokens": MAX_TOKENS})


def environment() -> dict[str, str]:
    # Simulated CPU devices, as many as the suite's own process has (conftest.py): the
    # compilation cache's programs fit these processes too.
    return {**cached_compiles_env(), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"}


@pytest.fixture(scope="module")
def setup(tiny_llama, tiny_llama_tok_dir, tmp_path_factory):
    """(the tiny model directory, its adapter's directory, the library's greedy
    answers {(command, lora, int8): RequestOutput}) for comparing with the commands'."""
    pytest.importorskip("peft")
    from jpaged.engine.llm import LLM
    adapter = tmp_path_factory.mktemp("startup-lora") / ADAPTER
    make_peft_adapter(tiny_llama[1], adapter, seed=0, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    llm = LLM(**{**TINY_ENGINE, "model": tiny_llama_tok_dir, "max_loras": 2})
    llm.load_lora_adapter(ADAPTER, str(adapter))
    int8 = LLM(**{**TINY_ENGINE, "model": tiny_llama_tok_dir, "kv_cache_dtype": "int8"})
    answers = {}
    for engine, lora in ((llm, None), (llm, ADAPTER), (int8, None)):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, lora=lora)
        # serve: a /v1/completions prompt is plain text; batch: a "prompt" line is a chat message
        answers["serve", lora, engine is int8] = engine.generate([PROMPT], params)[0]
        answers["batch", lora, engine is int8] = engine.generate([{"prompt": PROMPT}], params)[0]
    assert answers["serve", None, False].token_ids != answers["serve", ADAPTER, False].token_ids  # it matters
    return tiny_llama_tok_dir, str(adapter), answers


def http(method: str, url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def serve(start: Start, flags: list[str], tmp: pathlib.Path) -> tuple[str, str, int]:
    """Starts `jpaged serve`, sends one completion (and with the RL routes, a prefix-cache
    reset), stops it with SIGTERM; returns (finish reason, text, completion tokens)."""
    port, log = free_port(), tmp / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen([*jpaged_command("serve"), "--port", str(port), "--noaccess_log",
                                 "--served_model_name=tiny", *flags],
                                cwd=tmp, env=environment(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            assert proc.poll() is None, f"jpaged serve exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready in {START_SECONDS} s:\n{log.read_text()[-3000:]}"
            try:
                if http("GET", url + "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass  # not listening yet
            time.sleep(0.3)
        status, text = http("POST", url + "/v1/completions",
                            {"model": start.lora or "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                             "temperature": 0, "ignore_eos": True})
        assert status == 200, text
        answer = json.loads(text)
        choice = answer["choices"][0]
        if start.rl_routes:
            status, text = http("POST", url + "/reset_prefix_cache")  # the engine is idle again
            assert status == 200, text
            assert json.loads(http("GET", url + "/is_paused")[1]) == {"is_paused": False}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        return choice["finish_reason"], choice["text"], answer["usage"]["completion_tokens"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def batch(start: Start, flags: list[str], tmp: pathlib.Path) -> tuple[str, list[int]]:
    """Runs `jpaged batch` on a one-line prompts file; returns (finish reason, token ids)."""
    prompts, output = tmp / "prompts.jsonl", tmp / "out.jsonl"
    line = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, **({"model": start.lora} if start.lora else {})}
    prompts.write_text(json.dumps(line) + "\n")
    proc = subprocess.run([*jpaged_command("batch"), f"--prompts={prompts}", f"--output={output}", *flags],
                          cwd=tmp, env=environment(), capture_output=True, text=True, timeout=START_SECONDS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [record] = [json.loads(r) for r in output.read_text().splitlines()]
    assert record["error"] is None, record
    return record["finish_reason"], record["token_ids"]


@pytest.mark.parametrize("name", list(STARTS))
def test_start_and_answer(name, setup, tmp_path):
    model, adapter, answers = setup
    start = STARTS[name]
    flags = engine_flags(model) + [f.format(lora_modules=f"{ADAPTER}={adapter}", model=model) for f in start.flags]
    want = answers[start.command, start.lora, start.int8]
    if start.command == "serve":
        assert serve(start, flags, tmp_path) == ("length", want.text, MAX_TOKENS)
    else:
        assert batch(start, flags, tmp_path) == ("length", want.token_ids)

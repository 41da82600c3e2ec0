"""Prefix caching on vs off, side by side, on the embedded model.

    python benchmarks/bench_prefix_cache.py [--num_questions=64 ...]   (defaults sized for a 2-core CPU)

Workloads (token-id prompts, greedy, ignore_eos so every request generates
--max_tokens tokens):
  shared_prefix  one ~system_tokens system prompt + num_questions short questions,
                 all submitted at once
  multi_turn     num_chats conversations of num_turns turns; turn t+1's prompt is
                 turn t's prompt + answer + a new user message (one generate per turn)
  no_reuse       num_unique distinct prompts of unique_tokens tokens: nothing to reuse,
                 so the difference is the cache's bookkeeping overhead

One engine serves every run (prefix caching toggled, cache reset between runs),
so both modes share the compiled steps; each (workload, mode) runs once untimed
to compile, then --repeats timed runs (the best is reported).  Writes
benchmarks/results/prefix_cache.{csv,md,png}.
"""

from __future__ import annotations

import csv
import pathlib
import time

import numpy as np
from absl import app, flags

from jpaged.engine.llm import LLM
from jpaged.entrypoints.metrics import summarize
from jpaged.core.sequence import SamplingParams

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (default: the embedded SmolLM2-135M).")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Weights / KV dtype.")
_SYSTEM_TOKENS = flags.DEFINE_integer("system_tokens", 1024, "Shared system prompt length.")
_NUM_QUESTIONS = flags.DEFINE_integer("num_questions", 8, "Questions sharing the system prompt.")
_NUM_CHATS = flags.DEFINE_integer("num_chats", 2, "Multi-turn conversations.")
_NUM_TURNS = flags.DEFINE_integer("num_turns", 3, "Turns per conversation.")
_NUM_UNIQUE = flags.DEFINE_integer("num_unique", 4, "Prompts of the no-reuse workload.")
_UNIQUE_TOKENS = flags.DEFINE_integer("unique_tokens", 256, "Tokens per no-reuse prompt.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 4, "Generated tokens per request.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 16, "Engine max_num_seqs.")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 512, "KV pool blocks.")
_INDEX = flags.DEFINE_enum("index", "hash", ["hash", "radix"], "Prefix index.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Timed runs per (workload, mode); best is kept.")
_WORKLOADS = flags.DEFINE_list("workloads", ["shared_prefix", "multi_turn", "no_reuse"], "Workloads.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/prefix_cache", "Output path prefix.")

FILLER = ("You are a helpful, careful and concise assistant. Answer the user's questions "
          "about science, history and programming accurately, cite no sources, and keep "
          "every answer short. ")


def encode(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


def system_prompt(llm: LLM, n: int) -> list[int]:
    ids: list[int] = []
    k = 0
    while len(ids) < n:
        ids += encode(llm, f"Rule {k}: " + FILLER)
        k += 1
    return ids[:n]


def run_batches(llm: LLM, batches, params: SamplingParams) -> dict:
    """Runs the batches in order (a batch may depend on the previous outputs)."""
    outputs, wall, prompt_tokens, cached = [], 0.0, 0, 0
    prev = None
    for make in batches:
        prompts = make(prev)
        t0 = time.perf_counter()
        prev = llm.generate(prompts, params)
        wall += time.perf_counter() - t0
        outputs += prev
        prompt_tokens += llm.stats.prompt_tokens
        cached += llm.stats.cached_prompt_tokens
    s = summarize(outputs, llm, wall)
    s["prompt_tokens"], s["cached_prompt_tokens"] = prompt_tokens, cached
    s["cache_hit_pct"] = 100 * cached / prompt_tokens if prompt_tokens else 0.0
    s["prompt_tokens_total"] = sum(len(o.prompt_token_ids) for o in outputs)
    return s


def workloads(llm: LLM) -> dict:
    rng = np.random.default_rng(0)
    sys_ids = system_prompt(llm, _SYSTEM_TOKENS.value)
    questions = [encode(llm, f"\nQuestion {i}: what is {i} times {i + 3}? Answer:")
                 for i in range(_NUM_QUESTIONS.value)]
    shared = [lambda _: [sys_ids + q for q in questions]]

    chats = [system_prompt(llm, 64 + 16 * c)[-(64 + 16 * c):] for c in range(_NUM_CHATS.value)]

    def turn(t):
        def make(prev):
            if prev is not None:
                for c, out in enumerate(prev):
                    chats[c] = list(out.prompt_token_ids) + list(out.token_ids)
            for c in range(len(chats)):
                chats[c] = chats[c] + encode(llm, f"\nUser turn {t}: tell me more about topic {c}.\nAssistant:")
            return [list(x) for x in chats]
        return make
    chat_init = [list(x) for x in chats]

    def reset_chats():
        chats[:] = [list(x) for x in chat_init]

    vocab = llm.model_config.vocab_size
    unique = [[int(i) + 1000] + rng.integers(1000, vocab - 1, _UNIQUE_TOKENS.value - 1).tolist()
              for i in range(_NUM_UNIQUE.value)]
    return {
        "shared_prefix": (shared, lambda: None),
        "multi_turn": ([turn(t) for t in range(_NUM_TURNS.value)], reset_chats),
        "no_reuse": ([lambda _: unique], lambda: None),
    }


def set_caching(llm: LLM, on: bool) -> None:
    llm.config.enable_prefix_caching = on
    llm.reset_prefix_cache()


def main(argv):
    del argv
    llm = LLM(model=_MODEL.value, dtype=_DTYPE.value, num_blocks=_NUM_BLOCKS.value,
              max_num_seqs=_MAX_NUM_SEQS.value, max_model_len=2048, max_num_batched_tokens=1024,
              prefix_cache_index=_INDEX.value)
    params = SamplingParams(max_tokens=_MAX_TOKENS.value, ignore_eos=True)
    results = []
    loads = workloads(llm)
    t_start = time.perf_counter()
    for name in _WORKLOADS.value:
        batches, reset = loads[name]
        for on in (False, True):
            best = None
            for rep in range(1 + _REPEATS.value):  # rep 0 compiles
                set_caching(llm, on)
                reset()
                s = run_batches(llm, batches, params)
                if rep and (best is None or s["wall_s"] < best["wall_s"]):
                    best = s
            best.update(workload=name, caching="on" if on else "off")
            results.append(best)
            print(f"{name:14s} caching {best['caching']:3s}: {best['wall_s']:7.2f} s  "
                  f"{best['output_tok_per_s']:7.1f} out tok/s  TTFT mean {best['ttft_mean_ms']:8.0f} ms  "
                  f"p50 {best['ttft_p50_ms']:8.0f} ms  hit {best['cache_hit_pct']:5.1f} %", flush=True)
    total = time.perf_counter() - t_start

    out = pathlib.Path(_OUT.value)
    out.parent.mkdir(parents=True, exist_ok=True)
    cols = ["workload", "caching", "requests", "prompt_tokens_total", "output_tokens", "wall_s",
            "output_tok_per_s", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "cache_hit_pct",
            "cached_prompt_tokens", "evictions", "cow_copies", "peak_kv_blocks"]
    with open(f"{out}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(results)

    by = {(r["workload"], r["caching"]): r for r in results}
    lines = [f"# Prefix caching: on vs off ({_MODEL.value}, {_DTYPE.value}, CPU)", "",
             f"system prompt {_SYSTEM_TOKENS.value} tokens x {_NUM_QUESTIONS.value} questions; "
             f"{_NUM_CHATS.value} chats x {_NUM_TURNS.value} turns; {_NUM_UNIQUE.value} unique prompts x "
             f"{_UNIQUE_TOKENS.value} tokens; {_MAX_TOKENS.value} output tokens per request; "
             f"index {_INDEX.value}; best of {_REPEATS.value} warm run(s); {total:.0f} s in all.", "",
             "| workload | caching | requests | prompt tok | hit rate | wall s | out tok/s | TTFT mean ms | TTFT p50 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['workload']} | {r['caching']} | {r['requests']} | {r['prompt_tokens_total']} | "
                     f"{r['cache_hit_pct']:.1f} % | {r['wall_s']:.2f} | {r['output_tok_per_s']:.1f} | "
                     f"{r['ttft_mean_ms']:.0f} | {r['ttft_p50_ms']:.0f} |")
    lines += ["", "| workload | TTFT mean off/on | throughput on/off |", "|---|---|---|"]
    for name in _WORKLOADS.value:
        off, on = by[(name, "off")], by[(name, "on")]
        lines.append(f"| {name} | {off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f}x | "
                     f"{on['output_tok_per_s'] / off['output_tok_per_s']:.2f}x |")
    pathlib.Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(_WORKLOADS.value)
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "ttft_mean_ms", "mean TTFT (ms, log)"),
                           (axes[1], "output_tok_per_s", "output tokens / s")):
        for k, mode in enumerate(("off", "on")):
            ax.bar(x + (k - 0.5) * 0.38, [by[(n, mode)][key] for n in names], 0.38,
                   label=f"prefix caching {mode}")
        ax.set_xticks(x, names)
        ax.set_ylabel(label)
        if key == "ttft_mean_ms":
            ax.set_yscale("log")
        ax.legend()
    fig.suptitle(f"Prefix caching, {_MODEL.value} {_DTYPE.value} on CPU")
    fig.tight_layout()
    fig.savefig(f"{out}.png", dpi=110)


if __name__ == "__main__":
    app.run(main)

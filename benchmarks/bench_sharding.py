"""Sharding on simulated CPU devices: tensor parallel (TP) sizes and data-parallel (DP) replicas.

    python benchmarks/bench_sharding.py [--num_prompts=8 --max_tokens=32 --repeats=3]

Four CPU devices are simulated (`jax_num_cpu_devices`, set before jax
initialises).  They share this machine's cores, so tokens/s here measures
what sharding costs in extra work (collectives, shard_map plumbing, one
program per device on the same cores), not a speed-up: on CPU sharding is
checked for correctness.

Two models:
- `smollm2`: the embedded SmolLM2-135M (9 query heads, 3 KV heads): TP = 1, 3
  and DP = 2 x TP = 1.  TP = 2 must fail at start-up with a ConfigError, and
  that is recorded as a row.
- `dummy8`: a SmolLM2-shaped Llama with 8 query heads and 2 KV heads (hidden
  512, 30 layers, MLP 1536, vocabulary 49152, tied embeddings), random weights
  (load_format="dummy", from a config.json written to a temp dir): TP = 1, 2, 4
  (4 > 2 KV heads: each KV head is repeated) and DP = 2 x TP = 2 (a 2 x 2 mesh).

For each configuration:
- memory per device (weights, KV pool) from `memory_per_device()`;
- output tokens/s of a fixed greedy batch (num_prompts x max_tokens, EOS
  ignored), after one untimed warm-up generate, so compilation is excluded
  (and checked: no compilation in the timed runs);
- the collectives of the compiled decode step (the smallest bucket program, 8
  tokens, compiled by `precompile(8)` on the fresh engine): count and bytes of
  every all-reduce and all-gather (and any other collective), and whether an
  all-gather moves an array as large as a weight shard or the pool (checked
  again, after the timed runs, in every program the workload compiled);
- whether the greedy tokens equal TP = 1's of the same model;
- for TP > 1, the all-gathers of the decode step's other variants (sampling
  with and without top-k/top-p filters, logprobs), after the timed runs.

Writes benchmarks/results/sharding.csv, sharding_variants.csv, sharding.png
and sharding.md (the tables plus every collective's HLO result shape per
configuration).
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 4)  # before anything initialises the backend

import collections  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import harness as B  # noqa: E402  (benchmarks/harness.py)
from jpaged.core.config import ConfigError  # noqa: E402
from jpaged.engine.router import DataParallelLLM, create_engine  # noqa: E402
from jpaged.layers.sharding import collectives  # noqa: E402

_MODELS = flags.DEFINE_list("models", ["smollm2", "dummy8"], "Models to run (smollm2, dummy8).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "Prompts in the greedy batch.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "New tokens per prompt (EOS ignored).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed generate() runs per configuration (the median is reported).")
_ATTENTION = flags.DEFINE_string("attention_impl", "auto", "attention_impl of every engine (auto: the C++ "
                                 "CPU kernel here, called under shard_map).")

MIB = 1 << 20
# The same engine settings for every configuration: a fixed pool (so its split is
# visible), fp32, no prefix cache (timed runs recompute their prompts).
ENGINE = dict(dtype="float32", max_model_len=256, block_size=16, num_blocks=128, max_num_seqs=8,
              max_num_batched_tokens=256, enable_prefix_caching=False)
# (model, tp, dp) in run order; TP = 1 of each model first: it is the reference.
CONFIGS = {
    "smollm2": [(1, 1), (2, 1), (3, 1), (1, 2)],
    "dummy8": [(1, 1), (2, 1), (4, 1), (2, 2)],
}
# A SmolLM2-shaped Llama whose heads split over 2 and 4 devices.
DUMMY8_CONFIG = dict(model_type="llama", vocab_size=49152, hidden_size=512, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=2,
                     max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
                     bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)


def label(model: str, tp: int, dp: int) -> str:
    return f"{model} TP={tp}" if dp == 1 else f"{model} DP={dp}xTP={tp}"


def prompts_for(model: str, n: int) -> list:
    """smollm2: the demo queue's chat prompts; dummy8 (no tokenizer): token ids of
    lengths 12-60, fixed by a seed."""
    if model == "smollm2":
        return B.chat([B.DEFAULT_PROMPTS[i % len(B.DEFAULT_PROMPTS)] for i in range(n)])
    rng = np.random.default_rng(0)
    return [rng.integers(3, DUMMY8_CONFIG["vocab_size"], size=int(k)).tolist()
            for k in rng.integers(12, 61, size=n)]


def model_args(model: str, tmp: pathlib.Path) -> dict:
    if model == "smollm2":
        return {}  # the engine's default: the embedded GGUF
    path = tmp / "dummy8"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(DUMMY8_CONFIG))
    return dict(model=str(path), load_format="dummy")


def replicas(llm) -> list:
    return llm.replicas if isinstance(llm, DataParallelLLM) else [llm]


def decode_step_collectives(llm) -> tuple[list[tuple[str, str, int]], str]:
    """The collectives of replica 0's decode-step program (the 8-token bucket),
    compiled by precompile(8) on a fresh engine, and its HLO text."""
    llm.precompile(8)
    exes = replicas(llm)[0].runner.executables()
    assert len(exes) == 1, f"precompile(8) on a fresh engine compiled {len(exes)} programs"
    hlo = exes[0].as_text()
    return collectives(hlo), hlo


def shard_bytes(x) -> int:
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def collective_lines(hlo: str, op: str) -> list[str]:
    """The HLO instructions of one collective kind (for a report of a suspicious one)."""
    return [line.strip() for line in hlo.splitlines() if re.search(rf"\s{op}(-start)?\(", line)]


# The step's other variants (own programs): sampling without filters, with top-k/top-p
# filters, and with logprobs.  Run after the timed runs, on 2 prompts x 2 tokens.
VARIANTS = {
    "sampling (temperature)": dict(temperature=0.8),
    "sampling + top-k/top-p": dict(temperature=0.8, top_k=50, top_p=0.9),
    "greedy + logprobs=5": dict(temperature=0.0, logprobs=5),
}


def variant_collectives(llm, prompts: list) -> list[dict]:
    """All-gathers of the decode-bucket program of each variant in VARIANTS (it
    compiles on first use)."""
    from jpaged.core.sequence import SamplingParams
    runner, out = llm.runner, []
    smallest = runner.token_buckets[0]
    for variant, kw in VARIANTS.items():
        before = set(runner.programs)  # keyed by (tokens, seqs, sampling, variant)
        llm.generate(prompts, SamplingParams(max_tokens=2, seed=1, **kw))
        new = [(k, e) for k, e in runner.programs.items() if k not in before and k[0] == smallest]
        if len(new) != 1:
            out.append(dict(variant=variant, note=f"{len(new)} new decode-bucket programs"))
            continue
        ops = collectives(new[0][1].as_text())
        gathers = [(shape, b) for op, shape, b in ops if op == "all-gather"]
        out.append(dict(
            variant=variant, all_reduce_n=sum(op == "all-reduce" for op, _, _ in ops),
            all_gather_n=len(gathers), all_gather_bytes=sum(b for _, b in gathers),
            all_gathers="; ".join(f"{sh} x{n}" for sh, n in sorted(collections.Counter(
                sh for sh, _ in gathers).items()))))
    return out


def run_config(model: str, tp: int, dp: int, margs: dict, prompts: list, params, reference: dict,
               variant_rows: list) -> dict:
    name = label(model, tp, dp)
    row = dict(config=name, model=model, tp=tp, dp=dp, devices=tp * dp)
    print(f"\n-- {name}", flush=True)
    t0 = time.perf_counter()
    try:
        llm = create_engine(**margs, **ENGINE, attention_impl=_ATTENTION.value,
                            tensor_parallel_size=tp, data_parallel_size=dp)
    except ConfigError as e:
        print(f"   ConfigError at start-up: {e}", flush=True)
        return {**row, "status": "ConfigError", "note": str(e)}
    row["startup_s"] = time.perf_counter() - t0
    first = replicas(llm)[0]
    row["attention"] = first.attention_impl

    # ---- collectives of the decode step (before any generate: its one program)
    ops, hlo = decode_step_collectives(llm)
    by_op = collections.defaultdict(list)
    for op, shape, nbytes in ops:
        by_op[op].append((shape, nbytes))
    row["all_reduce_n"] = len(by_op["all-reduce"])
    row["all_reduce_bytes"] = sum(b for _, b in by_op["all-reduce"])
    row["all_gather_n"] = len(by_op["all-gather"])
    row["all_gather_bytes"] = sum(b for _, b in by_op["all-gather"])
    row["other_collectives"] = ", ".join(f"{op} x{len(v)}" for op, v in sorted(by_op.items())
                                         if op not in ("all-reduce", "all-gather")) or "-"
    row["expected_all_reduce_n"] = 0 if tp == 1 else 1 + 2 * first.model_config.num_layers
    weights = [x for x in jax.tree.leaves(first.params) if x.ndim >= 2]
    smallest_weight_shard = min(shard_bytes(x) for x in weights)
    pool_shard = shard_bytes(first.runner.kv_pool)
    big = [(s, b) for s, b in by_op["all-gather"] if b >= smallest_weight_shard or b >= pool_shard]
    row["largest_all_gather"] = max(by_op["all-gather"], key=lambda x: x[1])[0] if by_op["all-gather"] else "-"
    row["smallest_weight_shard_bytes"] = smallest_weight_shard
    row["big_all_gather"] = len(big)
    if big:
        print("   !! all-gather of a weight- or pool-sized array in the decode step:", flush=True)
        for line in collective_lines(hlo, "all-gather"):
            print("      " + line, flush=True)
    row["collective_shapes"] = "; ".join(
        f"{op} {shape} x{n}" for (op, shape), n in
        sorted(collections.Counter((op, shape) for op, shape, _ in ops).items()))

    # ---- memory per device
    mem = llm.memory_per_device()
    row["weights_mib_per_device"] = max(w for w, _ in mem.values()) / MIB
    row["kv_mib_per_device"] = max(k for _, k in mem.values()) / MIB
    row["weights_mib_total"] = sum(w for w, _ in mem.values()) / MIB
    row["kv_mib_total"] = sum(k for _, k in mem.values()) / MIB
    row["memory_devices"] = " ".join(f"{d}={w / MIB:.1f}+{k / MIB:.1f}" for d, (w, k) in mem.items())

    # ---- tokens/s of the greedy batch, warm
    B.timed_generate(llm, prompts, params)  # warm-up: compiles the prefill buckets
    compiled = llm.num_compilations
    walls, outs = [], None
    for _ in range(_REPEATS.value):
        outs, wall = B.timed_generate(llm, prompts, params)
        walls.append(wall)
    tokens = [o.token_ids for o in outs]
    n_tokens = sum(map(len, tokens))
    row["output_tokens"] = n_tokens
    row["wall_s"] = float(np.median(walls))
    row["tok_per_s"] = n_tokens / row["wall_s"]
    row["compiles_timed"] = llm.num_compilations - compiled
    # Every program the workload compiled (prefill buckets too): any big all-gather?
    programs = [(exe, collectives(exe.as_text())) for r in replicas(llm) for exe in r.runner.executables()]
    row["programs_checked"] = len(programs)
    row["big_all_gather_any_program"] = sum(
        b >= smallest_weight_shard or b >= pool_shard
        for _, ops_ in programs for op, _, b in ops_ if op == "all-gather")
    for exe, ops_ in programs:
        if any(op == "all-gather" and (b >= smallest_weight_shard or b >= pool_shard) for op, _, b in ops_):
            print("   !! big all-gather in a compiled step program:", flush=True)
            for line in collective_lines(exe.as_text(), "all-gather"):
                print("      " + line, flush=True)
    if isinstance(llm, DataParallelLLM):
        row["replica_requests"] = "/".join(str(r["requests"]) for r in llm.replica_summary())

    # ---- same greedy tokens as TP = 1
    if tp == 1 and dp == 1:
        reference[model] = tokens
        row["same_tokens_as_tp1"] = "reference"
    elif model in reference:
        want = reference[model]
        same = sum(a == b for a, b in zip(tokens, want))
        row["same_tokens_as_tp1"] = f"{same}/{len(want)}"
        for i, (a, b) in enumerate(zip(tokens, want)):
            if a != b:
                k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                print(f"   prompt {i}: first differing token at position {k} ({a[k]} vs TP=1's {b[k]})")
    row["status"] = "ok"
    if tp > 1:
        variant_rows.extend(dict(config=name, **v) for v in variant_collectives(first, prompts[:2]))
    print(f"   {row['weights_mib_per_device']:.1f} MiB weights + {row['kv_mib_per_device']:.1f} MiB KV "
          f"per device; {row['tok_per_s']:.1f} tok/s; all-reduce {row['all_reduce_n']} "
          f"({row['all_reduce_bytes']} B), all-gather {row['all_gather_n']} ({row['all_gather_bytes']} B); "
          f"tokens vs TP=1: {row['same_tokens_as_tp1']}", flush=True)
    del llm, first
    gc.collect()
    return row


COLUMNS = ["config", "status", "devices", "weights_mib_per_device", "kv_mib_per_device", "tok_per_s",
           "compiles_timed", "all_reduce_n", "all_reduce_bytes", "all_gather_n", "all_gather_bytes",
           "big_all_gather", "same_tokens_as_tp1"]
CSV_COLUMNS = COLUMNS + ["model", "tp", "dp", "attention", "startup_s", "output_tokens", "wall_s",
                         "weights_mib_total", "kv_mib_total", "memory_devices", "expected_all_reduce_n",
                         "other_collectives", "largest_all_gather", "smallest_weight_shard_bytes",
                         "programs_checked", "big_all_gather_any_program", "replica_requests",
                         "collective_shapes", "note"]
FORMATS = {"weights_mib_per_device": ".1f", "kv_mib_per_device": ".1f", "tok_per_s": ".1f",
           "wall_s": ".2f", "startup_s": ".1f", "weights_mib_total": ".1f", "kv_mib_total": ".1f"}


def plot(rows: list[dict]) -> None:
    ok = [r for r in rows if r["status"] == "ok"]
    names = [r["config"].replace(" ", "\n") for r in ok]
    x = np.arange(len(ok))
    fig, (a1, a2) = B.figure(2, width=6.5)
    w = [r["weights_mib_per_device"] for r in ok]
    k = [r["kv_mib_per_device"] for r in ok]
    a1.bar(x, w, label="weights")
    a1.bar(x, k, bottom=w, label="KV pool")
    a1.set_xticks(x, names, fontsize=7)
    a1.set_ylabel("MiB per device (largest device)")
    a1.set_title("memory per device")
    a1.legend()
    a2.bar(x, [r["tok_per_s"] for r in ok], color=["C2" if r["dp"] == 1 else "C3" for r in ok])
    a2.set_xticks(x, names, fontsize=7)
    a2.set_ylabel("output tok/s (warm, median)")
    a2.set_title(f"{_NUM_PROMPTS.value} prompts x {_MAX_TOKENS.value} tokens, greedy\n"
                 "simulated devices share the CPU cores: overhead, not speed-up", fontsize=9)
    B.save_figure("sharding", fig, "Sharding on 4 simulated CPU devices")


def main(argv):
    del argv
    B.header("sharding")
    load_before = os.getloadavg()
    print(f"devices: {jax.devices()}; load average {load_before[0]:.2f} (1 min)")
    params = B.greedy(_MAX_TOKENS.value, ignore_eos=True)
    rows, reference, variant_rows = [], {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for model in _MODELS.value:
            margs = model_args(model, pathlib.Path(tmp))
            prompts = prompts_for(model, _NUM_PROMPTS.value)
            for tp, dp in CONFIGS[model]:
                rows.append(run_config(model, tp, dp, margs, prompts, params, reference, variant_rows))
    B.report("sharding", rows, CSV_COLUMNS, FORMATS, title="Sharding (full rows in the CSV)")
    print()
    md = B.markdown_table(rows, COLUMNS, FORMATS)
    print(md)
    vcols = ["config", "variant", "all_reduce_n", "all_gather_n", "all_gather_bytes", "all_gathers"]
    if variant_rows:
        B.report("sharding_variants", variant_rows, vcols + ["note"],
                 title="The decode step's other variants (decode bucket): collectives")
    vmd = B.markdown_table(variant_rows, vcols) if variant_rows else ""
    details = ["", "Decode-step collectives (HLO result shape x count), per configuration:", ""]
    details += [f"- {r['config']}: {r.get('collective_shapes') or '(none)'}" for r in rows if r["status"] == "ok"]
    details += [f"- {r['config']}: {r['note']}" for r in rows if r["status"] != "ok"]
    details += ["", "The decode step's sampling and logprobs variants (all-gathers):", "", vmd]
    print("\n".join(details))
    load = f"load average (1 min) {load_before[0]:.2f} before the run, {os.getloadavg()[0]:.2f} after"
    print(load)
    B.write_markdown("sharding", f"# sharding ({B.machine()}, {B.today()}; {load})\n\n{md}\n"
                     + "\n".join(details))
    plot(rows)
    bad = [r["config"] for r in rows if r.get("big_all_gather") or r.get("big_all_gather_any_program")]
    if bad:
        print(f"\n!! weight- or pool-sized all-gather in the decode step of: {', '.join(bad)}")


if __name__ == "__main__":
    app.run(main)

"""Throughput: jpaged vs transformers (static batches, continuous batching), plus the
decode-step floor (matmuls alone) and the host share of step time.

    python benchmarks/bench_throughput.py [--num_requests=64 --max_tokens=128 --hf_batch=32]

Same weights (jpaged's dequantised embedded GGUF, fp32), same prompt tokens,
greedy, real answers (EOS honoured), up to --max_running sequences at once.
Targets: jpaged >= 4x both transformers peers; decode step <= 1.3x the matmuls
alone at batch 32 and 64; host share < 10 %.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)

_N = flags.DEFINE_integer("num_requests", 64, "Requests in the mixed workload.")
_WORKLOAD = flags.DEFINE_enum("workload", "mixed", ["mixed", "demo"],
                              "mixed: num_requests short/long chat prompts; demo: the 8 default "
                              "prompts of serve_batch (num_requests is ignored).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "Max new tokens per request.")
_MAX_RUNNING = flags.DEFINE_integer("max_running", 64, "Sequences running at once (jpaged, HF CB).")
_HF_BATCH = flags.DEFINE_integer("hf_batch", 32, "Static batch size of the transformers generate() peer.")
_PEERS = flags.DEFINE_list("peers", ["hf_static", "hf_cb"], "Peers to run (hf_static, hf_cb; empty: none).")
_STEP_BATCHES = flags.DEFINE_list("step_batches", ["32", "64"], "Batch sizes of the decode-step floor test.")
_STEP_TOKENS = flags.DEFINE_integer("step_tokens", 32, "Decode steps timed per batch size.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "jpaged KV block size.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Run the jpaged workload once untimed first (compiles).")
_KV_DTYPE = flags.DEFINE_enum("kv_cache_dtype", "auto", ["auto", "float32", "bfloat16"],
                              "jpaged KV pool dtype (results get a _kv_<dtype> suffix unless auto).")


def main(argv):
    del argv
    tag = "throughput" if _WORKLOAD.value == "mixed" else "throughput_demo"
    if _KV_DTYPE.value != "auto":
        tag += f"_kv_{_KV_DTYPE.value}"
    B.header(tag)
    N, T, R = _N.value, _MAX_TOKENS.value, _MAX_RUNNING.value
    llm = B.make_llm(max_num_seqs=max(R, *(int(b) for b in _STEP_BATCHES.value)),
                     block_size=_BLOCK_SIZE.value, max_num_batched_tokens=2048,
                     kv_cache_dtype=_KV_DTYPE.value)
    if _WORKLOAD.value == "demo":
        N = len(B.DEFAULT_PROMPTS)
    prompts = B.chat(B.DEFAULT_PROMPTS if _WORKLOAD.value == "demo" else B.mixed_prompts(N))
    ids = B.token_ids(llm, prompts)
    params = B.greedy(T)
    print(f"workload: {N} requests, prompts {min(map(len, ids))}-{max(map(len, ids))} tokens, "
          f"max {T} new tokens (EOS honoured), greedy, up to {R} running; jpaged KV pool "
          f"{llm.num_blocks} blocks x {_BLOCK_SIZE.value}")

    # ---- jpaged
    if _WARMUP.value:
        B.timed_generate(llm, ids, params)
    comp0 = llm.num_compilations
    outs, wall = B.timed_generate(llm, ids, params)
    comp_timed, comp_total = llm.num_compilations - comp0, llm.num_compilations
    jp_tokens = [o.token_ids for o in outs]
    st = llm.stats
    host_pct = 100 * st.host_seconds / (st.host_seconds + st.device_seconds)
    rows = [{"engine": "jpaged (continuous, paged)", "requests": N,
             "output_tokens": sum(map(len, jp_tokens)), "wall_s": wall,
             "tok_per_s": sum(map(len, jp_tokens)) / wall, "match_jpaged": "-"}]
    print(f"jpaged: {rows[0]['output_tokens']} tokens in {wall:.2f} s; {st.steps} steps, "
          f"host {st.host_seconds:.2f} s / device {st.device_seconds:.2f} s ({host_pct:.1f} % host); "
          f"compilations {llm.num_compilations} total, {llm.num_compilations - comp0} in the timed run",
          flush=True)

    # ---- transformers peers
    if _PEERS.value:
        t0 = time.perf_counter()
        model = B.hf_model(llm)
        print(f"transformers model built from the same weights in {time.perf_counter() - t0:.1f} s", flush=True)
        warm = ids[:2]
        if "hf_static" in _PEERS.value:
            B.hf_static(model, llm, warm, 4, 2)
            toks, w, _ = B.hf_static(model, llm, ids, T, _HF_BATCH.value)
            rows.append({"engine": f"HF generate, static batches of {_HF_BATCH.value}", "requests": N,
                         "output_tokens": sum(map(len, toks)), "wall_s": w,
                         "tok_per_s": sum(map(len, toks)) / w,
                         "match_jpaged": f"{sum(a == b for a, b in zip(toks, jp_tokens))}/{N}"})
            print(f"HF static: {rows[-1]['output_tokens']} tokens in {w:.1f} s", flush=True)
        if "hf_cb" in _PEERS.value:
            B.hf_continuous(model, llm, warm, 4, 2)
            toks, w = B.hf_continuous(model, llm, ids, T, R)
            rows.append({"engine": f"HF generate_batch (continuous, paged|sdpa), {R} running",
                         "requests": N, "output_tokens": sum(map(len, toks)), "wall_s": w,
                         "tok_per_s": sum(map(len, toks)) / w,
                         "match_jpaged": f"{sum(a == b for a, b in zip(toks, jp_tokens))}/{N}"})
            print(f"HF CB: {rows[-1]['output_tokens']} tokens in {w:.1f} s", flush=True)
    for r in rows:
        r["jpaged_speedup"] = rows[0]["tok_per_s"] / r["tok_per_s"]
    B.report(tag, rows,
             ["engine", "requests", "output_tokens", "wall_s", "tok_per_s", "jpaged_speedup", "match_jpaged"],
             {"wall_s": ".1f", "tok_per_s": ".1f", "jpaged_speedup": ".2f"},
             title="Output throughput (same run, same weights / prompts / max tokens, greedy)")

    # ---- decode step vs matmul floor
    steps = []
    for b in (int(x) for x in _STEP_BATCHES.value):
        d = B.time_decode_steps(llm, b, _STEP_TOKENS.value)
        mm = 1000 * B.time_matmuls(llm, b, 20)
        steps.append({"batch": b, "step_ms": d["step_ms"], "device_ms": d["device_ms"],
                      "matmul_floor_ms": mm, "step_over_floor": d["step_ms"] / mm,
                      "host_pct_of_step": 100 * (d["step_ms"] - d["device_ms"]) / d["step_ms"],
                      "steps_timed": d["steps_timed"]})
    B.report(f"{tag}_decode_step", steps,
             ["batch", "step_ms", "device_ms", "matmul_floor_ms", "step_over_floor", "host_pct_of_step", "steps_timed"],
             {"step_ms": ".2f", "device_ms": ".2f", "matmul_floor_ms": ".2f", "step_over_floor": ".2f",
              "host_pct_of_step": ".1f"},
             title="jpaged decode step (median, all rows decoding) vs the model's matmuls alone")

    # ---- targets
    peers = rows[1:]
    checks = [("jpaged >= 4x every transformers peer",
               bool(peers) and all(r["jpaged_speedup"] >= 4 for r in peers),
               ", ".join(f"{r['jpaged_speedup']:.2f}x" for r in peers) or "no peer run")]
    for s in steps:
        checks.append((f"decode step <= 1.3x matmuls alone at batch {s['batch']}",
                       s["step_over_floor"] <= 1.3, f"{s['step_over_floor']:.2f}x"))
    checks.append(("host share < 10 % (whole workload)", host_pct < 10, f"{host_pct:.1f} %"))
    checks.append(("no compilation in the timed jpaged run", comp_timed == 0,
                   f"{comp_timed} (of {comp_total} shapes)"))
    B.report(f"{tag}_targets", [{"target": c, "met": "yes" if ok else "NO", "measured": m}
                                    for c, ok, m in checks], title="Targets")

    fig, (a1, a2) = B.figure(2)
    a1.bar([r["engine"].split(",")[0].replace(" (continuous", "\n(continuous") for r in rows],
           [r["tok_per_s"] for r in rows], color=["C0", "C1", "C2"][:len(rows)])
    a1.set_ylabel("output tok/s")
    a1.set_title(f"{N} requests, <= {T} new tokens")
    a1.tick_params(axis="x", labelsize=7)
    x = np.arange(len(steps))
    a2.bar(x - 0.2, [s["step_ms"] for s in steps], 0.4, label="jpaged decode step")
    a2.bar(x + 0.2, [s["matmul_floor_ms"] for s in steps], 0.4, label="matmuls alone")
    a2.set_xticks(x, [f"batch {s['batch']}" for s in steps])
    a2.set_ylabel("ms")
    a2.legend()
    B.save_figure(tag, fig, "jpaged vs transformers; decode step vs matmul floor")


if __name__ == "__main__":
    app.run(main)

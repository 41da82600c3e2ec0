"""Online serving: N requests arriving as a Poisson process, driven through
llm.add_request() + llm.step(); per-token timestamps are taken by this driver
after every step (a token counts as delivered when its step returns).

    python benchmarks/bench_serving.py [--num_requests=64 --rate=4 --max_tokens=128 --max_running=16]

TTFT = first token - scheduled arrival; TPOT = (last - first token) / (n - 1)
per request; ITL = every gap between consecutive tokens of a request.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)

_N = flags.DEFINE_integer("num_requests", 64, "Requests.")
_RATE = flags.DEFINE_float("rate", 4.0, "Mean arrivals per second (Poisson); inf: all at t=0.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "Max new tokens per request.")
_MAX_RUNNING = flags.DEFINE_integer("max_running", 16, "Sequences running at once.")
_SEED = flags.DEFINE_integer("seed", 0, "Arrival-time seed.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Run the workload once offline first.")
_PRECOMPILE = flags.DEFINE_bool("precompile", True,
                                "llm.precompile() every step shape the workload can meet first.")


def serve(llm, ids, params, arrivals):
    """Returns per-request (arrival, token timestamps, finish reason), and the span."""
    order = np.argsort(arrivals)
    nxt, seqs, stamps = 0, {}, {}
    t0 = time.perf_counter()
    while nxt < len(ids) or llm.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(ids) and arrivals[order[nxt]] <= now:
            i = int(order[nxt])
            rid = llm.add_request(ids[i], params)
            seqs[i], stamps[i] = llm.get_sequence(rid), []
            nxt += 1
        if not llm.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[order[nxt]] - (time.perf_counter() - t0)))
            continue
        llm.step()
        t = time.perf_counter() - t0
        for i, s in seqs.items():
            new = len(s.output_token_ids) - len(stamps[i])
            stamps[i] += [t] * new
    return seqs, stamps, time.perf_counter() - t0


def main(argv):
    del argv
    B.header("serving")
    N, T = _N.value, _MAX_TOKENS.value
    llm = B.make_llm(max_num_seqs=_MAX_RUNNING.value)
    prompts = B.mixed_prompts(N)
    ids = B.token_ids(llm, B.chat(prompts))
    params = B.greedy(T)
    rng = np.random.default_rng(_SEED.value)
    arrivals = (np.cumsum(rng.exponential(1 / _RATE.value, N)) if np.isfinite(_RATE.value)
                else np.zeros(N))
    arrivals -= arrivals[0]
    summary = []
    if _PRECOMPILE.value:
        t0 = time.perf_counter()
        n = llm.precompile()
        summary += [{"metric": "precompile_s", "value": time.perf_counter() - t0},
                    {"metric": "precompiled_shapes", "value": n}]
    if _WARMUP.value:
        B.timed_generate(llm, ids, params)
    comp0 = llm.num_compilations
    seqs, stamps, span = serve(llm, ids, params, arrivals)
    ttft, tpot, itl, ntok = [], [], [], 0
    per_req = []
    for i in range(N):
        ts = stamps[i]
        ntok += len(ts)
        if not ts:
            continue
        ttft.append(1000 * (ts[0] - arrivals[i]))
        if len(ts) > 1:
            tpot.append(1000 * (ts[-1] - ts[0]) / (len(ts) - 1))
            itl += list(1000 * np.diff(ts))
        per_req.append({"request": i, "arrival_s": arrivals[i], "prompt_tokens": len(ids[i]),
                        "output_tokens": len(ts), "ttft_ms": ttft[-1], "latency_ms": 1000 * (ts[-1] - arrivals[i])})
    summary += [{"metric": "requests", "value": N}, {"metric": "duration_s", "value": span},
               {"metric": "request_throughput_per_s", "value": N / span},
               {"metric": "output_tok_per_s", "value": ntok / span},
               {"metric": "output_tokens", "value": ntok},
               {"metric": "compilations_during_run", "value": llm.num_compilations - comp0}]
    for name, v in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        summary += [{"metric": f"{name}_mean", "value": float(np.mean(v))},
                    {"metric": f"{name}_p50", "value": B.pct(v, 50)},
                    {"metric": f"{name}_p99", "value": B.pct(v, 99)}]
    B.report("serving", summary, formats={"value": ".2f"},
             title=f"Serving: {N} requests, Poisson rate {_RATE.value}/s, <= {T} new tokens, "
                   f"<= {_MAX_RUNNING.value} running, prompts {min(map(len, ids))}-{max(map(len, ids))} tokens")
    B.write_csv("serving_requests", per_req)
    fig, (a1, a2) = B.figure(2)
    a1.hist(ttft, bins=30); a1.set_xlabel("TTFT (ms)"); a1.set_ylabel("requests")
    a2.hist(itl, bins=50); a2.set_xlabel("inter-token latency (ms)"); a2.set_yscale("log")
    B.save_figure("serving", fig, f"Poisson arrivals at {_RATE.value}/s")


if __name__ == "__main__":
    app.run(main)

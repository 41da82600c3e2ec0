"""Where each millisecond of a batch-1 decode step goes (SmolLM2-135M, fp32, CPU).

    python benchmarks/bench_decode_profile.py [--configs=async:cpu,sync:cpu,async:reference,sync:reference \
        --requests=2 --max_tokens=64 --prompt_tokens=158 --max_num_seqs=1 --reps=20]

Three parts, per engine config (async_scheduling on/off x attention_impl cpu/reference):

host    One request at a time through the public engine (`jpaged.LLM`, fresh
        prompts of --prompt_tokens ids, --max_tokens new tokens, greedy, EOS
        ignored; one untimed request first compiles the buckets).  Over the steps
        where exactly one token decodes, the mean ms per `llm.step()` split into
        schedule, commit (placeholders, prefix-cache bookkeeping), build inputs,
        program lookup, dispatch (the executable call returning), wait for the
        device (`runner.collect`: device_get), resolve (Scheduler.update_from_output:
        tokens in, stop checks), stats, the request deltas (outputs.deltas), and
        the rest of step() (other).  The pieces are timed by wrapping the engine's
        own methods on this instance (the script says which one is missing if
        they move).  Then the server's streaming
        path per token: `SampleText.push` (jpaged.tokenizer.detokenizer, with the
        server's decode) and the SSE chunk encoding; and the engine thread's
        hand-off (`AsyncEngine`, as the server drives it): gap between deltas seen
        by an asyncio consumer, and the delay from the step's return to the
        consumer waking up.
device  The decode step's program in pieces, each jitted alone on the engine's
        decode shapes (T tokens, S sequences of the decode bucket, the pool, a
        context of prompt + max_tokens/2): embedding; the attention half of a
        layer (norm, q/k/v, RoPE, K/V write + paged attention, o-projection) and
        the MLP half (norm, gate/up/down), each unrolled over all the layers'
        own weights and divided by the layer count (so a layer's weights come
        from memory, as in the step, and one dispatch is amortised); final norm
        + lm_head; greedy sampling; the K/V write + attention call alone; the
        whole forward + sample jitted as one program; one trivial jitted call
        (the dispatch floor).  Median of --reps calls each.
summary The engine's own step program (StepTiming.forward of the synchronous
        engine: dispatch to tokens on the host) against the sum of the pieces.

Writes benchmarks/results/decode_profile.{csv,md}.  About 2-3 minutes on an idle
2-core machine with the defaults (four engines load and compile).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from typing import Any, Callable

import numpy as np
from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)
from jpaged.core.rounding import cdiv

_CONFIGS = flags.DEFINE_list("configs", ["async:cpu", "sync:cpu", "async:reference", "sync:reference"],
                             "Engine configs, scheduling:attention_impl.")
_REQUESTS = flags.DEFINE_integer("requests", 2, "Timed requests per config (one at a time).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "New tokens per request (EOS ignored).")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 158, "Prompt length in tokens.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 1, "max_num_seqs of the engine (the decode bucket "
                                     "follows it: `jpaged serve`'s default 8 pads one decode token to 8).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 2048, "max_model_len (block-table width).")
_REPS = flags.DEFINE_integer("reps", 20, "Timed calls per device piece (median).")
_HANDOFF = flags.DEFINE_bool("handoff", True, "Also time the AsyncEngine hand-off per config.")

HOST_PARTS = ["schedule", "commit", "build_inputs", "program_lookup", "dispatch", "wait_device", "resolve",
              "stats", "deltas"]
COLUMNS = ["section", "config", "item", "ms", "per", "count_per_step", "ms_per_step"]


def parse_config(spec: str) -> tuple[bool, str]:
    scheduling, impl = spec.split(":")
    if scheduling not in ("async", "sync"):
        raise ValueError(f"scheduling must be async or sync, got {spec!r}")
    return scheduling == "async", impl


def make_llm(async_scheduling: bool, impl: str) -> Any:
    from jpaged.engine.llm import LLM
    budget = max(256, _PROMPT_TOKENS.value + 16)  # the prompt prefills in one step
    return LLM(model="smollm2-135m", async_scheduling=async_scheduling, attention_impl=impl,
               max_num_seqs=_MAX_NUM_SEQS.value, max_model_len=_MAX_MODEL_LEN.value,
               max_num_batched_tokens=budget, num_blocks=256)


def fresh_prompts(llm: Any, n: int) -> list[list[int]]:
    """n prompts of exactly --prompt_tokens ids, each different from the first block
    on (no prefix-cache reuse between requests)."""
    text = " ".join(B.mixed_prompts(64))
    base = llm.tokenize(text)
    return [(llm.tokenize(f"Request {i}: ") + base)[:_PROMPT_TOKENS.value] for i in range(n)]


# ------------------------------------------------------------------ host side
class Clock:
    """Seconds per named piece, accumulated by wrappers around engine methods."""

    def __init__(self):
        self.acc: dict[str, float] = collections.defaultdict(float)

    def timed(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[name] += time.perf_counter() - t0
        return wrapper

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        if not hasattr(obj, attr):
            raise AttributeError(f"{type(obj).__name__}.{attr} is gone: update bench_decode_profile.Clock wiring")
        setattr(obj, attr, self.timed(name, getattr(obj, attr)))

    def take(self) -> dict[str, float]:
        out, self.acc = dict(self.acc), collections.defaultdict(float)
        return out


def instrument(llm: Any) -> Clock:
    """Wraps the (disjoint) pieces of one llm.step() on this instance only."""
    clock = Clock()
    clock.wrap(llm.scheduler, "schedule", "schedule")
    clock.wrap(llm.scheduler, "on_launched", "commit")
    clock.wrap(llm.runner, "_step_inputs", "build_inputs")
    clock.wrap(llm.runner, "collect", "wait_device")
    clock.wrap(llm.scheduler, "update_from_output", "resolve")
    clock.wrap(llm.step_stats, "record", "stats")
    clock.wrap(llm.outputs, "deltas", "deltas")
    # _executable returns the program the step then calls: its call is the dispatch.
    clock.wrap(llm.runner, "_executable", "program_lookup")
    lookup = llm.runner._executable
    llm.runner._executable = lambda inputs: clock.timed("dispatch", lookup(inputs))
    return clock


def run_request(llm: Any, clock: Clock, prompt: list[int]) -> tuple[list[dict], list[int]]:
    """One request to the end: per decode step its pieces (s); the output tokens."""
    rid = llm.add_request(prompt, B.greedy(_MAX_TOKENS.value, ignore_eos=True))
    steps, tokens = [], []
    while llm.has_unfinished_requests():
        st = llm.stats
        prefills, sched, dev, builds = st.prefill_steps, st.tokens_scheduled, st.device_seconds, llm.compile_seconds
        clock.take()
        t0 = time.perf_counter()
        finished = llm.step()
        wall = time.perf_counter() - t0
        st = llm.stats
        parts = clock.take()
        # Decode steps only, and none that a program build (in any thread) slowed down.
        if st.prefill_steps == prefills and st.tokens_scheduled - sched == 1 and llm.compile_seconds == builds:
            steps.append({**parts, "step_wall": wall, "engine_device": st.device_seconds - dev})
        tokens += [t for d in finished if d.finished and d.request_id == rid for t in d.output.token_ids]
    return steps, tokens


def host_rows(config: str, steps: list[dict]) -> list[dict]:
    mean = lambda k: 1000 * float(np.mean([s.get(k, 0.0) for s in steps]))  # noqa: E731
    rows = [{"item": p, "ms": mean(p)} for p in HOST_PARTS]
    wall = mean("step_wall")
    rows.append({"item": "other", "ms": wall - sum(r["ms"] for r in rows)})
    rows.append({"item": "step_wall (mean)", "ms": wall})
    rows.append({"item": "step_wall (median)", "ms": 1000 * float(np.median([s["step_wall"] for s in steps]))})
    rows.append({"item": "engine device_seconds", "ms": mean("engine_device")})
    return [{"section": "host", "config": config, "per": "step", "count_per_step": 1,
             "ms_per_step": r["ms"], **r} for r in rows]


def detok_rows(config: str, llm: Any, tokens: list[int]) -> list[dict]:
    """The server's per-token streaming work on these tokens: SampleText.push with the
    server's decode (ServerState.decode), and one SSE chunk's encoding."""
    from jpaged.entrypoints.openai.serving import _sse
    from jpaged.tokenizer.detokenizer import SampleText
    decode = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    sample, pushes, encodes = SampleText(decode), [], []
    for token in tokens:
        t0 = time.perf_counter()
        text = sample.push([token])
        t1 = time.perf_counter()
        _sse({"id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 0, "model": "smollm2-135m",
              "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]})
        pushes.append(t1 - t0)
        encodes.append(time.perf_counter() - t1)
    return [{"section": "server", "config": config, "item": item, "ms": 1000 * float(np.mean(xs)),
             "per": "token", "count_per_step": 1, "ms_per_step": 1000 * float(np.mean(xs))}
            for item, xs in (("detokenize (SampleText.push)", pushes), ("SSE chunk encode", encodes))]


async def _consume(engine: Any, prompt: list[int]) -> tuple[list[float], list[float]]:
    """One request through AsyncEngine; (arrival times, arrival - step return) per delta."""
    sub = engine.submit([(prompt, B.greedy(_MAX_TOKENS.value, ignore_eos=True), None)])
    arrivals, delays = [], []
    while True:
        delta = await sub.queue.get()
        now = time.perf_counter()
        arrivals.append(now)
        delays.append(now - delta.time)
        if delta.finished:
            return arrivals, delays


def handoff_rows(config: str, llm: Any, prompts: list[list[int]]) -> list[dict]:
    """The engine thread as the server runs it: ITL seen by an asyncio consumer and
    the hand-off delay (step returned -> consumer woke), over the decode deltas."""
    from jpaged.engine.async_engine import AsyncEngine
    engine = AsyncEngine(llm, max_queued_requests=16)
    engine.start()
    gaps, delays = [], []
    try:
        for prompt in prompts:
            arrivals, d = asyncio.run(_consume(engine, prompt))
            gaps += list(np.diff(arrivals[1:]))  # from the second delta on: decode steps
            delays += d[1:]
    finally:
        engine.close(timeout=30)
    return [{"section": "server", "config": config, "item": item, "ms": 1000 * float(np.mean(xs)),
             "per": "token", "count_per_step": 1, "ms_per_step": 1000 * float(np.mean(xs))}
            for item, xs in (("AsyncEngine ITL at consumer (mean)", gaps),
                             ("AsyncEngine hand-off (step return -> consumer)", delays))]


def profile_host(spec: str) -> tuple[list[dict], Any]:
    async_scheduling, impl = parse_config(spec)
    llm = make_llm(async_scheduling, impl)
    prompts = fresh_prompts(llm, 1 + 2 * _REQUESTS.value)
    clock = instrument(llm)
    run_request(llm, clock, prompts[0])  # compiles the prefill and decode buckets
    steps, tokens = [], []
    for prompt in prompts[1:1 + _REQUESTS.value]:
        s, tokens = run_request(llm, clock, prompt)
        steps += s
    rows = host_rows(spec, steps) + detok_rows(spec, llm, tokens)
    if _HANDOFF.value:
        rows += handoff_rows(spec, llm, prompts[1 + _REQUESTS.value:])
    print(B.table(rows, ["section", "item", "ms"], {"ms": ".3f"}))
    return rows, llm


# ---------------------------------------------------------------- device side
def median_ms(fn: Callable, *args: Any) -> float:
    """Median ms of fn(*args) with its result on the host (one warm-up call)."""
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(_REPS.value):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def decode_inputs(llm: Any) -> dict[str, Any]:
    """The engine's decode shapes: T, S of the smallest bucket, one sequence at
    context prompt + max_tokens/2, padding rows pointing at the null block."""
    import jax.numpy as jnp
    from jpaged.decode import ragged_metadata
    runner, bs = llm.runner, llm.config.block_size
    T = runner.token_bucket(1)
    S = runner.seq_bucket(T)
    ctx = _PROMPT_TOKENS.value + _MAX_TOKENS.value // 2
    tables = np.zeros((S, runner.table_width), np.int32)
    tables[0, :cdiv(ctx, bs)] = np.arange(1, cdiv(ctx, bs) + 1)
    q_lens = np.zeros(S, np.int32)
    q_lens[0] = 1
    meta = ragged_metadata(jnp.asarray(tables), jnp.asarray(np.where(q_lens > 0, ctx - 1, 0)),
                           jnp.asarray(q_lens), num_tokens=T, block_size=bs)
    tokens = jnp.asarray(np.full(T, 42, np.int32))
    return {"T": T, "S": S, "ctx": ctx, "meta": meta, "tokens": tokens}


def layer_weights(model: Any) -> list[dict]:
    layers = model.layers
    if hasattr(layers, "items"):  # scanned: stacked weights
        stacked = {k: v[...] for k, v in layers.items()}
        return [{k: v[i] for k, v in stacked.items()} for i in range(model.cfg.num_layers)]
    return [{k: p[...] for k, p in layer.items()} for layer in layers]


def device_pieces(llm: Any, impl: str) -> dict[str, float]:
    """ms of each piece of the decode program (per layer for the layer halves)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jpaged.decode import forward_step, sample
    from jpaged.models.base import paged_attention, rms_norm, rope_angles
    from jpaged.runtime.kv_pool import create_kv_pool
    from pallas_kernels import get_backend
    model, cfg, x = nnx.merge(llm.graphdef, llm.params), llm.model_config, decode_inputs(llm)
    meta, ws, L, eps, backend = x["meta"], layer_weights(model), cfg.num_layers, cfg.rms_norm_eps, get_backend(impl)
    pool = create_kv_pool(cfg, llm.num_blocks, llm.config.block_size, llm.kv_dtype)
    h = model.embed[...][x["tokens"]]
    rope = rope_angles(meta.positions, model.inv_freq[...])

    # The attention half of Llama.layer (jpaged/models/llama.py), over every layer.
    def attn_half(h, ws, pool, meta, rope):
        for i, w in enumerate(ws):
            q, k, v = model.qkv(rms_norm(h, w["attn_norm"], eps), w, rope)
            a, pool = paged_attention(cfg, q, k, v, i, model.window(i), pool, meta, backend)
            h = h + a.astype(h.dtype) @ w["wo"]
        return h, pool

    def mlp_half(h, ws):
        for w in ws:
            x_ = rms_norm(h, w["mlp_norm"], eps)
            h = h + (jax.nn.silu(x_ @ w["w_gate"]) * (x_ @ w["w_up"])) @ w["w_down"]
        return h

    def kernel_only(q, k, v, pool, meta):  # K/V write + attention: the custom calls under impl=cpu
        for i in range(L):
            pool = backend.write_kv(pool, i, k, v, meta.write_blocks, meta.write_offsets)
            out = backend.attention(q, pool, i, meta.block_tables, meta.kv_lens, meta.cu_q_lens,
                                    sm_scale=cfg.sm_scale)
            # The next layer's inputs depend on this layer's output, as in the model: without
            # that XLA may run the next in-place write first and copy the whole pool per layer.
            nudge = 1e-6 * out.mean()
            q, k, v = q + nudge, k + nudge, v + nudge
        return q, pool

    def step(params, pool, tokens, meta):
        logits, pool = forward_step(llm.graphdef, params, pool, tokens, meta, attention_impl=impl)
        return sample(logits, None), jnp.isnan(logits).any(-1), pool

    T = x["T"]
    q = jnp.full((T, cfg.num_heads, cfg.head_dim), 0.01, llm.dtype)
    kv = jnp.full((T, cfg.num_kv_heads, cfg.head_dim), 0.01, llm.dtype)
    pool_fns = {"attn_half": jax.jit(attn_half, donate_argnums=(2,)),
                "kernel": jax.jit(kernel_only, donate_argnums=(3,)),
                "step": jax.jit(step, donate_argnums=(1,))}
    pool_args = {"attn_half": lambda p: (h, ws, p, meta, rope), "kernel": lambda p: (q, kv, kv, p, meta),
                 "step": lambda p: (llm.params, p, x["tokens"], meta)}
    out: dict[str, float] = {}
    for name, fn in pool_fns.items():
        box = {"pool": pool}

        def call(fn=fn, name=name, box=box):
            *res, box["pool"] = fn(*pool_args[name](box["pool"]))
            return res
        out[name] = median_ms(call)
        pool = box["pool"]
    out["embed"] = median_ms(jax.jit(lambda e, t: e[t]), model.embed[...], x["tokens"])
    out["mlp_half"] = median_ms(jax.jit(mlp_half), h, ws)
    hs = h[meta.logits_indices]
    out["head"] = median_ms(jax.jit(lambda m_params, hs: nnx.merge(llm.graphdef, m_params).final_norm_logits(hs)),
                            llm.params, hs)
    logits = jnp.zeros((x["S"], cfg.vocab_size), jnp.float32)
    out["sample"] = median_ms(jax.jit(lambda lg: (sample(lg, None), jnp.isnan(lg).any(-1))), logits)
    out["dispatch_floor"] = median_ms(jax.jit(lambda a: a + 1), jnp.zeros((), jnp.int32))
    return out


def device_rows(impl: str, p: dict[str, float], L: int, shapes: str) -> list[dict]:
    items = [("embedding", p["embed"], "call", 1), ("attention half of a layer", p["attn_half"] / L, "layer", L),
             ("MLP half of a layer", p["mlp_half"] / L, "layer", L), ("final norm + lm_head", p["head"], "call", 1),
             ("sampling (greedy + NaN check)", p["sample"], "call", 1)]
    rows = [{"item": i, "ms": ms, "per": per, "count_per_step": n, "ms_per_step": ms * n} for i, ms, per, n in items]
    rows.append({"item": "sum of the pieces", "ms": sum(r["ms_per_step"] for r in rows), "per": "step",
                 "count_per_step": 1})
    rows += [{"item": "K/V write + attention alone (in the attention half)", "ms": p["kernel"] / L, "per": "layer",
              "count_per_step": L},
             {"item": "whole forward + sample, one jitted program", "ms": p["step"], "per": "step", "count_per_step": 1},
             {"item": "dispatch floor (trivial jitted call)", "ms": p["dispatch_floor"], "per": "call",
              "count_per_step": 1}]
    for r in rows:
        r.setdefault("ms_per_step", r["ms"] * r["count_per_step"])
        r.update(section="device", config=f"{impl} ({shapes})")
    return rows


# -------------------------------------------------------------------- report
def pivot(rows: list[dict], section: str, value: str = "ms_per_step") -> list[dict]:
    """Items down, configs across."""
    sel = [r for r in rows if r["section"] == section]
    configs = list(dict.fromkeys(r["config"] for r in sel))
    out: dict[str, dict] = {}
    for r in sel:
        out.setdefault(r["item"], {"item": r["item"], "per": r["per"]})[r["config"]] = r[value]
    return [out[k] for k in out], configs


def markdown(rows: list[dict], title: str) -> str:
    lines = [f"{title}; {B.machine()}, {B.today()}", ""]
    for section, value, note in (
            ("host", "ms", "Host side: mean ms per decode `llm.step()`"),
            ("server", "ms", "Server streaming path, mean ms per token"),
            ("device", "ms", "Device side: ms per call / per layer (the unit in `per`)"),
            ("device", "ms_per_step", "Device side: ms per decode step (per-layer pieces x layers)")):
        table, configs = pivot(rows, section, value)
        fmt = {c: ".3f" for c in configs}
        lines += [f"**{note}**", "", B.markdown_table(table, ["item", "per", *configs], fmt), ""]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    B.header("decode profile")
    rows: list[dict] = []
    devices_done: set[str] = set()
    for spec in _CONFIGS.value:
        print(f"\n-- {spec}")
        host, llm = profile_host(spec)
        rows += host
        impl = parse_config(spec)[1]
        if impl not in devices_done:  # the device pieces do not depend on the scheduling
            x = decode_inputs(llm)
            shapes = f"T={x['T']} S={x['S']} ctx={x['ctx']}"
            dev = device_rows(impl, device_pieces(llm, impl), llm.model_config.num_layers, shapes)
            print(B.table(dev, ["item", "per", "ms", "ms_per_step"], {"ms": ".3f", "ms_per_step": ".2f"}))
            rows += dev
            devices_done.add(impl)
        del llm
    title = (f"Batch-1 decode step profile: SmolLM2-135M fp32, prompt {_PROMPT_TOKENS.value} tokens, "
             f"{_MAX_TOKENS.value} new (EOS ignored), max_num_seqs={_MAX_NUM_SEQS.value}, "
             f"max_model_len={_MAX_MODEL_LEN.value}")
    B.report("decode_profile", rows, COLUMNS, {"ms": ".4f", "ms_per_step": ".4f"}, title=title)
    B.write_markdown("decode_profile", markdown(rows, title))


if __name__ == "__main__":
    app.run(main)

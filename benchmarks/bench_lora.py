"""LoRA adapters: what serving requests under adapters costs, where the time goes,
the LoRA update alone (one-hot vs gather), and the slots' memory.

    python benchmarks/bench_lora.py [--parts=throughput,kernel,memory] [--note="idle, ..."]
    make bench-lora ARGS='--parts=kernel --iters=500'

Parts (--parts, any of them; default all three; TIMINGS: run on an idle machine and say so
with --note, whose text goes into the .md header):

throughput  SmolLM2-135M (fp32, whatever backend jax picks: the CPU here) with --num_adapters
            (4) random PEFT adapters of rank --rank (16) on q,k,v,o,gate,up,down of every
            layer, written at start as PEFT directories (adapter_config.json +
            adapter_model.safetensors, numpy only: A ~ N(0, 1/in), B ~ N(0, 0.02^2),
            lora_alpha --lora_alpha) and loaded through `lora_modules` into one engine
            (max_loras = num_adapters, max_lora_rank = rank).  Workload: --num_requests (64)
            prompts of random token ids, --min/--max_prompt_tokens (32-128) long, distinct
            (no prefix reuse), --max_tokens (64) new tokens each, ignore_eos, greedy, up to
            --max_running (64) at once, run (a) `base`: every request on the base model and
            (b) `mixed`: the same requests spread round robin over base + each adapter (13
            each at 64).  After llm.precompile() and one untimed pass of each, (a) and (b)
            alternate --reps (3) times; median wall and output tok/s of each, the ratio
            mixed/base of the walls, and from the engine's step stats: steps, device
            (forward) and host seconds, device ms per step.  Sanity: base rows of (b) vs the
            same prompts in (a) (identical greedy tokens expected), adapter rows that differ
            from base (the adapters are applied).
            Then the decode step alone: --step_batch sequences (0: min(num_requests,
            max_running)) decoding --step_tokens (0: max_tokens) tokens from
            --step_prompt_tokens-token prompts, rows all on the base model (`base`, the program
            without adapters), all on adapter 0 (`one_adapter`) or spread over base + every
            adapter (`mixed`); median wall and device ms of the steps in which exactly
            step_batch rows decode (harness.time_decode_steps' rule), after one untimed pass of
            each, modes interleaved, --reps passes.
kernel      The LoRA update of one projection alone, jitted, fp32: x [T, in] with T in
            --kernel_tokens (16,64,256,1024) tokens spread round robin over base (slot -1)
            and --num_adapters slots of rank --rank, for SmolLM2's (in, out) = (576, 576)
            (q / o) and (576, 1536) (gate / up):
              onehot      jpaged.layers.lora.LoraLayer.delta (what the engine runs: every
                          slot for every token, masked by the token's one-hot slot)
              gather      each token's own A[slot] / B[slot] gathered, 'ti,tir->tr' then
                          'tr,tro->to' (slot -1 masked)
              base        x @ W alone (the scale)
              base+onehot x @ W + onehot delta in one program (the projection as the engine runs it)
            and a jitted scalar op (`empty`: the dispatch floor, in every figure).  Median us per
            call over --iters (200) calls, variants interleaved call by call; ratio to base.
memory      Bytes of the engine's LoRA slots (every leaf of llm.runner.lora) vs the base
            weights (every leaf of llm.params) and the KV pool, for max_loras = num_adapters,
            max_lora_rank = rank.

Writes <out>.md and <out>.csv (default --out=benchmarks/results/lora; one CSV, a `part`
column, the union of the parts' columns).
"""

from __future__ import annotations

import csv
import json
import pathlib
import shutil
import tempfile
import time
from typing import Any

import numpy as np
from absl import app, flags

import harness as B  # benchmarks/harness.py (the script's own directory is on sys.path)

PARTS = ("throughput", "kernel", "memory")
# PEFT module name -> (block, our target name)
PEFT_TARGETS = {"q_proj": ("self_attn", "wq"), "k_proj": ("self_attn", "wk"), "v_proj": ("self_attn", "wv"),
                "o_proj": ("self_attn", "wo"), "gate_proj": ("mlp", "w_gate"), "up_proj": ("mlp", "w_up"),
                "down_proj": ("mlp", "w_down")}

_PARTS = flags.DEFINE_list("parts", list(PARTS), f"Parts to run, of {','.join(PARTS)}.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/lora", "Output path prefix (.md / .csv appended).")
_NOTE = flags.DEFINE_string("note", "", "Free text for the .md header, e.g. whether the machine was idle "
                                        "(the operator's responsibility).")
_NUM_ADAPTERS = flags.DEFINE_integer("num_adapters", 4, "Random adapters (= max_loras).")
_RANK = flags.DEFINE_integer("rank", 16, "Adapter rank (= max_lora_rank).")
_ALPHA = flags.DEFINE_float("lora_alpha", 32.0, "lora_alpha of the adapters (scale alpha / rank).")
_ADAPTER_DIR = flags.DEFINE_string("adapter_dir", "", "Where to write the adapters ('': a temporary "
                                                      "directory, removed at the end).")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "Throughput: requests per run.")
_MIN_PROMPT = flags.DEFINE_integer("min_prompt_tokens", 32, "Throughput: shortest prompt (random token ids).")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_tokens", 128, "Throughput: longest prompt.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Throughput: new tokens per request (EOS ignored).")
_MAX_RUNNING = flags.DEFINE_integer("max_running", 64, "Engine max_num_seqs.")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 2048, "Engine max_num_batched_tokens.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Engine KV block size.")
_PRECOMPILE = flags.DEFINE_bool("precompile", True, "llm.precompile() before the warm-up passes.")
_REPS = flags.DEFINE_integer("reps", 3, "Throughput / decode step: timed passes of each run (interleaved).")
_STEP_BATCH = flags.DEFINE_integer("step_batch", 0, "Decode step: sequences decoding (0: min(num_requests, "
                                                    "max_running); <= max_running).")
_STEP_TOKENS = flags.DEFINE_integer("step_tokens", 0, "Decode step: new tokens per sequence (0: max_tokens).")
_STEP_PROMPT = flags.DEFINE_integer("step_prompt_tokens", 64, "Decode step: prompt tokens per sequence.")
_KERNEL_TOKENS = flags.DEFINE_list("kernel_tokens", ["16", "64", "256", "1024"], "Kernel: token counts T.")
_ITERS = flags.DEFINE_integer("iters", 200, "Kernel: timed calls per variant.")
_SEED = flags.DEFINE_integer("seed", 0, "Random adapters, prompts and kernel inputs.")

FMT = {"wall_s": ".2f", "tok_per_s": ".1f", "vs_base": ".3f", "device_s": ".2f", "host_s": ".2f",
       "device_ms_per_step": ".1f", "step_ms": ".1f", "device_ms": ".1f", "us": ".1f", "vs_base_matmul": ".2f",
       "mib": ".1f", "vs_base_weights": ".4f", "compile_s": ".1f"}


# ----------------------------------------------------------------- adapters
def write_adapter(root: pathlib.Path, cfg: Any, rank: int, alpha: float, rng: np.random.Generator) -> None:
    """A PEFT LoRA directory for a model of `cfg`: every layer's q,k,v,o,gate,up,down,
    A [r, in] ~ N(0, 1/in), B [out, r] ~ N(0, 0.02^2), float32."""
    from safetensors.numpy import save_file
    from jpaged.core.lora_adapters import lora_module_shapes
    shapes = lora_module_shapes(cfg)
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": sorted(PEFT_TARGETS), "bias": "none", "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "modules_to_save": None, "base_model_name_or_path": "SmolLM2-135M-Instruct",
        "inference_mode": True}, indent=2))
    tensors = {}
    for i in range(cfg.num_layers):
        for proj, (block, target) in PEFT_TARGETS.items():
            n_in, n_out = shapes[target]
            key = f"base_model.model.model.layers.{i}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.02 * rng.standard_normal((n_out, rank))).astype(np.float32)
    save_file(tensors, str(root / "adapter_model.safetensors"))


def make_adapters(root: pathlib.Path) -> dict[str, str]:
    """name -> directory of --num_adapters random adapters under root."""
    from jpaged.core.config import default_config
    from jpaged.loading.weights import read_model_config
    c = default_config()
    cfg = read_model_config(c.model, c.load_format)
    rng = np.random.default_rng(_SEED.value)
    out = {}
    for k in range(_NUM_ADAPTERS.value):
        path = root / f"lora{k}"
        write_adapter(path, cfg, _RANK.value, _ALPHA.value, rng)
        out[f"lora{k}"] = str(path)
    return out


def make_engine(adapters: dict[str, str]):
    max_running = _MAX_RUNNING.value
    return B.make_llm(lora_modules=",".join(f"{n}={p}" for n, p in adapters.items()),
                      max_loras=len(adapters), max_lora_rank=_RANK.value, max_num_seqs=max_running,
                      max_num_batched_tokens=max(_MAX_BATCHED.value, max_running), block_size=_BLOCK_SIZE.value,
                      max_model_len=max(_MAX_PROMPT.value + _MAX_TOKENS.value,
                                        _STEP_PROMPT.value + step_tokens()) + _BLOCK_SIZE.value)


def params(lora: str | None, max_tokens: int):
    from jpaged.core.sequence import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora=lora)


def spread(n: int, names: list[str]) -> list[str | None]:
    """Round robin over the base model (None) and each adapter."""
    cycle = [None, *names]
    return [cycle[i % len(cycle)] for i in range(n)]


def random_prompts(llm: Any, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n prompts of random token ids (lengths uniform in [lo, hi]); ids from 100 up to
    skip the special tokens."""
    rng = np.random.default_rng(seed)
    vocab = llm.model_config.vocab_size
    return [rng.integers(100, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def step_batch() -> int:
    return _STEP_BATCH.value or min(_NUM_REQUESTS.value, _MAX_RUNNING.value)


def step_tokens() -> int:
    return _STEP_TOKENS.value or _MAX_TOKENS.value


# ----------------------------------------------------------------- throughput
def run_once(llm: Any, ids: list[list[int]], loras: list[str | None]) -> dict:
    """One generate() of every prompt (request i under loras[i]); wall, tokens and step stats."""
    comp0, csec0 = llm.num_compilations, llm.compile_seconds
    outs, wall = B.timed_generate(llm, ids, [params(name, _MAX_TOKENS.value) for name in loras])
    st = llm.stats
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall, "steps": st.steps,
            "prefill_steps": st.prefill_steps, "device_s": st.device_seconds, "host_s": st.host_seconds,
            "device_ms_per_step": 1000 * st.device_seconds / max(1, st.steps),
            "compilations": llm.num_compilations - comp0, "compile_s": llm.compile_seconds - csec0,
            "tokens": [list(o.token_ids) for o in outs]}


def time_decode(llm: Any, ids: list[list[int]], loras: list[str | None], steps: int) -> tuple[list, list]:
    """One pass of harness.time_decode_steps' rule with each row under its adapter:
    (walls, device seconds) of the steps in which exactly len(ids) rows decode."""
    batch = len(ids)
    B.cold_prefix_cache(llm)
    for x, name in zip(ids, loras):
        llm.add_request(x, params(name, steps))
    return B.decode_step_times(llm, batch)


def run_throughput(llm: Any, names: list[str]) -> tuple[list[dict], list[dict], list[str]]:
    N, reps = _NUM_REQUESTS.value, _REPS.value
    ids = random_prompts(llm, N, _MIN_PROMPT.value, _MAX_PROMPT.value, _SEED.value)
    runs = {"base": [None] * N, "mixed": spread(N, names)}
    notes = []
    if _PRECOMPILE.value:
        t0 = time.perf_counter()
        n = llm.precompile()
        notes.append(f"precompile: {n} programs in {time.perf_counter() - t0:.1f} s")
        print(notes[-1], flush=True)
    for mode, loras in runs.items():  # warm-up: the buckets between the precompiled ones
        r = run_once(llm, ids, loras)
        print(f"warm-up {mode}: {r['wall_s']:.2f} s, {r['compilations']} compilations", flush=True)
    results: dict[str, list[dict]] = {m: [] for m in runs}
    for rep in range(reps):
        for mode, loras in runs.items():
            r = run_once(llm, ids, loras)
            results[mode].append(r)
            print(f"rep {rep} {mode}: {r['wall_s']:.2f} s, {r['tok_per_s']:.1f} tok/s, {r['steps']} steps, "
                  f"device {r['device_s']:.2f} s, host {r['host_s']:.2f} s, {r['compilations']} compilations",
                  flush=True)
    rows = []
    med = lambda rs, k: float(np.median([r[k] for r in rs]))  # noqa: E731
    for mode, rs in results.items():
        loras = runs[mode]
        rows.append({"part": "throughput", "run": mode, "requests": N,
                     "adapter_rows": sum(x is not None for x in loras), "reps": len(rs),
                     **{k: med(rs, k) for k in ("wall_s", "tok_per_s", "device_s", "host_s",
                                                "device_ms_per_step", "compile_s")},
                     **{k: int(round(med(rs, k))) for k in ("steps", "prefill_steps")},
                     "output_tokens": rs[0]["output_tokens"], "compilations": sum(r["compilations"] for r in rs)})
    base_wall = rows[0]["wall_s"]
    for r in rows:
        r["vs_base"] = r["wall_s"] / base_wall
    # Sanity: base rows of `mixed` vs the same prompts in `base`; adapter rows that differ.
    a, b = results["base"][0]["tokens"], results["mixed"][0]["tokens"]
    mixed = runs["mixed"]
    base_rows = [i for i, x in enumerate(mixed) if x is None]
    same = sum(a[i] == b[i] for i in base_rows)
    differ = sum(a[i] != b[i] for i, x in enumerate(mixed) if x is not None)
    notes.append(f"async_scheduling {llm.async_scheduling}: the host prepares a step while the one before "
                 "runs, so host work it hides counts in device_s; host_s is what it did not hide")
    notes.append(f"base rows of `mixed` with the same greedy tokens as in `base`: {same}/{len(base_rows)}; "
                 f"adapter rows whose tokens differ from the base model's: {differ}/{N - len(base_rows)}")
    print(notes[-1], flush=True)

    # ---- the decode step alone
    Bt, T = step_batch(), step_tokens()
    if Bt > _MAX_RUNNING.value:
        raise app.UsageError(f"--step_batch {Bt} > --max_running {_MAX_RUNNING.value}")
    sids = random_prompts(llm, Bt, _STEP_PROMPT.value, _STEP_PROMPT.value, _SEED.value + 1)
    modes = {"base": [None] * Bt, "one_adapter": [names[0]] * Bt, "mixed": spread(Bt, names)}
    for mode, loras in modes.items():
        time_decode(llm, sids, loras, T)  # warm-up
    timed: dict[str, tuple[list, list]] = {m: ([], []) for m in modes}
    comp0 = llm.num_compilations
    for _ in range(reps):
        for mode, loras in modes.items():
            w, d = time_decode(llm, sids, loras, T)
            timed[mode][0].extend(w)
            timed[mode][1].extend(d)
    step_rows = []
    for mode, (w, d) in timed.items():
        step_rows.append({"part": "decode_step", "run": mode, "batch": Bt,
                          "adapter_rows": sum(x is not None for x in modes[mode]),
                          "context": f"{_STEP_PROMPT.value}..{_STEP_PROMPT.value + T}", "steps_timed": len(w),
                          "step_ms": 1000 * float(np.median(w)) if w else float("nan"),
                          "device_ms": 1000 * float(np.median(d)) if d else float("nan")})
    for r in step_rows:
        r["vs_base"] = r["device_ms"] / step_rows[0]["device_ms"]
    notes.append(f"decode step: {llm.num_compilations - comp0} compilations during the timed passes")
    for r in step_rows:
        print(f"decode {r['run']}: step {r['step_ms']:.1f} ms, device {r['device_ms']:.1f} ms "
              f"({r['steps_timed']} steps)", flush=True)
    return rows, step_rows, notes


# ----------------------------------------------------------------- kernel
def run_kernel() -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jpaged.layers.lora import LoraLayer, one_hot_slots
    N, R, iters = _NUM_ADAPTERS.value, _RANK.value, _ITERS.value
    rng = np.random.default_rng(_SEED.value)

    def onehot_delta(x, a, b, onehot):
        return LoraLayer({"w": a}, {"w": b}, onehot).delta(x, "w")

    def gather_delta(x, a, b, slots, valid):
        xa = jnp.einsum("ti,tir->tr", x, a[slots]) * valid[:, None]
        return jnp.einsum("tr,tro->to", xa, b[slots]).astype(x.dtype)

    def base(x, w):
        return x @ w

    def fused(x, w, a, b, onehot):
        return x @ w + onehot_delta(x, a, b, onehot)

    fns = {"onehot": jax.jit(onehot_delta), "gather": jax.jit(gather_delta), "base": jax.jit(base),
           "base+onehot": jax.jit(fused)}
    empty = jax.jit(lambda s: s + 1)  # a scalar in and out: the dispatch floor
    rows = []
    for n_in, n_out, which in ((576, 576, "q/o"), (576, 1536, "gate/up")):
        w = jnp.asarray(rng.standard_normal((n_in, n_out)) / np.sqrt(n_in), jnp.float32)
        a = jnp.asarray(rng.standard_normal((N, n_in, R)) / np.sqrt(n_in), jnp.float32)
        b = jnp.asarray(0.02 * rng.standard_normal((N, R, n_out)), jnp.float32)
        for T in (int(t) for t in _KERNEL_TOKENS.value):
            x = jnp.asarray(rng.standard_normal((T, n_in)), jnp.float32)
            slot_np = (np.arange(T) % (N + 1)) - 1                       # -1 (base), 0 .. N-1
            onehot = one_hot_slots(jnp.asarray(slot_np, jnp.int32), N, jnp.float32)
            slots = jnp.asarray(np.maximum(slot_np, 0), jnp.int32)
            valid = jnp.asarray(slot_np >= 0, jnp.float32)
            args = {"onehot": (x, a, b, onehot), "gather": (x, a, b, slots, valid), "base": (x, w),
                    "base+onehot": (x, w, a, b, onehot)}
            ref = np.asarray(fns["onehot"](*args["onehot"]))
            got = np.asarray(fns["gather"](*args["gather"]))
            if not np.allclose(ref, got, rtol=1e-4, atol=1e-5):
                raise AssertionError(f"gather != onehot at T={T}, {n_in}x{n_out}: "
                                     f"max |diff| {np.abs(ref - got).max():.3g}")
            for name, f in fns.items():  # compile + warm
                for _ in range(3):
                    f(*args[name]).block_until_ready()
            zero = jnp.float32(0)
            empty(zero).block_until_ready()
            times: dict[str, list[float]] = {name: [] for name in [*fns, "empty"]}
            for _ in range(iters):  # interleaved call by call
                for name, f in fns.items():
                    t0 = time.perf_counter()
                    f(*args[name]).block_until_ready()
                    times[name].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                empty(zero).block_until_ready()
                times["empty"].append(time.perf_counter() - t0)
            us = {k: 1e6 * float(np.median(v)) for k, v in times.items()}
            for name in [*fns, "empty"]:
                rows.append({"part": "kernel", "run": name, "shape": f"{n_in}x{n_out} ({which})", "tokens": T,
                             "slots": N, "rank": R, "us": us[name], "vs_base_matmul": us[name] / us["base"],
                             "iters": iters})
            print(f"kernel {n_in}x{n_out} T={T}: " + ", ".join(f"{k} {v:.1f} us" for k, v in us.items()),
                  flush=True)
    return rows


# ----------------------------------------------------------------- memory
def run_memory(llm: Any) -> list[dict]:
    import jax
    lora = llm.runner.lora
    lora_bytes = int(sum(x.nbytes for x in jax.tree.leaves(lora))) if lora is not None else 0
    base = B.weight_bytes(llm)
    slots = lora.num_slots if lora is not None else 0
    rows = [{"part": "memory", "run": "base weights", "bytes": base},
            {"part": "memory", "run": f"LoRA slots ({slots} x rank {lora.max_rank if lora else 0})",
             "bytes": lora_bytes},
            {"part": "memory", "run": "LoRA, one slot", "bytes": lora_bytes // max(1, slots)},
            {"part": "memory", "run": "KV pool", "bytes": int(llm.kv_pool_bytes)}]
    for r in rows:
        r["mib"] = r["bytes"] / 2**20
        r["vs_base_weights"] = r["bytes"] / base
    return rows


# ----------------------------------------------------------------- output
def header_lines(parts: list[str]) -> list[str]:
    import jax
    note = _NOTE.value or "(none given: whether the machine was idle is the operator's to say, with --note)"
    return [
        "# LoRA adapters (`make bench-lora`)", "",
        f"- machine: {B.machine()}",
        f"- jax {jax.__version__} ({jax.default_backend()}), date {B.today()}",
        f"- note: {note}",
        f"- model: SmolLM2-135M-Instruct (embedded GGUF, fp32); {_NUM_ADAPTERS.value} random adapters of rank "
        f"{_RANK.value} (lora_alpha {_ALPHA.value:g}) on q,k,v,o,gate,up,down of every layer; "
        f"max_loras {_NUM_ADAPTERS.value}, max_lora_rank {_RANK.value}",
        f"- parts: {', '.join(parts)}; command: `python benchmarks/bench_lora.py "
        + " ".join(f"--{k}={v}" for k, v in flag_values().items()) + "`", ""]


def flag_values() -> dict[str, Any]:
    names = ["parts", "num_adapters", "rank", "num_requests", "min_prompt_tokens", "max_prompt_tokens",
             "max_tokens", "max_running", "max_num_batched_tokens", "reps", "step_batch", "step_tokens",
             "step_prompt_tokens", "kernel_tokens", "iters", "seed"]
    out = {}
    for n in names:
        v = flags.FLAGS[n].value
        out[n] = ",".join(v) if isinstance(v, list) else v
    return out


def write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def main(argv):
    del argv
    B.header("lora")
    parts = [p.strip() for p in _PARTS.value if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise app.UsageError(f"unknown parts {sorted(unknown)}; expected some of {PARTS}")
    out = pathlib.Path(_OUT.value)
    if not out.is_absolute():
        out = B.REPO / out
    out.parent.mkdir(parents=True, exist_ok=True)
    md = header_lines(parts)
    all_rows: list[dict] = []

    llm, tmp = None, None
    if "throughput" in parts or "memory" in parts:
        if not _ADAPTER_DIR.value:
            tmp = tempfile.mkdtemp(prefix="bench_lora_")
        root = pathlib.Path(_ADAPTER_DIR.value or tmp)
        t0 = time.perf_counter()
        adapters = make_adapters(root)
        print(f"{len(adapters)} adapters written under {root} in {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        llm = make_engine(adapters)
        print(f"engine with {len(adapters)} adapters loaded in {time.perf_counter() - t0:.1f} s; "
              f"{llm.num_blocks} KV blocks x {_BLOCK_SIZE.value}", flush=True)
    try:
        if "throughput" in parts:
            rows, step_rows, notes = run_throughput(llm, sorted(llm.lora_adapters))
            cols = ["run", "requests", "adapter_rows", "reps", "wall_s", "tok_per_s", "vs_base", "output_tokens",
                    "steps", "prefill_steps", "device_s", "host_s", "device_ms_per_step", "compilations"]
            print("\nThroughput (median of reps; vs_base: wall / base wall)")
            print(B.table(rows, cols, FMT))
            scols = ["run", "batch", "adapter_rows", "context", "steps_timed", "step_ms", "device_ms", "vs_base"]
            print("\nDecode step alone (median; vs_base: device ms / base device ms)")
            print(B.table(step_rows, scols, FMT))
            for n in notes:
                print(f"- {n}")
            all_rows += rows + step_rows
            md += [f"## Throughput ({_NUM_REQUESTS.value} requests, prompts {_MIN_PROMPT.value}-"
                   f"{_MAX_PROMPT.value} random tokens, {_MAX_TOKENS.value} new tokens, ignore_eos, greedy, "
                   f"up to {_MAX_RUNNING.value} running)", "",
                   "`base`: every request on the base model; `mixed`: round robin over base + each adapter. "
                   f"Median of {_REPS.value} alternating runs after precompile and a warm-up of each; "
                   "`vs_base` = wall / base wall; steps, device (forward) and host seconds from the engine's "
                   "step stats.", "", B.markdown_table(rows, cols, FMT), "",
                   f"### Decode step alone ({step_batch()} rows decoding)", "",
                   "Median wall (`step_ms`) and device (`device_ms`) time of the steps in which exactly the "
                   "batch decodes; `base` runs the program without adapters, `one_adapter` every row on one "
                   "adapter, `mixed` rows spread over base + every adapter. `vs_base` = device ms / base's.",
                   "", B.markdown_table(step_rows, scols, FMT), "", *[f"- {n}" for n in notes], ""]
        if "kernel" in parts:
            rows = run_kernel()
            cols = ["shape", "tokens", "run", "us", "vs_base_matmul"]
            print(f"\nLoRA update of one projection ({_NUM_ADAPTERS.value} slots, rank {_RANK.value}, fp32; "
                  f"median of {_ITERS.value} calls)")
            print(B.table(rows, cols, FMT))
            all_rows += rows
            md += [f"## The LoRA update alone ({_NUM_ADAPTERS.value} slots, rank {_RANK.value}, fp32)", "",
                   "One projection, jitted, tokens round robin over base (slot -1) and every slot. `onehot`: "
                   "`LoraLayer.delta` (shipped); `gather`: each token's A[slot], B[slot]; `base`: x @ W; "
                   "`base+onehot`: both in one program; `empty`: a jitted scalar op (the dispatch floor, "
                   f"included in every figure). Median us per call of {_ITERS.value}, interleaved.", "",
                   B.markdown_table(rows, cols, FMT), ""]
        if "memory" in parts:
            rows = run_memory(llm)
            cols = ["run", "bytes", "mib", "vs_base_weights"]
            print("\nMemory")
            print(B.table(rows, cols, FMT))
            all_rows += rows
            md += ["## Memory", "", f"Device bytes for max_loras {_NUM_ADAPTERS.value}, max_lora_rank "
                   f"{_RANK.value} (every leaf of `llm.runner.lora`) vs the base weights (`llm.params`).", "",
                   B.markdown_table(rows, cols, FMT), ""]
    finally:
        if llm is not None:
            llm.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    out_md, out_csv = out.with_name(out.name + ".md"), out.with_name(out.name + ".csv")
    out_md.write_text("\n".join(md).rstrip("\n") + "\n")
    write_csv(out_csv, all_rows)
    print(f"\n[wrote {out_md} and {out_csv}]")


if __name__ == "__main__":
    app.run(main)

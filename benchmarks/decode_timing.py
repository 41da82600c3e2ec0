"""How a decode step is timed: in the program of its own bucket, against what it reads.

Shared by benchmarks/device_check.py (part 5) and benchmarks/gpu_probe.py.  The
runner runs a step whose bucket is not built yet padded into the smallest larger
ready bucket while its own is built in the background
(`ModelRunner._ready_bucket`), so a decode timed right after a warm-up can run in
a prefill program many times its size.  `measure_decode` therefore warms up,
waits for the background builds, warms up again and only then times; it records
the bucket every timed step ran in and marks the row invalid if any was not the
batch's own.  Beside the wall time of `llm.step()` it times the step's program
alone (`device_ms`: the same executable called back to back with one step's exact
inputs, the donated pool fed back, one block at the end), so that
`host_ms = median_step_ms - device_ms` is what the engine adds around it.

`step_bytes` is the floor's numerator: the bytes one decode step must read.

    row = measure_decode(llm, batch=32, steps=32, prompt_len=16, nominal_gbps=4800.0, copy_gbps=4200.0)
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import jax
import numpy as np

from jpaged import SamplingParams
from jpaged.runtime.compilation import program_key
from jpaged.runtime.step_inputs import StepInputs

WARMUP_TOKENS = 3   # a prefill step and two decode steps: every program the timed pass runs
DISPATCH_SAMPLES = 5


# ----------------------------------------------------------------- bytes
def step_bytes(llm: Any, batch: int, context: float) -> int:
    """Bytes one decode step of `batch` sequences at `context` tokens of K/V reads:
    every weight but the embedding table (a step gathers `batch` of its rows; tied
    embeddings are read whole, as the LM head), plus each layer's K/V of `context`
    tokens per sequence (at most its sliding window), at the pool's bytes per token
    and layer (a quantized pool's code rows included).  Summed over devices."""
    tied = llm.model_config.tie_word_embeddings
    weights = sum(x.nbytes for path, x in jax.tree_util.tree_flatten_with_path(llm.runner.params)[0]
                  if tied or _top_key(path) != "embed")
    return weights + batch * kv_bytes_per_token(llm, context)


def kv_bytes_per_token(llm: Any, context: float) -> int:
    """K/V bytes one sequence at `context` tokens holds in the pool, over all layers."""
    cfg, layers_per_page = llm.model_config, llm.kv_layout.layers_per_page
    per_token_layer = llm.block_bytes / (layers_per_page * llm.config.block_size)
    tokens = sum(context if cfg.layer_window(i) is None else min(context, cfg.layer_window(i))
                 for i in range(cfg.num_layers))
    return round(per_token_layer * tokens)


def _top_key(path: tuple) -> str:
    first = path[0]
    return str(getattr(first, "key", getattr(first, "name", first)))


# ----------------------------------------------------------- step records
class StepRecorder:
    """While active, notes the exact StepInputs of every step the runner launches and
    hands them out as the steps are collected (`take`).  It wraps the runner
    instance's `_run` and `collect` (the runner offers no hook for the inputs it builds; its
    class is untouched) and unwraps on exit."""

    def __init__(self, runner: Any):
        self.runner = runner
        self._launched: dict[int, tuple[Any, StepInputs]] = {}  # id(PendingStep) -> (it, its inputs)
        self._collected: list[StepInputs] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "StepRecorder":
        run, collect = self.runner._run, self.runner.collect

        def recording_run(block_copies, inputs, num_seqs):
            pending = run(block_copies, inputs, num_seqs)
            if pending.outputs is not None:
                self._launched[id(pending)] = (pending, inputs)
            return pending

        def recording_collect(pending):
            result = collect(pending)
            launched = self._launched.pop(id(pending), None)
            if launched is not None:
                self._collected.append(launched[1])
            return result

        for name, fn in (("_run", recording_run), ("collect", recording_collect)):
            self._saved[name] = vars(self.runner).get(name)
            setattr(self.runner, name, fn)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, previous in self._saved.items():
            if previous is None:
                delattr(self.runner, name)
            else:
                setattr(self.runner, name, previous)

    def take(self) -> list[StepInputs]:
        """The inputs of the steps collected since the last take, in order."""
        out, self._collected = self._collected, []
        return out


@dataclasses.dataclass
class TimedStep:
    """One llm.step() call whose completed step had the whole batch decoding."""
    wall: float
    inputs: StepInputs

    @property
    def bucket(self) -> int:
        return self.inputs.num_tokens

    @property
    def context(self) -> float:
        lens = np.asarray(self.inputs.meta.kv_lens)
        return float(lens[lens > 0].mean())


def is_batch_decode(inputs: StepInputs, batch: int) -> bool:
    """Whether the step's real tokens are one decode token of each of `batch` sequences."""
    meta = inputs.meta
    return int(np.asarray(meta.cu_q_lens)[-1]) == batch and int((np.asarray(meta.kv_lens) > 0).sum()) == batch


def decode_pass(llm: Any, recorder: StepRecorder, batch: int, prompt_len: int, max_tokens: int,
                seed: int) -> tuple[list[TimedStep], int]:
    """Runs `batch` random greedy prompts to max_tokens with llm.step(); returns the
    calls whose completed step was a decode of the whole batch and during which no
    program was built (timed), and how many calls did build one."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(seed)
    for ids in rng.integers(3, llm.model_config.vocab_size, (batch, prompt_len)):
        llm.add_request(ids.tolist(), params)
    timed, compiled = [], 0
    recorder.take()
    while llm.has_unfinished_requests():
        compile0 = llm.compile_seconds
        t0 = time.perf_counter()
        llm.step()
        wall = time.perf_counter() - t0
        done = recorder.take()
        built = llm.compile_seconds > compile0
        compiled += built
        if not built and len(done) == 1 and is_batch_decode(done[0], batch):
            timed.append(TimedStep(wall, done[0]))
    return timed, compiled


# ------------------------------------------------------------ device time
def device_time(runner: Any, inputs: StepInputs, calls: int) -> tuple[float, float]:
    """(seconds per call, dispatch seconds) of the program `inputs` ran in: `calls`
    calls back to back with these inputs already on the device, the donated pool
    fed from each call to the next, one block at the end; dispatch is the median
    time one call takes to return, from an idle device.  Every call rewrites the
    step's own K/V slots with what the step wrote there, and the last pool goes
    back to the runner, so the engine goes on as before."""
    exe = runner.programs[program_key(inputs)]
    args = jax.device_put(inputs, exe.input_shardings[0][2])
    weights, pool = runner.step_weights(), runner.kv_pool  # as the runner hands them to its programs
    try:
        dispatch = []
        for _ in range(DISPATCH_SAMPLES):
            t0 = time.perf_counter()
            out, pool = exe(weights, pool, args)
            dispatch.append(time.perf_counter() - t0)
            jax.block_until_ready((out, pool))
        t0 = time.perf_counter()
        for _ in range(calls):
            out, pool = exe(weights, pool, args)
        jax.block_until_ready((out, pool))
        per_call = (time.perf_counter() - t0) / calls
    finally:
        runner.kv_pool = pool
        runner.restore_pool()  # a call that failed after taking the pool: a fresh one
    return per_call, statistics.median(dispatch)


# ------------------------------------------------------------------ a row
def measure_decode(llm: Any, batch: int, steps: int, prompt_len: int, *, nominal_gbps: float | None,
                   copy_gbps: float | None, device_calls: int = 20) -> dict[str, Any]:
    """One decode row: a warm-up pass, the background builds awaited, a second
    warm-up, then `steps` timed decode steps of `batch` sequences of `prompt_len`
    random prompt tokens, on an idle engine.  See the module docstring for what
    each field means; `invalid` says why a row's numbers are not the batch's own."""
    for name, value in (("batch", batch), ("steps", steps), ("prompt_len", prompt_len),
                        ("device_calls", device_calls)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if batch > llm.config.max_num_seqs:
        raise ValueError(f"batch {batch} exceeds the engine's max_num_seqs={llm.config.max_num_seqs}")
    if llm.has_unfinished_requests():
        raise RuntimeError("measure_decode needs an idle engine")
    runner = llm.runner
    with StepRecorder(runner) as recorder:
        decode_pass(llm, recorder, batch, prompt_len, WARMUP_TOKENS, seed=batch)
        runner.wait_for_programs()  # the buckets the warm-up ran padded, built in the background
        decode_pass(llm, recorder, batch, prompt_len, WARMUP_TOKENS, seed=5_000 + batch)
        timed, compiled = decode_pass(llm, recorder, batch, prompt_len, steps + 1, seed=10_000 + batch)
    if not timed:
        raise RuntimeError(f"batch {batch}: no step decoded the whole batch without building a program")
    row = timing_row(llm, batch, timed, nominal_gbps, copy_gbps)
    if compiled:  # the warm-ups should have built every program
        row["steps_that_compiled"] = compiled
    device_s, dispatch_s = device_time(runner, timed[-1].inputs, device_calls)
    row["device_ms"] = round(1000 * device_s, 3)
    row["host_ms"] = round(row["median_step_ms"] - row["device_ms"], 3)
    row["dispatch_us"] = round(1e6 * dispatch_s, 1)
    return row


def significant(x: float, digits: int = 4) -> float:
    """x rounded to `digits` significant digits (a tiny model's floors are microseconds)."""
    return float(f"{x:.{digits}g}")


def timing_row(llm: Any, batch: int, timed: list[TimedStep], nominal_gbps: float | None,
               copy_gbps: float | None) -> dict[str, Any]:
    """The wall-time fields of a row, its buckets and its floors."""
    walls = [t.wall for t in timed]
    step_s = statistics.median(walls)
    context = statistics.mean(t.context for t in timed)
    own = llm.runner.token_bucket(batch)
    buckets = sorted({t.bucket for t in timed})
    read = step_bytes(llm, batch, context)
    row: dict[str, Any] = {
        "batch": batch, "context": round(context, 1), "bucket": own, "buckets_run": buckets,
        "bucket_ok": buckets == [own], "decode_steps_timed": len(timed),
        "median_step_ms": round(1000 * step_s, 3),
        "decode_tok_per_s": round(batch * len(walls) / sum(walls), 1),
        "step_GB": significant(read / 1e9)}
    floors = {suffix: read / (gbps * 1e9) if gbps else None for suffix, gbps in (("", nominal_gbps),
                                                                                  ("@copy", copy_gbps))}
    row.update({f"floor_ms{suffix}": significant(1000 * s) if s else None for suffix, s in floors.items()})
    row.update({f"step / floor{suffix}": round(step_s / s, 2) if s else None for suffix, s in floors.items()})
    if not row["bucket_ok"]:
        row["invalid"] = f"ran padded into bucket(s) {[b for b in buckets if b != own]} (own bucket {own})"
    return row

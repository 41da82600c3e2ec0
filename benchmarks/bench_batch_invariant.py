"""batch_invariant mode: which XLA:CPU operations make a token's result depend on
its batch, whether the mode fixes them, and what the mode costs.

    python benchmarks/bench_batch_invariant.py [--parts=probe,engine] [--note="idle, ..."]
    make bench-batch-invariant ARGS='--reps=3'

probe   Each operation alone, fp32, jitted, on SmolLM2-135M's shapes: the rows of a
        batch of M (1..1024) against the same rows computed in a batch of 64 (or 1024):
        `x @ W` for the 7 projections and the tied LM head, RMSNorm's mean of squares
        (d = 576), log_softmax's sum over the vocabulary (49152, and 256 as in the tests'
        models), and the CPU attention
        kernel on one query token (G = 3 heads of one kv head, head_dim 64, 200 cached
        keys) decoded alone vs as the last token of a 48-token prefill chunk.  Each row:
        the batch sizes at which some row changes and the largest change, for XLA /
        the default kernel (`default`) and for the batch_invariant replacement
        (jpaged.layers.batch_invariant: `invariant`).
engine  SmolLM2-135M fp32, attention_impl=cpu, one engine per mode (batch_invariant off
        / on).  Invariance: a 100-token target prompt, 32 greedy tokens with logprobs,
        run alone, then as the last of --num_requests (64) requests (32-128 random prompt
        tokens, --max_tokens new tokens, greedy) with max_num_batched_tokens 256 (its
        prompt is chunked differently); max |difference| of its logprobs between the two
        runs and against decode.score of prompt + output.  Cost: the same 64 requests
        (precompiled, one untimed pass), modes alternated --reps (3) times: median wall,
        output tok/s, ratio; then the decode step alone at batch 64 (harness.time_decode_steps).

Writes benchmarks/results/<out>.md and .csv (default --out=batch_invariant).
TIMINGS: run on an idle machine and say so with --note.
"""

from __future__ import annotations

import pathlib
import time

import numpy as np
from absl import app, flags

import harness

FLAGS = flags.FLAGS
flags.DEFINE_list("parts", ["probe", "engine"], "probe, engine")
flags.DEFINE_integer("num_requests", 64, "requests of the engine workload")
flags.DEFINE_integer("max_tokens", 64, "new tokens per request")
flags.DEFINE_integer("reps", 3, "alternating timed passes per mode")
flags.DEFINE_string("out", "batch_invariant", "name of the .md / .csv written under benchmarks/results/")
flags.DEFINE_string("note", "", "how the machine was (idle, ...): goes into the .md header")

SMOLLM = dict(dtype="float32", attention_impl="cpu", max_model_len=512, max_num_seqs=64,
              max_num_batched_tokens=256, enable_prefix_caching=False)


def _changes(f, x: np.ndarray, sizes, ref_rows: int) -> tuple[str, float]:
    """(batch sizes whose rows differ from those of a batch of ref_rows, largest difference)."""
    import jax.numpy as jnp
    ref = np.asarray(f(jnp.asarray(x[:ref_rows])))
    bad, worst = [], 0.0
    for m in sizes:
        y = np.asarray(f(jnp.asarray(x[:m])))
        diff = float(np.abs(y - ref[:m]).max())
        if diff:
            bad.append(m)
            worst = max(worst, diff)
    return ",".join(map(str, bad)) or "none", worst


def probe() -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jpaged.layers import batch_invariant as bi
    from pallas_kernels import cpu
    rng = np.random.default_rng(0)
    sizes = (1, 2, 3, 7, 8, 16, 47, 48, 64, 256, 512)
    rows = []

    def add(op, default, invariant, x, sizes=sizes, ref_rows=1024):
        d, dw = _changes(jax.jit(default), x, sizes, ref_rows)
        i, iw = _changes(jax.jit(invariant), x, sizes, ref_rows)
        rows.append(dict(op=op, default_changes_at=d, default_max_diff=dw, invariant_changes_at=i,
                         invariant_max_diff=iw))

    for name, (k, n) in {"q / o (576x576)": (576, 576), "k / v (576x192)": (576, 192),
                         "gate / up (576x1536)": (576, 1536), "down (1536x576)": (1536, 576)}.items():
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
        x = rng.standard_normal((1024, k)).astype(np.float32)
        add(f"x @ W {name}", lambda x, w=w: x @ w, lambda x, w=w: bi.matmul(x, w), x)
    embed = jnp.asarray(rng.standard_normal((49152, 576)) * 0.05, jnp.float32)
    x = rng.standard_normal((64, 576)).astype(np.float32)
    add("LM head (tied, 576x49152)", lambda x: x @ embed.T, lambda x: bi.matmul(x, embed, transpose_w=True), x,
        sizes=(1, 2, 7, 8, 16, 48), ref_rows=64)
    x = rng.standard_normal((1024, 576)).astype(np.float32)
    add("RMSNorm mean of squares (576)", lambda x: jnp.mean(x * x, -1, keepdims=True), bi.mean_square, x)
    for vocab in (49152, 256):  # SmolLM2's, the test models'
        x = (rng.standard_normal((64, vocab)) * 3).astype(np.float32)
        add(f"log_softmax sum ({vocab})", lambda x: jnp.sum(jnp.exp(x - x.max(-1, keepdims=True)), -1, keepdims=True),
            lambda x: bi.row_sum(jnp.exp(x - x.max(-1, keepdims=True))), x, sizes=(1, 2, 7, 8, 16, 48), ref_rows=64)
    rows.append(_attention_probe(rng, cpu))
    return rows


def _attention_probe(rng, cpu) -> dict:
    """One token at position 199 of a sequence: decoded alone (T = 1) vs the last
    of a 48-token prefill chunk, default kernel vs token_tile=1."""
    import jax.numpy as jnp
    H, KVH, D, BS, kv_len = 9, 3, 64, 16, 200
    blocks = -(-kv_len // BS)
    pool = jnp.asarray(rng.standard_normal((blocks + 1, 1, 2, KVH, BS, D)), jnp.float32)
    table = jnp.arange(1, blocks + 1, dtype=jnp.int32)[None]
    q = jnp.asarray(rng.standard_normal((48, H, D)), jnp.float32)
    out = {}
    for tile in (0, 1):
        alone = cpu.paged_attention_cpu(q[-1:], pool, 0, table, jnp.array([kv_len]), jnp.array([0, 1]),
                                        token_tile=tile)
        chunk = cpu.paged_attention_cpu(q, pool, 0, table, jnp.array([kv_len]), jnp.array([0, 48]),
                                        token_tile=tile)
        out[tile] = float(np.abs(np.asarray(alone[0]) - np.asarray(chunk[-1])).max())
    fmt = lambda d: "decode vs prefill" if d else "none"  # noqa: E731
    return dict(op="attention, 1 query (G=3, 200 keys)", default_changes_at=fmt(out[0]), default_max_diff=out[0],
                invariant_changes_at=fmt(out[1]), invariant_max_diff=out[1])


def engine() -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jpaged import decode
    from jpaged.core.sequence import SamplingParams
    rng = np.random.default_rng(0)
    target = rng.integers(3, 40000, size=100).tolist()
    lengths = rng.integers(32, 129, size=FLAGS.num_requests - 1)
    others = [rng.integers(3, 40000, size=int(n)).tolist() for n in lengths]
    work = [rng.integers(3, 40000, size=int(n)).tolist() for n in rng.integers(32, 129, size=FLAGS.num_requests)]
    target_params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=1)
    params = harness.greedy(FLAGS.max_tokens, ignore_eos=True)
    score = jax.jit(decode.score, static_argnums=0)
    llms, rows = {}, []
    for mode in (False, True):
        t0 = time.perf_counter()
        llm = harness.make_llm(**SMOLLM, batch_invariant=mode)
        llm.precompile()
        ready = time.perf_counter() - t0
        alone = llm.generate([target], target_params)[0]
        mixed = llm.generate(others + [target], [params] * len(others) + [target_params])[-1]
        lp = lambda o: np.array([x.logprob for x in o.logprobs], np.float32)  # noqa: E731
        ids = target + alone.token_ids
        scored = np.asarray(score(llm.graphdef, llm.params, jnp.array([ids]), jnp.array([len(ids)])))[0]
        same = mixed.token_ids == alone.token_ids
        rows.append(dict(part="engine", mode="batch_invariant" if mode else "default", ready_s=ready,
                         same_tokens=same,
                         alone_vs_batch64=float(np.abs(lp(alone) - lp(mixed)).max()) if same else float("nan"),
                         alone_vs_score=float(np.abs(lp(alone) - scored[len(target) - 1:]).max())))
        llm.generate(work, params)  # untimed pass
        llms[mode] = llm
    walls = {False: [], True: []}
    for _ in range(FLAGS.reps):
        for mode, llm in llms.items():
            walls[mode].append(harness.timed_generate(llm, work, params)[1])
    out_tokens = len(work) * FLAGS.max_tokens
    for row, mode in zip(rows, (False, True)):
        wall = float(np.median(walls[mode]))
        step = harness.time_decode_steps(llms[mode], 64, 32, ids=work[:64])
        row.update(wall_s=wall, tok_s=out_tokens / wall, ratio=wall / float(np.median(walls[False])),
                   decode_step_ms=step["step_ms"])
    return rows


FORMATS = {"default_max_diff": ".2e", "invariant_max_diff": ".2e", "alone_vs_batch64": ".2e",
           "alone_vs_score": ".2e", "ready_s": ".1f", "wall_s": ".2f", "tok_s": ".0f", "ratio": ".2f",
           "decode_step_ms": ".1f"}


def main(_):
    sections = [f"# batch_invariant mode\n\n{harness.machine()}, {harness.today()}. {FLAGS.note}"]
    all_rows = []
    if "probe" in FLAGS.parts:
        rows = probe()
        print(harness.table(rows, formats=FORMATS))
        sections.append("## Which operations change with the batch (probe)\n\n" +
                        harness.markdown_table(rows, formats=FORMATS))
        all_rows += [dict(part="probe", **r) for r in rows]
    if "engine" in FLAGS.parts:
        rows = engine()
        print(harness.table(rows, formats=FORMATS))
        sections.append(f"## SmolLM2 fp32, {FLAGS.num_requests} requests x {FLAGS.max_tokens} tokens "
                        f"(precompiled, warm, median of {FLAGS.reps})\n\n" +
                        harness.markdown_table(rows, formats=FORMATS))
        all_rows += rows
    name = pathlib.Path(FLAGS.out).name
    harness.write_markdown(name, "\n\n".join(sections))
    harness.write_csv(name, all_rows, list(dict.fromkeys(k for r in all_rows for k in r)))


if __name__ == "__main__":
    app.run(main)

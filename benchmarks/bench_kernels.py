"""Benchmark ragged paged attention (batch x context grid; decode by default).

Each point is one ragged step of `batch` sequences, all with K/V of length
`context` and `--q_len` new tokens each at the end (1 = decode; more = a
prefill chunk over a cached prefix): q [batch * q_len, H, D], cu_q_lens =
arange(batch + 1) * q_len, the contract of `pallas_kernels.paged_attention`.
  ours      pallas_kernels.paged_attention(impl=<--impl, default by backend>);
            for "pallas_gpu", pallas_kernels.gpu.paged_attention_gpu with the
            tuning flags below
  jax_ops   jax.experimental.pallas.ops.gpu.paged_attention (decode only,
            its own layout: k/v_pages [KVH, pages, BS, D]; the pool is
            converted outside the timed region).  GPU only unless
            --jax_ops_on_cpu; skipped for --q_len > 1.
  reference pallas_kernels.reference (gather + masked dense, fp32)
  contig    jax.nn.dot_product_attention over a contiguous [B, S, KVH, D]
            cache (XLA or cuDNN, whatever jax picks; a causal-offset mask for
            --q_len > 1): no paging at all, so paging overhead = ours / contig - 1.
  time per call is the slope between two jitted programs running --iters
  and 2 x --iters unrolled, data-dependent attention calls (median over
  --reps of each): (t(2n) - t(n)) / n, so dispatch, synchronisation and the
  fixed cost of a program cancel and what is left is device time; the calls rotate over
  several input sets living in disjoint pool blocks so the K/V bytes do not
  fit in L2 (>= --rotate_mb of K/V across the sets).
  GB/s = K/V bytes that must be read (B * ctx * KVH * D * 2 * itemsize; and
  D bytes of codes per BS rows for a quantized --kv_dtype, int8 or float8_e4m3fn) /
  time; %copy = GB/s / device-to-device copy bandwidth measured in the same
  run (read + write of a --copy_mb buffer).

Writes <out>.md and <out>.csv (default benchmarks/kernels/results_<device>).

  python benchmarks/bench_kernels.py                      # on a GPU
  python benchmarks/bench_kernels.py --smoke              # tiny CPU run (interpret)
  python benchmarks/bench_kernels.py --kv_dtype=int8 --variants=ours,reference   # quantized pool
"""

from __future__ import annotations

import csv
import datetime
import functools
import math
import os
import re
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402
from pallas_kernels.reference import (is_quantized, paged_attention_reference,  # noqa: E402
                                      quantize_pages)

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "4", "16", "64", "256"], "Batch sizes.")
flags.DEFINE_list("context_lens", ["512", "2048", "8192", "32768"], "Context lengths (tokens).")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
flags.DEFINE_integer("gqa", 4, "Query heads per KV head.")
flags.DEFINE_integer("block_size", 16, "Tokens per pool block.")
flags.DEFINE_string("dtype", "bfloat16", "q dtype (and K/V's unless --kv_dtype).")
flags.DEFINE_string("kv_dtype", None, "K/V pool dtype (default --dtype); int8 or float8_e4m3fn: "
                    "quantized rows (head_dim values + a scale code). jax_ops and contig "
                    "are skipped for quantized pools.")
flags.DEFINE_integer("iters", 20, "n: unrolled attention calls per timed program (n and 2n are run).")
flags.DEFINE_integer("reps", 10, "Timed repetitions (median is reported).")
flags.DEFINE_enum("impl", None, list(pallas_kernels.IMPLS), "Our impl (default by backend: "
                  "pallas_kernels.default_impl()).")
flags.DEFINE_integer("q_len", 1, "New tokens per sequence (1 = decode).")
flags.DEFINE_integer("block_k", None, "gpu: keys per loop iteration (default: the kernel's).")
flags.DEFINE_integer("block_m", None, "gpu: query rows per ragged tile (default: the kernel's).")
flags.DEFINE_integer("decode_rows", None,
                     "gpu: rows of a split-KV tile, 0 = no split-KV kernel (default: kernel's).")
flags.DEFINE_integer("num_warps", None, "gpu: warps per CTA (default: the kernel's).")
flags.DEFINE_integer("num_stages", None, "gpu: Triton pipeline stages (default: the kernel's).")
flags.DEFINE_integer("num_partitions", None, "gpu: split-KV partitions (default: heuristic).")
flags.DEFINE_list("variants", ["ours", "jax_ops", "reference", "contig"], "What to time.")
flags.DEFINE_float("max_kv_gb", 12.0, "Skip points whose K/V (one input set) exceeds this.")
flags.DEFINE_float("rotate_mb", 256.0, "Rotate input sets until this much K/V is touched.")
flags.DEFINE_integer("max_sets", 8, "Most input sets to rotate over.")
flags.DEFINE_float("copy_mb", 1024.0, "Buffer size for the device copy bandwidth test.")
flags.DEFINE_bool("smoke", False, "Tiny grid that runs on CPU (interpret mode).")
flags.DEFINE_bool("jax_ops_on_cpu", False, "Also run jax's shipped GPU kernel in interpret mode.")
flags.DEFINE_enum("contig_impl", None, ["xla", "cudnn"],
                  "jax.nn.dot_product_attention implementation for the contiguous baseline.")
flags.DEFINE_string("out", None, "Output path prefix (.md / .csv appended).")


def device_name() -> str:
    d = jax.devices()[0]
    return getattr(d, "device_kind", d.platform)


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_").lower()


def timeit(fn, *args, reps: int) -> float:
    """Median wall time of fn(*args) with the result blocked on (seconds)."""
    jax.block_until_ready(fn(*args))                      # compile + warm
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def per_call_seconds(build, n: int, *args, reps: int) -> float:
    """Device time of one call: slope between programs of n and 2n chained calls.

    If noise makes the slope non-positive (a loaded CPU), falls back to the
    amortised time of the longer program, an upper bound, and says so.
    """
    t_n = timeit(build(n), *args, reps=reps)
    t_2n = timeit(build(2 * n), *args, reps=reps)
    if t_2n <= t_n:
        print(f"timing noise: t(2n)={t_2n:.3g}s <= t(n)={t_n:.3g}s; using t(2n)/2n", flush=True)
        return t_2n / (2 * n)
    return (t_2n - t_n) / n


def copy_bandwidth(mb: float, reps: int) -> float:
    """Device-to-device copy GB/s (bytes read + bytes written)."""
    n = int(mb * 2 ** 20) // 4
    x = jnp.arange(n, dtype=jnp.float32)

    def build(iters):
        def f(x):
            for _ in range(iters):
                x = jax.lax.optimization_barrier(x + 1.0)    # read n*4, write n*4; no fusion
            return x
        return jax.jit(f)

    return 2 * n * 4 / per_call_seconds(build, 5, x, reps=reps) / 1e9


def make_sets(rng, *, B, ctx, q_len, n_sets, H, KVH, D, BS, dtype, kv_dtype=None):
    """One pool holding n_sets disjoint input sets (full-length sequences, q_len
    new tokens each): pool, block tables [n_sets, B, W], q [n_sets, B*q_len, H, D],
    kv_lens [B], cu_q_lens [B + 1].  The pool is `kv_dtype` (default `dtype`),
    `quantize_pages` of the random K/V when that is int8 / float8_e4m3fn."""
    W = -(-ctx // BS)
    nb = 1 + n_sets * B * W
    kv_dtype = jnp.dtype(kv_dtype or dtype)
    pool = rng.standard_normal((nb, 1, 2, KVH, BS, D), np.float32)
    pool = (quantize_pages(jnp.asarray(pool), kv_dtype) if is_quantized(kv_dtype)
            else jnp.asarray(pool, kv_dtype))
    perm = 1 + rng.permutation(nb - 1)
    bts = jnp.asarray(perm.reshape(n_sets, B, W).astype(np.int32))
    qs = jnp.asarray(rng.standard_normal((n_sets, B * q_len, H, D), np.float32), dtype)
    kv_lens = jnp.full((B,), ctx, jnp.int32)
    cu_q_lens = jnp.arange(B + 1, dtype=jnp.int32) * q_len
    return pool, bts, qs, kv_lens, cu_q_lens


def looped(attn, iters: int, n_sets: int):
    """jit(fn) running `iters` chained calls, rotating over the input sets.

    Each call gets `dep`, an int32 0 that XLA cannot prove is 0 (it is
    computed from the previous call's output), added to q and, for the paged
    variants, to the block table, so the gather of the reference cannot be
    CSE'd or hoisted out of the chain (an optimization barrier is not enough:
    XLA strips it before CSE).  The contiguous baseline has no K/V-only work
    to hoist (jax.nn.dot_product_attention feeds K, V straight into its dots).
    """
    def run(qs, *arrays):
        acc = jnp.zeros((), jnp.float32)
        for i in range(iters):
            s = i % n_sets
            dep = jnp.where(acc == 1.2345e-30, 1, 0).astype(jnp.int32)
            out = attn(qs[s] + dep.astype(qs.dtype), s, dep, *arrays)
            acc = acc + out.reshape(-1)[0].astype(jnp.float32)
        return acc
    return jax.jit(run)


GPU_TUNING = ("block_k", "block_m", "decode_rows", "num_partitions", "num_warps", "num_stages")


def ours(impl: str):
    """Our attention; the gpu kernels with any launch overrides from the flags."""
    if impl != "pallas_gpu":
        return functools.partial(pallas_kernels.paged_attention, impl=impl)
    from pallas_kernels import gpu
    tuning = {name: getattr(FLAGS, name) for name in GPU_TUNING if getattr(FLAGS, name) is not None}
    return functools.partial(gpu.paged_attention_gpu, **tuning)


def bench_point(rng, B, ctx, impl, variants, bw):
    H, KVH, D, BS = FLAGS.num_kv_heads * FLAGS.gqa, FLAGS.num_kv_heads, FLAGS.head_dim, FLAGS.block_size
    dtype = jnp.dtype(FLAGS.dtype)
    kv_dtype = jnp.dtype(FLAGS.kv_dtype or FLAGS.dtype)
    quantized = is_quantized(kv_dtype)
    kv_bytes = B * ctx * KVH * D * (1 + quantized / BS) * 2 * kv_dtype.itemsize   # + the code rows
    row = dict(batch=B, context=ctx, kv_mb=round(kv_bytes / 2 ** 20, 2))
    if kv_bytes > FLAGS.max_kv_gb * 2 ** 30:
        row["note"] = "skipped: K/V larger than --max_kv_gb"
        return row
    n_sets = int(min(FLAGS.max_sets, max(1, math.ceil(FLAGS.rotate_mb * 2 ** 20 / kv_bytes))))
    ql = FLAGS.q_len
    pool, bts, qs, kv_lens, cu_q_lens = make_sets(rng, B=B, ctx=ctx, q_len=ql, n_sets=n_sets, H=H,
                                                  KVH=KVH, D=D, BS=BS, dtype=dtype,
                                                  kv_dtype=kv_dtype)
    W = bts.shape[-1]
    iters, reps = FLAGS.iters, FLAGS.reps
    notes = []

    def record(name, fn, *args):
        try:
            t = per_call_seconds(lambda n: looped(fn, n, n_sets), iters, qs, *args, reps=reps)
        except Exception as e:  # noqa: BLE001 - report, keep going
            notes.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            return
        gbs = kv_bytes / t / 1e9
        row[f"{name}_us"] = round(t * 1e6, 2)
        row[f"{name}_GBps"] = round(gbs, 1)
        row[f"{name}_pct_copy"] = round(100 * gbs / bw, 1)

    if "ours" in variants:
        record("ours", lambda q, s, dep, pool, bts: ours(impl)(
            q, pool, 0, bts[s] + dep, kv_lens, cu_q_lens), pool, bts)
    if "reference" in variants:
        record("reference", lambda q, s, dep, pool, bts: paged_attention_reference(
            q, pool, 0, bts[s] + dep, kv_lens, cu_q_lens), pool, bts)
    if quantized and ("jax_ops" in variants or "contig" in variants):
        notes.append("jax_ops, contig: skipped (quantized pool)")
        variants = [v for v in variants if v not in ("jax_ops", "contig")]
    if ("jax_ops" in variants and ql == 1
            and (jax.default_backend() == "gpu" or FLAGS.jax_ops_on_cpu)):
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
        k_pages = jnp.transpose(pool[:, 0, 0], (1, 0, 2, 3))   # [KVH, pages, BS, D], untimed
        v_pages = jnp.transpose(pool[:, 0, 1], (1, 0, 2, 3))
        k_splits = math.gcd(W, 16)
        ppcb = math.gcd(W // k_splits, 8)
        interp = jax.default_backend() != "gpu"
        record("jax_ops", lambda q, s, dep, kp, vp, bts: jax_pa.paged_attention(
            q, kp, vp, bts[s] + dep, kv_lens, k_splits=k_splits, pages_per_compute_block=ppcb,
            interpret=interp), k_pages, v_pages, bts)
        del k_pages, v_pages
    if "contig" in variants:
        # contiguous caches for every set: [n_sets, B, S, KVH, D], built untimed
        k_c = jnp.stack([pool[bts[s], 0, 0].transpose(0, 1, 3, 2, 4).reshape(B, W * BS, KVH, D)
                         for s in range(n_sets)])
        v_c = jnp.stack([pool[bts[s], 0, 1].transpose(0, 1, 3, 2, 4).reshape(B, W * BS, KVH, D)
                         for s in range(n_sets)])
        # new token i of a sequence sits at ctx - ql + i and sees keys 0 .. that position
        mask = None if ql == 1 else (jnp.arange(W * BS)[None, :]
                                     <= ctx - ql + jnp.arange(ql)[:, None])[None, None]
        record("contig", lambda q, s, dep, k_c, v_c: jax.nn.dot_product_attention(
            q.reshape(B, ql, H, D), k_c[s], v_c[s], mask=mask,
            implementation=FLAGS.contig_impl), k_c, v_c)
        del k_c, v_c
    if "ours_us" in row and "contig_us" in row:
        row["paging_overhead_pct"] = round(100 * (row["ours_us"] / row["contig_us"] - 1), 1)
    if notes:
        row["note"] = "; ".join(notes)
    return row


COLUMNS = ["batch", "context", "kv_mb"] + [
    f"{v}_{m}" for v in ("ours", "jax_ops", "reference", "contig") for m in ("us", "GBps", "pct_copy")
] + ["paging_overhead_pct", "note"]


def main(argv):
    del argv
    if FLAGS.smoke:
        FLAGS.batch_sizes = ["1", "3"]
        FLAGS.context_lens = ["64", "200"]
        FLAGS.head_dim, FLAGS.num_kv_heads, FLAGS.gqa, FLAGS.block_size = 64, 2, 4, 16
        FLAGS.iters, FLAGS.reps = 2, 2
        FLAGS.copy_mb, FLAGS.rotate_mb, FLAGS.max_sets = 16.0, 1.0, 2
    impl = FLAGS.impl or ("pallas_gpu" if FLAGS.smoke and jax.default_backend() == "cpu"
                          else pallas_kernels.default_impl())
    dev = device_name()
    backend = jax.default_backend()
    out = FLAGS.out or os.path.join("benchmarks", "kernels",
                                    f"results_{slug(dev)}"
                                    + (f"_q{FLAGS.q_len}" if FLAGS.q_len != 1 else "")
                                    + (f"_kv{slug(FLAGS.kv_dtype)}" if FLAGS.kv_dtype else "")
                                    + ("_smoke" if FLAGS.smoke else ""))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)

    bw = copy_bandwidth(FLAGS.copy_mb, FLAGS.reps)
    print(f"device={dev} backend={backend} impl={impl} copy_bw={bw:.1f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for ctx in map(int, FLAGS.context_lens):
        for B in map(int, FLAGS.batch_sizes):
            row = bench_point(rng, B, ctx, impl, FLAGS.variants, bw)
            print(row, flush=True)
            rows.append(row)

    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cfg = (f"q_len={FLAGS.q_len} head_dim={FLAGS.head_dim} num_kv_heads={FLAGS.num_kv_heads} "
           f"gqa={FLAGS.gqa} block_size={FLAGS.block_size} dtype={FLAGS.dtype} "
           f"kv_dtype={FLAGS.kv_dtype or FLAGS.dtype} "
           f"iters={FLAGS.iters} reps={FLAGS.reps}")
    cfg += "".join(f" {n}={getattr(FLAGS, n)}" for n in GPU_TUNING if getattr(FLAGS, n) is not None)
    kind = "decode" if FLAGS.q_len == 1 else f"{FLAGS.q_len}-token chunk"
    lines = [f"# Ragged paged-attention benchmark ({kind} per sequence): {dev}", "",
             f"{stamp}; backend={backend}; ours=impl \"{impl}\"; jax {jax.__version__}; {cfg}", "",
             f"Device copy bandwidth (read+write, same run): {bw:.1f} GB/s", ""]
    if FLAGS.smoke or backend == "cpu":
        lines += ["**Smoke run on CPU: kernels run in interpret mode; the times say nothing "
                  "about kernel performance.**", ""]
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out}.md and {out}.csv")


if __name__ == "__main__":
    app.run(main)

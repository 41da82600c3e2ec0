"""CPU ragged paged attention (C++ kernel) vs the jnp reference vs the model's matmuls.

SmolLM2-135M shapes by default (9 query heads over 3 KV heads, head_dim 64,
30 layers, block_size 16, hidden 576, intermediate 1536, float32).  Per shape,
all times are per layer, median over --reps runs of one jitted program that
runs `lax.scan` over the pool's layers (layer traced, as in the engine):

  kernel     pallas_kernels.cpu.paged_attention_cpu (C++ XLA FFI call)
  reference  pallas_kernels.reference.paged_attention_reference (gather +
             masked dense fp32); over --ref_layers layers only (it is slow)
  matmul     the layer's projections for the same token count, one jitted
             function: x@wq, x@wk, x@wv, q@wo, x@w_gate, x@w_up, (g*u)@w_down
             (weights differ per layer, scanned like the attention)

Shapes: prefill of whole prompts (1x1024, 2x512, 8x128 new tokens, no cached
context), chunked prefill (4x256 new tokens over 512 cached ones) and decode
(batch 32 / 64 at contexts 150 / 600, batch 32 at 500 / 2000).  GFLOP/s
counts the causal work (4 * D flops per visible (query head, key) pair); GB/s
the K/V bytes that decode must read (of the pool's dtype: a quantized row is
head_dim bytes and its code byte).  The machine may be shared: ratios measured in the same
run are what matter.

--kv_dtypes times the kernel over pools of several dtypes (float32, bfloat16,
int8, float8_e4m3fn; the quantized ones hold `quantize_pages` of the same
random K/V) with the same queries and block tables: one row per (shape, pool
dtype), plus a table of kernel times side by side.  Their timed calls are
interleaved round by round, so that load from other processes hits them alike.

  python benchmarks/bench_cpu_attention.py
  python benchmarks/bench_cpu_attention.py --reps=3 --shapes=prefill_2x512,decode_64x600
  python benchmarks/bench_cpu_attention.py --shapes=decode_32x500,decode_32x2000 \\
      --kv_dtypes=float32,int8,float8_e4m3fn --reference=false
"""

from __future__ import annotations

import datetime
import math
import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import harness as B  # noqa: E402
from pallas_kernels import cpu  # noqa: E402
from pallas_kernels.reference import (is_quantized, paged_attention_reference,  # noqa: E402
                                      quantize_pages, write_kv_reference)

# name -> list of (kv_len, q_len) sequences
SHAPES = {
    "prefill_1x1024": [(1024, 1024)],
    "prefill_2x512": [(512, 512)] * 2,
    "prefill_8x128": [(128, 128)] * 8,
    "chunk_4x256+512": [(768, 256)] * 4,
    "decode_32x150": [(150, 1)] * 32,
    "decode_32x600": [(600, 1)] * 32,
    "decode_64x150": [(150, 1)] * 64,
    "decode_64x600": [(600, 1)] * 64,
    "decode_32x500": [(500, 1)] * 32,
    "decode_32x2000": [(2000, 1)] * 32,
}

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", list(SHAPES), f"Shapes to time, of {list(SHAPES)}.")
flags.DEFINE_integer("reps", 7, "Timed repetitions per measurement (median reported).")
flags.DEFINE_integer("num_layers", 30, "Layers in the pool (and scanned per timed program).")
flags.DEFINE_integer("ref_layers", 2, "Layers the reference is scanned over (it is slow).")
flags.DEFINE_integer("ref_reps", 3, "Timed repetitions of the reference.")
flags.DEFINE_integer("num_heads", 9, "Query heads.")
flags.DEFINE_integer("num_kv_heads", 3, "KV heads.")
flags.DEFINE_integer("head_dim", 64, "Head dim.")
flags.DEFINE_integer("block_size", 16, "Tokens per pool block.")
flags.DEFINE_integer("hidden", 576, "Model hidden size (matmul baseline).")
flags.DEFINE_integer("intermediate", 1536, "MLP intermediate size (matmul baseline).")
flags.DEFINE_string("dtype", "float32", "q / K/V / weight dtype.")
flags.DEFINE_list("kv_dtypes", [], "Pool dtypes to time the kernel over (float32, bfloat16, "
                  "int8, float8_e4m3fn); default: --dtype.")
flags.DEFINE_integer("max_threads", 0, "Kernel thread cap (0: XLA's intra-op pool).")
flags.DEFINE_bool("reference", True, "Also time the jnp reference.")
flags.DEFINE_list("write_tokens", [], "Also time the K/V write of this many tokens (e.g. 64,1024) "
                  "into each pool dtype: write_kv_cpu vs write_kv_reference, donated pool.")
flags.DEFINE_string("out", None, "Write the markdown table here too (e.g. "
                    "benchmarks/results/cpu_attention.md).")


def median_time(fn, *args, reps: int) -> float:
    """Median wall seconds of fn(*args), result blocked on; one warm-up call first."""
    return median_times([(fn, args)], reps=reps)[0]


def median_times(calls, reps: int) -> list[float]:
    """Median wall seconds of each (fn, args) in `calls`, one warm-up call each first;
    the timed calls go round by round (each call once per round)."""
    for fn, args in calls:
        jax.block_until_ready(fn(*args))
    ts = [[] for _ in calls]
    for _ in range(reps):
        for (fn, args), t in zip(calls, ts):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in ts]


def make_pools(rng, num_blocks: int, dtypes) -> dict:
    """dtype -> pool of the same random K/V: cast, or `quantize_pages` (block by block, to
    bound the memory the quantization takes)."""
    L, KVH, BS, D = FLAGS.num_layers, FLAGS.num_kv_heads, FLAGS.block_size, FLAGS.head_dim
    pool = rng.standard_normal((num_blocks, L, 2, KVH, BS, D), dtype=np.float32)
    pools = {}
    for dtype in dtypes:
        if is_quantized(dtype):
            quantize = jax.jit(lambda x, dtype=dtype: quantize_pages(x, dtype))
            q = np.empty((*pool.shape[:-2], BS + 1, D), dtype)
            for i in range(0, num_blocks, 256):
                q[i:i + 256] = np.asarray(quantize(jnp.asarray(pool[i:i + 256])))
            pools[dtype] = jnp.asarray(q)
        else:
            pools[dtype] = jnp.asarray(pool, dtype)
    return pools


def make_batch(rng, seqs, num_blocks: int, dtype):
    """(q, block_tables, kv_lens, cu_q_lens) for sequences (kv_len, q_len) in random blocks."""
    BS = FLAGS.block_size
    kv_lens = np.array([kv for kv, _ in seqs], np.int32)
    q_lens = np.array([q for _, q in seqs], np.int32)
    n_blk = -(-kv_lens // BS)
    W = int(n_blk.max())
    phys = 1 + rng.permutation(num_blocks - 1)[:int(n_blk.sum())]
    bt = np.zeros((len(seqs), W), np.int32)
    k = 0
    for s, n in enumerate(n_blk):
        bt[s, :n] = phys[k:k + n]
        k += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), FLAGS.num_heads, FLAGS.head_dim), dtype=np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(bt), jnp.asarray(kv_lens), jnp.asarray(cu))


def scan_layers(attn, n_layers: int):
    """jit(q, pool, bt, kv_lens, cu) -> scalar: attention of every layer < n_layers in a scan.

    One element of each output is folded into the carry so that no call is
    dead code; q gets a carry-dependent zero so that nothing is hoisted."""
    def run(q, pool, bt, kv_lens, cu):
        def body(acc, layer):
            dep = jnp.where(acc == 1.2345e-30, 1.0, 0.0).astype(q.dtype)
            out = attn(q + dep, pool, layer, bt, kv_lens, cu)
            return acc + out[0, 0, 0].astype(jnp.float32), None
        return jax.lax.scan(body, jnp.float32(0), jnp.arange(n_layers, dtype=jnp.int32))[0]
    return jax.jit(run)


def attention_ms(attn, batch, pool, n_layers: int, reps: int) -> float:
    return attention_ms_pools(attn, batch, [pool], n_layers, reps)[0]


def attention_ms_pools(attn, batch, pools, n_layers: int, reps: int) -> list[float]:
    """Per-layer ms of `attn` over each pool, timed round by round."""
    run = scan_layers(attn, n_layers)
    calls = [(run, (batch[0], pool, *batch[1:])) for pool in pools]
    return [1e3 * t / n_layers for t in median_times(calls, reps=reps)]


def matmul_ms(rng, T: int, dtype, reps: int) -> float:
    """Per-layer time of the layer's seven projections for T tokens."""
    L, E, I = FLAGS.num_layers, FLAGS.hidden, FLAGS.intermediate
    H, KVH, D = FLAGS.num_heads, FLAGS.num_kv_heads, FLAGS.head_dim
    shapes = dict(wq=(E, H * D), wk=(E, KVH * D), wv=(E, KVH * D), wo=(H * D, E), wg=(E, I),
                  wu=(E, I), wd=(I, E))
    ws = {k: jnp.asarray(rng.standard_normal((L, *s), dtype=np.float32) * 0.02, dtype)
          for k, s in shapes.items()}
    x = jnp.asarray(rng.standard_normal((T, E), dtype=np.float32), dtype)

    @jax.jit
    def run(x, ws):
        def body(x, w):
            q, k, v = x @ w["wq"], x @ w["wk"], x @ w["wv"]
            o = q @ w["wo"]
            d = ((x @ w["wg"]) * (x @ w["wu"])) @ w["wd"]
            kv = (k[0, 0] + v[0, 0]).astype(x.dtype)
            return x + o + d + kv, None
        return jax.lax.scan(body, x, ws)[0]

    return 1e3 * median_time(run, x, ws, reps=reps) / L


def write_ms(write, pool, T: int, reps: int):
    """(per-layer ms, pool) of `write` of T tokens' K/V (float32) into every layer of the
    donated pool in one scan; the pool comes back (donation consumed the one passed)."""
    rng = np.random.default_rng(1)
    NB, L, _, KVH, BS, _ = pool.shape
    D = FLAGS.head_dim
    k = jnp.asarray(rng.standard_normal((T, KVH, D), dtype=np.float32))
    v = jnp.asarray(rng.standard_normal((T, KVH, D), dtype=np.float32))
    slots = rng.permutation((NB - 1) * BS)[:T] + BS
    blocks, offsets = jnp.asarray(slots // BS, jnp.int32), jnp.asarray(slots % BS, jnp.int32)

    def body(pool, layer):
        return write(pool, layer, k + layer.astype(k.dtype), v, blocks, offsets), None
    run = jax.jit(lambda pool: jax.lax.scan(body, pool, jnp.arange(L))[0], donate_argnums=0)
    pool = jax.block_until_ready(run(pool))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        pool = jax.block_until_ready(run(pool))
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts) / L, pool


def causal_flops(seqs) -> float:
    H, D = FLAGS.num_heads, FLAGS.head_dim
    pairs = sum(q * (kv - q) + q * (q + 1) / 2 for kv, q in seqs)
    return 4.0 * D * H * pairs


def kv_bytes(seqs, pool_dtype) -> float:
    """K/V bytes the sequences' keys take in a pool of `pool_dtype` (quantized rows:
    head_dim values, and a code byte per row in the page's code row)."""
    row = FLAGS.head_dim + int(is_quantized(pool_dtype))   # the code, read from the code row
    return sum(kv for kv, _ in seqs) * FLAGS.num_kv_heads * row * 2 * pool_dtype.itemsize


def kernel_fn():
    mt = FLAGS.max_threads
    return lambda q, pool, layer, bt, kv, cu: cpu.paged_attention_cpu(q, pool, layer, bt, kv, cu,
                                                                      max_threads=mt)


def main(argv):
    del argv
    if not cpu.available():
        raise SystemExit(f"CPU kernel unavailable: {cpu.unavailable_reason()}")
    unknown = set(FLAGS.shapes) - set(SHAPES)
    if unknown:
        raise SystemExit(f"unknown shapes {sorted(unknown)}; choose from {list(SHAPES)}")
    dtype = jnp.dtype(FLAGS.dtype)
    kv_dtypes = [jnp.dtype(d) for d in FLAGS.kv_dtypes] or [dtype]
    rng = np.random.default_rng(0)
    BS = FLAGS.block_size
    need = max(sum(-(-kv // BS) for kv, _ in SHAPES[s]) for s in FLAGS.shapes)
    t0 = time.time()
    pools = make_pools(rng, need + 1, kv_dtypes)
    print(f"{B.machine()}, jax {jax.__version__}; load average {os.getloadavg()[0]:.2f}")
    for kvd, pool in pools.items():
        print(f"pool {pool.shape} {kvd} ({pool.nbytes / 2 ** 30:.2f} GiB)")
    print(f"built in {time.time() - t0:.1f} s", flush=True)
    mm_cache: dict[int, float] = {}
    rows, loads = [], []
    for name in FLAGS.shapes:
        seqs = SHAPES[name]
        batch = make_batch(rng, seqs, need + 1, dtype)
        T = int(batch[0].shape[0])
        kerns = attention_ms_pools(kernel_fn(), batch, list(pools.values()), FLAGS.num_layers,
                                   FLAGS.reps)
        loads.append(os.getloadavg()[0])
        if T not in mm_cache:
            mm_cache[T] = matmul_ms(rng, T, dtype, FLAGS.reps)
        mm = mm_cache[T]
        for kvd, kern in zip(pools, kerns):
            ref = float("nan")
            if FLAGS.reference:
                ref = attention_ms(paged_attention_reference, batch, pools[kvd], FLAGS.ref_layers,
                                   FLAGS.ref_reps)
            row = dict(shape=name, kv=kvd.name, tokens=T, kernel_ms=kern, reference_ms=ref,
                       matmul_ms=mm, pct=100 * kern / mm, gflops=causal_flops(seqs) / kern / 1e6,
                       gbps=kv_bytes(seqs, kvd) / kern / 1e6)
            rows.append(row)
            print(f"{name:16s} {kvd.name:14s} T={T:5d}  kernel {kern:8.3f} ms  reference "
                  f"{ref:9.2f} ms  matmul {mm:7.2f} ms  kernel/matmul {row['pct']:5.1f} %  "
                  f"{row['gflops']:6.1f} GFLOP/s  {row['gbps']:5.1f} GB/s", flush=True)

    lines = [f"# CPU paged attention per layer (q {FLAGS.dtype}; K/V "
             f"{', '.join(d.name for d in kv_dtypes)})", "",
             f"{B.machine()}, jax {jax.__version__}; {datetime.date.today()}; "
             f"H={FLAGS.num_heads} KVH={FLAGS.num_kv_heads} D={FLAGS.head_dim} "
             f"block_size={BS} layers={FLAGS.num_layers}; median of {FLAGS.reps} "
             f"(reference: {FLAGS.ref_reps} runs over {FLAGS.ref_layers} layers); load average "
             f"{min(loads):.2f}-{max(loads):.2f} while timing.", "",
             "| shape | K/V | tokens | kernel ms | reference ms | matmul ms | kernel / matmul | "
             "reference / kernel | kernel GFLOP/s | kernel K/V GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref, ratio = "-", "-"   # --reference=false
        if not math.isnan(r["reference_ms"]):
            ref, ratio = f"{r['reference_ms']:.2f}", f"{r['reference_ms'] / r['kernel_ms']:.0f}x"
        lines.append(f"| {r['shape']} | {r['kv']} | {r['tokens']} | {r['kernel_ms']:.3f} | "
                     f"{ref} | {r['matmul_ms']:.2f} | {r['pct']:.1f} % | {ratio} | "
                     f"{r['gflops']:.1f} | {r['gbps']:.2f} |")
    if len(kv_dtypes) > 1:  # kernel times side by side, relative to the first pool dtype
        base = kv_dtypes[0].name
        others = [d.name for d in kv_dtypes[1:]]
        lines += ["", f"Kernel ms per layer by pool dtype (ratios: / {base}):", "",
                  "| shape | " + " | ".join(d.name for d in kv_dtypes) + " | "
                  + " | ".join(f"{o} / {base}" for o in others) + " |",
                  "|---" * (1 + len(kv_dtypes) + len(others)) + "|"]
        for name in FLAGS.shapes:
            ms = {r["kv"]: r["kernel_ms"] for r in rows if r["shape"] == name}
            lines.append(f"| {name} | " + " | ".join(f"{ms[d.name]:.3f}" for d in kv_dtypes)
                         + " | " + " | ".join(f"{ms[o] / ms[base]:.2f}" for o in others) + " |")
    if FLAGS.write_tokens:
        lines += ["", "K/V write of T tokens (float32 K/V), ms per layer, donated pool "
                  f"(median of {FLAGS.reps}; reference into bf16 / fp8: one run):", "",
                  "| pool | T | write_kv_cpu ms | write_kv_reference ms |", "|---|---|---|---|"]
        for kvd in list(pools):
            for T in map(int, FLAGS.write_tokens):
                ms = {}
                for name, fn in (("cpu", cpu.write_kv_cpu), ("reference", write_kv_reference)):
                    # XLA's scatter into a bf16 / fp8 pool converts the whole pool (seconds
                    # per 30-layer call): one timed call of those is enough.
                    slow = name == "reference" and kvd in (jnp.bfloat16, jnp.float8_e4m3fn)
                    ms[name], pools[kvd] = write_ms(fn, pools[kvd], T, 1 if slow else FLAGS.reps)
                print(f"write {kvd.name:14s} T={T:5d}  cpu {ms['cpu']:8.4f} ms  reference "
                      f"{ms['reference']:9.4f} ms", flush=True)
                lines.append(f"| {kvd.name} | {T} | {ms['cpu']:.4f} | {ms['reference']:.4f} |")
    table = "\n".join(lines)
    print("\n" + table)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    app.run(main)

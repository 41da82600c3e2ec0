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
(batch 32 / 64 at contexts 150 / 600).  GFLOP/s counts the causal work
(4 * D flops per visible (query head, key) pair); GB/s the K/V bytes that
decode must read.  The machine may be shared: ratios measured in the same run
are what matter.

  python benchmarks/bench_cpu_attention.py
  python benchmarks/bench_cpu_attention.py --reps=3 --shapes=prefill_2x512,decode_64x600
"""

from __future__ import annotations

import datetime
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
from pallas_kernels.reference import paged_attention_reference  # noqa: E402

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
flags.DEFINE_integer("max_threads", 0, "Kernel thread cap (0: XLA's intra-op pool).")
flags.DEFINE_bool("reference", True, "Also time the jnp reference.")
flags.DEFINE_string("out", None, "Write the markdown table here too (e.g. "
                    "benchmarks/results/cpu_attention.md).")


def median_time(fn, *args, reps: int) -> float:
    """Median wall seconds of fn(*args), result blocked on; one warm-up call first."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def make_pool(rng, num_blocks: int, dtype) -> jax.Array:
    L, KVH, BS, D = FLAGS.num_layers, FLAGS.num_kv_heads, FLAGS.block_size, FLAGS.head_dim
    pool = rng.standard_normal((num_blocks, L, 2, KVH, BS, D), dtype=np.float32)
    return jnp.asarray(pool, dtype)


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
    return 1e3 * median_time(scan_layers(attn, n_layers), batch[0], pool, *batch[1:],
                             reps=reps) / n_layers


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


def causal_flops(seqs) -> float:
    H, D = FLAGS.num_heads, FLAGS.head_dim
    pairs = sum(q * (kv - q) + q * (q + 1) / 2 for kv, q in seqs)
    return 4.0 * D * H * pairs


def kv_bytes(seqs, itemsize: int) -> float:
    return sum(kv for kv, _ in seqs) * FLAGS.num_kv_heads * FLAGS.head_dim * 2 * itemsize


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
    rng = np.random.default_rng(0)
    BS = FLAGS.block_size
    need = max(sum(-(-kv // BS) for kv, _ in SHAPES[s]) for s in FLAGS.shapes)
    t0 = time.time()
    pool = make_pool(rng, need + 1, dtype)
    print(f"{B.machine()}, jax {jax.__version__}\npool {pool.shape} {dtype} "
          f"({pool.nbytes / 2 ** 30:.2f} GiB), built in {time.time() - t0:.1f} s", flush=True)
    mm_cache: dict[int, float] = {}
    rows = []
    for name in FLAGS.shapes:
        seqs = SHAPES[name]
        batch = make_batch(rng, seqs, need + 1, dtype)
        T = int(batch[0].shape[0])
        kern = attention_ms(kernel_fn(), batch, pool, FLAGS.num_layers, FLAGS.reps)
        ref = float("nan")
        if FLAGS.reference:
            ref = attention_ms(paged_attention_reference, batch, pool, FLAGS.ref_layers,
                               FLAGS.ref_reps)
        if T not in mm_cache:
            mm_cache[T] = matmul_ms(rng, T, dtype, FLAGS.reps)
        mm = mm_cache[T]
        row = dict(shape=name, tokens=T, kernel_ms=kern, reference_ms=ref, matmul_ms=mm,
                   pct=100 * kern / mm, gflops=causal_flops(seqs) / kern / 1e6,
                   gbps=kv_bytes(seqs, dtype.itemsize) / kern / 1e6)
        rows.append(row)
        print(f"{name:16s} T={T:5d}  kernel {kern:8.3f} ms  reference {ref:9.2f} ms  "
              f"matmul {mm:7.2f} ms  kernel/matmul {row['pct']:5.1f} %  "
              f"{row['gflops']:6.1f} GFLOP/s  {row['gbps']:5.1f} GB/s", flush=True)

    lines = [f"# CPU paged attention per layer ({FLAGS.dtype})", "",
             f"{B.machine()}, jax {jax.__version__}; {datetime.date.today()}; "
             f"H={FLAGS.num_heads} KVH={FLAGS.num_kv_heads} D={FLAGS.head_dim} "
             f"block_size={BS} layers={FLAGS.num_layers}; median of {FLAGS.reps} "
             f"(reference: {FLAGS.ref_reps} runs over {FLAGS.ref_layers} layers).", "",
             "| shape | tokens | kernel ms | reference ms | matmul ms | kernel / matmul | "
             "reference / kernel | kernel GFLOP/s | kernel K/V GB/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['kernel_ms']:.3f} | "
                     f"{r['reference_ms']:.2f} | {r['matmul_ms']:.2f} | {r['pct']:.1f} % | "
                     f"{r['reference_ms'] / r['kernel_ms']:.0f}x | {r['gflops']:.1f} | "
                     f"{r['gbps']:.1f} |")
    table = "\n".join(lines)
    print("\n" + table)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    app.run(main)

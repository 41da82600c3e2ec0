"""Static resource report of the GPU kernels compiled for sm_90, without a GPU.

Lowers each kernel of `paged_attention_gpu` (the split-KV "decode" kernel and
the "ragged" query-tile kernel, one at a time) with jax (Pallas -> Triton IR), compiles it
with the `triton` package for sm_<--arch> and records ptxas' report:
registers per thread, spilled bytes, shared memory per CTA and the CTAs per
SM that allows.  Nothing runs on a GPU; see pallas_kernels/triton_aot.py.

  python scripts/report_triton_sm90.py                     # default grid
  python scripts/report_triton_sm90.py --kernels=decode --dtypes=bfloat16 --num_warps=4,8

Writes <out>.md and <out>.csv (default benchmarks/kernels/triton_sm90).
"""

from __future__ import annotations

import csv
import datetime
import itertools
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from pallas_kernels import triton_aot  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("kernels", ["decode", "ragged"], "Kernels to compile.")
flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "K/V dtypes.")
flags.DEFINE_list("head_dims", ["64", "128"], "Head dims.")
flags.DEFINE_list("block_sizes", ["8", "16", "32", "128"], "Pool block sizes.")
flags.DEFINE_list("gqa", ["4"], "Query heads per KV head.")
flags.DEFINE_list("num_warps", ["4"], "Warps per CTA.")
flags.DEFINE_list("block_k", ["default"], "Keys per loop iteration ('default' = the kernel's).")
flags.DEFINE_integer("arch", 90, "CUDA compute capability, e.g. 90 for H100/H200.")
flags.DEFINE_string("out", os.path.join("benchmarks", "kernels", "triton_sm90"),
                    "Output path prefix (.md / .csv appended).")

COLUMNS = ["kernel", "dtype", "head_dim", "block_size", "gqa", "block_k", "block_m", "decode_rows",
           "num_partitions", "num_warps", "num_stages", "registers", "spill_stores", "spill_loads", "shared_kib", "ctas_per_sm",
           "warps_per_sm", "note"]


def main(argv):
    del argv
    import triton
    rows = []
    grid = itertools.product(FLAGS.kernels, FLAGS.dtypes, map(int, FLAGS.head_dims),
                             map(int, FLAGS.block_sizes), map(int, FLAGS.gqa),
                             map(int, FLAGS.num_warps), FLAGS.block_k)
    for kernel, dtype, d, bs, g, warps, bk in grid:
        launch = dict(num_warps=warps)
        if bk != "default":
            launch["block_k"] = int(bk)
        row = dict(kernel=kernel, dtype=dtype, head_dim=d, block_size=bs, gqa=g)
        try:
            tiling, r = triton_aot.jpaged_kernel_resources(
                kernel, dtype=dtype, head_dim=d, block_size=bs, gqa=g, arch=FLAGS.arch, **launch)
        except Exception as e:  # noqa: BLE001 - a kernel Triton rejects is a result
            row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        else:
            row.update(tiling, num_warps=r.num_warps, num_stages=r.num_stages,
                       registers=r.registers, spill_stores=r.spill_stores,
                       spill_loads=r.spill_loads, shared_kib=round(r.shared_bytes / 1024, 1),
                       ctas_per_sm=r.ctas_per_sm, warps_per_sm=r.ctas_per_sm * r.num_warps,
                       note="" if r.fits else "does not fit on an SM")
        print(row, flush=True)
        rows.append(row)

    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# GPU kernels compiled for sm_{FLAGS.arch} (static, no GPU)", "",
             f"{stamp}; jax {jax.__version__} lowering, triton {triton.__version__} + its ptxas. "
             "CTAs/SM from registers, shared memory and warps (sm_90 limits). "
             "`paged_attention_gpu` on 8 sequences, 8 KV heads, block tables of 64 pages; "
             "decode = the split-KV kernel (1 new token per sequence, T = 8), "
             "ragged = the query-tile kernel (64 new tokens per sequence, T = 512).", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    with open(FLAGS.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {FLAGS.out}.md and {FLAGS.out}.csv")


if __name__ == "__main__":
    app.run(main)

"""Static resource report of the GPU kernels compiled for sm_90, without a GPU.

Lowers each kernel of `paged_attention_gpu` (the split-KV "decode" kernel and
the "ragged" query-tile kernel, one at a time) with jax (Pallas -> Triton IR), compiles it
with the `triton` package for sm_<--arch> and records ptxas' report:
registers per thread, spilled bytes, shared memory per CTA and the CTAs per
SM that allows, and the kernel's global loads by width (`triton_aot.GlobalLoads`,
static instruction counts, q and code loads included): PTX ld.global, its
128-bit ld.global.v4 and byte loads, 16-byte cp.async (the pipelined key
tiles); SASS LDG, LDG.E.128, LDG.E.U8/S8 and LDGSTS .128 from Triton's bundled
cuobjdump (-1 without it).
Nothing runs on a GPU; see pallas_kernels/triton_aot.py.

Two tables (one CSV):
  1. --kernels x --dtypes x --head_dims x --block_sizes x --gqa (x --num_warps,
     --block_k): a quantized pool in --dtypes gets one row per --q_dtypes.
  2. quantized pools: --kernels x --quant_shapes (head_dim:gqa pairs) x
     --quant_dtypes x --q_dtypes x --block_sizes, after unquantized baselines
     (each q dtype as the pool) at those shapes and --quant_baseline_block_sizes
     that table 1 lacks.  `dtype` is the pool's, `note` q's ("q bfloat16").

  python scripts/report_triton_sm90.py                     # default grid (both tables, ~100 rows)
  python scripts/report_triton_sm90.py --kernels=decode --dtypes=bfloat16 --num_warps=4,8
  python scripts/report_triton_sm90.py --quant_dtypes= --q_dtypes=bfloat16   # table 1 only

Writes <out>.md and <out>.csv (default benchmarks/kernels/triton_sm90).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import itertools
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from pallas_kernels import triton_aot  # noqa: E402
from pallas_kernels.reference import is_quantized  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("kernels", ["decode", "ragged"], "Kernels to compile.")
flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "K/V pool dtypes of table 1.")
flags.DEFINE_list("head_dims", ["64", "128"], "Head dims of table 1.")
flags.DEFINE_list("block_sizes", ["8", "16", "32", "128"], "Pool block sizes (both tables).")
flags.DEFINE_list("gqa", ["4"], "Query heads per KV head (table 1).")
flags.DEFINE_list("num_warps", ["4"], "Warps per CTA.")
flags.DEFINE_list("block_k", ["default"], "Keys per loop iteration ('default' = the kernel's).")
flags.DEFINE_list("q_dtypes", ["float32", "bfloat16"],
                  "Query dtypes compiled for each quantized pool (int8, float8_e4m3fn), in both "
                  "tables; an unquantized pool's q is the pool's dtype.")
flags.DEFINE_list("quant_dtypes", ["int8", "float8_e4m3fn"],
                  "Quantized pools of table 2 ('' = no table 2).")
flags.DEFINE_list("quant_shapes", ["64:3", "128:4"],
                  "head_dim:gqa pairs of table 2 (64:3 = SmolLM2-135M, 128:4 = Llama-3-8B).")
flags.DEFINE_list("quant_baseline_block_sizes", ["16"],
                  "Block sizes of table 2's unquantized baselines ('' = none).")
flags.DEFINE_integer("arch", 90, "CUDA compute capability, e.g. 90 for H100/H200.")
flags.DEFINE_string("out", os.path.join("benchmarks", "kernels", "triton_sm90"),
                    "Output path prefix (.md / .csv appended).")

COLUMNS = ["kernel", "dtype", "head_dim", "block_size", "gqa", "block_k", "block_m", "decode_rows",
           "num_partitions", "num_warps", "num_stages", "registers", "spill_stores", "spill_loads", "shared_kib", "ctas_per_sm",
           "warps_per_sm", "ptx_ld", "ptx_ld_v4", "ptx_ld_b8", "ptx_cp_async_16", "sass_ldg", "sass_ldg_128",
           "sass_ldg_8", "sass_ldgsts_128", "note"]
KNOWN_SHAPES = {(64, 3): "SmolLM2-135M's; its embedded model runs in float32", (128, 4): "Llama-3-8B's"}


def q_variants(dtype: str) -> list[str | None]:
    """The q dtypes compiled for a pool: --q_dtypes if quantized, else the pool's (None)."""
    return list(FLAGS.q_dtypes) if is_quantized(dtype) else [None]


def compile_row(kernel: str, dtype: str, d: int, bs: int, g: int, warps: int, bk: str,
                q_dtype: str | None) -> dict:
    """One report row: the kernel compiled for sm_<arch>, or the error Triton gave."""
    launch = dict(num_warps=warps)
    if bk != "default":
        launch["block_k"] = int(bk)
    row = dict(kernel=kernel, dtype=dtype, head_dim=d, block_size=bs, gqa=g)
    notes = [f"q {q_dtype}"] if q_dtype else []
    try:
        tiling, r = triton_aot.jpaged_kernel_resources(
            kernel, dtype=dtype, head_dim=d, block_size=bs, gqa=g, arch=FLAGS.arch, q_dtype=q_dtype,
            **launch)
    except Exception as e:  # noqa: BLE001 - a kernel Triton rejects is a result
        notes.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    else:
        row.update(tiling, num_warps=r.num_warps, num_stages=r.num_stages,
                   registers=r.registers, spill_stores=r.spill_stores,
                   spill_loads=r.spill_loads, shared_kib=round(r.shared_bytes / 1024, 1),
                   ctas_per_sm=r.ctas_per_sm, warps_per_sm=r.ctas_per_sm * r.num_warps)
        if r.loads is not None:
            row.update(dataclasses.asdict(r.loads))
        if not r.fits:
            notes.append("does not fit on an SM")
    row["note"] = "; ".join(notes)
    print(row, flush=True)
    return row


def table1_specs() -> list[tuple]:
    specs = []
    for kernel, dtype, d, bs, g, warps, bk in itertools.product(
            FLAGS.kernels, FLAGS.dtypes, map(int, FLAGS.head_dims), map(int, FLAGS.block_sizes),
            map(int, FLAGS.gqa), map(int, FLAGS.num_warps), FLAGS.block_k):
        specs += [(kernel, dtype, d, bs, g, warps, bk, q) for q in q_variants(dtype)]
    return specs


def parse_shapes() -> list[tuple[int, int]]:
    try:
        return [(int(d), int(g)) for d, g in (s.split(":") for s in FLAGS.quant_shapes)]
    except ValueError:
        raise app.UsageError(f"--quant_shapes: head_dim:gqa pairs, got {FLAGS.quant_shapes}") from None


def table2_specs(shapes: list[tuple[int, int]], done: set[tuple]) -> list[tuple]:
    """Per kernel: the unquantized baselines table 1 lacks, then the quantized pools."""
    if not FLAGS.quant_dtypes:
        return []
    specs = []
    for kernel in FLAGS.kernels:
        for (d, g), q, bs, warps, bk in itertools.product(
                shapes, FLAGS.q_dtypes, map(int, FLAGS.quant_baseline_block_sizes),
                map(int, FLAGS.num_warps), FLAGS.block_k):
            spec = (kernel, q, d, bs, g, warps, bk, None)
            if spec not in done:
                specs.append(spec)
        for (d, g), dtype, q, bs, warps, bk in itertools.product(
                shapes, FLAGS.quant_dtypes, FLAGS.q_dtypes, map(int, FLAGS.block_sizes),
                map(int, FLAGS.num_warps), FLAGS.block_k):
            specs.append((kernel, dtype, d, bs, g, warps, bk, q))
    return specs


def md_table(rows: list[dict]) -> list[str]:
    return (["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
            + ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows])


def table2_text(shapes: list[tuple[int, int]], specs: list[tuple]) -> list[str]:
    """Table 2's heading and paragraph (markdown lines)."""
    baselines = [s for s in specs if s[7] is None]
    base_gqa = sorted({s[4] for s in baselines})
    title = f"## Quantized pools ({', '.join(FLAGS.quant_dtypes)})"
    if base_gqa:
        title += f" and GQA {', '.join(map(str, base_gqa))} baselines"
    shape_text = "; ".join(f"head_dim {d}, GQA {g}" + (f" ({KNOWN_SHAPES[(d, g)]})" if (d, g) in KNOWN_SHAPES
                                                        else "") for d, g in shapes)
    text = ("Same run and call shapes as above. `dtype` is the pool's: quantized pages hold block_size "
            "rows of head_dim one-byte values, then a row of their scale codes; `note` gives q's dtype "
            "(`--q_dtypes`), "
            f"which the dots run in. Shapes (`--quant_shapes`): {shape_text}; block sizes "
            f"{', '.join(FLAGS.block_sizes)}.")
    if baselines:
        text += (" The first rows of each kernel are the unquantized pools (each q dtype as the pool) at "
                 f"block {', '.join(FLAGS.quant_baseline_block_sizes)} for the shapes the table above "
                 "lacks.")
    return ["", title, "", text, ""]


def main(argv):
    del argv
    import triton
    shapes = parse_shapes()
    t1 = table1_specs()
    t2 = table2_specs(shapes, set(t1))
    rows1 = [compile_row(*s) for s in t1]
    rows2 = [compile_row(*s) for s in t2]

    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows1 + rows2:
            w.writerow({k: r.get(k, "") for k in COLUMNS})
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# GPU kernels compiled for sm_{FLAGS.arch} (static, no GPU)", "",
             f"{stamp}; jax {jax.__version__} lowering, triton {triton.__version__} + its ptxas. "
             "CTAs/SM from registers, shared memory and warps (sm_90 limits). "
             "`paged_attention_gpu` on 8 sequences, 8 KV heads, block tables of 64 pages; "
             "decode = the split-KV kernel (1 new token per sequence, T = 8), "
             "ragged = the query-tile kernel (64 new tokens per sequence, T = 512). "
             "Global loads (static instruction counts, `triton_aot.GlobalLoads`): ptx_ld / ptx_ld_v4 / "
             "ptx_ld_b8 = ld.global / its 128-bit .v4 / byte loads, ptx_cp_async_16 = 16-byte cp.async "
             "(the pipelined key tiles); sass_ldg / sass_ldg_128 / sass_ldg_8 = LDG / LDG.E.128 / "
             "LDG.E.U8|S8, sass_ldgsts_128 = LDGSTS .128 (cuobjdump; -1: none).", "",
             *md_table(rows1)]
    if rows2:
        lines += table2_text(shapes, t2) + md_table(rows2)
    with open(FLAGS.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {FLAGS.out}.md and {FLAGS.out}.csv ({len(rows1) + len(rows2)} rows)")


if __name__ == "__main__":
    app.run(main)

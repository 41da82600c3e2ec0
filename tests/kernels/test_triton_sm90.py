"""The GPU kernels compile with Triton for sm_90 (H100/H200) and fit an SM.

No GPU is needed: jax lowers the kernels to Triton IR on the CPU and the
`triton` package (a test dependency on Linux x86-64) compiles it to a cubin
with its ptxas.  This checks what interpret mode cannot: Triton accepts the
kernel, registers do not spill, shared memory fits, and at least two CTAs
stay resident per SM.  Nothing here runs a kernel on a GPU.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

triton = pytest.importorskip("triton")

from pallas_kernels import triton_aot  # noqa: E402

# (kernel, dtype, head_dim, block_size, gqa): the two pallas_calls of
# `paged_attention_gpu` ("decode" = split-KV, "ragged" = query tiles) at the
# benchmark shape (bf16, D 128, block 16, GQA 4), the embedded model's (fp32,
# D 64, GQA 3), big pages, GQA 8 and fp32 x D 128 (the register-hungriest);
# quantized pools below.
CASES = [
    ("decode", jnp.bfloat16, 128, 16, 4),
    ("decode", jnp.bfloat16, 128, 128, 8),
    ("decode", jnp.float32, 64, 16, 3),
    ("decode", jnp.float32, 128, 128, 4),
    ("ragged", jnp.bfloat16, 128, 16, 4),
    ("ragged", jnp.bfloat16, 128, 128, 8),
    ("ragged", jnp.float32, 64, 16, 3),
    ("ragged", jnp.float32, 128, 32, 4),
]


@pytest.mark.parametrize("kernel,dtype,head_dim,block_size,gqa", CASES)
def test_kernel_compiles_for_sm90_without_spills(kernel, dtype, head_dim, block_size, gqa):
    tiling, r = triton_aot.jpaged_kernel_resources(kernel, dtype=dtype, head_dim=head_dim,
                                                   block_size=block_size, gqa=gqa)
    what = f"{kernel} {jnp.dtype(dtype).name} D={head_dim} BS={block_size} {tiling}: {r}"
    assert r.spill_stores == 0 and r.stack_bytes == 0, what
    assert r.fits and r.ctas_per_sm >= 2, what


# Gemma's options (sliding window + logit soft cap: the window mask and a tanh in the
# key loop) at the benchmark shape and at Gemma 2/3's head_dim 256 with GQA 2.
GEMMA_CASES = [
    ("decode", jnp.bfloat16, 128, 16, 4),
    ("ragged", jnp.bfloat16, 128, 16, 4),
    ("decode", jnp.bfloat16, 256, 16, 2),
    ("ragged", jnp.bfloat16, 256, 16, 2),
]


@pytest.mark.parametrize("kernel,dtype,head_dim,block_size,gqa", GEMMA_CASES)
def test_window_and_soft_cap_compile_for_sm90_without_spills(kernel, dtype, head_dim, block_size,
                                                             gqa):
    tiling, r = triton_aot.jpaged_kernel_resources(kernel, dtype=dtype, head_dim=head_dim,
                                                   block_size=block_size, gqa=gqa,
                                                   sliding_window=4096, soft_cap=50.0)
    what = f"{kernel} window+cap {jnp.dtype(dtype).name} D={head_dim} BS={block_size} {tiling}: {r}"
    assert r.spill_stores == 0 and r.stack_bytes == 0, what
    assert r.fits and r.ctas_per_sm >= 2, what


# Quantized pools (int8, float8_e4m3fn pages: head_dim-byte value rows, then a row of
# scale codes; Triton converts the 1-byte values in registers, fp8 with sm_90's cvt):
# SmolLM2-135M's shape (D 64, GQA 3) with fp32 queries (the embedded model's dtype) and
# bf16 ones, and D 128 with bf16.  The value tiles load 16 bytes at a time (16-byte
# cp.async into shared memory in the pipelined key loop, or ld.global.v4): no byte loads
# (rows of head_dim + 1 bytes with the code inline compiled to ~70 ld.global.b8).
QUANT_CASES = [(kernel, kv, q, d, 16, g) for kernel in ("decode", "ragged")
               for kv in (jnp.int8, jnp.float8_e4m3fn)
               for q, d, g in ((jnp.float32, 64, 3), (jnp.bfloat16, 64, 3), (jnp.bfloat16, 128, 4))]


@pytest.mark.parametrize("kernel,kv_dtype,q_dtype,head_dim,block_size,gqa", QUANT_CASES)
def test_quantized_pools_compile_for_sm90_without_spills(kernel, kv_dtype, q_dtype, head_dim,
                                                          block_size, gqa):
    tiling, r = triton_aot.jpaged_kernel_resources(kernel, dtype=kv_dtype, q_dtype=q_dtype,
                                                   head_dim=head_dim, block_size=block_size,
                                                   gqa=gqa)
    what = (f"{kernel} pool {jnp.dtype(kv_dtype).name} q {jnp.dtype(q_dtype).name} D={head_dim} "
            f"BS={block_size} {tiling}: {r}")
    assert r.spill_stores == 0 and r.stack_bytes == 0, what
    assert r.fits and r.ctas_per_sm >= 2, what
    loads = r.loads
    assert loads.ptx_ld_b8 == 0 and loads.ptx_cp_async_16 + loads.ptx_ld_v4 >= 4, (what, loads)
    assert loads.sass_ldg_8 in (0, -1), (what, loads)


def test_global_loads_are_counted_by_width():
    ptx = """
        ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        @%p1 ld.global.b8 { %rs1 }, [ %rd2 + 0 ];
        ld.global.b32 { %r5 }, [ %rd3 + 0 ];
        cp.async.cg.shared.global [ %r6 + 0 ], [ %rd4 + 0 ], 0x10, %r7;
        cp.async.ca.shared.global [ %r8 + 0 ], [ %rd5 + 0 ], 4, %r9;
    """
    sass = "LDG.E.128 R4, desc[UR4][R2.64] ;\n LDG.E.U8 R0, [R2] ;\n LDGSTS.E.BYPASS.128 [R5], [R6] ;"
    got = triton_aot.count_global_loads(ptx, sass)
    assert got == triton_aot.GlobalLoads(ptx_ld=3, ptx_ld_v4=1, ptx_ld_b8=1, ptx_cp_async_16=1,
                                         sass_ldg=2, sass_ldg_128=1, sass_ldg_8=1, sass_ldgsts_128=1)
    assert triton_aot.count_global_loads(ptx, None).sass_ldg == -1


def test_small_tile_path_compiles():
    """block_k 8 (< the 16 a Triton dot needs): broadcast-multiply-sum tiles."""
    _, r = triton_aot.jpaged_kernel_resources("decode", dtype=jnp.float32, head_dim=64,
                                              block_size=8, gqa=4, block_k=8)
    assert r.spill_stores == 0 and r.fits, r


def test_oversized_tile_is_reported():
    """The check is live: fp32 x head_dim 128 x 128-key tiles need more shared
    memory than an SM has (the kernel's default tile for that shape is 16 keys)."""
    _, r = triton_aot.jpaged_kernel_resources("decode", dtype=jnp.float32, head_dim=128,
                                              block_size=128, gqa=4, block_k=128)
    assert not r.fits and r.shared_bytes > triton_aot.SM90["smem_per_cta_max"], r

"""Compile the Pallas GPU kernels ahead of time for a CUDA arch, with no GPU.

jax lowers a Pallas kernel to Triton IR (TTIR) in Python, on any machine.
This module captures that TTIR and compiles it with the `triton` package
(TTIR -> PTX -> cubin with the ptxas it bundles) for a target such as sm_90
(H100/H200), then reads ptxas' resource report.  That catches, on a CPU-only
machine, what interpret mode cannot: kernels Triton rejects, registers
spilled to local memory, shared memory over the SM limit, and the occupancy
(CTAs per SM) a launch configuration allows.

It is a static check: nothing runs on a GPU.  jax on a GPU compiles the same
TTIR with the Triton inside jaxlib/XLA rather than the `triton` package, so
register counts can differ slightly between the two; a kernel that spills or
fails here is worth fixing either way.

    from pallas_kernels import gpu, triton_aot
    kernels = triton_aot.capture_ttir(gpu.paged_attention_gpu, q, pool, 0, bt, kv_lens, cu_q_lens,
                                      interpret=False)
    print([triton_aot.compile_for_cuda(k) for k in kernels])
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Callable

import jax

# sm_90 (H100/H200) limits, CUDA occupancy rules.
SM90 = dict(regs_per_sm=65536, reg_alloc_unit=256, max_warps_per_sm=64, max_ctas_per_sm=32,
            smem_per_sm=228 * 1024, smem_per_cta_max=227 * 1024, smem_reserved_per_cta=1024)


@dataclasses.dataclass(frozen=True)
class TritonKernelIR:
    """One pallas_call lowered by jax's Triton backend."""
    name: str
    ttir: str
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """ptxas' report for one kernel compiled for `arch`, plus the occupancy it allows."""
    name: str
    arch: int
    num_warps: int
    num_stages: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_bytes: int
    loads: "GlobalLoads | None" = None

    @property
    def ctas_per_sm(self) -> int:
        """Resident CTAs per SM allowed by registers, shared memory and warps (sm_90 rules)."""
        lim = SM90
        regs_per_warp = math.ceil(self.registers * 32 / lim["reg_alloc_unit"]) * lim["reg_alloc_unit"]
        by_regs = lim["regs_per_sm"] // (regs_per_warp * self.num_warps)
        by_smem = lim["smem_per_sm"] // (self.shared_bytes + lim["smem_reserved_per_cta"])
        by_warps = lim["max_warps_per_sm"] // self.num_warps
        return int(min(by_regs, by_smem, by_warps, lim["max_ctas_per_sm"]))

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= SM90["smem_per_cta_max"] and self.ctas_per_sm >= 1


@dataclasses.dataclass(frozen=True)
class GlobalLoads:
    """Global-memory loads of one compiled kernel, by width: static instruction counts
    (in the code, not executions).  PTX: `ld.global` (`ptx_ld`), its 128-bit form
    `ld.global.v4` (`ptx_ld_v4`), its byte loads (`ptx_ld_b8`), and the 16-byte
    asynchronous copies global -> shared that Triton's pipelined loops use for key
    tiles (`cp.async.cg.shared.global ..., 16`: `ptx_cp_async_16`).  SASS, when the
    bundled cuobjdump disassembles the cubin (else -1): `LDG` (`sass_ldg`),
    `LDG.E.128` (`sass_ldg_128`), byte loads `LDG.E.U8` / `.S8` (`sass_ldg_8`) and
    `LDGSTS.*.128` (`sass_ldgsts_128`).  128-bit loads of a key tile: ptx_ld_v4 +
    ptx_cp_async_16 (sass_ldg_128 + sass_ldgsts_128)."""
    ptx_ld: int
    ptx_ld_v4: int
    ptx_ld_b8: int
    ptx_cp_async_16: int
    sass_ldg: int
    sass_ldg_128: int
    sass_ldg_8: int
    sass_ldgsts_128: int


_PTX_LD_RE = re.compile(r"\bld\.global(?:\.\w+)*")
_PTX_CP_ASYNC_RE = re.compile(r"\bcp\.async\.\w+\.shared\.global[^;]*?,\s*(0x10|16)\b")
_SASS_LDG_RE = re.compile(r"\bLDG(?:STS)?(?:\.\w+)*")


def count_global_loads(ptx: str, sass: str | None) -> GlobalLoads:
    """`GlobalLoads` of a kernel's PTX and SASS (None: no SASS)."""
    ld = _PTX_LD_RE.findall(ptx)
    sass_ops = _SASS_LDG_RE.findall(sass) if sass is not None else []
    ldg = [op for op in sass_ops if not op.startswith("LDGSTS")]
    count = (lambda n: n) if sass is not None else (lambda n: -1)
    return GlobalLoads(
        ptx_ld=len(ld), ptx_ld_v4=sum(".v4" in x for x in ld),
        ptx_ld_b8=sum(x.endswith((".b8", ".u8", ".s8")) for x in ld),
        ptx_cp_async_16=len(_PTX_CP_ASYNC_RE.findall(ptx)),
        sass_ldg=count(len(ldg)), sass_ldg_128=count(sum(x.endswith(".128") for x in ldg)),
        sass_ldg_8=count(sum(x.endswith((".U8", ".S8")) for x in ldg)),
        sass_ldgsts_128=count(sum(x.startswith("LDGSTS") and x.endswith(".128") for x in sass_ops)))


def _sass(cubin: str, bin_dir: str) -> str | None:
    """The SASS of `cubin` from Triton's bundled cuobjdump, or None without one."""
    tool = os.path.join(bin_dir, "cuobjdump")
    if not os.access(tool, os.X_OK):
        return None
    done = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


class _LaunchRecorded(Exception):
    """Stops a lowering once the kernel's IR and launch config are recorded."""


@contextlib.contextmanager
def _capture_triton_modules(sink: list[dict]):
    """Record the TTIR and launch config of every pallas_call jax lowers for a GPU.

    The launch config is read off the lowering rule that calls the Triton
    lowering (its `num_warps` / `num_stages` locals, which every jax so far
    computes first); the lowered module's backend_config is the fallback.
    jaxlib <= 0.10.2 embeds the IR in a custom call; 0.10.2's rule, told it runs
    on a later jaxlib, compiles the IR while lowering through a GPU plugin's
    handler, which a CPU-only install lacks: there that compile call is
    intercepted and the lowering stopped.  jax 0.11 has no such module-level
    handle (and, on a GPU, the plugin to compile with).
    """
    from jax._src.pallas.triton import lowering
    from jax._src.pallas.triton import pallas_call_registration as registration
    original_lower = lowering.lower_jaxpr_to_triton_module
    original_triton = getattr(registration, "triton", None)

    def lower(*args, **kwargs):
        result = original_lower(*args, **kwargs)
        record = dict(ttir=result.module.operation.get_asm(enable_debug_info=False))
        caller = sys._getframe(1).f_locals
        if isinstance(caller.get("num_warps"), int) and isinstance(caller.get("num_stages"), int):
            record.update(num_warps=caller["num_warps"], num_stages=caller["num_stages"])
        sink.append(record)
        return result

    class _RecordingTriton:
        def __getattr__(self, name):
            return getattr(original_triton, name)

        @staticmethod
        def compile(platform, ir, arch, *, num_warps, num_stages, **_):
            sink[-1].update(num_warps=int(num_warps), num_stages=int(num_stages))
            raise _LaunchRecorded

    lowering.lower_jaxpr_to_triton_module = lower
    if original_triton is not None:
        registration.triton = _RecordingTriton()
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = original_lower
        if original_triton is not None:
            registration.triton = original_triton


_LAUNCH_RE = re.compile(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')
_MODULE_RE = re.compile(r"^module @([\w$.]+)", re.M)


def _recorded(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, _LaunchRecorded):
            return True
        e = e.__cause__ or e.__context__
    return False


def capture_ttir(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[TritonKernelIR]:
    """TTIR and launch config of each Pallas kernel in `fn(*args, **kwargs)`, lowered for CUDA.

    `args` may be arrays or `jax.ShapeDtypeStruct`s; the kernels must not be
    in interpret mode (pass `interpret=False` to ours).  With jaxlib > 0.10.2
    only the first kernel of `fn` is captured (the lowering stops there).
    """
    modules: list[dict] = []
    text = ""
    with _capture_triton_modules(modules):
        try:
            text = jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args).lower(
                lowering_platforms=("cuda",)).as_text()
        except Exception as e:  # noqa: BLE001 - jax may wrap the stop signal
            if not _recorded(e):
                raise
    launch = {name: (int(stages), int(warps)) for name, stages, warps in _LAUNCH_RE.findall(text)}
    kernels = []
    for m in modules:
        name = _MODULE_RE.search(m["ttir"]).group(1)
        if "num_warps" in m:
            stages, warps = m["num_stages"], m["num_warps"]
        elif name in launch:
            stages, warps = launch[name]
        else:
            raise RuntimeError(f"no launch config for Triton kernel {name!r} in the lowered module "
                               "(this jax version may lower Pallas GPU calls differently)")
        kernels.append(TritonKernelIR(name, m["ttir"], num_warps=warps, num_stages=stages))
    return kernels


_PTXAS_RE = {
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "registers": re.compile(r"Used (\d+) registers"),
}


def compile_for_cuda(kernel: TritonKernelIR, arch: int = 90) -> KernelResources:
    """Compile `kernel` with the `triton` package for sm_<arch>; ptxas' resource report."""
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    options = dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = os.path.join(bin_dir, "ptxas")
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, f"{kernel.name}.ttir")
        with open(src, "w") as f:
            f.write(kernel.ttir)
        compiled = triton.compile(src, target=target, options=options)
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        cubin = os.path.join(tmp, "kernel.cubin")
        report = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", ptx, "-o", cubin],
                                capture_output=True, text=True, check=True).stderr
        loads = count_global_loads(compiled.asm["ptx"], _sass(cubin, bin_dir))
    values = {}
    for key, rx in _PTXAS_RE.items():
        m = rx.search(report)
        if m is None:
            raise RuntimeError(f"unexpected ptxas report for {kernel.name}:\n{report}")
        values[key] = int(m.group(1))
    return KernelResources(name=kernel.name, arch=arch, num_warps=kernel.num_warps,
                           num_stages=kernel.num_stages, shared_bytes=int(compiled.metadata.shared),
                           loads=loads, **values)


def jpaged_kernel_resources(kernel: str, *, dtype: Any, head_dim: int, block_size: int, gqa: int,
                            num_kv_heads: int = 8, num_seqs: int = 8, q_len: int | None = None,
                            max_blocks: int = 64, arch: int = 90, q_dtype: Any = None,
                            **launch: Any) -> tuple[dict, KernelResources]:
    """Compile one of our GPU kernels ("decode" or "ragged") for sm_<arch>.

    The call is `paged_attention_gpu` on `num_seqs` sequences of `q_len` new
    tokens each (default 1 for "decode", 64 for "ragged"), T = num_seqs *
    q_len, [num_seqs, max_blocks] tables; only the named kernel is lowered
    (`gpu.single_kernel`).  `launch` goes to the kernel (block_k, block_m,
    decode_rows, num_partitions, num_warps, ..., and the contract's static
    options sliding_window and soft_cap); omitted ones take the defaults.
    `dtype` is the pool's; q's is `q_dtype`, default the pool's, or bfloat16
    for a quantized pool (int8, float8_e4m3fn: pages of block_size + 1 rows,
    the scale codes last: `reference.quantize_pages`).  Returns (the tiling used, resources).  The pool is
    2^32+ bytes so that offsets are 64-bit, as in a real pool.
    """
    import jax.numpy as jnp
    from pallas_kernels import gpu
    from pallas_kernels.reference import is_quantized, page_rows

    dtype = jnp.dtype(dtype)
    quantized = is_quantized(dtype)
    q_dtype = jnp.dtype(q_dtype or (jnp.bfloat16 if quantized else dtype))
    rows = page_rows(block_size, dtype)
    per_block = 2 * num_kv_heads * rows * head_dim * dtype.itemsize
    num_blocks = max(max_blocks + 1, 2 ** 32 // per_block + 1)
    q_len = q_len or (1 if kernel == "decode" else 64)
    T = num_seqs * q_len
    args = (jax.ShapeDtypeStruct((T, num_kv_heads * gqa, head_dim), q_dtype),
            jax.ShapeDtypeStruct((num_blocks, 1, 2, num_kv_heads, rows, head_dim), dtype),
            0,
            jax.ShapeDtypeStruct((num_seqs, max_blocks), jnp.int32),
            jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
            jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32))
    (ir,) = capture_ttir(gpu.single_kernel(kernel), *args, interpret=False, **launch)
    t = gpu.plan_tiling(T, gqa, head_dim, block_size, num_seqs, max_blocks, num_kv_heads,
                        gpu.tile_itemsize(dtype, q_dtype), quantized=quantized,
                        **{k: launch.get(k) for k in ("block_m", "block_k", "decode_rows",
                                                      "num_partitions")})
    tiling = dict(block_k=t.block_k)
    if kernel == "ragged":
        tiling["block_m"] = t.block_m
    tiling["decode_rows"] = t.decode_rows
    if kernel == "decode":
        tiling["num_partitions"] = t.num_partitions
    return tiling, compile_for_cuda(ir, arch)

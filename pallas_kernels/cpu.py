"""Ragged paged attention, the K/V write and two matmuls for XLA:CPU: C++ XLA FFI custom calls.

`paged_attention_cpu` is one kernel for decode tokens and prefill chunks
alike (the ragged contract of `pallas_kernels.paged_attention`).  It reads K/V
straight from the pool through the block table, never gathering a padded copy.
A work item is (sequence, kv head, tile of up to 48 / G of the sequence's new
tokens); its rows are the tile's tokens x the G query heads sharing the kv
head.  It walks the keys up to the tile's causal limit in chunks of 48 with an
fp32 online softmax (base-2, polynomial exp2): Q K^T and P V are
register-blocked, vectorized micro-kernels (6 x 16 fp32 tiles, ~95 % of the
FMA peak on AVX2), so prefill runs near the machine's matmul efficiency; items
of at most 4 rows (decode with G <= 4) take Q K^T as dot products over the head
dim instead.  Items, largest first, are spread over XLA's intra-op thread
pool; each is computed by one thread (results do not depend on the thread
count).  q and the output may be float32 or bfloat16; the K/V pool float32,
bfloat16 (converted on load), or quantized: int8 or float8_e4m3fn pages of
head_dim-byte rows and a row of one-byte scale codes (`reference.quantize_pages`),
dequantized exactly while a chunk of keys is staged (int8: sign-extend and
convert; fp8: its bits shifted into a binary16 that vcvtph2ps converts, no
table lookup per value), so every micro-kernel runs unchanged on them.  Decode
reads 64 bytes per int8 / fp8 row of head_dim 64, and a code byte per row from
the page's code row, where fp32 reads 256: it takes about half fp32's time.  Timings: benchmarks/bench_cpu_attention.py,
benchmarks/results/cpu_attention.md.

Gemma's options are FFI attributes (0 = none): `window` starts an item's key
loop at its first token's window start (keys before it are never loaded) and
masks per element; `soft_cap` caps the fp32 scores with std::tanh before the
mask.

`write_kv_cpu` writes the new tokens' K/V rows into the pool in place (the
result aliases the pool; donate it to keep one buffer).  XLA:CPU's own scatter
converts a whole bf16 or fp8 pool to f32 and back on every write.  For a
quantized pool the rows are quantized by `reference.quantize_rows` (jnp, one
small fusion: the same quantizer as the reference's, so the pool is
bit-identical) and copied in place by the kernel.  A C++ quantizer would not
be: XLA:CPU's log2 and exp2 are approximations (its ceil(log2(y)) is k, not
k + 1, for y 1-8 ulps above 2^k; exp2(-13), exp2(15), ... are not exact).

`matmul_cpu` is jpaged's batch-invariant matmul: each row of a @ b is computed
alone, in an order fixed by K (one FMA chain per element), so it does not
change with the number of rows as XLA's dot does (jpaged.layers.batch_invariant).

`skinny_matmul_cpu` is the weight matmul of steps of a few tokens (decode):
a [M <= 32, K] @ b [K, N] reading b once, b's rows streamed contiguously eight
at a time against accumulators that stay in L1; with `transpose_b`, b [N, K]
(a tied LM head), eight rows of b at a time against every row of a.
`grouped_skinny_matmul_cpu` is the same per group of rows, each group against
its own matrix (a MoE layer's experts, `jax.lax.ragged_dot`'s contract).
XLA:CPU's dot costs several passes over the weights at these M
(jpaged.layers.skinny_matmul; timings in benchmarks/README.md, "Skinny matmul").

`paged_attention_or_reference` / `write_kv_or_reference` (what
`pallas_kernels.get_backend("cpu")` returns) use the kernels when they apply
and fall back to the jnp reference otherwise.

The source (`csrc/paged_attention_cpu.cc`) is compiled lazily on first use
with g++ into `$JPAGED_CACHE_DIR/kernels/` (default `~/.cache/jpaged/kernels/`),
under a name keyed by a hash of the source, the compiler flags, the compiler,
the jax version and the host CPU (-march=native); it is built into a temporary
file and renamed into place, so concurrent processes never load a half-written
library.  A `<library>.sha256` digest written with it is checked before every
load: a cached library that is truncated, altered or has no digest is rebuilt
rather than handed to dlopen (where a truncated file dies of SIGBUS).
`available()` is False (reason logged once) when g++ is missing or the build
or load fails; importing this module never compiles or fails.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import (attention_dims, attention_options, check_page_layout,
                                      is_quantized, paged_attention_reference, pool_block_size,
                                      pool_head_dim, quantize_rows,
                                      write_kv_reference)

log = logging.getLogger(__name__)

TARGET = "jpaged_paged_attention_cpu"
_SYMBOL = "JpagedPagedAttentionCpu"
WRITE_TARGET = "jpaged_write_kv_cpu"
_WRITE_SYMBOL = "JpagedWriteKvCpu"
MATMUL_TARGET = "jpaged_matmul_cpu"
_MATMUL_SYMBOL = "JpagedMatmulCpu"
SKINNY_TARGET = "jpaged_skinny_matmul_cpu"
_SKINNY_SYMBOL = "JpagedSkinnyMatmulCpu"
GROUPED_SKINNY_TARGET = "jpaged_grouped_skinny_matmul_cpu"
_GROUPED_SKINNY_SYMBOL = "JpagedGroupedSkinnyMatmulCpu"
_SRC = pathlib.Path(__file__).parent / "csrc" / "paged_attention_cpu.cc"
_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-shared", "-fPIC",
          "-std=c++17")

_lock = threading.Lock()
_state: dict = {}  # "ok": bool, "reason": str, "lib": ctypes.CDLL


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("JPAGED_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jpaged")
    return pathlib.Path(root) / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++")


def _cpu_id() -> bytes:
    """The host CPU's model and feature flags: the build uses -march=native."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(dict.fromkeys(keep)).encode()
    except OSError:
        import platform
        return (platform.machine() + platform.processor()).encode()


def _build() -> pathlib.Path:
    """The path of a verified kernel library for this source/compiler/CPU, built if needed."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ not on PATH, $CXX unset)")
    src = _SRC.read_bytes()
    inc = jax.ffi.include_dir()
    try:
        cxx_version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                     timeout=60).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"cannot run C++ compiler {cxx!r}: {e}") from e
    key = hashlib.sha256(b"\0".join([src, " ".join(_FLAGS).encode(), cxx_version.encode(),
                                     jax.__version__.encode(), inc.encode(), _cpu_id()])).hexdigest()[:16]
    out_dir = _cache_dir()
    out = out_dir / f"paged_attention_cpu-{key}.so"
    if out.exists():
        problem = _damage(out)
        if not problem:
            return out
        # Rebuilt and renamed over it, never truncated or rewritten in place: a
        # process that has the old file mapped keeps its (old) inode intact.
        log.warning("cached CPU kernel %s is unusable (%s); rebuilding", out, problem)
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_files(out_dir)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        cmd = [cxx, *_FLAGS, f"-I{inc}", str(_SRC), "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if res.returncode != 0:
            raise RuntimeError(f"build failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
        problem = _elf_problem(pathlib.Path(tmp).read_bytes())
        if problem:
            raise RuntimeError(f"the compiler wrote no usable library ({' '.join(cmd)}): {problem}")
        # The digest goes in place first, so whoever sees the new library also sees
        # its digest; a reader that catches an older library beside it rebuilds.
        _write_atomic(_digest_file(out), f"{_sha256_file(pathlib.Path(tmp))}  {out.name}\n".encode())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_BUILD_TIMEOUT_S = 600
_ELF_MAGIC = b"\x7fELF"


def _digest_file(lib: pathlib.Path) -> pathlib.Path:
    """`<lib>.sha256`, in `sha256sum` format, written when `lib` was built."""
    return lib.with_name(lib.name + ".sha256")


def _sha256_file(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _elf_problem(data: bytes) -> str:
    """Why `data` is not a whole ELF file ("" if it looks like one).  The digest is the
    real check; this one also covers a fresh build, and names what a truncation cut."""
    if len(data) < 64 or data[:4] != _ELF_MAGIC:  # 64: an ELF64 header
        return f"not an ELF shared library ({len(data):,} bytes)"
    if data[4:6] == b"\x02\x01":  # ELF64, little-endian: the section headers end the file
        sh_end = int.from_bytes(data[0x28:0x30], "little") + \
            int.from_bytes(data[0x3A:0x3C], "little") * int.from_bytes(data[0x3C:0x3E], "little")
        if sh_end > len(data):
            return f"truncated ELF file ({len(data):,} of at least {sh_end:,} bytes)"
    return ""


def _damage(lib: pathlib.Path) -> str:
    """Why the cached library must not be loaded ("" if it is the one we built).

    dlopen maps the file; a truncated one dies of SIGBUS at load (or later), and a
    flipped bit runs wrong code, so only a file matching the digest recorded at
    build time is loaded.  A library without a digest (built by an older jpaged,
    or whose build was cut short) is rebuilt too.
    """
    try:
        data = lib.read_bytes()
        recorded = _digest_file(lib).read_text().split()
    except FileNotFoundError as e:
        return f"{pathlib.Path(e.filename).name} is missing"
    problem = _elf_problem(data)
    if problem:
        return problem
    if not recorded or recorded[0] != hashlib.sha256(data).hexdigest():
        return "sha256 differs from the one recorded at build time"
    return ""


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from other users of a shared cache
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _remove_stale_temp_files(out_dir: pathlib.Path) -> None:
    """Removes `*.tmp` files of builds killed midway.  A build is cut off after
    _BUILD_TIMEOUT_S, so a temp file untouched for an hour has no live writer."""
    cutoff = time.time() - max(3600, 2 * _BUILD_TIMEOUT_S)
    for tmp in out_dir.glob("*.tmp"):
        try:
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
        except OSError:  # gone already, or not ours to remove
            pass


def _load() -> bool:
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        try:
            path = _build()
            lib = ctypes.CDLL(str(path))
            _declare_block_registry(lib)
            for target, symbol in ((TARGET, _SYMBOL), (WRITE_TARGET, _WRITE_SYMBOL),
                                   (MATMUL_TARGET, _MATMUL_SYMBOL), (SKINNY_TARGET, _SKINNY_SYMBOL),
                                   (GROUPED_SKINNY_TARGET, _GROUPED_SKINNY_SYMBOL)):
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                            platform="cpu")
            _state.update(ok=True, lib=lib, reason="")
        except Exception as e:  # never crash the caller: fall back to the reference
            _state.update(ok=False, reason=f"{type(e).__name__}: {e}")
            log.warning("jpaged CPU paged-attention kernel unavailable, using the jnp reference: %s",
                        _state["reason"])
        return _state["ok"]


def available() -> bool:
    """True if the kernel is built (compiling it on the first call) and registered."""
    return _load()


def unavailable_reason() -> str:
    """Why `available()` is False ("" when it is True)."""
    _load()
    return _state.get("reason", "")


SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # q, output, K/V to write
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
POOL_DTYPES = SUPPORTED_DTYPES + QUANTIZED_DTYPES


def supports(q: jax.Array, kv_pool: jax.Array) -> bool:
    """Whether `paged_attention_cpu` takes these operands ([T, H, D] q of f32/bf16, a
    f32/bf16/int8/fp8 pool, kernel built)."""
    return (q.ndim == 3 and jnp.dtype(q.dtype) in SUPPORTED_DTYPES
            and jnp.dtype(kv_pool.dtype) in POOL_DTYPES and available())


def paged_attention_cpu(q: jax.Array, kv_pool: jax.Array, layer: jax.Array | int,
                        block_tables: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array,
                        *, sm_scale: float | None = None, sliding_window: int | None = None,
                        soft_cap: float | None = None, max_threads: int = 0,
                        token_tile: int = 0) -> jax.Array:
    """Ragged paged attention (q: [T, H, D]); see `pallas_kernels.paged_attention`.

    Decode tokens, prefill chunks and padding mixed in one call.  Only reads
    the pool, so it works with donated pools and inside jit / scan (layer may
    be traced).  `max_threads` > 0 caps the threads used (default: XLA's
    intra-op pool size, at most the number of cores).  `token_tile` > 0 sets
    the tokens per work item (default 48 / G); 1 makes each query's arithmetic
    independent of the other tokens of the call (jpaged's batch_invariant mode).
    """
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"paged_attention_cpu: q dtype {q.dtype} unsupported (float32 or bfloat16)")
    if jnp.dtype(kv_pool.dtype) not in POOL_DTYPES:
        raise TypeError(f"paged_attention_cpu: kv_pool dtype {kv_pool.dtype} unsupported "
                        "(float32, bfloat16, int8 or float8_e4m3fn)")
    *_, scale = attention_dims(q, kv_pool, block_tables, kv_lens, cu_q_lens, sm_scale,
                               sliding_window, soft_cap)
    sliding_window, soft_cap = attention_options(sliding_window, soft_cap)
    if not available():
        raise RuntimeError(f"CPU paged-attention kernel unavailable: {unavailable_reason()}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    return call(q, kv_pool, jnp.asarray(layer, jnp.int32).reshape(()),
                jnp.asarray(block_tables, jnp.int32), jnp.asarray(kv_lens, jnp.int32),
                jnp.asarray(cu_q_lens, jnp.int32), sm_scale=np.float32(scale),
                max_threads=np.int64(max_threads), window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0), token_tile=np.int64(token_tile))


def paged_attention_or_reference(q: jax.Array, kv_pool: jax.Array, layer: jax.Array | int,
                                 block_tables: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array,
                                 *, sm_scale: float | None = None,
                                 sliding_window: int | None = None,
                                 soft_cap: float | None = None) -> jax.Array:
    """`paged_attention_cpu` when `supports(q, kv_pool)`, else the jnp reference."""
    opts = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if supports(q, kv_pool):
        return paged_attention_cpu(q, kv_pool, layer, block_tables, kv_lens, cu_q_lens, **opts)
    return paged_attention_reference(q, kv_pool, layer, block_tables, kv_lens, cu_q_lens, **opts)


def _write_args_ok(kv_pool: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    return (kv_pool.ndim == 6 and k.ndim == 3 and k.shape == v.shape and k.dtype == v.dtype
            and jnp.dtype(kv_pool.dtype) in POOL_DTYPES
            and jnp.dtype(k.dtype) in SUPPORTED_DTYPES)


def write_kv_cpu(kv_pool: jax.Array, layer: jax.Array | int, k: jax.Array, v: jax.Array,
                 blocks: jax.Array, offsets: jax.Array) -> jax.Array:
    """kv_pool with k, v [T, KVH, D] at row offsets[t] of block blocks[t] of `layer`, in place.

    The result aliases the pool (donate it to keep one buffer); writes whose
    block, offset or layer is out of range are dropped, like the reference's
    scatter.  Padding tokens carry block 0, the null block.  A quantized pool
    gets `quantize_rows` of k and v (bit-identical to `write_kv_reference`).
    """
    if not _write_args_ok(kv_pool, k, v):
        raise TypeError(f"write_kv_cpu: kv_pool {kv_pool.shape} {kv_pool.dtype}, k {k.shape} "
                        f"{k.dtype}, v {v.shape} {v.dtype}: need a 6-d pool (float32, bfloat16, "
                        "int8 or float8_e4m3fn) and [T, KVH, D] k/v of one dtype, float32 or "
                        "bfloat16")
    blocks, offsets = jnp.asarray(blocks, jnp.int32), jnp.asarray(offsets, jnp.int32)
    if k.shape[1:] != (kv_pool.shape[3], pool_head_dim(kv_pool)) or blocks.shape != k.shape[:1] \
            or offsets.shape != k.shape[:1]:
        raise ValueError(f"write_kv_cpu: k/v {k.shape}, blocks {blocks.shape}, offsets "
                         f"{offsets.shape} do not fit pool {kv_pool.shape}")
    check_page_layout(pool_block_size(kv_pool), pool_head_dim(kv_pool), kv_pool.dtype)
    if not available():
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    if is_quantized(kv_pool.dtype):
        # Quantized here, by the reference's own quantizer (one small fusion over the new
        # rows), so that the pool is bit-identical to write_kv_reference's; each row goes
        # to the kernel as D values then its code, which it copies to the row and to the
        # page's code row.  XLA's scatter would be the slow part: into an fp8 pool it
        # converts the whole pool to f32 and back.
        k, v = (_with_code(*quantize_rows(x, kv_pool.dtype)) for x in (k, v))
    call = jax.ffi.ffi_call(WRITE_TARGET, jax.ShapeDtypeStruct(kv_pool.shape, kv_pool.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(kv_pool, k, v, jnp.asarray(layer, jnp.int32).reshape(()), blocks, offsets)


def _with_code(values: jax.Array, codes: jax.Array) -> jax.Array:
    """Quantized rows [T, KVH, D] and their codes [T, KVH] as [T, KVH, D + 1], the code
    last: what `write_kv_cpu`'s kernel takes for a quantized pool."""
    return jnp.concatenate([values, codes[..., None]], axis=-1)


def write_kv_or_reference(kv_pool: jax.Array, layer: jax.Array | int, k: jax.Array, v: jax.Array,
                          blocks: jax.Array, offsets: jax.Array) -> jax.Array:
    """`write_kv_cpu` when the kernel is built and the dtypes fit, else `write_kv_reference`."""
    if _write_args_ok(kv_pool, k, v) and available():
        return write_kv_cpu(kv_pool, layer, k, v, blocks, offsets)
    return write_kv_reference(kv_pool, layer, k, v, blocks, offsets)


def matmul_cpu(a: jax.Array, b: jax.Array, *, transpose_b: bool = False, soft_cap: float | None = None,
               max_threads: int = 0) -> jax.Array:
    """a [M, K] @ b [K, N] (b [N, K] and b.T with `transpose_b`: a tied LM head is
    read as it is stored) in float32, each row of the result independent of M and
    of the other rows: every element is one fused multiply-add chain over k in
    order (XLA's dot changes its blocking, and so its rounding, with M).  The
    kernel of jpaged's batch_invariant mode; not differentiable by itself
    (jpaged.layers.batch_invariant gives it a VJP).  `soft_cap`: each element
    becomes soft_cap * tanh(element / soft_cap) (std::tanh), computed here so that
    XLA cannot contract it into the ops that read it."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1 if transpose_b else 0]:
        raise ValueError(f"matmul_cpu: need a [M, K] and b [{'N, K' if transpose_b else 'K, N'}], "
                         f"got {a.shape} and {b.shape}")
    if jnp.dtype(a.dtype) != jnp.float32 or jnp.dtype(b.dtype) != jnp.float32:
        raise TypeError(f"matmul_cpu: a and b must be float32, got {a.dtype} and {b.dtype}")
    if not available():
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    n = b.shape[0 if transpose_b else 1]
    call = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((a.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    _, soft_cap = attention_options(None, soft_cap)
    return call(a, b, max_threads=np.int64(max_threads), transpose_b=bool(transpose_b),
                soft_cap=np.float32(soft_cap or 0.0))


# The most rows skinny_matmul_cpu takes: its accumulators (4096 floats per column
# panel) hold 8 columns of 512 rows, but past ~48 rows XLA's dot is the faster
# (benchmarks/README.md, "Skinny matmul").
SKINNY_MAX_ROWS = 32


def skinny_matmul_cpu(a: jax.Array, b: jax.Array, *, transpose_b: bool = False, max_threads: int = 0) -> jax.Array:
    """a [M, K] @ b [K, N] (b [N, K] and b.T with `transpose_b`: a tied LM head as
    stored) in float32 for a few rows (M <= SKINNY_MAX_ROWS: a decode step's
    tokens), reading b once: the weight matmuls of jpaged's CPU decode steps
    (jpaged.layers.skinny_matmul).  XLA's own dot costs several passes over b at
    these M.  Not differentiable by itself (jpaged.layers.skinny_matmul gives it a VJP)."""
    k_axis = 1 if transpose_b else 0
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[k_axis]:
        want = "[N, K]" if transpose_b else "[K, N]"
        raise ValueError(f"skinny_matmul_cpu: need a [M, K] and b {want}, got {a.shape} and {b.shape}")
    if a.shape[0] > SKINNY_MAX_ROWS:
        raise ValueError(f"skinny_matmul_cpu: at most {SKINNY_MAX_ROWS} rows, got {a.shape[0]}")
    if jnp.dtype(a.dtype) != jnp.float32 or jnp.dtype(b.dtype) != jnp.float32:
        raise TypeError(f"skinny_matmul_cpu: a and b must be float32, got {a.dtype} and {b.dtype}")
    if not available():
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    call = jax.ffi.ffi_call(SKINNY_TARGET, jax.ShapeDtypeStruct((a.shape[0], b.shape[1 - k_axis]), jnp.float32),
                            vmap_method="sequential")
    return call(a, b, max_threads=np.int64(max_threads), transpose_b=bool(transpose_b))


# GGUF block weights (jpaged.loading.gguf_blocks) for skinny_matmul_cpu: the C++
# kBlocksQ4 / kBlocksQ8, and the arrays each registered weight's blocks live in
# (kept here until unregistered: the registry holds only their addresses).
BLOCK_KINDS = {"q4": 0, "q8": 1}
_registered_blocks: dict[int, tuple[np.ndarray, ...]] = {}


def _declare_block_registry(lib: ctypes.CDLL) -> None:
    """The C signatures of the block-weights registry (csrc: jpaged_register_block_weights, ...)."""
    ptr = ctypes.c_void_p
    lib.jpaged_register_block_weights.argtypes = [ptr, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64,
                                                  ctypes.c_int32, ptr, ptr, ptr]
    lib.jpaged_unregister_block_weights.argtypes = [ptr]
    lib.jpaged_block_matmul_calls.restype = ctypes.c_int64


def register_block_weights(weight: jax.Array, kind: str, codes: np.ndarray, scales: np.ndarray,
                           offsets: np.ndarray | None, *, transposed: bool = False) -> int:
    """From now on, skinny_matmul_cpu calls whose `b` is `weight`'s own buffer (a
    float32 [K, N]; with `transposed`, [N, K] read with transpose_b=True; on one CPU
    device) read these blocks of the same matrix [N, K] instead: `kind` "q4" (codes uint8 [N, K / 2], two weights a
    byte as in a GGUF Q4 block; scales and offsets float32 [N, K / 32]; a weight is
    scale * code + offset) or "q8" (codes int8 [N, K]; scales [N, K / 32]).  The
    result is the one skinny_matmul_cpu gives for the dequantised matrix, transposed.
    The caller vouches that `weight` holds exactly that dequantised matrix, and must
    unregister before the buffer is freed or its contents change.  Returns the
    buffer's address (the key for unregister_block_weights)."""
    if not available():
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    if kind not in BLOCK_KINDS:
        raise ValueError(f"register_block_weights: kind must be one of {sorted(BLOCK_KINDS)}, got {kind!r}")
    n, k = scales.shape[0], scales.shape[1] * 32
    want = {"codes": ((n, k // 2) if kind == "q4" else (n, k), np.uint8 if kind == "q4" else np.int8),
            "scales": ((n, k // 32), np.float32)}
    if kind == "q4":
        want["offsets"] = ((n, k // 32), np.float32)
    arrays = {"codes": codes, "scales": scales, "offsets": offsets}
    for name, (shape, dtype) in want.items():
        a = arrays[name]
        if a is None or a.shape != shape or a.dtype != dtype or not a.flags.c_contiguous:
            got = None if a is None else (a.shape, a.dtype)
            raise ValueError(f"register_block_weights: {name} must be C-contiguous {np.dtype(dtype)} {shape}, got {got}")
    shape = (n, k) if transposed else (k, n)
    if weight.dtype != jnp.float32 or weight.shape != shape or len(weight.addressable_shards) != 1:
        raise ValueError(f"register_block_weights: the weight must be one float32 {list(shape)} array on one "
                         f"device, got {weight.dtype} {weight.shape}")
    address = weight.unsafe_buffer_pointer()
    kept = tuple(a for a in (codes, scales, offsets) if a is not None)
    lib = _state["lib"]
    with _lock:
        _registered_blocks[address] = kept
        if lib.jpaged_register_block_weights(address, BLOCK_KINDS[kind], n, k, int(transposed), codes.ctypes.data,
                                             scales.ctypes.data, None if offsets is None else offsets.ctypes.data):
            del _registered_blocks[address]
            raise ValueError(f"register_block_weights: blocks of [{n}, {k}] refused")
    return address


def unregister_block_weights(address: int) -> bool:
    """Forgets the blocks registered under `address` (waiting for calls reading them);
    True if there were any."""
    if not _state.get("ok"):
        return False
    lib = _state["lib"]
    with _lock:
        had = bool(lib.jpaged_unregister_block_weights(address))
        _registered_blocks.pop(address, None)
    return had


def block_matmul_calls() -> int:
    """How many skinny_matmul_cpu calls read registered blocks (since the library loaded)."""
    if not available():
        return 0
    return int(_state["lib"].jpaged_block_matmul_calls())


def grouped_skinny_matmul_cpu(a: jax.Array, group_sizes: jax.Array, b: jax.Array, *,
                              max_threads: int = 0) -> jax.Array:
    """Rows a [R, K] sorted by group (group_sizes [E] rows each, in order) times
    their group's b [E, K, N]: [R, N] float32, rows past the groups' total zero
    (`jax.lax.ragged_dot`'s contract).  A MoE layer's experts in a decode step
    (jpaged.layers.moe): each group's matrix is read once, as skinny_matmul_cpu
    reads one, in chunks of SKINNY_MAX_ROWS rows."""
    if a.ndim != 2 or b.ndim != 3 or group_sizes.ndim != 1 or a.shape[1] != b.shape[1] \
            or group_sizes.shape[0] != b.shape[0]:
        raise ValueError("grouped_skinny_matmul_cpu: need a [R, K], group_sizes [E] and b [E, K, N], got "
                         f"{a.shape}, {group_sizes.shape} and {b.shape}")
    if jnp.dtype(a.dtype) != jnp.float32 or jnp.dtype(b.dtype) != jnp.float32:
        raise TypeError(f"grouped_skinny_matmul_cpu: a and b must be float32, got {a.dtype} and {b.dtype}")
    if not available():
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    call = jax.ffi.ffi_call(GROUPED_SKINNY_TARGET, jax.ShapeDtypeStruct((a.shape[0], b.shape[2]), jnp.float32),
                            vmap_method="sequential")
    return call(a, group_sizes.astype(jnp.int32), b, max_threads=np.int64(max_threads))


__all__ = ["available", "unavailable_reason", "supports", "paged_attention_cpu", "matmul_cpu",
           "skinny_matmul_cpu", "grouped_skinny_matmul_cpu", "SKINNY_MAX_ROWS",
           "paged_attention_or_reference", "write_kv_cpu", "write_kv_or_reference"]

"""Decode (Q == 1) paged attention and the K/V write for XLA:CPU: C++ XLA FFI custom calls.

`write_kv_cpu` writes new K/V rows into the pool in place; the engine uses it
for bf16 pools, which XLA:CPU's scatter would convert whole to f32 and back.

The jnp reference spends most of a CPU decode step in XLA:CPU's gather (the
copy of every sequence's K/V out of the pool).  This kernel reads K/V straight
from the pool through the block table: one work item per (sequence, kv head),
the G query heads of a KV head computed together while that head's K/V rows
stream through once, fp32 online softmax, items spread over XLA's intra-op
thread pool.  K/V may be float32 or bfloat16 (converted on load); q and the
output float32 or bfloat16.

The source (`csrc/paged_decode_cpu.cc`) is compiled lazily on first use with
g++ into `$JPAGED_CACHE_DIR/kernels/` (default `~/.cache/jpaged/kernels/`),
under a name keyed by a hash of the source, the compiler flags, the compiler,
the jax version and the host CPU (-march=native); it is built into a temporary file and renamed into place,
so concurrent processes never load a half-written library.  `available()` is
False (reason logged once) when g++ is missing or the build or load fails;
importing this module never compiles or fails.
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

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

TARGET = "jpaged_paged_decode_cpu"
_SYMBOL = "JpagedPagedDecodeCpu"
WRITE_TARGET = "jpaged_write_kv_cpu"
_WRITE_SYMBOL = "JpagedWriteKvCpu"
_SRC = pathlib.Path(__file__).parent / "csrc" / "paged_decode_cpu.cc"
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c++17")

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
    out = out_dir / f"paged_decode_cpu-{key}.so"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        cmd = [cxx, *_FLAGS, f"-I{inc}", str(_SRC), "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"build failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load() -> bool:
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        try:
            path = _build()
            lib = ctypes.CDLL(str(path))
            for target, symbol in ((TARGET, _SYMBOL), (WRITE_TARGET, _WRITE_SYMBOL)):
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


SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def supports(q: jax.Array, kv_pool: jax.Array) -> bool:
    """Whether `paged_decode_cpu` handles these operands (Q == 1, f32/bf16, kernel built)."""
    return (q.ndim == 4 and q.shape[1] == 1 and jnp.dtype(q.dtype) in SUPPORTED_DTYPES
            and jnp.dtype(kv_pool.dtype) in SUPPORTED_DTYPES and available())


def paged_decode_cpu(q: jax.Array, kv_pool: jax.Array, layer: jax.Array | int,
                     block_tables: jax.Array, kv_lens: jax.Array, q_lens: jax.Array,
                     *, sm_scale: float | None = None, max_threads: int = 0) -> jax.Array:
    """Decode attention (q: [B, 1, H, D]) over the paged pool; see `pallas_kernels.paged_attention`.

    Only reads the pool, so it works with donated pools and inside jit (layer
    may be traced).  `max_threads` > 0 caps the threads used (default: XLA's
    intra-op pool size, at most the number of cores).
    """
    if q.ndim != 4 or q.shape[1] != 1:
        raise ValueError(f"paged_decode_cpu is decode-only: q must be [B, 1, H, D], got {q.shape}")
    for name, x in (("q", q), ("kv_pool", kv_pool)):
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"paged_decode_cpu: {name} dtype {x.dtype} unsupported "
                            "(float32 or bfloat16)")
    if kv_pool.ndim != 6 or kv_pool.shape[2] != 2 or kv_pool.shape[5] != q.shape[3]:
        raise ValueError(f"paged_decode_cpu: bad kv_pool shape {kv_pool.shape} for q {q.shape}")
    if q.shape[2] % kv_pool.shape[3]:
        raise ValueError(f"num_heads {q.shape[2]} not a multiple of num_kv_heads {kv_pool.shape[3]}")
    if not available():
        raise RuntimeError(f"CPU paged-attention kernel unavailable: {unavailable_reason()}")
    D = q.shape[3]
    scale = float(D ** -0.5 if sm_scale is None else sm_scale)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    return call(q, kv_pool, jnp.asarray(layer, jnp.int32).reshape(()),
                jnp.asarray(block_tables, jnp.int32), jnp.asarray(kv_lens, jnp.int32),
                jnp.asarray(q_lens, jnp.int32), sm_scale=np.float32(scale),
                max_threads=np.int64(max_threads))


def write_kv_cpu(kv_pool: jax.Array, layer: jax.Array | int, new_kv: jax.Array,
                 slots: jax.Array) -> jax.Array:
    """kv_pool with new_kv [T, 2, KVH, D] written at flat slots [T] of `layer`, in place.

    Slot s is row s % block_size of block s // block_size; slots outside the
    pool are dropped.  The result aliases the pool (donate it to keep one
    buffer).  XLA:CPU's own scatter converts a whole bf16 pool to f32 and back
    on every write; this writes only the new rows.
    """
    for name, x in (("new_kv", new_kv), ("kv_pool", kv_pool)):
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"write_kv_cpu: {name} dtype {x.dtype} unsupported (float32 or bfloat16)")
    if not available():
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    call = jax.ffi.ffi_call(WRITE_TARGET, jax.ShapeDtypeStruct(kv_pool.shape, kv_pool.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(kv_pool, new_kv, jnp.asarray(layer, jnp.int32).reshape(()),
                jnp.asarray(slots, jnp.int32))


__all__ = ["available", "unavailable_reason", "supports", "paged_decode_cpu", "write_kv_cpu"]

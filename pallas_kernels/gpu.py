"""Pallas (Triton lowering) paged-attention kernels for GPU.

Two kernels, both reading K/V straight out of the whole pool
`kv_pool[num_blocks, num_layers, 2, KVH, BS, D]` through the block table (no
gather copy, no per-layer slice copy; `layer` is a traced scalar):

* `paged_decode_gpu` (Q == 1): flash-decoding.  Grid (B, KVH, P).  Program
  (b, h, p) takes the G query heads of KV head h as the M dimension of the
  dot (padded to >= 16 rows for the Triton dot), loops over the key tiles of
  partition p of sequence b (`block_k` tokens: several pages, one page or a
  slice of one, block ids read from the block table), keeps an fp32 online
  softmax (m, l, acc) and writes the un-normalised partial (acc, m, l).  A small jnp combine merges the P partials.  P is a
  static heuristic that fills ~2 waves of an H100 (132 SMs) for small
  batches with long contexts.
* `paged_ragged_gpu` (Q >= 1, ragged q_lens): grid (B, KVH, row tiles).  The
  Q tokens x G heads of one KV head are flattened to Q*G rows (row r is token
  r // G), tiled by `block_m` rows; each tile loops over key tiles 0..the
  last one visible to its last valid token (fully masked tiles are never
  visited) with a causal + length mask and online softmax.

Masking never multiplies by a mask: keys/values past kv_len are replaced with
`where`, so NaN in blocks a sequence does not own (block 0 included) never
reaches the output.  Rows with no visible key produce zeros.

On a non-GPU backend the kernels run with `interpret=True` automatically.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.reference import attention_dims, row_tile_span

try:  # jax >= 0.6 naming; present in 0.10 and 0.11
    from jax.experimental.pallas import triton as plgpu
    _CompilerParams = plgpu.CompilerParams
except (ImportError, AttributeError):  # pragma: no cover - very old jax
    _CompilerParams = None

MASK_VALUE = -1e30
H100_SMS = 132
_MIN_DOT = 16  # the Triton dot wants every dimension >= 16


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _check_pow2(*dims):
    for x in dims:
        if x & (x - 1):
            raise ValueError(f"Triton kernels need power-of-two block_size/head_dim, got {x}")


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _compiler_params(num_warps: int, num_stages: int):
    # Passing Triton CompilerParams is what selects the Triton lowering: with
    # None, jax >= 0.8 lowers GPU Pallas kernels with Mosaic GPU instead.
    if _CompilerParams is None:
        return None
    return _CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _fp32_dot_precision(interpret: bool):
    """Dot precision for fp32 K/V: products as accurate as fp32, never plain TF32.

    Compiled for a GPU this is TF32x3 (three tensor-core TF32 products, ~fp32
    accuracy): Triton's exact-fp32 ("ieee") dot is a CUDA-core FMA loop that
    spills kilobytes of registers to local memory (ptxas -v, sm_90, 64x64
    tiles).  The interpreter runs on the CPU backend, which has no TF32x3
    algorithm, so it computes the exact fp32 product instead.
    """
    return lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _qk(q, k, fp32_precision):
    """[M, D] x [N, D] -> [M, N] fp32 scores (q, k already fp32 or bf16)."""
    m, _ = q.shape
    n, _ = k.shape
    if m >= _MIN_DOT and n >= _MIN_DOT:
        prec = fp32_precision if k.dtype == jnp.float32 else None
        return lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                               preferred_element_type=jnp.float32)
    # Tiny tiles (block_size 8): broadcast-multiply-reduce instead of a dot.
    return jnp.sum(q.astype(jnp.float32)[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=-1)


def _pv(p, v, fp32_precision):
    """[M, N] fp32 probs x [N, D] -> [M, D] fp32."""
    m, n = p.shape
    if m >= _MIN_DOT and n >= _MIN_DOT:
        prec = fp32_precision if v.dtype == jnp.float32 else None
        return lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                               precision=prec, preferred_element_type=jnp.float32)
    return jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)


def _online_softmax_step(carry, q, k, v, key_valid, visible, fp32_precision):
    """One key tile of flash attention: (acc, m, l) updated with q [M, D] over k, v [TK, D].

    Keys past the sequence (key_valid False) are zeroed with `where`, never
    multiplied, so NaN in blocks a sequence does not own cannot leak;
    `visible` [M, TK] (or [1, TK]) masks the scores.
    """
    acc, m_i, l_i = carry
    k = jnp.where(key_valid[:, None], k, jnp.zeros_like(k))
    v = jnp.where(key_valid[:, None], v, jnp.zeros_like(v))
    s = _qk(q.astype(k.dtype), k, fp32_precision)          # [M, TK] fp32
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    alpha = jnp.exp(m_i - m_new)
    pr = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    l_new = l_i * alpha + jnp.sum(pr, axis=1)
    return acc * alpha[:, None] + _pv(pr, v, fp32_precision), m_new, l_new


# --------------------------------------------------------------------------
# Decode (Q == 1), flash-decoding partitions.
# --------------------------------------------------------------------------

def num_partitions_heuristic(batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                             num_sms: int = H100_SMS) -> int:
    """Static partition count: ~2 CTAs per SM, each partition >= 256 tokens."""
    programs = batch * num_kv_heads
    want = -(-2 * num_sms // programs)
    min_blocks_per_part = max(1, 256 // block_size)
    most = max(1, max_blocks // min_blocks_per_part)
    return int(max(1, min(want, most)))


def _decode_kernel(layer_ref, bt_ref, lens_ref, q_ref, kv_ref, o_ref, m_ref, l_ref, *,
                   block_size: int, block_k: int, iters_per_part: int, sm_scale: float,
                   fp32_precision):
    b = pl.program_id(0)
    h = pl.program_id(1)
    p = pl.program_id(2)
    layer = layer_ref[0]
    kv_len = lens_ref[b]
    gp, d = q_ref.shape
    tk = block_k
    q = q_ref[...].astype(jnp.float32) * sm_scale

    n_iters = (kv_len + tk - 1) // tk
    start = p * iters_per_part
    end = jnp.minimum(start + iters_per_part, n_iters)

    def body(it, carry):
        k, v = _load_kv_tile(kv_ref, bt_ref, b, it, layer, h, block_size, tk)
        pos = it * tk + jnp.arange(tk, dtype=jnp.int32)
        valid = pos < kv_len                              # [TK]
        return _online_softmax_step(carry, q, k, v, valid, valid[None, :], fp32_precision)

    init = (jnp.zeros((gp, d), jnp.float32),
            jnp.full((gp,), MASK_VALUE, jnp.float32),
            jnp.zeros((gp,), jnp.float32))
    acc, m_i, l_i = lax.fori_loop(start, jnp.maximum(start, end), body, init)
    o_ref[...] = acc
    m_ref[...] = m_i
    l_ref[...] = l_i


def _load_kv_tile(kv_ref, bt_ref, b, it, layer, h, block_size, block_k):
    """K and V [block_k, D] of key tile `it` of row b, read straight from the pool.

    A tile is several whole pages (block_k > block_size: one gather-load of
    the page vector, no copy), one page, or a slice of one page (block_k <
    block_size: large pages are walked in pieces to bound registers and
    shared memory).
    """
    d = kv_ref.shape[-1]
    if block_k > block_size:
        ppi = block_k // block_size
        ids = bt_ref[b, pl.ds(it * ppi, ppi)]                     # [ppi] block ids
        k = kv_ref[ids, layer, 0, h].reshape(block_k, d)          # gather-load, no copy
        v = kv_ref[ids, layer, 1, h].reshape(block_k, d)
        return k, v
    if block_k == block_size:
        blk = bt_ref[b, it]
        return kv_ref[blk, layer, 0, h], kv_ref[blk, layer, 1, h]
    tiles_per_page = block_size // block_k
    # lax.div/rem: `it` >= 0, so C semantics suffice (jnp's floor-mod adds sign fix-ups).
    blk = bt_ref[b, lax.div(it, tiles_per_page)]
    rows = pl.ds(pl.multiple_of(lax.rem(it, tiles_per_page) * block_k, block_k), block_k)
    return kv_ref[blk, layer, 0, h, rows], kv_ref[blk, layer, 1, h, rows]


def default_block_k(head_dim: int, itemsize: int) -> int:
    """Keys per loop iteration: a ~16 KiB K tile (64 tokens of bf16 x 128).

    Sized with `triton_aot` for sm_90: larger fp32 tiles spill registers and
    (fp32, head_dim 128, 128 keys) need more shared memory than an SM has.
    """
    return max(_MIN_DOT, min(128, 16384 // (head_dim * itemsize)))


def default_block_m(rows: int, head_dim: int, itemsize: int) -> int:
    """Query rows per ragged tile: 64, or 32 for fp32 x head_dim 128 (spills at 64)."""
    cap = 64 if head_dim * itemsize <= 256 else 32
    return min(cap, max(_MIN_DOT, _next_pow2(rows)))


def key_tiling(block_k: int | None, W: int, BS: int, head_dim: int,
               itemsize: int) -> tuple[int, int]:
    """(keys per tile, pages one tile spans, >= 1) for a [B, W] table of BS-token
    pages; block_k None takes `default_block_k`; never more than the table holds."""
    tk = block_k or default_block_k(head_dim, itemsize)
    tk = max(1, min(_next_pow2(tk), _next_pow2(W * BS)))
    return tk, max(1, tk // BS)


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_partitions", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def paged_decode_gpu(q, kv_pool, layer, block_tables, kv_lens, q_lens, *, sm_scale=None,
                     num_partitions=None, block_k=None, num_warps=4, num_stages=2,
                     interpret=None):
    """Decode attention (Q == 1).  Same contract as `pallas_kernels.paged_attention`.

    block_k: keys per loop iteration (a power of two; several pages, one page
    or part of one), default `default_block_k`.  num_partitions: the
    flash-decoding split, default `num_partitions_heuristic`.
    """
    B, Q, H, D, KVH, BS, G, W, scale = attention_dims(q, kv_pool, block_tables, sm_scale)
    if Q != 1:
        raise ValueError(f"paged_decode_gpu needs Q == 1, got Q={Q}")
    if interpret is None:
        interpret = not _on_gpu()
    _check_pow2(BS, D)
    tk, pages_per_tile = key_tiling(block_k, W, BS, D, kv_pool.dtype.itemsize)
    n_it = -(-(W * BS) // tk)                             # key tiles of a full row
    P = num_partitions or num_partitions_heuristic(B, KVH, W, BS)
    P = max(1, min(P, n_it))
    ipp = -(-n_it // P)                                   # tiles per partition
    Wp = -(-W // pages_per_tile) * pages_per_tile
    GP = max(_MIN_DOT, _next_pow2(G))
    block_tables = block_tables.astype(jnp.int32)
    if Wp != W:  # pad with the null block so every page-vector load stays in bounds
        block_tables = jnp.pad(block_tables, ((0, 0), (0, Wp - W)))

    eff_lens = jnp.where(q_lens > 0, kv_lens, 0).astype(jnp.int32)
    qg = q.reshape(B, KVH, G, D)
    if GP != G:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, GP - G), (0, 0)))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)

    kernel = functools.partial(_decode_kernel, block_size=BS, block_k=tk,
                               iters_per_part=ipp, sm_scale=scale,
                               fp32_precision=_fp32_dot_precision(interpret))
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, p: (0,) * len(shape))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, KVH, P),
        in_specs=[
            full((1,)),
            full((B, Wp)),
            full((B,)),
            pl.BlockSpec((None, None, GP, D), lambda b, h, p: (b, h, 0, 0)),
            full(kv_pool.shape),                              # whole pool, read by block id
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, GP, D), lambda b, h, p: (b, h, p, 0, 0)),
            pl.BlockSpec((None, None, None, GP), lambda b, h, p: (b, h, p, 0)),
            pl.BlockSpec((None, None, None, GP), lambda b, h, p: (b, h, p, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, KVH, P, GP, D), jnp.float32),
            jax.ShapeDtypeStruct((B, KVH, P, GP), jnp.float32),
            jax.ShapeDtypeStruct((B, KVH, P, GP), jnp.float32),
        ],
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jpaged_decode_gpu",
    )(layer_arr, block_tables, eff_lens, qg, kv_pool)
    out = combine_partials(o, m, l)                       # [B, KVH, GP, D]
    out = out[:, :, :G].reshape(B, 1, H, D)
    return out.astype(q.dtype)


def combine_partials(o, m, l):
    """Merge flash-decoding partials [B, KVH, P, G, D] / [B, KVH, P, G] -> [B, KVH, G, D]."""
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_max) * (l > 0)                      # empty partitions weigh 0
    l_tot = jnp.sum(w * l, axis=2)
    o_tot = jnp.sum(w[..., None] * o, axis=2)
    safe = jnp.where(l_tot > 0, l_tot, 1.0)
    return jnp.where((l_tot > 0)[..., None], o_tot / safe[..., None], 0.0)


# --------------------------------------------------------------------------
# Ragged prefill / mixed (Q >= 1).
# --------------------------------------------------------------------------

def _ragged_kernel(layer_ref, bt_ref, kvl_ref, ql_ref, q_ref, kv_ref, o_ref, *,
                   block_size: int, block_k: int, block_m: int, group: int,
                   sm_scale: float, fp32_precision):
    b = pl.program_id(0)
    h = pl.program_id(1)
    t = pl.program_id(2)
    layer = layer_ref[0]
    kv_len = kvl_ref[b]
    q_len = ql_ref[b]
    d = q_ref.shape[-1]
    q = (q_ref[...].astype(jnp.float32) * sm_scale)

    rows = t * block_m + jnp.arange(block_m, dtype=jnp.int32)
    tok = rows // group
    row_valid = tok < q_len
    q_pos = kv_len - q_len + tok                          # [M]
    first_tok, last_pos = row_tile_span(t, block_m, group, q_len, kv_len)
    tk = block_k
    n_iters = jnp.where(first_tok < q_len, last_pos // tk + 1, 0)   # causal skip

    def body(it, carry):
        k, v = _load_kv_tile(kv_ref, bt_ref, b, it, layer, h, block_size, tk)
        pos = it * tk + jnp.arange(tk, dtype=jnp.int32)
        kvalid = pos < kv_len
        vis = (pos[None, :] <= q_pos[:, None]) & kvalid[None, :] & row_valid[:, None]
        return _online_softmax_step(carry, q, k, v, kvalid, vis, fp32_precision)

    init = (jnp.zeros((block_m, d), jnp.float32),
            jnp.full((block_m,), MASK_VALUE, jnp.float32),
            jnp.zeros((block_m,), jnp.float32))
    acc, m_i, l_i = lax.fori_loop(0, n_iters, body, init)
    ok = l_i > 0
    out = acc / jnp.where(ok, l_i, 1.0)[:, None]
    o_ref[...] = jnp.where(ok[:, None], out, 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_m", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def paged_ragged_gpu(q, kv_pool, layer, block_tables, kv_lens, q_lens, *, sm_scale=None,
                     block_m=None, block_k=None, num_warps=4, num_stages=2,
                     interpret=None):
    """Ragged prefill / mixed attention (any Q).  Same contract as `paged_attention`.

    block_m: query rows (tokens x heads of a KV head) per tile, default
    `default_block_m`; block_k: keys per loop iteration, default
    `default_block_k`.  Both powers of two.
    """
    B, Q, H, D, KVH, BS, G, W, scale = attention_dims(q, kv_pool, block_tables, sm_scale)
    if interpret is None:
        interpret = not _on_gpu()
    _check_pow2(BS, D)
    tk, pages_per_tile = key_tiling(block_k, W, BS, D, kv_pool.dtype.itemsize)
    Wp = -(-W // pages_per_tile) * pages_per_tile
    block_tables = block_tables.astype(jnp.int32)
    if Wp != W:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, Wp - W)))
    rows = Q * G
    if block_m is None:
        block_m = default_block_m(rows, D, kv_pool.dtype.itemsize)
    assert block_m & (block_m - 1) == 0, "block_m must be a power of two"
    n_tiles = -(-rows // block_m)
    R = n_tiles * block_m

    # [B, Q, KVH, G, D] -> [B, KVH, Q*G, D] (row r = token r // G, head r % G)
    qr = q.reshape(B, Q, KVH, G, D).transpose(0, 2, 1, 3, 4).reshape(B, KVH, rows, D)
    if R != rows:
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, R - rows), (0, 0)))
    q_lens = jnp.where(kv_lens > 0, q_lens, 0).astype(jnp.int32)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)

    kernel = functools.partial(_ragged_kernel, block_size=BS, block_k=tk, block_m=block_m,
                               group=G, sm_scale=scale,
                               fp32_precision=_fp32_dot_precision(interpret))
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, t: (0,) * len(shape))
    out = pl.pallas_call(
        kernel,
        grid=(B, KVH, n_tiles),
        in_specs=[
            full((1,)),
            full((B, Wp)),
            full((B,)),
            full((B,)),
            pl.BlockSpec((None, None, block_m, D), lambda b, h, t: (b, h, t, 0)),
            full(kv_pool.shape),
        ],
        out_specs=pl.BlockSpec((None, None, block_m, D), lambda b, h, t: (b, h, t, 0)),
        out_shape=jax.ShapeDtypeStruct((B, KVH, R, D), q.dtype),
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jpaged_ragged_gpu",
    )(layer_arr, block_tables, kv_lens.astype(jnp.int32), q_lens, qr, kv_pool)
    out = out[:, :, :rows].reshape(B, KVH, Q, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Q, H, D)
    return out

"""Pallas (Triton lowering) ragged paged attention for GPU.

One public entry, `paged_attention_gpu`, with the contract of
`pallas_kernels.paged_attention`: a flat ragged batch `q[T, H, D]` where
sequence s owns tokens `cu_q_lens[s]:cu_q_lens[s + 1]`, K/V read straight out
of the whole pool `kv_pool[num_blocks, num_layers, 2, KVH, BS, D]` (BS + 1 rows
a page for a quantized pool, below) through the block table (no gather copy, no
per-layer slice copy; `layer` may be traced).

Rows.  The new tokens x the G query heads of one KV head are the M rows of
every dot: row r of sequence s is token `cu_q_lens[s] + r // G`, query head
`kv_head * G + r % G`, i.e. row `token * H + kv_head * G + r % G` of
`q.reshape(T * H, D)`.  Rows are gather-loaded from q and scatter-stored
(masked) into the output in its own [T, H, D] layout, so any G works without
padding G to a power of two and nothing is transposed or sliced around the
kernels (the block table is padded to whole key tiles when W is not a
multiple of the pages per tile).  Rows are independent and the row sets of
two programs never overlap, so there are no write races.

Two pallas_calls per attention (both static grids, sized from T, S and the
static tiling only, never from W or the padding):

* `jpaged_decode_gpu`, split-KV flash-decoding for *short* sequences, those
  whose q_len * G rows fit one tile of `decode_rows` (default max(16,
  next_pow2(G)): a decode token, or a few speculative tokens for small G).
  Grid (S, KVH, P).  Program (s, h, p) takes the rows of sequence s, splits
  its own key range [0, kv_len) into P partitions of equal key-tile counts
  and runs an fp32 online softmax over partition p's key tiles, writing the
  un-normalised partial (acc, m, l).  Other sequences' programs get an empty
  key loop and store no acc.  P is a static heuristic that fills ~2 waves
  of an H100 (132 SMs) when S * KVH is small and contexts may be long; with
  many sequences P is 1.
* `jpaged_ragged_gpu`, every other row.  Grid (T * G // block_m + S + 1,
  KVH): query tiles of `block_m` rows that never straddle sequences.
  Sequence s owns tiles `key(s) ... key(s) + cdiv(q_len * G, block_m) - 1`,
  `key(s) = cu_q_lens[s] * G // block_m + s` (vLLM's unified-attention
  numbering; key is strictly increasing, so the grid bound above is static);
  program i finds its sequence by a binary search over cu_q_lens (scalar
  loads) and its tile j = i - key(s).  Pseudo-sequence S owns the padding
  tokens cu_q_lens[S]..T-1, whose rows the kernel writes as zeros.  Tiles
  past a sequence's rows exit.  A tile of a long sequence loops over key
  tiles 0 .. the one holding its last token's position (causal; key tiles
  past it are never visited) with the causal + length mask.  The tile of a
  short sequence merges the P partials of the decode kernel (the combine is
  fused here: no extra XLA pass) and writes the normalised rows.

Key tiles are `block_k` keys, decoupled from pages: several whole pages (one
gather-load of the page-id vector), one page, or a slice of one page.

Sliding window (static `sliding_window`): a query tile's key loop starts at
the key tile holding its first token's window start (the decode kernel splits
[that tile, last tile] into its P partitions), so key tiles wholly before the
window are never loaded; keys before the first token's window start in the
first tile are zeroed like keys past kv_len, and each row's window is masked
per element.  Soft cap (static `soft_cap`): s = c * tanh(s / c) on the fp32
scores before the mask.  Both None: the kernels are those without the options.

Quantized pools (int8, float8_e4m3fn; `reference.quantize_pages`): a page of
one (layer, K/V, KV head) is [BS + 1, D], BS rows of D values then one row
whose first BS elements are those rows' scale codes c (2**(c/4) for int8, 2**c
for float8: `reference.row_scale`).  A key tile loads its value rows
(`pl.ds(0, BS)` of each page, or a slice of one) as a [block_k, D] tile of
D-byte rows, 16-byte aligned for D a multiple of 16 (128-bit loads:
`make kernels-sm90` counts them), and the codes as one [block_k] vector from
the code rows.  The 1-byte values are converted in registers to q's dtype,
which the dots run in (bf16 for bf16 q: int8 and e4m3 values are exact in
bf16; fp32 for fp32 q, TF32x3 as for fp32 pools); K's scales multiply the
scores' columns after q . k, V's the probabilities before p . v (l sums the
unscaled ones), so the result is that of the dequantized rows in fp32 to
rounding.  Scales are built from exponent bits and a quarter-power constant
(exact).  The unquantized kernels are unchanged (the same Triton IR).

Masking never multiplies by a mask: keys/values past kv_len are replaced
with `where`, so NaN in blocks a sequence does not own (block 0 included)
never reaches the output; for a quantized pool the values and the scales of
such keys are zeroed (an int8 row there may carry any code, an fp8 row
NaN).  Rows with no visible key produce zeros.

On a non-GPU backend the kernels run with `interpret=True` automatically.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.reference import (QUARTER_POWERS, attention_dims, attention_options,
                                      is_quantized, pool_block_size, row_tile_span, window_start)

try:  # jax >= 0.6 naming; present in 0.10 and 0.11
    from jax.experimental.pallas import triton as plgpu
    _CompilerParams = plgpu.CompilerParams
except (ImportError, AttributeError):  # pragma: no cover - very old jax
    plgpu = None
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
    # Tiny tiles (block_k 8): broadcast-multiply-reduce instead of a dot.
    return jnp.sum(q.astype(jnp.float32)[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=-1)


def _pv(p, v, fp32_precision):
    """[M, N] fp32 probs x [N, D] -> [M, D] fp32."""
    m, n = p.shape
    if m >= _MIN_DOT and n >= _MIN_DOT:
        prec = fp32_precision if v.dtype == jnp.float32 else None
        return lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                               precision=prec, preferred_element_type=jnp.float32)
    return jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)


def _pow2(e):
    """2.0 ** e (fp32) of int32 exponents e, exact: the exponent field built from the
    bits (no exp2 approximation)."""
    return lax.bitcast_convert_type(lax.shift_left(e + 127, jnp.int32(23)), jnp.float32)


def _row_scale(c):
    """reference.row_scale of the rows' codes c (int8 or float8 values), exact in fp32:
    2**c for float8, 2**floor(c/4) * QUARTER_POWERS[c mod 4] for int8.  Only valid
    rows' codes are used; others are replaced by the caller."""
    if not jnp.issubdtype(c.dtype, jnp.integer):
        return _pow2(c.astype(jnp.float32).astype(jnp.int32))  # Triton: float8 to int via fp32
    c = c.astype(jnp.int32)
    k = lax.bitwise_and(c, jnp.int32(3))
    q1, q2, q3 = QUARTER_POWERS[1:]
    quarter = jnp.where(k == 0, 1.0, jnp.where(k == 1, q1, jnp.where(k == 2, q2, q3)))
    return _pow2(lax.shift_right_arithmetic(c, jnp.int32(2))) * quarter.astype(jnp.float32)


def _dequant_tile(x, e, key_valid, dot_dtype):
    """Values [TK, D] (int8 / float8, poison zeroed with `where`) in `dot_dtype` (exact:
    int8 and e4m3 values are bf16 numbers) and the row scales [TK] fp32, 0 for
    invalid keys (whose code may be 127 or NaN)."""
    x = jnp.where(key_valid[:, None], x.astype(dot_dtype), jnp.zeros((), dot_dtype))
    return x, jnp.where(key_valid, _row_scale(e), 0.0)


def _online_softmax_step(carry, q, k, v, key_valid, visible, fp32_precision, soft_cap=None,
                         scale_exps=None, dot_dtype=None):
    """One key tile of flash attention: (acc, m, l) updated with q [M, D] over k, v [TK, D].

    Keys past the sequence or before the window (key_valid False) are zeroed
    with `where`, never multiplied, so NaN in blocks a sequence does not own
    cannot leak; `visible` [M, TK] (which implies key_valid) masks the scores,
    soft-capped first when soft_cap is set.

    Quantized K/V (`scale_exps` = the rows' exponents (ek, ev) [TK]): the
    values go into the dots in `dot_dtype` (q's), K's row scales multiply the
    scores (columns) after q . k and V's the probabilities before p . v, so that
    (q . k) * 2**ek and (p * 2**ev) . v are the dots with dequantized rows.
    """
    acc, m_i, l_i = carry
    if scale_exps is None:
        k = jnp.where(key_valid[:, None], k, jnp.zeros_like(k))
        v = jnp.where(key_valid[:, None], v, jnp.zeros_like(v))
        k_scale = v_scale = None
    else:
        k, k_scale = _dequant_tile(k, scale_exps[0], key_valid, dot_dtype)
        v, v_scale = _dequant_tile(v, scale_exps[1], key_valid, dot_dtype)
    s = _qk(q.astype(k.dtype), k, fp32_precision)          # [M, TK] fp32
    if k_scale is not None:
        s = s * k_scale[None, :]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s * (1.0 / soft_cap))
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    alpha = jnp.exp(m_i - m_new)
    pr = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    l_new = l_i * alpha + jnp.sum(pr, axis=1)
    pv = pr if v_scale is None else pr * v_scale[None, :]
    return acc * alpha[:, None] + _pv(pv, v, fp32_precision), m_new, l_new


def _masks(pos, q_pos, kv_len, lo, sliding_window):
    """(key_valid [TK], visible [M, TK]) of keys at `pos` for rows at `q_pos`: keys
    past kv_len and (with a window) before `lo`, the tile's first window start,
    are invalid; a row sees the valid keys of its causal window."""
    kvalid = pos < kv_len
    if sliding_window is None:
        return kvalid, (pos[None, :] <= q_pos[:, None]) & kvalid[None, :]
    kvalid &= pos >= lo
    # 0 <= q_pos - pos < sliding_window, as one unsigned compare
    behind = (q_pos[:, None] - pos[None, :]).astype(jnp.uint32)
    return kvalid, (behind < jnp.uint32(sliding_window)) & kvalid[None, :]


def _first_key_tile(first_pos, block_k: int, sliding_window):
    """(window start of the query at first_pos, the key tile holding it); (None, 0)
    without a window (the loops then start at the Python int 0, as before)."""
    if sliding_window is None:
        return None, 0
    lo = window_start(first_pos, sliding_window)
    return lo, lax.div(lo, jnp.int32(block_k))


def _init_carry(rows: int, d: int):
    return (jnp.zeros((rows, d), jnp.float32),
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def _load_kv_tile(kv_ref, bt_ref, s, it, layer, h, block_size, block_k, head_dim):
    """K and V [block_k, D] of key tile `it` of sequence s, read straight from the pool,
    and their rows' scale codes ([block_k] each; None unless the pool is quantized).

    A tile is several whole pages (block_k > block_size: one gather-load of
    the page vector, no copy), one page, or a slice of one page (block_k <
    block_size: large pages are walked in pieces to bound registers and
    shared memory).  A quantized pool's page is [block_size + 1, D]: the
    values are its rows pl.ds(0, block_size) (D-byte rows, loaded 16 bytes at
    a time), the codes the first block_size elements of row block_size (one
    vector load per page).
    """
    del head_dim
    quant = is_quantized(kv_ref.dtype)

    def read(lead, kv, rows, shape=None):
        """(values, codes or None) of K (kv 0) or V (1) at lead + (layer, kv, h) + (rows,)."""
        at = lead + (layer, kv, h)
        x = kv_ref[at + (rows,)]
        if shape is not None:
            x = x.reshape(shape, x.shape[-1])
        if not quant:
            return x, None
        e = kv_ref[at + (block_size, rows)]
        return x, (e if shape is None else e.reshape(shape))

    whole = pl.ds(0, block_size) if quant else slice(None)   # a page's value rows
    if block_k > block_size:
        ppi = block_k // block_size
        ids = bt_ref[s, pl.ds(it * ppi, ppi)]                     # [ppi] block ids
        (k, ek), (v, ev) = read((ids,), 0, whole, block_k), read((ids,), 1, whole, block_k)
        return k, v, ek, ev                                       # gather-loads, no copy
    if block_k == block_size:
        blk = bt_ref[s, it]
        (k, ek), (v, ev) = read((blk,), 0, whole), read((blk,), 1, whole)
        return k, v, ek, ev
    tiles_per_page = block_size // block_k
    # lax.div/rem: `it` >= 0, so C semantics suffice (jnp's floor-mod adds sign fix-ups).
    blk = bt_ref[s, lax.div(it, tiles_per_page)]
    rows = pl.ds(pl.multiple_of(lax.rem(it, tiles_per_page) * block_k, block_k), block_k)
    (k, ek), (v, ev) = read((blk,), 0, rows), read((blk,), 1, rows)
    return k, v, ek, ev


def _tile_rows(q_start, q_len, row0, n: int, group: int, num_heads: int, h):
    """Rows row0 .. row0+n-1 of the sequence owning tokens q_start .. q_start+q_len-1, KV head h.

    Returns (ids, ids_safe, id_end, tok): flat row ids into q.reshape(T * H, D),
    the same clamped to 0 where invalid (safe to gather-load), and the token
    index within the sequence [n].  Ids increase strictly with the row, so row
    r is valid iff ids[r] < id_end (the id of row q_len * G); valid ids are
    distinct, so a masked scatter-store never collides.
    """
    r = row0 + lax.iota(jnp.int32, n)
    tok = lax.div(r, jnp.int32(group))
    ids = (q_start + tok) * num_heads + h * group + lax.rem(r, jnp.int32(group))
    id_end = (q_start + q_len) * num_heads + h * group
    return ids, jnp.where(ids < id_end, ids, 0), id_end, tok


def _store_rows(o_ref, ids, id_end, val):
    """Masked scatter of val [n, D] into the rows `ids` < id_end of o_ref [T * H, D].

    The mask is derived from `ids` at the store, not from a row mask kept
    alive across the key loop: the latter costs ~50 B of register spills
    (sm_90, fp32, head_dim 128).
    """
    n, d = val.shape
    cols = lax.iota(jnp.int32, d)
    plgpu.store(o_ref.at[ids[:, None], cols[None, :]], val.astype(o_ref.dtype),
                mask=(ids[:, None] < id_end) & (cols[None, :] < d))


# --------------------------------------------------------------------------
# Static tiling.
# --------------------------------------------------------------------------

def num_partitions_heuristic(num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int,
                             num_sms: int = H100_SMS) -> int:
    """Static split-KV partition count: ~2 CTAs per SM, partitions of >= 256 tokens of a
    full-length (max_blocks) sequence."""
    programs = num_seqs * num_kv_heads
    want = -(-2 * num_sms // programs)
    most = max(1, (max_blocks * block_size) // 256)
    return int(max(1, min(want, most)))


def default_block_k(head_dim: int, itemsize: int, quantized: bool = False) -> int:
    """Keys per loop iteration: a 16 KiB K tile for 16-bit K/V (64 tokens of bf16 x
    128), 8 KiB for fp32 (32 tokens x 64, 16 x 128); for a quantized pool
    (`itemsize` that of q, the dots' dtype) 8 KiB of the converted tile
    (bf16 q: 64 keys x 64, 32 x 128; fp32 q: 32 x 64, 16 x 128).

    Sized with `triton_aot` for sm_90: 16 KiB fp32 tiles push both kernels to
    the register limit (the decode kernel spills a few bytes at head_dim 64),
    and (fp32, head_dim 128, 128 keys) need more shared memory than an SM has.
    Quantized value rows (head_dim bytes, 16-byte loads) converted in registers:
    with bf16 q, 16 KiB tiles spill (int8 decode at head_dim 128 and 64 keys:
    4 B; ragged at head_dim 64 and 128 keys: 8-16 B), 8 KiB ones spill nowhere
    (2026-11-27; rows of head_dim + 1 bytes loaded byte by byte needed <= 32 keys).
    """
    if quantized:
        return max(_MIN_DOT, min(64, 8192 // (head_dim * itemsize)))
    budget = 16384 if itemsize <= 2 else 8192
    return max(_MIN_DOT, min(128, budget // (head_dim * itemsize)))


def default_block_m(rows: int, head_dim: int, itemsize: int) -> int:
    """Query rows per ragged tile: 64, or 16 for fp32 x head_dim 128 (32 spills a
    few bytes on sm_90, `triton_aot`), never more than `rows` (T * G) needs."""
    cap = 64 if head_dim * itemsize <= 256 else 16
    return min(cap, max(_MIN_DOT, _next_pow2(rows)))


def default_decode_rows(group: int) -> int:
    """Rows of a split-KV decode tile: the G heads of a decode token, padded to the
    16 rows a Triton dot needs (more tokens when G < 16: 4 for G = 4)."""
    return max(_MIN_DOT, _next_pow2(group))


def tile_itemsize(kv_dtype, q_dtype) -> int:
    """The element size `plan_tiling` sizes tiles by: the pool's, or for a quantized
    pool (1-byte values converted in-kernel) that of q, the dtype its dots run in
    (then with `quantized=True`)."""
    if is_quantized(kv_dtype):
        return jnp.dtype(q_dtype).itemsize
    return jnp.dtype(kv_dtype).itemsize


def key_tiling(block_k: int | None, W: int, BS: int, head_dim: int,
               itemsize: int, quantized: bool = False) -> tuple[int, int]:
    """(keys per tile, pages one tile spans, >= 1) for a [S, W] table of BS-token
    pages; block_k None takes `default_block_k`; never more than the table holds."""
    tk = block_k or default_block_k(head_dim, itemsize, quantized)
    tk = max(1, min(_next_pow2(tk), _next_pow2(W * BS)))
    return tk, max(1, tk // BS)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static launch plan of one `paged_attention_gpu` call."""
    block_m: int          # rows per ragged query tile
    block_k: int          # keys per loop iteration
    pages_per_tile: int   # pages one key tile spans (>= 1)
    decode_rows: int      # rows of a split-KV tile; sequences with q_len * G <= it; 0 = none
    num_partitions: int   # split-KV partitions P
    table_width: int      # block-table width padded to whole key tiles
    num_q_tiles: int      # ragged grid axis 0: T * G // block_m + S + 1


def plan_tiling(T: int, G: int, D: int, BS: int, S: int, W: int, KVH: int, itemsize: int, *,
                quantized: bool = False, block_m: int | None = None, block_k: int | None = None,
                decode_rows: int | None = None, num_partitions: int | None = None) -> Tiling:
    """The static tiling for T tokens, S sequences, [S, W] tables (None = defaults);
    `itemsize` is `tile_itemsize`'s, `quantized` whether the pool is."""
    tk, ppt = key_tiling(block_k, W, BS, D, itemsize, quantized)
    bm = block_m or default_block_m(T * G, D, itemsize)
    if bm & (bm - 1):
        raise ValueError(f"block_m must be a power of two, got {bm}")
    dr = default_decode_rows(G) if decode_rows is None else decode_rows
    if dr and (dr & (dr - 1) or dr < max(G, _MIN_DOT)):
        raise ValueError(f"decode_rows must be 0 or a power of two >= max(G={G}, 16), got {dr}")
    n_it = -(-(W * BS) // tk)                              # key tiles of a full-length sequence
    P = num_partitions or num_partitions_heuristic(S, KVH, W, BS)
    P = max(1, min(P, n_it)) if dr else 1
    return Tiling(block_m=bm, block_k=tk, pages_per_tile=ppt, decode_rows=dr, num_partitions=P,
                  table_width=-(-W // ppt) * ppt, num_q_tiles=(T * G) // bm + S + 1)


# --------------------------------------------------------------------------
# Split-KV decode kernel (short sequences).
# --------------------------------------------------------------------------

def _decode_kernel(layer_ref, bt_ref, kvl_ref, cu_ref, q_ref, kv_ref, o_ref, m_ref, l_ref, *,
                   group: int, num_heads: int, block_size: int, block_k: int, rows: int,
                   num_partitions: int, sm_scale: float, fp32_precision, sliding_window=None,
                   soft_cap=None):
    s = pl.program_id(0)
    h = pl.program_id(1)
    p = pl.program_id(2)
    layer = layer_ref[0]
    d = q_ref.shape[-1]
    q_start = cu_ref[s]
    q_len = cu_ref[s + 1] - q_start
    n_rows = q_len * group
    short = (n_rows > 0) & (n_rows <= rows)
    kv_len = jnp.where(short, kvl_ref[s], 0)               # other sequences: no key tiles

    ids, ids_safe, id_end, tok = _tile_rows(q_start, q_len, 0, rows, group, num_heads, h)
    q = q_ref[ids_safe].astype(jnp.float32) * sm_scale     # [rows, D]
    q_pos = kv_len - q_len + tok                           # [rows]

    tk = block_k
    n_k = (kv_len + tk - 1) // tk                          # this sequence's key tiles
    if sliding_window is None:
        lo = None
        per_part = (n_k + num_partitions - 1) // num_partitions
        start = p * per_part
    else:  # key tiles before the one holding the first token's window start are skipped
        lo, it0 = _first_key_tile(kv_len - q_len, tk, sliding_window)
        per_part = (n_k - it0 + num_partitions - 1) // num_partitions
        start = it0 + p * per_part
    end = jnp.minimum(start + per_part, n_k)

    def body(it, carry):
        k, v, ek, ev = _load_kv_tile(kv_ref, bt_ref, s, it, layer, h, block_size, tk, d)
        pos = it * tk + lax.iota(jnp.int32, tk)
        kvalid, vis = _masks(pos, q_pos, kv_len, lo, sliding_window)
        return _online_softmax_step(carry, q, k, v, kvalid, vis, fp32_precision, soft_cap,
                                    None if ek is None else (ek, ev), q_ref.dtype)

    acc, m_i, l_i = lax.fori_loop(start, jnp.maximum(start, end), body, _init_carry(rows, d))
    # Every partition of a short sequence writes (empty ones: m = MASK_VALUE,
    # l = 0), acc only for the valid rows, which are all the merge reads back;
    # other sequences write no acc.  (A pl.when around the whole body instead
    # makes ptxas spill at the benchmark shape.)
    id_end = jnp.where(short, id_end, 0)
    cols = lax.iota(jnp.int32, d)
    plgpu.store(o_ref, acc, mask=(ids[:, None] < id_end) & (cols[None, :] < d))
    m_ref[...] = m_i
    l_ref[...] = l_i


def _decode_partials(t: Tiling, q2, kv_pool, layer_arr, bt, kv_lens, cu, *, group, sm_scale,
                     num_warps, num_stages, interpret, sliding_window=None, soft_cap=None):
    """(acc [S, KVH, P, rows, D], m, l [S, KVH, P, rows]) of the split-KV decode kernel."""
    S = kv_lens.shape[0]
    KVH, BS, D = kv_pool.shape[3], pool_block_size(kv_pool), q2.shape[-1]
    P, R = t.num_partitions, t.decode_rows
    kernel = functools.partial(
        _decode_kernel, group=group, num_heads=KVH * group, block_size=BS, block_k=t.block_k,
        rows=R, num_partitions=P, sm_scale=sm_scale,
        fp32_precision=_fp32_dot_precision(interpret), sliding_window=sliding_window,
        soft_cap=soft_cap)
    full = lambda shape: pl.BlockSpec(shape, lambda s, h, p: (0,) * len(shape))
    part = lambda *shape: pl.BlockSpec((None, None, None) + shape,
                                       lambda s, h, p: (s, h, p) + (0,) * len(shape))
    return pl.pallas_call(
        kernel,
        grid=(S, KVH, P),
        in_specs=[full((1,)), full(bt.shape), full((S,)), full((S + 1,)), full(q2.shape),
                  full(kv_pool.shape)],                    # whole pool, read by block id
        out_specs=[part(R, D), part(R), part(R)],
        out_shape=[jax.ShapeDtypeStruct((S, KVH, P, R, D), jnp.float32),
                   jax.ShapeDtypeStruct((S, KVH, P, R), jnp.float32),
                   jax.ShapeDtypeStruct((S, KVH, P, R), jnp.float32)],
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jpaged_decode_gpu",
    )(layer_arr, bt, kv_lens, cu, q2, kv_pool)


# --------------------------------------------------------------------------
# Ragged kernel: every query tile, the merge of the decode partials, padding.
# --------------------------------------------------------------------------

def _seq_of_tile(i, cu_ref, num_seqs: int, group: int, block_m: int):
    """(s, j): query tile i is tile j of sequence s (s == num_seqs: the padding tokens).

    Sequence s owns tiles from key(s) = cu[s] * G // block_m + s; key is
    strictly increasing, so s is the last one with key(s) <= i (binary search
    over s in [0, num_seqs], ceil(log2(num_seqs + 1)) scalar loads).
    """
    def key(s):
        return lax.div(cu_ref[s] * group, block_m) + s

    def body(_, lohi):
        lo, hi = lohi
        mid = lax.div(lo + hi, 2)
        ok = key(mid) <= i
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    steps = max(1, num_seqs.bit_length())
    lo, _ = lax.fori_loop(0, steps, body, (jnp.int32(0), jnp.int32(num_seqs + 1)))
    return lo, i - key(lo)


def _ragged_kernel(layer_ref, bt_ref, kvl_ref, cu_ref, q_ref, kv_ref, *rest,
                   num_seqs: int, num_tokens: int, group: int, num_heads: int, block_size: int,
                   block_k: int, block_m: int, decode_rows: int, num_partitions: int,
                   sm_scale: float, fp32_precision, sliding_window=None, soft_cap=None):
    if decode_rows:
        po_ref, pm_ref, pl_ref, o_ref = rest
    else:
        (o_ref,) = rest
    i = pl.program_id(0)
    h = pl.program_id(1)
    d = q_ref.shape[-1]
    s, j = _seq_of_tile(i, cu_ref, num_seqs, group, block_m)
    is_pad = s == num_seqs
    sc = jnp.minimum(s, num_seqs - 1)
    q_start = cu_ref[s]
    q_len = jnp.where(is_pad, num_tokens, cu_ref[sc + 1]) - q_start
    n_rows = q_len * group
    row0 = j * block_m
    live = row0 < n_rows
    short = n_rows <= decode_rows          # decode_rows 0: only empty sequences

    @pl.when(live & is_pad)
    def _padding():
        ids, _, id_end, _ = _tile_rows(q_start, q_len, row0, block_m, group, num_heads, h)
        _store_rows(o_ref, ids, id_end, jnp.zeros((block_m, d), jnp.float32))

    if decode_rows:
        @pl.when((j == 0) & (n_rows > 0) & short & ~is_pad)
        def _merge_partials():
            R = decode_rows
            ids, _, id_end, _ = _tile_rows(q_start, q_len, 0, R, group, num_heads, h)
            rr = lax.iota(jnp.int32, R)
            cols = lax.iota(jnp.int32, d)
            mask = (ids[:, None] < id_end) & (cols[None, :] < d)

            def body(p, carry):
                acc, m_i, l_i = carry
                m_p = pm_ref[s, h, p]
                l_p = pl_ref[s, h, p]
                o_p = plgpu.load(po_ref.at[s, h, p, rr[:, None], cols[None, :]], mask=mask,
                                 other=0.0)
                m_new = jnp.maximum(m_i, m_p)
                a = jnp.exp(m_i - m_new)
                b = jnp.exp(m_p - m_new)          # empty partitions: l_p = 0, acc 0
                return acc * a[:, None] + o_p * b[:, None], m_new, l_i * a + l_p * b

            acc, _, l_i = lax.fori_loop(0, num_partitions, body, _init_carry(R, d))
            ok_l = l_i > 0
            out = jnp.where(ok_l[:, None], acc / jnp.where(ok_l, l_i, 1.0)[:, None], 0.0)
            _store_rows(o_ref, ids, id_end, out)

    @pl.when(live & ~is_pad & ~short)
    def _attend():
        layer = layer_ref[0]
        kv_len = kvl_ref[sc]
        ids, ids_safe, id_end, tok = _tile_rows(q_start, q_len, row0, block_m, group, num_heads, h)
        q = q_ref[ids_safe].astype(jnp.float32) * sm_scale        # [block_m, D]
        q_pos = kv_len - q_len + tok
        first_tok, last_pos = row_tile_span(j, block_m, group, q_len, kv_len)
        tk = block_k
        n_iters = (jnp.maximum(last_pos, -1) + tk) // tk         # causal: later tiles unseen
        # window: earlier tiles unseen
        lo, it0 = _first_key_tile(kv_len - q_len + first_tok, tk, sliding_window)

        def body(it, carry):
            k, v, ek, ev = _load_kv_tile(kv_ref, bt_ref, sc, it, layer, h, block_size, tk, d)
            pos = it * tk + lax.iota(jnp.int32, tk)
            kvalid, vis = _masks(pos, q_pos, kv_len, lo, sliding_window)
            return _online_softmax_step(carry, q, k, v, kvalid, vis, fp32_precision, soft_cap,
                                        None if ek is None else (ek, ev), q_ref.dtype)

        acc, _, l_i = lax.fori_loop(it0, n_iters, body, _init_carry(block_m, d))
        ok_l = l_i > 0
        out = jnp.where(ok_l[:, None], acc / jnp.where(ok_l, l_i, 1.0)[:, None], 0.0)
        _store_rows(o_ref, ids, id_end, out)


def _ragged_call(t: Tiling, q2, kv_pool, layer_arr, bt, kv_lens, cu, partials, *, group,
                 sm_scale, num_warps, num_stages, interpret, sliding_window=None, soft_cap=None):
    """out [T * H, D] of the ragged kernel (partials: the decode kernel's, or ())."""
    S = kv_lens.shape[0]
    KVH, BS = kv_pool.shape[3], pool_block_size(kv_pool)
    H = KVH * group
    kernel = functools.partial(
        _ragged_kernel, num_seqs=S, num_tokens=q2.shape[0] // H, group=group, num_heads=H,
        block_size=BS, block_k=t.block_k, block_m=t.block_m, decode_rows=t.decode_rows,
        num_partitions=t.num_partitions, sm_scale=sm_scale,
        fp32_precision=_fp32_dot_precision(interpret), sliding_window=sliding_window,
        soft_cap=soft_cap)
    full = lambda shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))
    return pl.pallas_call(
        kernel,
        grid=(t.num_q_tiles, KVH),
        in_specs=[full((1,)), full(bt.shape), full((S,)), full((S + 1,)), full(q2.shape),
                  full(kv_pool.shape)] + [full(x.shape) for x in partials],
        out_specs=full(q2.shape),                          # rows written by masked scatter
        out_shape=jax.ShapeDtypeStruct(q2.shape, q2.dtype),
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="jpaged_ragged_gpu",
    )(layer_arr, bt, kv_lens, cu, q2, kv_pool, *partials)


def _prepare(q, kv_pool, layer, block_tables, kv_lens, cu_q_lens, *, sm_scale, block_m, block_k,
             decode_rows, num_partitions, sliding_window=None, soft_cap=None):
    """(tiling, G, scale, (q2, kv_pool, layer_arr, bt, kv_lens, cu)) of one call."""
    T, H, D, KVH, BS, G, S, W, scale = attention_dims(q, kv_pool, block_tables, kv_lens,
                                                      cu_q_lens, sm_scale, sliding_window,
                                                      soft_cap)
    _check_pow2(BS, D)
    t = plan_tiling(T, G, D, BS, S, W, KVH, tile_itemsize(kv_pool.dtype, q.dtype),
                    quantized=is_quantized(kv_pool.dtype), block_m=block_m, block_k=block_k,
                    decode_rows=decode_rows, num_partitions=num_partitions)
    bt = block_tables.astype(jnp.int32)
    if t.table_width != W:  # pad with the null block so every page-vector load stays in bounds
        bt = jnp.pad(bt, ((0, 0), (0, t.table_width - W)))
    args = (q.reshape(T * H, D), kv_pool, jnp.asarray(layer, jnp.int32).reshape(1), bt,
            kv_lens.astype(jnp.int32), cu_q_lens.astype(jnp.int32))
    return t, G, scale, args


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_m",
                                             "block_k", "decode_rows", "num_partitions",
                                             "num_warps", "num_stages", "interpret"))
def paged_attention_gpu(q, kv_pool, layer, block_tables, kv_lens, cu_q_lens, *, sm_scale=None,
                        sliding_window=None, soft_cap=None, block_m=None, block_k=None,
                        decode_rows=None, num_partitions=None, num_warps=4, num_stages=2,
                        interpret=None):
    """Ragged paged attention.  Same contract as `pallas_kernels.paged_attention`
    (sm_scale, sliding_window and soft_cap included).

    Tuning (all static; None = the default):
      block_m: query rows (tokens x the G heads of a KV head) per ragged tile,
        a power of two, default `default_block_m`.
      block_k: keys per loop iteration (a power of two; several pages, one
        page or part of one), default `default_block_k`.
      decode_rows: sequences with q_len * G <= decode_rows go through the
        split-KV decode kernel; a power of two >= max(G, 16), default
        `default_decode_rows`; 0 sends every sequence through the ragged
        kernel (no decode kernel is launched).
      num_partitions: split-KV partitions, default `num_partitions_heuristic`.
      num_warps, num_stages: Triton launch parameters of both kernels.
      interpret: default True off a GPU.
    """
    if interpret is None:
        interpret = not _on_gpu()
    t, G, scale, args = _prepare(q, kv_pool, layer, block_tables, kv_lens, cu_q_lens,
                                 sm_scale=sm_scale, block_m=block_m, block_k=block_k,
                                 decode_rows=decode_rows, num_partitions=num_partitions,
                                 sliding_window=sliding_window, soft_cap=soft_cap)
    launch = dict(group=G, sm_scale=scale, num_warps=num_warps, num_stages=num_stages,
                  interpret=interpret, **_options(sliding_window, soft_cap))
    partials = _decode_partials(t, *args, **launch) if t.decode_rows else ()
    out = _ragged_call(t, *args, partials, **launch)
    return out.reshape(q.shape)


def _options(sliding_window, soft_cap) -> dict:
    """The checked static options as kernel keyword arguments."""
    sliding_window, soft_cap = attention_options(sliding_window, soft_cap)
    return dict(sliding_window=sliding_window, soft_cap=soft_cap)


def single_kernel(kernel: str):
    """`paged_attention_gpu` reduced to one of its pallas_calls, for static
    compile reports (`triton_aot`): "decode" returns the split-KV partials,
    "ragged" runs the ragged kernel on zero partials (no decode kernel lowered)."""
    if kernel not in ("decode", "ragged"):
        raise ValueError(f"kernel must be 'decode' or 'ragged', got {kernel!r}")

    def fn(q, kv_pool, layer, block_tables, kv_lens, cu_q_lens, *, sm_scale=None,
           sliding_window=None, soft_cap=None, block_m=None, block_k=None, decode_rows=None,
           num_partitions=None, num_warps=4, num_stages=2, interpret=False):
        t, G, scale, args = _prepare(q, kv_pool, layer, block_tables, kv_lens, cu_q_lens,
                                     sm_scale=sm_scale, block_m=block_m, block_k=block_k,
                                     decode_rows=decode_rows, num_partitions=num_partitions,
                                     sliding_window=sliding_window, soft_cap=soft_cap)
        launch = dict(group=G, sm_scale=scale, num_warps=num_warps, num_stages=num_stages,
                      interpret=interpret, **_options(sliding_window, soft_cap))
        if kernel == "decode":
            if not t.decode_rows:
                raise ValueError("decode_rows=0 launches no decode kernel")
            return _decode_partials(t, *args, **launch)
        S, KVH, D = kv_lens.shape[0], kv_pool.shape[3], q.shape[-1]
        P, R = t.num_partitions, t.decode_rows
        partials = (jnp.zeros((S, KVH, P, R, D), jnp.float32), jnp.zeros((S, KVH, P, R)),
                    jnp.zeros((S, KVH, P, R))) if R else ()
        return _ragged_call(t, *args, partials, **launch)

    return fn

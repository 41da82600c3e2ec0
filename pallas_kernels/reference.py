"""Pure-jnp ragged paged attention: the oracle every kernel is tested against.

Each query token gathers its own sequence's K/V blocks out of the pool through
the block table (a copy the kernels avoid) and runs masked dense attention in
fp32: scores `(q . k) * scale`, soft-capped (`soft_cap * tanh(s / soft_cap)`)
when asked, then the causal mask (and the sliding window's lower bound), then
the softmax.  Tokens are processed in tiles (`lax.map` with a batch size) so
that the gathered K/V stay bounded: tile x kv_heads x W*block_size x head_dim.

`attention_dims` checks the shapes and the static options (`sliding_window`,
`soft_cap`) for every implementation.

Quantized pools (int8, float8_e4m3fn): a page of one (layer, K/V, KV head)
is [block_size + 1, head_dim]: rows 0 .. block_size - 1 hold the tokens'
head_dim values, and row block_size holds each of those rows' scale code c in
its first block_size elements (the rest zero), so a row stands for
values * scale(c).  Value rows are exactly head_dim bytes (16-byte aligned for
head_dim a multiple of 16), so kernels load them with full-width vector loads,
and the codes of a page are one contiguous vector.  The code is stored as a
number in the pool's own dtype (an integer, exact in both), so a quantized
pool is still one array: block moves, swap and head sharding carry the
scales with the values.  Needs block_size <= head_dim (`check_page_layout`).
The codes cost head_dim bytes per page, 1/block_size of the values (6.25 % at
block_size 16), where an fp32 scale per row would cost 4 bytes a row.

* int8: scale(c) = 2**(c / 4), c in [-64, 64]: a quarter-power of two, so
  the row's largest value lands in (127 / 2**0.25, 127] and keeps most of an
  exact scale's precision (a power of two would waste up to one bit:
  benchmarks/results/kv_quant.md).  Computed as 2**floor(c / 4) *
  QUARTER_POWERS[c mod 4] in fp32, the same product in every kernel.
* float8_e4m3fn: scale(c) = 2**c, c in [-16, 16] (e4m3 holds those exactly
  and has no more than 3 mantissa bits to keep: its relative precision does
  not depend on the scale, which only brings the row into range).

`quantize_rows` is the one quantizer (the K/V write of every backend),
`quantize_pages` lays whole pages out from it, and `dequantize_rows` /
`read_pages` are the one definition of what a row / page means; `row_scale`
maps codes to scales, exactly in fp32.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30  # finite, so a row with no visible key gives zeros, not NaN
TOKEN_TILE = 16

# Largest magnitude a quantized value takes, per pool dtype: the quantized dtypes.
QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
# Steps of a row's scale code per power of two, and the largest |code|, per dtype.
CODES_PER_OCTAVE = {jnp.dtype(jnp.int8): 4, jnp.dtype(jnp.float8_e4m3fn): 1}
SCALE_CODE_MAX = {jnp.dtype(jnp.int8): 64, jnp.dtype(jnp.float8_e4m3fn): 16}
# 2**(k / 4) in fp32, k = 0..3: the int8 scale's mantissas (the kernels hold the same four).
QUARTER_POWERS = (1.0, 1.18920707702636718750, 1.41421353816986083984, 1.68179285526275634766)


def is_quantized(dtype) -> bool:
    """True for the pool dtypes whose pages carry a row of scale codes (int8, float8_e4m3fn)."""
    return jnp.dtype(dtype) in QUANT_MAX


def page_rows(block_size: int, dtype) -> int:
    """Rows of one page (one layer, K or V, one KV head): block_size, + 1 (the codes)
    when quantized."""
    return block_size + int(is_quantized(dtype))


def check_page_layout(block_size: int, head_dim: int, dtype) -> None:
    """ValueError unless a page of `dtype` fits: a quantized page's code row holds
    block_size codes in head_dim elements."""
    if is_quantized(dtype) and block_size > head_dim:
        raise ValueError(f"a {jnp.dtype(dtype).name} KV pool keeps a page's {block_size} scale codes "
                         f"in one extra row of head_dim {head_dim} elements: block_size must be "
                         f"<= head_dim, got block_size {block_size}")


def pool_head_dim(kv_pool: jax.Array) -> int:
    """head_dim of the K/V rows a pool holds (its last axis)."""
    return kv_pool.shape[-1]


def pool_block_size(kv_pool: jax.Array) -> int:
    """Tokens per page of a pool (its rows axis, less the code row when quantized)."""
    return kv_pool.shape[-2] - int(is_quantized(kv_pool.dtype))


def quantize_rows(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] (any float dtype) as (values [..., D], codes [...]) of the quantized
    `dtype`: the row's values divided by scale(c), and the code c, the smallest
    that brings max |x| within the dtype's range (QUANT_MAX), clamped to
    [-SCALE_CODE_MAX, SCALE_CODE_MAX].  int8 rounds to nearest (ties to even);
    float8_e4m3fn rounds on the cast.  Values past the range (only with the
    code clamped at its largest) saturate."""
    dtype = jnp.dtype(dtype)
    qmax, steps, cmax = QUANT_MAX[dtype], CODES_PER_OCTAVE[dtype], SCALE_CODE_MAX[dtype]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    code = jnp.clip(jnp.ceil(steps * jnp.log2(jnp.maximum(amax, 1e-30) / qmax)), -cmax, cmax)
    scaled = jnp.clip(x / row_scale(code, dtype), -qmax, qmax)  # log2's rounding may overshoot
    if dtype == jnp.int8:
        scaled = jnp.round(scaled)
    return scaled.astype(dtype), code[..., 0].astype(dtype)


def quantize_pages(x: jax.Array, dtype) -> jax.Array:
    """Pages x [..., BS, D] (any float dtype) laid out quantized: [..., BS + 1, D],
    `quantize_rows`' values in rows 0 .. BS - 1 and their codes in the first BS
    elements of row BS (the rest zero)."""
    *lead, BS, D = x.shape
    check_page_layout(BS, D, dtype)
    values, codes = quantize_rows(x, dtype)
    code_row = jnp.zeros((*lead, 1, D), values.dtype).at[..., 0, :BS].set(codes)
    return jnp.concatenate([values, code_row], axis=-2)


def dequantize_rows(values: jax.Array, codes: jax.Array) -> jax.Array:
    """Quantized values [..., D] with their rows' codes [...] as fp32 [..., D]:
    values * scale(code)."""
    scale = row_scale(codes.astype(jnp.float32), values.dtype)
    return values.astype(jnp.float32) * scale[..., None]


def read_pages(pages: jax.Array) -> jax.Array:
    """Pages of a pool [..., page rows, D] as fp32 [..., BS, D], dequantized when
    the pool is quantized (row BS holds the codes)."""
    if not is_quantized(pages.dtype):
        return pages.astype(jnp.float32)
    BS = pages.shape[-2] - 1
    return dequantize_rows(pages[..., :BS, :], pages[..., BS, :BS])


def row_scale(code: jax.Array, dtype) -> jax.Array:
    """The fp32 scale of rows whose code (integer-valued fp32) is `code`, in a pool of
    `dtype`: 2**code for float8_e4m3fn, 2**floor(code / 4) * QUARTER_POWERS[code mod 4]
    for int8 (exact products: a power of two times an fp32 constant)."""
    if jnp.dtype(dtype) != jnp.int8:
        return pow2(code)
    c = code.astype(jnp.int32)
    quarter = jnp.asarray(QUARTER_POWERS, jnp.float32)[c & 3]
    return pow2((c >> 2).astype(jnp.float32)) * quarter


def pow2(exp: jax.Array) -> jax.Array:
    """2 ** exp, exactly, for integer-valued fp32 exp in [-126, 127] (built from the
    float's bits: XLA:CPU's exp2 is off by an ulp at some integers)."""
    return jax.lax.bitcast_convert_type((exp.astype(jnp.int32) + 127) << 23, jnp.float32)


def token_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sequence [T], position [T], valid [T]) of each flat query token.

    Token t belongs to the sequence s with cu_q_lens[s] <= t < cu_q_lens[s + 1];
    tokens at or past cu_q_lens[-1] are padding (valid False, sequence clamped).
    """
    S = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1, 0, S - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, pos, t < cu_q_lens[S]


def paged_attention_reference(q: jax.Array, kv_pool: jax.Array, layer: jax.Array | int,
                              block_tables: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array,
                              *, sm_scale: float | None = None, sliding_window: int | None = None,
                              soft_cap: float | None = None) -> jax.Array:
    """See `pallas_kernels.paged_attention` for shapes and semantics."""
    T, H, D, KVH, BS, G, S, W, scale = attention_dims(q, kv_pool, block_tables, kv_lens,
                                                      cu_q_lens, sm_scale, sliding_window,
                                                      soft_cap)
    sliding_window, soft_cap = attention_options(sliding_window, soft_cap)
    seq, pos, valid = token_layout(cu_q_lens, kv_lens, T)
    heads = jnp.arange(KVH)[:, None]
    key_pos = jnp.arange(W * BS)

    def attend(args):
        q_t, s, p, ok = args                                   # [H, D], scalars
        blocks = block_tables[s][None, :]                      # [1, W]
        k = read_pages(kv_pool[blocks, layer, 0, heads]).reshape(KVH, W * BS, D)
        v = read_pages(kv_pool[blocks, layer, 1, heads]).reshape(KVH, W * BS, D)
        owned = key_pos < kv_lens[s]
        if sliding_window is not None:  # keys before the window may hold anything too
            owned &= key_pos > p - sliding_window
        visible = owned & (key_pos <= p) & ok                  # [W*BS]
        # Blocks a sequence does not own may hold anything (NaN included):
        # zero them so that 0 * NaN never reaches the output.
        k = jnp.where(owned[None, :, None], k, 0)
        v = jnp.where(owned[None, :, None], v, 0)
        qg = q_t.astype(jnp.float32).reshape(KVH, G, D)
        scores = jnp.einsum("kgd,ksd->kgs", qg, k) * scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(visible, scores, MASK_VALUE)
        probs = jnp.where(visible, jax.nn.softmax(scores, axis=-1), 0.0)
        return jnp.einsum("kgs,ksd->kgd", probs, v).reshape(H, D)

    out = jax.lax.map(attend, (q, seq, pos, valid), batch_size=min(T, TOKEN_TILE))
    return out.astype(q.dtype)


def attention_options(sliding_window: int | None, soft_cap: float | None
                      ) -> tuple[int | None, float | None]:
    """(sliding_window, soft_cap) checked and normalised to (int | None, float | None).

    Both are static (they change the compiled program): a Python / numpy int
    >= 1 and a finite float > 0, or None (global attention, no capping).
    """
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) \
                or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int or None (static), "
                             f"got {sliding_window!r}")
        sliding_window = int(sliding_window)
    if soft_cap is not None:
        if isinstance(soft_cap, bool) or not isinstance(soft_cap, numbers.Real) \
                or not math.isfinite(soft_cap) or soft_cap <= 0:
            raise ValueError(f"soft_cap must be a positive finite float or None (static), "
                             f"got {soft_cap!r}")
        soft_cap = float(soft_cap)
    return sliding_window, soft_cap


def attention_dims(q: jax.Array, kv_pool: jax.Array, block_tables: jax.Array, kv_lens: jax.Array,
                   cu_q_lens: jax.Array, sm_scale: float | None,
                   sliding_window: int | None = None, soft_cap: float | None = None
                   ) -> tuple[int, int, int, int, int, int, int, int, float]:
    """(T, H, D, KVH, BS, G, S, W, scale) of a ragged paged_attention call, checked
    (the static options too: `attention_options`)."""
    attention_options(sliding_window, soft_cap)
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {q.shape}")
    T, H, D = q.shape
    if kv_pool.ndim != 6 or kv_pool.shape[2] != 2:
        raise ValueError(f"kv_pool must be [num_blocks, num_layers, 2, kv_heads, block_size, "
                         f"head_dim], got {kv_pool.shape}")
    KVH, BS = kv_pool.shape[3], pool_block_size(kv_pool)
    Dk = pool_head_dim(kv_pool)
    check_page_layout(BS, Dk, kv_pool.dtype)
    if Dk != D or H % KVH:
        raise ValueError(f"q {q.shape} does not fit pool {kv_pool.shape}: head_dim must match "
                         "and num_heads must be a multiple of num_kv_heads")
    S, W = block_tables.shape
    if kv_lens.shape != (S,) or cu_q_lens.shape != (S + 1,):
        raise ValueError(f"block_tables {block_tables.shape} needs kv_lens [{S}] and cu_q_lens "
                         f"[{S + 1}], got {kv_lens.shape} and {cu_q_lens.shape}")
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    return T, H, D, KVH, BS, H // KVH, S, W, scale


def write_kv_reference(kv_pool: jax.Array, layer: jax.Array | int, k: jax.Array, v: jax.Array,
                       blocks: jax.Array, offsets: jax.Array) -> jax.Array:
    """kv_pool with k, v [T, kv_heads, head_dim] written at (blocks[T], offsets[T]) of `layer`.

    One XLA scatter; with the pool donated it updates in place.  Padding tokens
    point at the null block 0, which no sequence reads unmasked.  A quantized
    pool gets `quantize_rows` of each token's K and V rows: the values in row
    offsets[t] of the page, the code in element offsets[t] of its code row
    (a second scatter).
    """
    kv = jnp.stack([k, v], axis=1)  # [T, 2, KVH, D]
    if not is_quantized(kv_pool.dtype):
        return kv_pool.at[blocks, layer, :, :, offsets].set(kv.astype(kv_pool.dtype), mode="drop",
                                                             unique_indices=False)
    values, codes = quantize_rows(kv, kv_pool.dtype)   # [T, 2, KVH, D], [T, 2, KVH]
    BS = pool_block_size(kv_pool)
    inside = offsets < BS    # an offset past the page is dropped: it never reaches the code row
    rows, cols = jnp.where(inside, offsets, kv_pool.shape[-2]), jnp.where(inside, offsets, kv_pool.shape[-1])
    kv_pool = kv_pool.at[blocks, layer, :, :, rows].set(values, mode="drop", unique_indices=False)
    return kv_pool.at[blocks, layer, :, :, BS, cols].set(codes, mode="drop", unique_indices=False)


def row_tile_span(t, block_m: int, group: int, q_len, kv_len):
    """(first new token, last key position seen) of row tile t of one sequence.

    The ragged kernels flatten a sequence's new tokens x the G query heads of a
    KV head into rows (row r is token r // G) tiled by block_m; a tile with
    first token >= q_len holds only padding.
    """
    first_tok = (t * block_m) // group
    last_tok = jnp.minimum((t * block_m + block_m - 1) // group, q_len - 1)
    return first_tok, kv_len - q_len + last_tok


def window_start(pos, sliding_window: int | None):
    """First key position visible to a query at `pos` (any int / array): 0 without
    a window, else max(0, pos - sliding_window + 1).  Kernels start their key
    loops at the block holding the window start of a tile's first token."""
    if sliding_window is None:
        return 0
    return jnp.maximum(pos - (sliding_window - 1), 0)

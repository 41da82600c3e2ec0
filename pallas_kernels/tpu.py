"""Pallas Mosaic-TPU ragged paged attention (prefill chunks and decode tokens mixed).

Contract: `pallas_kernels.paged_attention` (flat ragged batch q[T, H, D],
`cu_q_lens[S + 1]`, `kv_lens[S]`, `block_tables[S, W]`, the whole pool
`kv_pool[num_blocks, num_layers, 2, KVH, BS, D]` (fp32, bf16) or
`[..., BS + 1, D]` (quantized: int8, float8_e4m3fn; see below), a traced or
static `layer`).
The design follows tpu-inference's ragged_paged_attention.

Query tiles.  Each sequence's q_len new tokens are cut into tiles of at most
`block_q` tokens that never straddle sequences; after the sequence tiles come
tiles of at most `block_q` padding tokens (tokens >= cu_q_lens[S]).  At most
`NT = cdiv(T, block_q) + S` tiles are needed, a static bound from the bucketed
T and S alone; the tiles past the last needed one are empty.  A few jnp ops
on [S]- and [NT]-sized arrays (`tile_layout`, outside the kernel) give every
tile its sequence (-1: nothing to attend), first token and token count; those,
the layer, the flattened block tables, kv_lens and cu_q_lens are
scalar-prefetched into SMEM (`PrefetchScalarGridSpec`).

Grid (head_blocks, NT), ("parallel", "arbitrary").  A grid step handles one
tile for `kv_heads_per_block` KV heads (default all of them) and the
G = H / KVH query heads of each: the tile's tokens x G heads of a KV head are
the M rows of the dots (row r is token r // G), so each K/V page is loaded
once per KV head whatever G.  q, kv_pool and the output stay in HBM
(`memory_space=ANY`) and move by explicit DMA:

* q: only the tile's n tokens (a dynamic-size copy of q[start:start + n]) into
  one of 2 VMEM slots; a tile starts the copy of the next tile's q.
* K/V: the tile walks its sequence's pages 0 .. the page of the last key its
  last token sees, `pages_per_compute_block` pages per step, in a
  `lax.fori_loop` with a dynamic trip count: the cost never depends on W nor
  on padding.  One DMA per page copies K and V of the block's heads,
  `kv_pool.at[page, layer, :, heads]` (one contiguous [2, KVH, BS, D] chunk
  when the block is all heads; quantized: the value rows, and a second DMA
  for the code rows), into one of 2 VMEM slots.  While a step computes, the next step's pages are in flight,
  and the last step of a tile fetches the next tile's first pages, so a run
  of decode tiles keeps the DMA engine busy across grid steps.  Pages past
  the causal bound are never copied.
* out: only the tile's n rows (dynamic-size copy) from one of 2 VMEM slots;
  the copy is waited one grid step later (or at the last step).  Tiles of
  padding tokens write zeros; empty tiles issue no DMA and do no compute.

Decode stays cheap: a tile of at most `block_q_small` tokens (default
cdiv(sublanes, G), i.e. one 8-row fp32 / 16-row bf16 tile of the dots' rows)
runs a second instance of the compute whose dots and softmax have
block_q_small * G rows instead of block_q * G: a decode token costs ~G rows of MXU/VPU work,
not block_q * G, and a decode batch costs one grid step per sequence.

Sliding window (static `sliding_window`): a tile's page walk starts at the
page holding its first token's window start (its K/V step is the compute
block holding that page), so pages wholly before the window are never copied
(nor their block-table entries read); within the first step, the key slots
before that start (stale VMEM, or rows before the window) are masked like
the keys past the limit, and each row's window per element.  Soft cap
(static `soft_cap`): s = c * tanh(s / c) on the fp32 scores before the mask.
Both None: the kernel is the one without the options.

Masking uses `where` (never a multiply): keys at or past the tile's last
visible position (block 0, unowned blocks, the tail of the last block, pages
never copied, stale VMEM) are masked in the scores and zeroed in V, so NaN
anywhere a sequence does not own never reaches its output (rows past the
tile's tokens compute on stale q and are never copied out); rows with no
visible key give zeros.  fp32 online
softmax (m, l, acc in VMEM scratch); fp32 K/V use HIGHEST-precision dots, bf16
K/V bf16 dots (q is scaled in fp32, then rounded to the dots' dtype).

Quantized pools (int8, float8_e4m3fn; `reference.quantize_pages`): a page is
[BS + 1, D], BS rows of D values in the pool dtype, then a row whose first BS
elements are those rows' scale codes c (integers stored as pool-dtype
numbers); a row stands for values * scale(c): 2**(c/4) for int8, 2**c for
float8 (`reference.row_scale`).  Each page moves by two DMAs, its value rows
into a kv_buf of [.., N, D] 8-bit rows (D lanes, as an unquantized pool's) and
its codes into a code_buf of [.., 1, N] (one lane vector per head and step).
The values are converted to the dots' dtype (`compute_dtype`: fp32 with fp32
q, else bf16, which holds every int8 / e4m3 value exactly; fp8 through an
`extf`, int8 through `sitofp`) and the scales, built exactly from bits
((c + 127) << 23 as fp32, times a quarter-power constant for int8: integer
VPU ops and a select, no transcendental), multiply the score columns after
q . k (K) and the probabilities before p . v (V), as in the GPU kernel: no
[N, D] dequantization per step, the result that of the dequantized rows to
fp32 / bf16 rounding.  Rows a sequence does not own may hold anything (fp8
NaN; int8 random bytes with any code): V's values and scales are selected
with `where`, K's bad rows only reach score columns the mask replaces, as for
NaN in an fp32 pool.

Real-TPU constraints (interpret mode accepts anything; this kernel has run in
TPU interpret mode and been lowered to Mosaic for a v5e target, fp32 / bf16 /
int8 / fp8 pools, but never been compiled by libtpu nor run on a TPU: none of
the layout costs below has been measured):
* head_dim a multiple of 128 (64 works with half the lanes idle);
* block_size a multiple of 8 for fp32 K/V, of 16 for bf16 and of 32 for
  int8 / fp8 (native VMEM tiles of 8 / 16 / 32 rows): pages are stacked
  along sublanes in VMEM (DMA destinations at page offsets);
  pages_per_compute_block * block_size ideally a multiple of 128;
* quantized pages: value rows are D lanes, as an unquantized pool's; a code
  row of BS codes lands at lane offset p * BS of its step's [1, N] code
  vector (a DMA of BS bytes per page and K/V, besides the values');
* fp8 -> fp32 converts on chips without fp8 hardware (v4, v5e) are left to
  Mosaic's emulation, if it has one;
* the G heads of a KV head are sliced out of q's sublane (head) axis and
  folded into rows in fp32, as tpu-inference's kernel does; rows are padded to
  whole sublane tiles, which is exact for G dividing 8 (16 for bf16) and
  block_q a power of two; other G leave partial-tile stores (unverified);
* with kv_heads_per_block < KVH, kv_heads_per_block * G a multiple of 8 (fp32
  q) / 16 (bf16 q), since the q / out DMAs slice the head axis (the megacore
  default halves KVH only then);
* SMEM holds the flattened block table, S * W int32 (1 MiB of SMEM on v4 /
  v5 / v6: S * W <= ~200K entries), plus 3 * NT + 2 * S + 3 scalars;
* `vmem_limit_bytes` defaults to an estimate of the scratch when that exceeds
  12 MiB (the default scoped limit is 16 MiB on v4 / v5e).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference import (QUARTER_POWERS, attention_dims, attention_options, is_quantized,
                                      window_start)

MASK_VALUE = -1e30
KEYS_PER_COMPUTE_BLOCK = 256   # default pages_per_compute_block = this // block_size
ROWS_PER_TILE = 256            # default block_q = this // G (power of two, 8..128)


def _cdiv(a, b):
    return (a + b - 1) // b


def _round_up(x: int, m: int) -> int:
    return _cdiv(x, m) * m


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _sublanes(dtype) -> int:
    """Rows of one native VMEM tile: 8 for 32-bit, 16 for bf16 (packed in pairs)."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def compute_dtype(q_dtype, kv_dtype):
    """dtype of the dots' operands: the pool's for fp32 / bf16 pools; for a quantized
    pool fp32 with fp32 q, else bf16 (a dequantized int8 / fp8 value is exact in bf16:
    at most 8 significant bits, times a power of two in [2**-16, 2**16])."""
    if not is_quantized(kv_dtype):
        return jnp.dtype(kv_dtype)
    return jnp.dtype(jnp.float32 if jnp.dtype(q_dtype) == jnp.float32 else jnp.bfloat16)


def _pow2(e):
    """2.0**e (fp32) of integer exponents e (int32, |e| <= 126), exactly: the bits of
    the float with biased exponent e + 127 and a zero mantissa (integer VPU ops,
    no transcendental)."""
    return lax.bitcast_convert_type(lax.shift_left(e + 127, 23), jnp.float32)


def _row_scale(c, int8: bool):
    """reference.row_scale of int32 codes c, exactly: 2**c (float8 pools), or
    2**floor(c/4) * QUARTER_POWERS[c mod 4] (int8 pools)."""
    if not int8:
        return _pow2(c)
    k = lax.bitwise_and(c, 3)
    q1, q2, q3 = QUARTER_POWERS[1:]
    quarter = jnp.where(k == 0, 1.0, jnp.where(k == 1, q1, jnp.where(k == 2, q2, q3)))
    return _pow2(lax.shift_right_arithmetic(c, 2)) * quarter.astype(jnp.float32)


def _on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def default_interpret():
    """TPU interpret mode (CPU simulation of HBM/VMEM/DMA) off-TPU, else None."""
    return None if _on_tpu() else pltpu.InterpretParams()


def _default_heads_per_block(KVH: int, G: int, q_dtype, compiled: bool) -> int:
    """All KV heads, or half of them on a megacore chip (v4, v5p: 2 TensorCores
    share the "parallel" head-block axis) when the halves stay sublane-aligned."""
    if compiled and KVH % 2 == 0 and (KVH // 2 * G) % _sublanes(q_dtype) == 0:
        try:
            if pltpu.get_tpu_info().num_cores > 1:
                return KVH // 2
        except Exception:  # unknown device kind: keep one head block
            pass
    return KVH


def block_sizes(T: int, G: int, BS: int, W: int, dot_dtype, block_q=None, block_q_small=None,
                pages_per_compute_block=None) -> tuple[int, int, int]:
    """(block_q, block_q_small, pages_per_compute_block) with the defaults filled in;
    `dot_dtype`: `compute_dtype` (the pool's dtype when not quantized)."""
    bq = block_q or min(128, max(8, _pow2_floor(ROWS_PER_TILE // G)), _round_up(T, 8))
    small = max(1, min(block_q_small or _cdiv(_sublanes(dot_dtype), G), bq))
    ppcb = max(1, min(pages_per_compute_block or KEYS_PER_COMPUTE_BLOCK // BS, W))
    return bq, small, ppcb


def tile_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int, block_q: int):
    """(tile_seq, tile_start, tile_len), each [cdiv(T, block_q) + S] int32.

    Tiles of each sequence's tokens (at most block_q, never straddling
    sequences) in sequence order, then tiles of the padding tokens
    cu_q_lens[S]..T-1, then empty tiles (tile_len 0).  tile_seq is the
    sequence of a tile whose tokens see at least one key, else -1 (padding
    tiles, and tiles that must output zeros)."""
    T = num_tokens
    S = kv_lens.shape[0]
    NT = _cdiv(T, block_q) + S
    cu = jnp.minimum(cu_q_lens.astype(jnp.int32), T)
    kv_lens = kv_lens.astype(jnp.int32)
    q_lens = jnp.maximum(cu[1:] - cu[:-1], 0)
    tiles = _cdiv(q_lens, block_q)
    ends = jnp.cumsum(tiles)
    i = jnp.arange(NT, dtype=jnp.int32)
    s = jnp.minimum(jnp.searchsorted(ends, i, side="right").astype(jnp.int32), S - 1)
    seq_start = cu[s] + (i - (ends[s] - tiles[s])) * block_q
    seq_len = jnp.clip(cu[s + 1] - seq_start, 0, block_q)
    first_pos = kv_lens[s] - q_lens[s] + (seq_start - cu[s])
    sees_keys = jnp.minimum(first_pos + seq_len, kv_lens[s]) > 0
    is_seq = i < ends[S - 1]
    pad_start = cu[S] + (i - ends[S - 1]) * block_q
    pad_len = jnp.clip(T - pad_start, 0, block_q)
    start = jnp.minimum(jnp.where(is_seq, seq_start, pad_start), T)
    length = jnp.where(is_seq, seq_len, pad_len)
    seq = jnp.where(is_seq & sees_keys & (seq_len > 0), s, -1)
    return seq.astype(jnp.int32), start.astype(jnp.int32), length.astype(jnp.int32)


def _kernel(layer_ref, bt_ref, kvl_ref, cu_ref, tseq_ref, tstart_ref, tlen_ref,  # SMEM
            q_hbm, kv_hbm,                                                       # inputs (HBM)
            o_hbm,                                                               # output (HBM)
            q_buf, qs_sc, kv_buf, code_buf, o_buf, fin, m_sc, l_sc, acc_sc, sems, state,  # scratch
            *, block_size: int, pages_per_cb: int, block_q: int, block_q_small: int,
            group: int, heads_per_blk: int, width: int, head_blocks: int, sm_scale: float,
            sliding_window: int | None = None, soft_cap: float | None = None):
    BS, P, G, hb = block_size, pages_per_cb, group, heads_per_blk
    N = P * BS
    D = q_buf.shape[-1]
    quantized = is_quantized(kv_buf.dtype)   # then code_buf holds the rows' scale codes
    cd = qs_sc.dtype                         # the dots' dtype (`compute_dtype`)
    sublanes = _sublanes(cd)
    prec = lax.Precision.HIGHEST if cd == jnp.float32 else None
    hblk = pl.program_id(0)
    i = pl.program_id(1)
    NT = pl.num_programs(1)
    layer = layer_ref[0]

    def heads(ref):
        """q / out HBM ref restricted to this grid step's query heads."""
        if head_blocks == 1:
            return ref
        return ref.at[:, pl.ds(hblk * (hb * G), hb * G)]

    def kv_src(page):
        if head_blocks == 1:
            return kv_hbm.at[page, layer]
        return kv_hbm.at[page, layer, :, pl.ds(hblk * hb, hb)]

    def tile(t):
        """Scalars of tile t (any index < NT)."""
        seq = tseq_ref[t]
        start = tstart_ref[t]
        n = tlen_ref[t]
        s = jnp.maximum(seq, 0)
        kv_len = kvl_ref[s]
        q_lo = cu_ref[s]
        first_pos = kv_len - (cu_ref[s + 1] - q_lo) + (start - q_lo)   # position of token 0
        limit = jnp.clip(first_pos + n, 0, kv_len)                    # keys seen: 0..limit-1
        tl = dict(seq=seq, s=s, start=start, n=n, first_pos=first_pos, limit=limit,
                  pages=_cdiv(limit, BS), blocks=_cdiv(limit, N),
                  lo=0, first_page=0, first_block=0)   # the page walk starts at page 0
        if sliding_window is not None:                # ... or at token 0's window start
            lo = jnp.minimum(window_start(first_pos, sliding_window), limit)
            tl.update(lo=lo, first_page=lo // BS, first_block=lo // N)
        return tl

    cur = tile(i)
    nxt_i = jnp.minimum(i + 1, NT - 1)
    nxt = tile(nxt_i)
    work = cur["seq"] >= 0
    nxt_work = (i + 1 < NT) & (nxt["seq"] >= 0)
    prev_work = (i > 0) & (tseq_ref[jnp.maximum(i - 1, 0)] >= 0)

    # ---- DMA descriptors (start and wait must build identical ones) ----
    def q_copy(tl, slot):
        return pltpu.make_async_copy(heads(q_hbm).at[pl.ds(tl["start"], tl["n"])],
                                     q_buf.at[slot, pl.ds(0, tl["n"])], sems.at[1, slot])

    def out_copy(start, n, slot):
        return pltpu.make_async_copy(o_buf.at[slot, pl.ds(0, n)],
                                     heads(o_hbm).at[pl.ds(start, n)], sems.at[2, slot])

    def kv_each(tl, j, slot, action):
        """`action` on the copy of each page of K/V step j that tile tl needs."""
        def one(p, carry):
            phys = bt_ref[tl["s"] * width + jnp.minimum(j * P + p, width - 1)]
            rows = pl.ds(pl.multiple_of(p * BS, BS), BS)
            if not quantized:
                action(pltpu.make_async_copy(kv_src(phys), kv_buf.at[slot, :, :, rows],
                                             sems.at[0, slot]))
                return carry
            page = kv_src(phys)                                   # [2, hb, BS + 1, D]
            action(pltpu.make_async_copy(page.at[:, :, pl.ds(0, BS)], kv_buf.at[slot, :, :, rows],
                                         sems.at[0, slot]))
            action(pltpu.make_async_copy(page.at[:, :, pl.ds(BS, 1), pl.ds(0, BS)],
                                         code_buf.at[slot, :, :, :, rows], sems.at[0, slot]))
            return carry
        if sliding_window is None:
            first = 0
        else:  # pages of the step before the window's first page: not copied
            first = jnp.maximum(tl["first_page"] - j * P, 0)
        lax.fori_loop(first, jnp.minimum(tl["pages"] - j * P, P), one, 0)

    def kv_start(tl, j, slot):
        kv_each(tl, j, slot, lambda c: c.start())

    def kv_wait(tl, j, slot):
        kv_each(tl, j, slot, lambda c: c.wait())

    # ---- prologue: the previous tile prefetched this one's q and first pages iff it worked ----
    @pl.when(work & jnp.logical_not(prev_work))
    def _prologue():
        state[0] = 0
        q_copy(cur, i % 2).start()
        kv_start(cur, cur["first_block"], 0)

    def attend(ntok: int):
        """Online softmax over the tile's K/V blocks; rows = ntok tokens x G heads."""
        R = ntok * G
        Rp = _round_up(R, sublanes)          # rows R.. are masked (token >= ntok)
        qslot = i % 2
        for h in range(hb):
            qh = q_buf[qslot, :ntok, h * G:(h + 1) * G, :].astype(jnp.float32).reshape(R, D)
            qs_sc[h, :R] = (qh * sm_scale).astype(cd)
        m_sc[:, :Rp] = jnp.full((hb, Rp, 1), MASK_VALUE, jnp.float32)
        l_sc[:, :Rp] = jnp.zeros((hb, Rp, 1), jnp.float32)
        acc_sc[:, :Rp] = jnp.zeros((hb, Rp, D), jnp.float32)

        # Last key each row sees (its causal position, within the keys the tile
        # needs).  Rows of tokens >= n hold stale q and are never copied out.
        tok = lax.broadcasted_iota(jnp.int32, (Rp, 1), 0) // G
        last_key = jnp.minimum(cur["first_pos"] + tok, cur["limit"] - 1)    # [Rp, 1]
        if sliding_window is not None:  # first key each row sees
            first_key = cur["first_pos"] + tok - (sliding_window - 1)       # [Rp, 1]

        def step(j, slot):
            last = j + 1 == cur["blocks"]

            @pl.when(jnp.logical_not(last))
            def _():
                kv_start(cur, j + 1, 1 - slot)

            @pl.when(last & nxt_work)
            def _():
                state[0] = 1 - slot
                kv_start(nxt, nxt["first_block"], 1 - slot)

            kv_wait(cur, j, slot)
            key_row = j * N + lax.broadcasted_iota(jnp.int32, (1, N), 1)    # [1, N]
            key_col = j * N + lax.broadcasted_iota(jnp.int32, (N, 1), 0)    # [N, 1]
            vis = key_row <= last_key                                        # [Rp, N]
            kv_ok = key_col < cur["limit"]
            if sliding_window is not None:  # slots before the window: stale or not ours
                vis &= key_row >= first_key
                kv_ok &= key_col >= cur["lo"]

            if quantized:                                                    # [1, N]: kv_ok by lane
                key_ok = key_row < cur["limit"]
                if sliding_window is not None:
                    key_ok &= key_row >= cur["lo"]

            def scales(kv, h):
                """fp32 [1, N] scales of K (kv 0) or V (1) rows of head h, from their codes;
                0 for keys past the tile's (their codes may be anything)."""
                c = code_buf[slot, kv, h]                                    # [1, N]
                int8 = jnp.issubdtype(c.dtype, jnp.integer)
                c = c.astype(jnp.int32) if int8 else c.astype(jnp.float32).astype(jnp.int32)
                return jnp.where(key_ok, _row_scale(c, int8), 0.0)

            def head(h, carry):
                k = kv_buf[slot, 0, h].astype(cd)                            # [N, D]: exact
                v = kv_buf[slot, 1, h].astype(cd)
                v = jnp.where(kv_ok, v, jnp.zeros_like(v))   # NaN, inf of keys not ours
                s = lax.dot_general(qs_sc[h, :Rp], k, (((1,), (1,)), ((), ())), precision=prec,
                                    preferred_element_type=jnp.float32)      # [Rp, N]
                if quantized:
                    s = s * scales(0, h)                     # K's row scales, by column
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s * (1.0 / soft_cap))
                s = jnp.where(vis, s, MASK_VALUE)
                m_prev = m_sc[h, :Rp]
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                alpha = jnp.exp(m_prev - m_new)
                p = jnp.where(vis, jnp.exp(s - m_new), 0.0)
                l_sc[h, :Rp] = alpha * l_sc[h, :Rp] + jnp.sum(p, axis=1, keepdims=True)
                pv = p * scales(1, h) if quantized else p    # V's row scales, on the probabilities
                acc_sc[h, :Rp] = alpha * acc_sc[h, :Rp] + lax.dot_general(
                    pv.astype(cd), v, (((1,), (0,)), ((), ())), precision=prec,
                    preferred_element_type=jnp.float32)
                m_sc[h, :Rp] = m_new
                return carry

            lax.fori_loop(0, hb, head, 0)
            return 1 - slot

        lax.fori_loop(cur["first_block"], cur["blocks"], step, state[0])
        for h in range(hb):
            l = l_sc[h, :R]
            ok = l > 0
            out = jnp.where(ok, acc_sc[h, :R] / jnp.where(ok, l, 1.0), 0.0)
            fin[:ntok, h * G:(h + 1) * G, :] = out.reshape(ntok, G, D)
        o_buf[i % 2, :ntok] = fin[:ntok].astype(o_buf.dtype)

    @pl.when(work)
    def _work():
        @pl.when(nxt_work)
        def _():
            q_copy(nxt, (i + 1) % 2).start()

        q_copy(cur, i % 2).wait()
        if block_q_small < block_q:
            pl.when(cur["n"] <= block_q_small)(lambda: attend(block_q_small))
            pl.when(cur["n"] > block_q_small)(lambda: attend(block_q))
        else:
            attend(block_q)

    @pl.when(jnp.logical_not(work) & (cur["n"] > 0))
    def _zeros():
        o_buf[i % 2] = jnp.zeros(o_buf.shape[1:], o_buf.dtype)

    # ---- output: start this tile's copy, wait the previous tile's (other slot) ----
    prev_i = jnp.maximum(i - 1, 0)
    prev_n = tlen_ref[prev_i]

    @pl.when((i > 0) & (prev_n > 0))
    def _():
        out_copy(tstart_ref[prev_i], prev_n, prev_i % 2).wait()

    @pl.when(cur["n"] > 0)
    def _():
        out_copy(cur["start"], cur["n"], i % 2).start()

    @pl.when((i == NT - 1) & (cur["n"] > 0))
    def _():
        out_copy(cur["start"], cur["n"], i % 2).wait()


def _vmem_bytes(block_q, hb, G, D, N, q_dtype, kv_dtype) -> int:
    cd = compute_dtype(q_dtype, kv_dtype)
    qi, ki, ci = jnp.dtype(q_dtype).itemsize, jnp.dtype(kv_dtype).itemsize, cd.itemsize
    hq = hb * G
    R = _round_up(block_q * G, _sublanes(cd))
    quantized = is_quantized(kv_dtype)
    return (2 * block_q * hq * D * qi * 2      # q_buf, o_buf
            + hb * R * D * ci                  # qs_sc
            + 2 * 2 * hb * N * D * ki          # kv_buf
            + quantized * 2 * 2 * hb * 32 * N  # code_buf (1 row, padded to a 32-row 8-bit tile)
            + quantized * 2 * N * D * ci       # converted K, V in flight
            + block_q * hq * D * 4             # fin
            + hb * R * (D + 2 * 128) * 4       # acc, m, l (lane-padded)
            + 3 * R * N * 4)                   # scores / probabilities in flight


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "interpret", "block_q", "block_q_small",
    "pages_per_compute_block", "kv_heads_per_block", "vmem_limit_bytes"))
def paged_attention_tpu(q, kv_pool, layer, block_tables, kv_lens, cu_q_lens, *, sm_scale=None,
                        sliding_window=None, soft_cap=None, interpret=None, block_q=None,
                        block_q_small=None, pages_per_compute_block=None,
                        kv_heads_per_block=None, vmem_limit_bytes=None):
    """Ragged paged attention on TPU.  Contract of `pallas_kernels.paged_attention`
    (sm_scale, sliding_window and soft_cap included).

    `interpret`: None -> real Mosaic on TPU, `pltpu.InterpretParams()` elsewhere;
    pass `pltpu.InterpretParams(detect_races=True)` to run the race detector.
    Tuning (all static):
      block_q: tokens per query tile (default ~256 rows' worth: 256 // G as a
        power of two in 8..128, at most T rounded up to 8).  Bigger tiles
        re-read a long prompt's K/V fewer times.
      block_q_small: tokens of the decode code path (default cdiv(8, G) for
        fp32 dots, cdiv(16, G) for bf16: `compute_dtype`); tiles of at most
        this many tokens use it.
      pages_per_compute_block: pages per K/V step (default 256 // block_size,
        at most W).
      kv_heads_per_block: KV heads per grid step, a divisor of KVH (default
        all, half on a megacore chip): head blocks are the "parallel" axis.
      vmem_limit_bytes: default by estimate (see the module notes).
    """
    T, H, D, KVH, BS, G, S, W, scale = attention_dims(q, kv_pool, block_tables, kv_lens,
                                                      cu_q_lens, sm_scale, sliding_window,
                                                      soft_cap)
    sliding_window, soft_cap = attention_options(sliding_window, soft_cap)
    if interpret is None:
        interpret = default_interpret()
    cd = compute_dtype(q.dtype, kv_pool.dtype)
    bq, small, ppcb = block_sizes(T, G, BS, W, cd, block_q, block_q_small,
                                  pages_per_compute_block)
    hb = kv_heads_per_block or _default_heads_per_block(KVH, G, q.dtype, not interpret)
    if KVH % hb:
        raise ValueError(f"kv_heads_per_block={hb} must divide num_kv_heads={KVH}")
    head_blocks = KVH // hb
    NT = _cdiv(T, bq) + S

    tseq, tstart, tlen = tile_layout(cu_q_lens, kv_lens, T, bq)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    bt_flat = block_tables.astype(jnp.int32).reshape(S * W)
    cu = jnp.minimum(cu_q_lens.astype(jnp.int32), T)

    if vmem_limit_bytes is None:
        est = _vmem_bytes(bq, hb, G, D, ppcb * BS, q.dtype, kv_pool.dtype)
        if est > 12 * 2**20:
            vmem_limit_bytes = min(int(est * 1.25) + 4 * 2**20, 100 * 2**20)

    kernel = functools.partial(_kernel, block_size=BS, pages_per_cb=ppcb, block_q=bq,
                               block_q_small=small, group=G, heads_per_blk=hb, width=W,
                               head_blocks=head_blocks, sm_scale=scale,
                               sliding_window=sliding_window, soft_cap=soft_cap)
    R = _round_up(bq * G, _sublanes(cd))
    codes = (1, ppcb * BS) if is_quantized(kv_pool.dtype) else (1, 1)   # unused unless quantized
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7,
        grid=(head_blocks, NT),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[
            pltpu.VMEM((2, bq, hb * G, D), q.dtype),            # q_buf
            pltpu.VMEM((hb, R, D), cd),                         # qs_sc: scaled q rows
            pltpu.VMEM((2, 2, hb, ppcb * BS, D), kv_pool.dtype),   # kv_buf: slot, K/V, head
            pltpu.VMEM((2, 2, hb, *codes), kv_pool.dtype),      # code_buf: rows' scale codes
            pltpu.VMEM((2, bq, hb * G, D), q.dtype),            # o_buf
            pltpu.VMEM((bq, hb * G, D), jnp.float32),           # fin
            pltpu.VMEM((hb, R, 1), jnp.float32),                # m
            pltpu.VMEM((hb, R, 1), jnp.float32),                # l
            pltpu.VMEM((hb, R, D), jnp.float32),                # acc
            pltpu.SemaphoreType.DMA((3, 2)),                    # (kv, q, out) x slot
            pltpu.SMEM((1,), jnp.int32),                        # kv slot of the next tile
        ],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((T, H, D), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret,
        name="jpaged_ragged_attention_tpu",
    )(layer_arr, bt_flat, kv_lens.astype(jnp.int32), cu, tseq, tstart, tlen, q, kv_pool)

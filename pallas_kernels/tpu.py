"""Pallas Mosaic-TPU paged attention (decode and ragged prefill in one kernel).

The pool `kv_pool[num_blocks, num_layers, 2, KVH, BS, D]` stays in HBM
(`memory_space=ANY`); the layer index, flattened block tables and the
lengths are scalar-prefetched into SMEM (`PrefetchScalarGridSpec`).

Grid (B, KVH, row_tiles, kv_steps).  The Q tokens x G query heads of one KV
head are flattened into Q*G rows (row r = token r // G) and tiled by
`block_m` rows (decode: Q == 1, one tile of G rows padded to a multiple of
8).  Step j of the last ("arbitrary") grid axis handles a compute block of
`pages_per_compute_block` pages: the pages of step j+1 are DMA'd
(`pltpu.make_async_copy`, one copy per page and K/V, straight from
`kv_pool.at[block, layer, k_or_v, head]`) into the other half of a
double-buffered VMEM scratch while step j computes.  Only the pages the
tile can see (causal bound) are copied; steps beyond them do nothing.  fp32
online softmax in VMEM scratch; the output tile is written on the last step.

Masking uses `where` on K, V and the scores (never a multiply), so NaN in
blocks the sequence does not own, block 0 included, and stale/uninitialised
VMEM never reach the output; rows with no visible key give zeros.

Real-TPU alignment (not checked here, interpret mode accepts anything):
head_dim a multiple of 128 is best (64 works as a full-dim block), block_size
a multiple of 8 for fp32 K/V and 16 for bf16 (sublane tiling of the
[pages*BS, D] reshape), pages_per_compute_block * block_size ideally a
multiple of 128.  The kernels have only been run in TPU interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference import attention_dims, row_tile_span

MASK_VALUE = -1e30


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def default_interpret():
    """TPU interpret mode (CPU simulation of HBM/VMEM/DMA) off-TPU, else None."""
    return None if _on_tpu() else pltpu.InterpretParams()


def _kernel(layer_ref, bt_ref, kvl_ref, ql_ref,            # scalar prefetch (SMEM)
            q_ref, kv_hbm,                                  # inputs
            o_ref,                                          # output
            k_buf, v_buf, sems, m_sc, l_sc, acc_sc,         # scratch
            *, block_size: int, pages_per_cb: int, block_m: int, group: int,
            width: int, sm_scale: float):
    b = pl.program_id(0)
    h = pl.program_id(1)
    t = pl.program_id(2)
    j = pl.program_id(3)
    n_steps = pl.num_programs(3)
    layer = layer_ref[0]
    kv_len = kvl_ref[b]
    q_len = ql_ref[b]
    cb_tokens = pages_per_cb * block_size

    first_tok, last_pos = row_tile_span(t, block_m, group, q_len, kv_len)
    active = (first_tok < q_len) & (kv_len > 0)
    pages_needed = jnp.where(active, last_pos // block_size + 1, 0)
    steps_needed = (pages_needed + pages_per_cb - 1) // pages_per_cb

    def copies(step, slot):
        out = []
        for i in range(pages_per_cb):
            page = step * pages_per_cb + i
            phys = bt_ref[b * width + jnp.minimum(page, width - 1)]
            kc = pltpu.make_async_copy(kv_hbm.at[phys, layer, 0, h], k_buf.at[slot, i],
                                       sems.at[0, slot])
            vc = pltpu.make_async_copy(kv_hbm.at[phys, layer, 1, h], v_buf.at[slot, i],
                                       sems.at[1, slot])
            out.append((page < pages_needed, kc, vc))
        return out

    def each_copy(step, slot, action):
        for cond, kc, vc in copies(step, slot):
            @pl.when(cond)
            def _():
                action(kc)
                action(vc)

    def start(step, slot):
        each_copy(step, slot, lambda c: c.start())

    def wait(step, slot):
        each_copy(step, slot, lambda c: c.wait())

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        start(0, 0)

    @pl.when(j < steps_needed)
    def _step():
        slot = j % 2

        @pl.when(j + 1 < steps_needed)
        def _prefetch():
            start(j + 1, 1 - slot)

        wait(j, slot)
        d = k_buf.shape[-1]
        k = k_buf[slot].reshape(cb_tokens, d)
        v = v_buf[slot].reshape(cb_tokens, d)
        pos = j * cb_tokens + lax.broadcasted_iota(jnp.int32, (1, cb_tokens), 1)   # [1, N]
        rows = t * block_m + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)       # [M, 1]
        tok = rows // group
        q_pos = kv_len - q_len + tok
        kvalid = pos < kv_len                                                       # [1, N]
        vis = (pos <= q_pos) & kvalid & (tok < q_len)                               # [M, N]
        k = jnp.where(kvalid.reshape(cb_tokens, 1), k, jnp.zeros_like(k))
        v = jnp.where(kvalid.reshape(cb_tokens, 1), v, jnp.zeros_like(v))
        prec = lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
        q = (q_ref[...].astype(jnp.float32) * sm_scale).astype(k.dtype)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32)                     # [M, N]
        s = jnp.where(vis, s, MASK_VALUE)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(vis, jnp.exp(s - m_new), 0.0)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
            preferred_element_type=jnp.float32)
        m_sc[...] = m_new

    @pl.when(j == n_steps - 1)
    def _finish():
        l = l_sc[...]
        ok = l > 0
        out = acc_sc[...] / jnp.where(ok, l, 1.0)
        o_ref[...] = jnp.where(ok, out, 0.0).astype(o_ref.dtype)


def _default_pages_per_cb(width: int, block_size: int) -> int:
    return max(1, min(width, 512 // block_size))


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_compute_block", "block_m",
                                             "interpret"))
def paged_attention_tpu(q, kv_pool, layer, block_tables, kv_lens, q_lens, *, sm_scale=None,
                        pages_per_compute_block=None, block_m=None, interpret=None):
    """Paged attention on TPU for any Q (decode: Q == 1).  Contract of `paged_attention`.

    `interpret`: None -> real Mosaic on TPU, `pltpu.InterpretParams()` elsewhere;
    pass `pltpu.InterpretParams(detect_races=True)` to run the race detector.
    """
    B, Q, H, D, KVH, BS, G, W, scale = attention_dims(q, kv_pool, block_tables, sm_scale)
    if interpret is None:
        interpret = default_interpret()
    ppcb = pages_per_compute_block or _default_pages_per_cb(W, BS)
    ppcb = max(1, min(ppcb, W))
    n_steps = -(-W // ppcb)
    rows = Q * G
    sublanes = 8 * max(1, 4 // jnp.dtype(q.dtype).itemsize)   # 8 fp32, 16 bf16 rows per tile
    if block_m is None:
        block_m = min(_round_up(rows, sublanes), 128)
    n_tiles = -(-rows // block_m)
    R = n_tiles * block_m

    qr = q.reshape(B, Q, KVH, G, D).transpose(0, 2, 1, 3, 4).reshape(B, KVH, rows, D)
    if R != rows:
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, R - rows), (0, 0)))
    kv_lens = kv_lens.astype(jnp.int32)
    q_lens = jnp.where(kv_lens > 0, q_lens, 0).astype(jnp.int32)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    bt_flat = block_tables.astype(jnp.int32).reshape(B * W)

    kernel = functools.partial(_kernel, block_size=BS, pages_per_cb=ppcb, block_m=block_m,
                               group=G, width=W, sm_scale=scale)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(B, KVH, n_tiles, n_steps),
        in_specs=[
            pl.BlockSpec((None, None, block_m, D), lambda b, h, t, j, *_: (b, h, t, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((None, None, block_m, D), lambda b, h, t, j, *_: (b, h, t, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, ppcb, BS, D), kv_pool.dtype),
            pltpu.VMEM((2, ppcb, BS, D), kv_pool.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((block_m, 1), jnp.float32),
            pltpu.VMEM((block_m, 1), jnp.float32),
            pltpu.VMEM((block_m, D), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((B, KVH, R, D), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="jpaged_attention_tpu",
    )(layer_arr, bt_flat, kv_lens, q_lens, qr, kv_pool)
    out = out[:, :, :rows].reshape(B, KVH, Q, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Q, H, D)
    return out

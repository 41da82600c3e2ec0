"""A grouped matmul (`jax.lax.ragged_dot`'s contract) as Pallas kernels, GPU and TPU.

`gmm(lhs [M, K], rhs [G, K, N], group_sizes [G])` -> [M, N]: with
ends = cumsum(group_sizes), rows ends[g - 1] .. ends[g] - 1 of lhs times rhs[g];
rows at or past ends[G - 1] are zeros (group sizes summing past M are clipped to
M).  `gmm_swiglu_experts` is a MoE layer's SwiGLU experts (jpaged.layers.moe's
`swiglu_experts` contract) in two kernel calls: gate and up fused (both dots
and silu(gate) * up in one pass over the rows), then down.

Layout (jnp, outside the kernels).  Every group's rows are moved to start a new
tile of `tm` rows, zero rows after them (`tile_layout`; jpaged's
`tiled_swiglu_experts` pads the same way), so no row tile straddles two groups
and each tile's group is one scalar.  cdiv(M, tm) + G tiles (static) hold any
group sizes; the `used` ones (sum of cdiv(size_g, tm)) are computed, the others
read no weights and give zeros.  Rows past the total sit in unused tiles.  The
rows are scattered into the tiles once and gathered back once (M x K and M x N
bytes, small beside the experts' weights at decode), and `gmm_swiglu_experts`
keeps the tiled layout between its two calls.

Kernels: the tiled rows times the tile's group's [K, N] weights, fp32
accumulation over K, output in lhs's dtype; fp32 inputs use fp32-accurate dots
(TF32x3 on a GPU, HIGHEST on TPU and in interpret mode), bf16 inputs bf16 dots.

* "gpu" (Pallas Triton): grid (tiles, N / tn); a program loops over K in steps of
  tk (the trip count is 0 for unused tiles), reading the group's weight tile
  straight from the whole [G, K, N] array by the group id.
* "tpu" (Pallas Mosaic): grid (tiles, N / tn, K / tk), the group ids scalar-
  prefetched into SMEM and the weight block chosen by them in the BlockSpec
  index map (the pipeline DMAs it); the fp32 accumulator lives in VMEM.  Unused
  tiles map every block to the last used tile's last block, so the pipeline
  fetches nothing for them.  Run here in TPU interpret mode only: never compiled
  by libtpu nor timed on a TPU.

The two variants share the layout, the dots and the epilogue.  Off their backend
they run in interpret mode (`interpret=True` for Triton, `pltpu.InterpretParams()`
for TPU); `backend=None` picks "tpu" on a TPU, else "gpu" (interpreted off a GPU).
Dimensions: N and K must be multiples of 16 (Triton dots want tiles >= 16); tiles
are powers of two dividing them, or on TPU multiples of 128 or the whole dim.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

try:  # jax >= 0.6 naming; present in 0.10 and 0.11
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - a jax without the Triton backend
    plgpu = None

BACKENDS = ("gpu", "tpu")
_MIN_TILE = 16   # Triton dots want every dimension >= 16; a bf16 TPU tile has 16 sublanes


# ------------------------------------------------------------------ layout
def default_tile_rows(num_rows: int, num_groups: int) -> int:
    """Rows of a tile: about one tile per group's even share, a power of two in 16..128."""
    share = -(-num_rows // num_groups)
    return min(128, max(_MIN_TILE, 1 << (share - 1).bit_length()))


def tile_layout(group_sizes: jax.Array, num_rows: int, tm: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dest [M] int32: each row's row in the tiles, tile_group [tiles] int32, used [1] int32)
    for rows sorted by group, every group starting a new tile of tm rows.  Rows past
    the groups' total go after the used tiles (which are never computed)."""
    G = group_sizes.shape[0]
    num_tiles = -(-num_rows // tm) + G
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)
    sizes = jnp.diff(ends, prepend=0)
    tiles_per_group = (sizes + tm - 1) // tm
    tile_ends = jnp.cumsum(tiles_per_group)
    used = tile_ends[-1]
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    group = jnp.searchsorted(ends, rows, side="right")    # G for rows past the total
    g = jnp.minimum(group, G - 1)
    in_group = (tile_ends - tiles_per_group)[g] * tm + rows - (ends - sizes)[g]
    dest = jnp.where(group < G, in_group, used * tm + rows - ends[-1]).astype(jnp.int32)
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_group = jnp.minimum(jnp.searchsorted(tile_ends, tiles, side="right"), G - 1).astype(jnp.int32)
    return dest, tile_group, used.reshape(1).astype(jnp.int32)


def to_tiles(x: jax.Array, dest: jax.Array, num_tiles: int, tm: int) -> jax.Array:
    """Rows x [M, K] scattered to their rows `dest` of [num_tiles * tm, K] zeros."""
    return jnp.zeros((num_tiles * tm, x.shape[1]), x.dtype).at[dest].set(x, unique_indices=True)


# ------------------------------------------------------------------ shared math
def _dim_tile(n: int, cap: int, backend: str) -> int:
    """The tile of a K or N dimension of size n: the largest power of two <= cap
    dividing n (>= 16); on TPU one that is a multiple of 128, else n itself."""
    t = cap
    while t >= _MIN_TILE and n % t:
        t //= 2
    if backend == "tpu" and t < 128:
        return n
    if t < _MIN_TILE:
        raise ValueError(f"grouped matmul dims must be multiples of {_MIN_TILE}, got {n}")
    return t


def _fp32_precision(backend: str, interpret: bool):
    """fp32-accurate dots: TF32x3 compiled for a GPU (Triton's exact fp32 dot is a slow
    CUDA-core loop), HIGHEST on TPU and in interpret mode (the CPU has no TF32x3)."""
    if backend == "gpu" and not interpret:
        return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lax.Precision.HIGHEST


def _dot(x: jax.Array, w: jax.Array, fp32_precision) -> jax.Array:
    """[tm, tk] x [tk, tn] -> [tm, tn] fp32, in x's dtype."""
    w = w.astype(x.dtype)
    precision = fp32_precision if x.dtype == jnp.float32 else None
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _epilogue(accs: tuple[jax.Array, ...]) -> jax.Array:
    """One weight: its product.  Two (gate, up): silu(gate) * up, in fp32."""
    if len(accs) == 1:
        return accs[0]
    gate, up = accs
    return gate / (1.0 + jnp.exp(-gate)) * up   # silu without logistic (lowers on Triton and Mosaic)


# ------------------------------------------------------------------ GPU (Triton)
def _gpu_kernel(tile_group_ref, used_ref, x_ref, *refs, tm: int, tk: int, tn: int, num_k: int, fp32_precision):
    *w_refs, o_ref = refs
    i, j = pl.program_id(0), pl.program_id(1)
    g = tile_group_ref[i]
    rows = pl.ds(pl.multiple_of(i * tm, tm), tm)
    cols = pl.ds(pl.multiple_of(j * tn, tn), tn)

    def step(k, accs):
        ks = pl.ds(pl.multiple_of(k * tk, tk), tk)
        x = x_ref[rows, ks]
        return tuple(acc + _dot(x, w_ref[g, ks, cols], fp32_precision) for acc, w_ref in zip(accs, w_refs))

    # Unused tiles: no weight read, zeros.  Integer arithmetic, not a select: Triton's
    # lowering of where(c, 1, 0) (num_k == 1) gave the loop an i1 bound.
    trips = jnp.clip(used_ref[0] - i, 0, 1) * num_k
    accs = lax.fori_loop(0, trips, step, (jnp.zeros((tm, tn), jnp.float32),) * len(w_refs))
    o_ref[...] = _epilogue(accs).astype(o_ref.dtype)


def _tiles_gpu(tiles, weights, tile_group, used, *, tm, interpret, num_warps=4, num_stages=3):
    (MT, K), (_, _, N) = tiles.shape, weights[0].shape
    # fp32's TF32x3 dots hold hi / lo parts of both operands: K steps of 32 keep the fused
    # gate + up kernel free of spills on sm_90 (ptxas spilled 100 bytes with steps of 64).
    tk, tn = _dim_tile(K, 64 if tiles.dtype.itemsize < 4 else 32, "gpu"), _dim_tile(N, 128, "gpu")
    kernel = functools.partial(_gpu_kernel, tm=tm, tk=tk, tn=tn, num_k=K // tk,
                               fp32_precision=_fp32_precision("gpu", interpret))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)
    params = None if plgpu is None else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        kernel,
        grid=(MT // tm, N // tn),
        in_specs=[whole(tile_group), whole(used), whole(tiles), *(whole(w) for w in weights)],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((MT, N), tiles.dtype),
        compiler_params=params,   # Triton params select the Triton lowering (not Mosaic GPU)
        interpret=interpret,
        name="jpaged_gmm_gpu",
    )(tile_group, used, tiles, *weights)


# ------------------------------------------------------------------ TPU (Mosaic)
def _tpu_kernel(tile_group_ref, used_ref, x_ref, *refs, num_w: int, num_k: int, fp32_precision):
    w_refs, o_ref, acc_refs = refs[:num_w], refs[num_w], refs[num_w + 1:]
    i, k = pl.program_id(0), pl.program_id(2)

    @pl.when(k == 0)
    def _():
        for acc in acc_refs:
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    @pl.when(i < used_ref[0])
    def _():
        x = x_ref[...]
        for acc, w_ref in zip(acc_refs, w_refs):
            acc[...] += _dot(x, w_ref[...], fp32_precision)

    @pl.when(k == num_k - 1)
    def _():
        o_ref[...] = _epilogue(tuple(acc[...] for acc in acc_refs)).astype(o_ref.dtype)


def _live_block(i, j, k, used_ref, num_j: int, num_k: int):
    """(tile, n block, k block) a grid step reads: its own, or for an unused tile the
    last used tile's last block (the same block as the step before: no DMA)."""
    used = used_ref[0]
    live = (i < used).astype(jnp.int32)
    last = jnp.maximum(used - 1, 0)
    return (live * i + (1 - live) * last, live * j + (1 - live) * (num_j - 1),
            live * k + (1 - live) * (num_k - 1))


def _tiles_tpu(tiles, weights, tile_group, used, *, tm, interpret):
    (MT, K), (_, _, N) = tiles.shape, weights[0].shape
    tk, tn = _dim_tile(K, 512, "tpu"), _dim_tile(N, 512, "tpu")
    num_j, num_k = N // tn, K // tk
    live = functools.partial(_live_block, num_j=num_j, num_k=num_k)

    def x_map(i, j, k, tg, used):
        ii, _, kk = live(i, j, k, used)
        return ii, kk

    def w_map(i, j, k, tg, used):
        ii, jj, kk = live(i, j, k, used)
        return tg[ii], kk, jj

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(MT // tm, num_j, num_k),
        in_specs=[pl.BlockSpec((tm, tk), x_map), *(pl.BlockSpec((None, tk, tn), w_map) for _ in weights)],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, k, tg, used: (i, j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32) for _ in weights],
    )
    kernel = functools.partial(_tpu_kernel, num_w=len(weights), num_k=num_k,
                               fp32_precision=_fp32_precision("tpu", interpret is not None))
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((MT, N), tiles.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="jpaged_gmm_tpu",
    )(tile_group, used, tiles, *weights)


# ------------------------------------------------------------------ entry points
def default_backend() -> str:
    """"tpu" on a TPU, else "gpu" (Triton; interpreted off a GPU)."""
    return "tpu" if jax.default_backend() == "tpu" else "gpu"


def grouped_tiles(tiles: jax.Array, weights: tuple[jax.Array, ...], tile_group: jax.Array, used: jax.Array,
                  *, tm: int, backend: str | None = None, interpret=None) -> jax.Array:
    """Rows already in `tile_layout`'s tiles [tiles * tm, K] times their tile's group's
    weights [G, K, N] (one: the product; two: silu(x @ w0) * (x @ w1)): [tiles * tm, N]
    in the rows' dtype, zeros in unused tiles.  `interpret`: None = automatic."""
    backend = backend or default_backend()
    if backend == "gpu":
        run: Callable = _tiles_gpu
        interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    elif backend == "tpu":
        run = _tiles_tpu
        if interpret is None and jax.default_backend() != "tpu":
            interpret = pltpu.InterpretParams()
    else:
        raise ValueError(f"unknown grouped matmul backend {backend!r}; expected one of {BACKENDS}")
    return run(tiles, tuple(weights), tile_group, used, tm=tm, interpret=interpret)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, tile_rows: int | None = None,
        backend: str | None = None, interpret=None) -> jax.Array:
    """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` ([M, K] x [G, K, N] -> [M, N], lhs's
    dtype, fp32 accumulation) as a Pallas grouped matmul (see the module docstring)."""
    M, G = lhs.shape[0], rhs.shape[0]
    tm = tile_rows or default_tile_rows(M, G)
    dest, tile_group, used = tile_layout(group_sizes, M, tm)
    tiles = to_tiles(lhs, dest, tile_group.shape[0], tm)
    out = grouped_tiles(tiles, (rhs,), tile_group, used, tm=tm, backend=backend, interpret=interpret)
    return out[dest]


def gmm_swiglu_experts(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                       group_sizes: jax.Array, *, tile_rows: int | None = None, backend: str | None = None,
                       interpret=None) -> jax.Array:
    """Rows xs [R, d] sorted by expert (group_sizes [E] rows each) through their experts'
    SwiGLU MLP (w_gate, w_up [E, d, f], w_down [E, f, d]): [R, d] in xs's dtype, rows
    past the groups zero.  Two kernel calls on one tiled layout: silu(x @ gate) * (x @ up)
    fused (fp32, rounded to xs's dtype once), then @ down."""
    R, E = xs.shape[0], w_gate.shape[0]
    tm = tile_rows or default_tile_rows(R, E)
    dest, tile_group, used = tile_layout(group_sizes, R, tm)
    tiles = to_tiles(xs, dest, tile_group.shape[0], tm)
    run = functools.partial(grouped_tiles, tile_group=tile_group, used=used, tm=tm, backend=backend,
                            interpret=interpret)
    return run(run(tiles, (w_gate, w_up)), (w_down,))[dest]


__all__ = ["gmm", "gmm_swiglu_experts", "grouped_tiles", "tile_layout", "to_tiles", "default_tile_rows",
           "default_backend", "BACKENDS"]

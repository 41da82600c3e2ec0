"""The Pallas grouped matmul (pallas_kernels.grouped_matmul) against a numpy oracle,
`jax.lax.ragged_dot` and jpaged's `swiglu_experts`, on CPU.

Both variants run here in interpret mode: "gpu" (Triton, `interpret=True`) and
"tpu" (Mosaic, TPU interpret mode).  Fixed cases, small shapes (each distinct
shape is a compile): uneven group sizes, empty groups (leading, inner, trailing,
all of them), groups that end mid-tile so that one 16-row tile of the sorted rows
spans several groups, more groups than rows (decode), rows past the groups' total
(zeros), K and N over several tiles (fp32 1e-5, bf16 loose), and one jitted
program over group sizes that change between calls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.layers.moe import moe_mlp, moe_mlp_dense, swiglu_experts
from pallas_kernels.grouped_matmul import BACKENDS, gmm, gmm_swiglu_experts, tile_layout

HI = jax.lax.Precision.HIGHEST
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=3e-2, atol=3e-2)

# (name, rows M, group sizes): group sizes summing to <= M.
CASES = [
    ("uneven, empty inner group, tiles straddling groups", 40, [5, 0, 20, 9, 6]),
    ("empty leading and trailing groups, rows past the total", 40, [0, 3, 17, 0, 0]),
    ("more groups than rows (decode: one row each)", 8, [1, 0, 1, 1, 0, 2, 1, 0, 1, 1]),
    ("all groups empty", 24, [0, 0, 0]),
]


def oracle(lhs: np.ndarray, rhs: np.ndarray, group_sizes: list[int]) -> np.ndarray:
    """ragged_dot in float64: each group's rows times its matrix, zeros past the total."""
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(group_sizes):
        out[start:start + size] = lhs[start:start + size].astype(np.float64) @ rhs[g].astype(np.float64)
        start += size
    return out


def draw(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), dtype)


@functools.lru_cache(maxsize=None)
def jitted_gmm(backend: str, tile_rows: int | None):
    return jax.jit(functools.partial(gmm, backend=backend, tile_rows=tile_rows))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,rows,sizes", CASES, ids=[c[0] for c in CASES])
def test_gmm_fp32_matches_oracle_and_ragged_dot(backend, name, rows, sizes):
    rng = np.random.default_rng(len(sizes) * 100 + rows)
    K, N = 64, 48          # "gpu": K in two 32-row steps, N in three 16-column tiles
    lhs, rhs = draw(rng, (rows, K), jnp.float32), draw(rng, (len(sizes), K, N), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out = jitted_gmm(backend, 16)(lhs, rhs, group_sizes)
    assert out.shape == (rows, N) and out.dtype == jnp.float32
    want = oracle(np.asarray(lhs), np.asarray(rhs), sizes)
    np.testing.assert_allclose(np.asarray(out), want, **FP32_TOL, err_msg=name)
    np.testing.assert_allclose(out, jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=HI), **FP32_TOL)
    assert not np.any(np.asarray(out)[sum(sizes):]), "rows past the groups' total must be zeros"


@pytest.mark.parametrize("backend", BACKENDS)
def test_gmm_bf16_several_k_and_n_tiles(backend):
    """bf16 inputs, K and N over several tiles ("gpu": K 10 x 64, N 3 x 128; "tpu": K 5 x 128,
    N 3 x 128), default tile rows (32)."""
    rng = np.random.default_rng(7)
    sizes = [30, 0, 3, 50, 11]
    rows, K, N = 100, 640, 384
    lhs, rhs = draw(rng, (rows, K), jnp.bfloat16), draw(rng, (len(sizes), K, N), jnp.bfloat16)
    out = jitted_gmm(backend, None)(lhs, rhs, jnp.asarray(sizes, jnp.int32))
    assert out.dtype == jnp.bfloat16
    want = oracle(np.asarray(lhs, np.float32), np.asarray(rhs, np.float32), sizes)
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(out, np.float32) / scale, want / scale, **BF16_TOL)


def test_one_program_for_changing_group_sizes():
    """Group sizes are data: one compiled program serves every routing."""
    rng = np.random.default_rng(3)
    lhs, rhs = draw(rng, (40, 32), jnp.float32), draw(rng, (5, 32, 16), jnp.float32)
    fn = jax.jit(functools.partial(gmm, backend="gpu", tile_rows=16))
    for sizes in ([8, 8, 8, 8, 8], [0, 40, 0, 0, 0], [17, 1, 1, 1, 15]):
        out = fn(lhs, rhs, jnp.asarray(sizes, jnp.int32))
        np.testing.assert_allclose(np.asarray(out), oracle(np.asarray(lhs), np.asarray(rhs), sizes), **FP32_TOL)
    assert fn._cache_size() == 1


def test_tile_layout_puts_each_group_in_its_own_tiles():
    sizes = [5, 0, 20, 9, 6]
    dest, tile_group, used = map(np.asarray, tile_layout(jnp.asarray(sizes, jnp.int32), 45, 16))
    assert len(set(dest.tolist())) == 45, "rows must land on distinct tile rows"
    group_of_row = np.repeat(np.arange(len(sizes)), sizes)
    assert np.array_equal(tile_group[dest[:40] // 16], group_of_row)
    assert used[0] == 1 + 0 + 2 + 1 + 1
    assert np.all(dest[40:] >= used[0] * 16) and np.all(dest < tile_group.shape[0] * 16)


def test_bad_arguments():
    lhs, rhs = jnp.zeros((8, 24)), jnp.zeros((2, 24, 16))
    with pytest.raises(ValueError, match="multiples of 16"):
        gmm(lhs, rhs, jnp.asarray([4, 4], jnp.int32), backend="gpu")
    with pytest.raises(ValueError, match="unknown grouped matmul backend"):
        gmm(jnp.zeros((8, 16)), jnp.zeros((2, 16, 16)), jnp.asarray([4, 4], jnp.int32), backend="cuda")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gmm_swiglu_experts_matches_swiglu_experts(backend, dtype):
    rng = np.random.default_rng(11)
    sizes = [7, 0, 19, 1, 9]                       # 36 of 40 rows: 4 rows past the total
    d, f = 32, 64
    xs = draw(rng, (40, d), dtype)
    w_gate, w_up = draw(rng, (5, d, f), dtype) * 0.3, draw(rng, (5, d, f), dtype) * 0.3
    w_down = draw(rng, (5, f, d), dtype) * 0.3
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out = jax.jit(functools.partial(gmm_swiglu_experts, backend=backend, tile_rows=16))(
        xs, w_gate, w_up, w_down, group_sizes)
    with jax.default_matmul_precision("highest"):
        want = swiglu_experts(xs, w_gate, w_up, w_down, group_sizes)
    assert out.shape == want.shape and out.dtype == dtype
    tol = FP32_TOL if dtype == jnp.float32 else BF16_TOL
    scale = float(jnp.abs(want.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(out, np.float32) / scale, np.asarray(want, np.float32) / scale, **tol)
    assert not np.any(np.asarray(out, np.float32)[sum(sizes):])


def test_moe_mlp_with_the_pallas_grouped_matmuls():
    """The layer's `grouped=` option takes gmm_swiglu_experts: same as the one-hot oracle."""
    rng = np.random.default_rng(5)
    T, d, f, E, k = 12, 32, 32, 6, 2
    x = draw(rng, (T, d), jnp.float32)
    router, w_gate = draw(rng, (d, E), jnp.float32), draw(rng, (E, d, f), jnp.float32) * 0.3
    w_up, w_down = draw(rng, (E, d, f), jnp.float32) * 0.3, draw(rng, (E, f, d), jnp.float32) * 0.3
    grouped = functools.partial(gmm_swiglu_experts, backend="gpu")
    out = jax.jit(functools.partial(moe_mlp, top_k=k, renormalize=True, grouped=grouped))(
        x, router, w_gate, w_up, w_down)
    want = moe_mlp_dense(x, router, w_gate, w_up, w_down, top_k=k, renormalize=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# Lowering for the real backends (no GPU / TPU needed): Triton IR compiled for
# sm_90 by the `triton` package (no spills), and Mosaic for a TPU v5e target.
# Qwen3-30B-A3B's expert shapes at 64 decode tokens (512 rows, 128 experts).
QWEN3_MOE = dict(rows=512, d=2048, f=768, experts=128)


def _swiglu_args(dtype, rows, d, f, experts):
    return (jax.ShapeDtypeStruct((rows, d), dtype), jax.ShapeDtypeStruct((experts, d, f), dtype),
            jax.ShapeDtypeStruct((experts, d, f), dtype), jax.ShapeDtypeStruct((experts, f, d), dtype),
            jax.ShapeDtypeStruct((experts,), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_to_triton_and_compiles_for_sm90(dtype):
    from pallas_kernels import triton_aot
    irs = triton_aot.capture_ttir(functools.partial(gmm_swiglu_experts, backend="gpu", interpret=False),
                                  *_swiglu_args(dtype, **QWEN3_MOE))
    assert irs and all(ir.name == "jpaged_gmm_gpu" for ir in irs)   # jaxlib > 0.10.2: the first one only
    pytest.importorskip("triton")
    for ir in irs:
        r = triton_aot.compile_for_cuda(ir)
        assert r.spill_stores == 0 and r.stack_bytes == 0 and r.fits, r


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_to_mosaic(monkeypatch, dtype):
    from jax._src.pallas.mosaic import tpu_info
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    fn = jax.jit(functools.partial(gmm_swiglu_experts, backend="tpu", interpret=False))
    text = fn.trace(*_swiglu_args(dtype, **QWEN3_MOE)).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 2 and "jpaged_gmm_tpu" in text

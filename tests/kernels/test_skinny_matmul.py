"""The skinny matmul of CPU decode steps (pallas_kernels.cpu.skinny_matmul_cpu, C++ XLA FFI call)
and its use by the model (jpaged.layers.skinny_matmul, config matmul_impl).

* Against float64 numpy, b stored [K, N] and transposed [N, K] (a tied LM
  head): SmolLM2's projection shapes, K and N that are not
  multiples of 4 or 8 (the k tail, the scalar column tail), N < 8 (no vector
  columns at all), M from 1 to SKINNY_MAX_ROWS.
* Any thread count gives the same bits (items are column panels x fixed k halves,
  or in the transposed form row ranges of b).
* Out-of-contract calls raise before any kernel runs.
* The grouped form (a MoE decode step's experts) against float64 per group.
* Its VJP equals XLA's dot's.
* An engine with matmul_impl "cpu" runs the kernel in its decode programs (the
  custom call is in the compiled HLO) and generates the greedy tokens of "xla".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_prompts
from jpaged import SamplingParams
from jpaged.layers import skinny_matmul
from pallas_kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels are unavailable")


def _operands(seed: int, m: int, k: int, n: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((m, k), np.float32)),
            jnp.asarray(rng.standard_normal((k, n), np.float32)))


@pytest.mark.parametrize("transpose_b", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (4, 1536, 576), (3, 577, 1539), (32, 128, 4100),
                                   (7, 5, 3), (2, 3, 7), (32, 6, 64), (16, 64, 20), (5, 1, 9)])
def test_matches_float64(m, k, n, transpose_b):
    a, b = _operands(m * 1000 + k, m, k, n)
    if transpose_b:  # the same product from b stored [N, K] (a tied LM head)
        b = jnp.asarray(np.ascontiguousarray(np.asarray(b).T))
    got = np.asarray(jax.jit(functools.partial(cpu.skinny_matmul_cpu, transpose_b=transpose_b))(a, b))
    want = np.asarray(a, np.float64) @ np.asarray(b.T if transpose_b else b, np.float64)
    # fp32 FMA chains over k: relative to the largest |entry|, a few ulps times sqrt(k)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max(), (m, k, n)


@pytest.mark.parametrize("transpose_b", [False, True], ids=["kn", "nk"])
def test_threads_give_the_same_bits(transpose_b):
    a, b = _operands(1, 8, 1536, 4100)
    b = b.T if transpose_b else b
    np.testing.assert_array_equal(np.asarray(cpu.skinny_matmul_cpu(a, b, transpose_b=transpose_b)),
                                  np.asarray(cpu.skinny_matmul_cpu(a, b, transpose_b=transpose_b, max_threads=1)))


def test_out_of_contract_calls_raise():
    a, b = _operands(2, cpu.SKINNY_MAX_ROWS + 1, 8, 8)
    with pytest.raises(ValueError, match="at most 32 rows"):
        cpu.skinny_matmul_cpu(a, b)
    with pytest.raises(ValueError, match=r"need a \[M, K\] and b \[K, N\]"):
        cpu.skinny_matmul_cpu(a[:4], b[:7])
    with pytest.raises(ValueError, match=r"need a \[M, K\] and b \[N, K\]"):
        cpu.skinny_matmul_cpu(a[:4], b[:, :7], transpose_b=True)
    with pytest.raises(TypeError, match="float32"):
        cpu.skinny_matmul_cpu(a[:4].astype(jnp.bfloat16), b)


@pytest.mark.parametrize("sizes", [(3, 5, 0, 8), (0, 0, 40, 1), (2, 0, 3), (70,), (1, 1)])
def test_grouped_matches_float64_per_group(sizes):
    """Each row through its own group's matrix (a MoE layer's experts): groups left
    empty, one over 32 rows (two chunks), and rows past the groups' total (zero)."""
    rng = np.random.default_rng(sum(sizes))
    R, K, N = sum(sizes) + 3, 37, 45
    a = rng.standard_normal((R, K), np.float32)
    b = rng.standard_normal((len(sizes), K, N), np.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(jax.jit(cpu.grouped_skinny_matmul_cpu)(a, group_sizes, b))
    group = np.repeat(np.arange(len(sizes)), sizes)
    want = np.einsum("rk,rkn->rn", a[:len(group)].astype(np.float64), b[group].astype(np.float64))
    assert np.abs(got[:len(group)] - want).max() <= 2e-6 * np.abs(want).max()
    assert not got[len(group):].any()
    np.testing.assert_array_equal(got, np.asarray(cpu.grouped_skinny_matmul_cpu(a, group_sizes, b, max_threads=1)))


def test_grouped_out_of_contract_calls_raise():
    a, b = _operands(5, 4, 8, 8)
    with pytest.raises(ValueError, match=r"need a \[R, K\], group_sizes \[E\] and b \[E, K, N\]"):
        cpu.grouped_skinny_matmul_cpu(a, jnp.asarray([4], jnp.int32), b)            # b not stacked
    with pytest.raises(ValueError, match="group_sizes"):
        cpu.grouped_skinny_matmul_cpu(a, jnp.asarray([2, 2], jnp.int32), b[None])   # 2 sizes, 1 group
    with pytest.raises(TypeError, match="float32"):
        cpu.grouped_skinny_matmul_cpu(a.astype(jnp.bfloat16), jnp.asarray([4], jnp.int32), b[None])


def test_layer_takes_only_what_the_kernel_can():
    a, b = _operands(3, 4, 16, 8)
    assert skinny_matmul.applies(a, b)
    assert not skinny_matmul.applies(jnp.zeros((skinny_matmul.STEP_MAX_TOKENS + 1, 16)), b)  # prefill: XLA
    assert not skinny_matmul.applies(a.astype(jnp.bfloat16), b)       # bf16 weights or activations
    assert not skinny_matmul.applies(a, jnp.zeros((2, 16, 8)))        # stacked (LoRA slots, experts)
    assert skinny_matmul.applies(a, b.T, transpose_w=True)            # a tied LM head, stored [N, K]
    assert not skinny_matmul.applies(a, b, transpose_w=True)          # K does not match


@pytest.mark.parametrize("transpose_w", [False, True], ids=["kn", "nk"])
def test_vjp_equals_xlas(transpose_w):
    a, b = _operands(4, 6, 40, 24)
    b = b.T if transpose_w else b
    loss = lambda mm: lambda x, w: jnp.sum(jnp.tanh(mm(x, w)))  # noqa: E731
    got = jax.grad(loss(lambda x, w: skinny_matmul.matmul(x, w, transpose_w)), argnums=(0, 1))(a, b)
    want = jax.grad(loss(lambda x, w: x @ (w.T if transpose_w else w)), argnums=(0, 1))(a, b)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_engine_decodes_through_the_kernel_with_xlas_tokens(make_tiny_llm):
    prompts = random_prompts([5, 17, 9], seed=7)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for impl in ("xla", "cpu"):
        # Prefill in 16-token chunks: every step fits a bucket the kernel takes (steps
        # run padded into a larger bucket where one is built: TINY_ENGINE builds no other).
        llm = make_tiny_llm(matmul_impl=impl, max_num_batched_tokens=skinny_matmul.STEP_MAX_TOKENS)
        tokens[impl] = [o.token_ids for o in llm.generate(prompts, params)]
        programs = {key[0]: exe.as_text() for key, exe in llm.runner.programs.items()}
        assert max(programs) <= skinny_matmul.STEP_MAX_TOKENS
        for text in programs.values():
            assert (cpu.SKINNY_TARGET in text) == (impl == "cpu")
    assert tokens["cpu"] == tokens["xla"]

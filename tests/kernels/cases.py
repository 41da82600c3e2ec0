"""Ragged paged-attention cases shared by the kernel tests (tests/kernels/test_*.py).

A case is a list of sequences (kv_len, q_len): q_len new tokens at the end of
kv_len tokens in the pool (q_len == kv_len: a prompt's first chunk; 1: decode;
0 with kv_len 0: a padding sequence).  Everything a sequence may not read is
NaN: block 0, blocks it does not own, the tail of its last block, and every
layer other than the one read.  With a sliding window, so is every key before
the window of the sequence's first new token, and the block-table entries of
blocks wholly before it point at the null block (as if the engine had freed
them).

`CASES` is the one table every implementation's test is driven by: each
test file runs the cases that list its impl in `impls` ("reference": the
oracle against a dense numpy implementation; "cpu", "pallas_gpu", "pallas_tpu": the
kernels against the oracle), with the kernel's static tuning from `tuning`.
Every case with a sliding window or a soft cap runs on the reference and the
CPU kernel; the interpreted Pallas kernels (slow on CPU: each distinct shape
is a compile of seconds) run a few chosen ones.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import is_quantized, paged_attention_reference, quantize_pages

F32 = np.float32
BF16 = jnp.bfloat16
INT8 = np.int8
FP8 = jnp.float8_e4m3fn
TOL = {np.dtype(np.float32): dict(atol=2e-5, rtol=1e-5),
       np.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2)}
NUM_LAYERS = 3
OPTIONS = ("sm_scale", "sliding_window", "soft_cap")
# The oracle compiled at XLA's backend optimisation level 2, over the suite's level 0
# (tests/conftest.py): at level 0 its gathers and per-token-tile map run 20-30x slower
# (3-5 s a call for the mixed cases, measured on the 2-core CPU VM) while level 2
# compiles about as fast (its results do not depend on the level).
OPTIMIZED = {"xla_backend_optimization_level": 2}
# The interpreted GPU kernels of test_gpu.py: level 0, as before.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
reference = jax.jit(paged_attention_reference, static_argnames=OPTIONS,
                    compiler_options=OPTIMIZED)
# A case's pool quantized in one compiled program, not op by op (each op eagerly is a
# compile of its own at every new pool shape).
_quantize_pages = jax.jit(quantize_pages, static_argnums=1)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pad_to(x: np.ndarray, shape: tuple[int, ...], fill=0) -> np.ndarray:
    """x at the end of each axis padded with `fill` to `shape` (numpy: no compile)."""
    return np.pad(x, [(0, n - m) for m, n in zip(x.shape, shape)], constant_values=fill)


def oracle(args, **options) -> np.ndarray:
    """The reference's output [T, H, D] (fp32) for a case's args, its fp32 products exact.

    It runs at shapes rounded up to powers of two, as the engine pads a step to a
    bucket: padding tokens after the real ones, padding sequences (kv_len 0, q_len 0),
    block-table columns of the null block 0 and pool blocks no table points at.  No
    real token's attention reads any of them, so the output rows of the real tokens
    are unchanged.  The random draws of the kernel tests then fall on a few shapes,
    and the oracle's compiles (the kernel tests' largest) are shared across cases,
    test modules and, through JAX's persistent cache, the suite's workers."""
    q, pool, layer, bt, kv_lens, cu = args
    q, pool, bt, kv_lens, cu = map(np.asarray, (q, pool, bt, kv_lens, cu))
    (T, *rest), S, W, NB = q.shape, len(kv_lens), bt.shape[1], pool.shape[0]
    q, pool = _pad_to(q, (_pow2(T), *rest)), _pad_to(pool, (_pow2(NB), *pool.shape[1:]))
    bt, kv_lens = _pad_to(bt, (_pow2(S), _pow2(W))), _pad_to(kv_lens, (_pow2(S),))
    cu = _pad_to(cu, (_pow2(S) + 1,), fill=cu[-1])
    # The oracle's fp32 products exact: a GPU's default matmul precision is one TF32 pass
    # (~1e-3 relative), which the kernel's TF32x3 dots are far more accurate than.
    with jax.default_matmul_precision("highest"):
        out = reference(*map(jnp.asarray, (q, pool)), layer, *map(jnp.asarray, (bt, kv_lens, cu)), **options)
    return np.asarray(out, np.float32)[:T]


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def make_ragged_case(seed: int, seqs: list[tuple[int, int]], *, G: int, KVH: int, D: int, BS: int,
                     dtype=np.float32, layer: int = 1, nan: bool = True, pad_tokens: int = 3,
                     pad_seqs: int = 1, width: int | None = None, num_blocks: int | None = None,
                     sliding_window: int | None = None, kv_dtype=None):
    """(q, kv_pool, layer, block_tables, kv_lens, cu_q_lens) for sequences (kv_len, q_len).

    `pad_tokens` padding tokens follow the real ones in q; `pad_seqs` padding
    sequences (kv_len 0, q_len 0) follow the real ones.  Block tables are
    padded with 0 to `width` (default: one more than the longest needs).
    With `sliding_window`, each sequence's keys before the window of its
    first new token are poisoned (with `nan`) and its blocks wholly before
    that window are replaced by the null block 0 in the table.

    `kv_dtype` (default `dtype`) is the pool's; a quantized one (int8,
    float8_e4m3fn) holds `quantize_pages` of the random K/V (pages [BS + 1, D],
    the last row the codes).  int8 has no NaN: its poisoned rows hold random
    bytes with scale code 127 (values up to ~6e11 once dequantized, where a
    valid row's scale is at most 2**16); fp8's poisoned rows and codes are NaN.
    """
    rng = np.random.default_rng(seed)
    kv_lens = np.array([kv for kv, _ in seqs] + [0] * pad_seqs, np.int32)
    q_lens = np.array([ql for _, ql in seqs] + [0] * pad_seqs, np.int32)
    assert (q_lens <= kv_lens).all()
    S = len(kv_lens)
    n_blk = -(-kv_lens // BS)
    W = width or max(1, int(n_blk.max())) + 1
    NB = num_blocks or 1 + int(n_blk.sum()) + 3           # + null block + spares
    assert W >= n_blk.max() and NB >= 1 + n_blk.sum()
    pool = rng.standard_normal((NB, NUM_LAYERS, 2, KVH, BS, D)).astype(np.float32)
    poison = np.ones(pool.shape, bool)
    bt = np.zeros((S, W), np.int32)
    phys = rng.permutation(np.arange(1, NB))
    k = 0
    for s in range(S):
        ids = phys[k:k + n_blk[s]]
        k += n_blk[s]
        lo = 0 if sliding_window is None else max(0, kv_lens[s] - q_lens[s] - sliding_window + 1)
        for j, blk in enumerate(ids):
            if (j + 1) * BS <= lo:
                continue                                    # freed: the table points at block 0
            bt[s, j] = blk
            poison[blk, layer, :, :, max(0, lo - j * BS):min(BS, kv_lens[s] - j * BS)] = False
    kv_dtype = np.dtype(dtype if kv_dtype is None else kv_dtype)
    if is_quantized(kv_dtype):
        pool = np.array(_quantize_pages(jnp.asarray(pool), kv_dtype))
        if nan:
            rows = poison[..., 0]                              # [NB, L, 2, KVH, BS]
            values, codes = pool[..., :BS, :], pool[..., BS, :BS]   # views of the pool
            if kv_dtype == np.int8:
                values[rows] = rng.integers(-128, 128, (int(rows.sum()), D)).astype(np.int8)
                codes[rows] = 127
            else:
                values[rows] = np.nan
                codes[rows] = np.nan
    elif nan:
        pool[poison] = np.nan
    T = int(q_lens.sum()) + pad_tokens
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((T, G * KVH, D)).astype(np.float32)
    # Cast by numpy (ml_dtypes), not on the device: no compile per new shape.
    return (jnp.asarray(q.astype(dtype)), jnp.asarray(pool.astype(kv_dtype)), layer, jnp.asarray(bt),
            jnp.asarray(kv_lens), jnp.asarray(cu))


def attention_per_layer(impl: str, q, pool, block_tables, kv_lens, cu_q_lens, *, sm_scale=0.3,
                        sliding_window=None, soft_cap=None, **jit_kwargs):
    """[NUM_LAYERS, T, H, D]: paged_attention of every layer through the public entry
    point, the layer index traced inside lax.scan under jit (as a scanned model does)."""
    import pallas_kernels

    def body(carry, layer):
        return carry, pallas_kernels.paged_attention(
            q, pool, layer, block_tables, kv_lens, cu_q_lens, impl=impl, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap)
    return jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(NUM_LAYERS))[1], **jit_kwargs)()


def check_ragged(out, args, seed: int, what: str, *, fp32_tol: float = 1.0, **options) -> None:
    """out matches the reference (called with `options`); padding tokens are exactly zero.
    `fp32_tol` scales the tolerance of fp32 queries."""
    q, cu = args[0], np.asarray(args[5])
    assert out.shape == q.shape and out.dtype == q.dtype, f"{what}: {out.shape} {out.dtype}"
    ref = oracle(args, **options)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), f"{what}: non-finite output (seed={seed})"
    t = TOL[np.dtype(q.dtype)]
    if q.dtype == np.float32:
        t = {k: v * fp32_tol for k, v in t.items()}
    np.testing.assert_allclose(out, ref, **t, err_msg=f"{what} seed={seed}")
    assert (out[cu[-1]:] == 0).all(), f"{what}: padding tokens not zero (seed={seed})"


def lens_profile(rng, n: int, BS: int, max_len: int) -> list[int]:
    """Lengths mixing 1, exact block boundaries, boundary + 1, the maximum and random."""
    special = [1, BS, BS + 1, 2 * BS, max_len, max_len - 1, (max_len // BS) * BS]
    out = [special[i] if i < len(special) else int(rng.integers(1, max_len + 1)) for i in range(n)]
    rng.shuffle(out)
    return [max(1, min(max_len, x)) for x in out]


def mixed_seqs(rng, n: int, BS: int, max_len: int, max_q: int) -> list[tuple[int, int]]:
    """n sequences: decodes, whole prompts and prefill chunks over a cached prefix."""
    seqs = []
    for i, kv in enumerate(lens_profile(rng, n, BS, max_len)):
        kind = i % 3
        q = 1 if kind == 0 else min(kv, max_q) if kind == 1 else int(rng.integers(1, min(kv, max_q) + 1))
        seqs.append((kv, q))
    return seqs


# --------------------------------------------------------------------------
# The case table.

SeqSpec = Sequence[tuple[int, int]] | Callable[[np.random.Generator, int], list[tuple[int, int]]]


def decode(n: int, max_len: int, *, longest: bool = False) -> Callable:
    """n decode tokens over `lens_profile` contexts (`longest`: the first one max_len)."""
    def draw(rng, BS):
        lens = lens_profile(rng, n, BS, max_len)
        if longest:
            lens[0] = max_len
        return [(kv, 1) for kv in lens]
    draw.__name__ = f"decode{n}x{max_len}"
    return draw


def mixed(n: int, max_len: int, max_q: int, *, extra: Sequence[tuple[int, int]] = ()) -> Callable:
    """`mixed_seqs`: decodes, whole prompts and chunks (then `extra`)."""
    def draw(rng, BS):
        return mixed_seqs(rng, n, BS, max_len, max_q) + list(extra)
    draw.__name__ = f"mixed{n}x{max_len}"
    return draw


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    seqs: SeqSpec            # (kv_len, q_len) pairs, or drawn from the seed: f(rng, BS)
    G: int
    KVH: int
    D: int
    BS: int
    dtype: object = F32
    kv_dtype: object = None   # the pool's dtype when it differs from q's (int8, fp8: quantized)
    sliding_window: int | None = None
    soft_cap: float | None = None
    sm_scale: float | None = None
    layer: int = 1
    pad_tokens: int = 3
    pad_seqs: int = 1
    impls: tuple[str, ...] = ("cpu",)   # the tests that run it: names of pallas_kernels.IMPLS
    tuning: dict = dataclasses.field(default_factory=dict)   # impl -> static kernel kwargs
    fp32_tol: float = 1.0     # x the fp32 tolerance (large soft-capped logits: fp32 rounding)

    @property
    def options(self) -> dict:
        """The contract's static options, for the kernel and the reference alike."""
        return dict(sm_scale=self.sm_scale, sliding_window=self.sliding_window,
                    soft_cap=self.soft_cap)

    def draw(self, seed: int) -> list[tuple[int, int]]:
        if callable(self.seqs):
            return self.seqs(np.random.default_rng(seed), self.BS)
        return list(self.seqs)

    def make(self, seed: int, **kw):
        """(seqs, args) of one random draw: args as `make_ragged_case` returns them."""
        seqs = self.draw(seed)
        return seqs, make_ragged_case(seed, seqs, G=self.G, KVH=self.KVH, D=self.D, BS=self.BS,
                                      dtype=self.dtype, kv_dtype=self.kv_dtype, layer=self.layer,
                                      pad_tokens=self.pad_tokens, pad_seqs=self.pad_seqs,
                                      sliding_window=self.sliding_window, **kw)

    def check(self, out, args, seed: int, seqs, impl: str) -> None:
        check_ragged(out, args, seed, f"{impl} {self.id} seqs={seqs}", fp32_tol=self.fp32_tol,
                     **self.options)


GPU, TPU = ("pallas_gpu",), ("pallas_tpu",)
REF_CPU = ("reference", "cpu")       # every window / soft-cap case at least
# Scores of +-60..90 under a cap of 50: the cap decides the softmax.  The scale is a power
# of two, so the scaled q the GPU / TPU kernels round to bf16 loses nothing (a rounded
# scale would move such scores by ~0.1: bf16's conditioning, not a kernel error); fp32
# rounding of scores this large takes a 3x wider tolerance.
BIG_LOGITS = dict(soft_cap=50.0, sm_scale=8.0, fp32_tol=3.0)

CASES = [
    # --- plain causal attention (no window, no cap) ---
    # decode-only batches: contexts up to ~1100 with exact block boundaries, +1 and 1
    Case("decode-smollm", decode(33, 700), G=3, KVH=3, D=64, BS=16),      # SmolLM2-135M
    Case("decode-bf16-bs8", decode(9, 300), G=1, KVH=2, D=128, BS=8, dtype=BF16),
    Case("decode-bs1", decode(6, 50), G=4, KVH=2, D=64, BS=1),
    Case("decode-g8-bf16", decode(12, 1100), G=8, KVH=1, D=128, BS=32, dtype=BF16),
    Case("decode-long-1seq", [(1037, 1)], G=1, KVH=2, D=64, BS=8, pad_tokens=2, pad_seqs=2,
         impls=GPU),                                                     # split-KV P = 4
    Case("decode-partitions", decode(5, 300), G=3, KVH=2, D=128, BS=16, dtype=BF16,
         pad_tokens=2, pad_seqs=2, impls=GPU, tuning=dict(pallas_gpu=dict(num_partitions=3))),
    Case("decode-batch33", decode(33, 256), G=4, KVH=2, D=64, BS=32, pad_tokens=2, pad_seqs=2,
         impls=GPU, tuning=dict(pallas_gpu=dict(block_k=64))),
    Case("decode-bigpages", decode(2, 1100), G=8, KVH=2, D=128, BS=128, dtype=BF16,
         pad_tokens=2, pad_seqs=2, impls=GPU),                           # slices of 128-key pages
    Case("decode-tiny-tiles", decode(9, 64), G=4, KVH=2, D=128, BS=8, dtype=BF16, pad_tokens=2,
         pad_seqs=2, impls=GPU, tuning=dict(pallas_gpu=dict(block_k=8))),       # [16, 8]: no-dot path
    Case("decode-mid-page-partitions", decode(3, 600), G=4, KVH=2, D=128, BS=128, pad_tokens=2,
         pad_seqs=2, impls=GPU, tuning=dict(pallas_gpu=dict(num_partitions=3, block_k=16))),
    Case("decode-long-steps", decode(3, 1040, longest=True), G=4, KVH=1, D=128, BS=32,
         dtype=BF16, pad_tokens=2, pad_seqs=2, impls=TPU,
         tuning=dict(pallas_tpu=dict(pages_per_compute_block=8))),              # many K/V steps
    Case("decode-g3", decode(6, 100, longest=True), G=3, KVH=2, D=64, BS=8, pad_tokens=2,
         pad_seqs=2, impls=TPU, tuning=dict(pallas_tpu=dict(pages_per_compute_block=3))),
    # whole prompts: several token tiles and key chunks, boundaries +-1
    Case("prompts", [(n, n) for n in (1, 17, 48, 49, 130, 33)], G=3, KVH=3, D=64, BS=16,
         pad_tokens=5, pad_seqs=2),
    Case("prompts-g8-bf16", [(n, n) for n in (1, 17, 48, 49, 130, 17)], G=8, KVH=1, D=64, BS=8,
         dtype=BF16, pad_tokens=5, pad_seqs=2),
    # chunked prefill over a cached prefix
    Case("chunks", [(500, 37), (64, 48), (97, 1), (250, 200), (33, 2)], G=1, KVH=2, D=128,
         BS=32, pad_tokens=5, pad_seqs=2),
    # mixed batches
    Case("mixed", mixed(10, 400, 120), G=3, KVH=3, D=64, BS=16, pad_tokens=5, pad_seqs=2),
    Case("mixed-bf16", mixed(10, 400, 120), G=4, KVH=2, D=128, BS=16, dtype=BF16, pad_tokens=5,
         pad_seqs=2),
    Case("mixed-bs1", mixed(10, 400, 120), G=1, KVH=4, D=64, BS=1, pad_tokens=5, pad_seqs=2),
    Case("mixed-small-d", mixed(4, 2 * 8 + 5, 6, extra=[(8, 8)]), G=1, KVH=2, D=16, BS=8,
         layer=2, impls=("reference",)),
    Case("mixed-g3-bs4", mixed(4, 2 * 4 + 5, 6, extra=[(4, 4)]), G=3, KVH=1, D=16, BS=4, layer=2,
         impls=("reference",)),
    # head_dim 20 (not a multiple of 8: the CPU kernel's scalar Q^T and staged V rows)
    Case("odd-d", [(40, 40), (33, 1), (70, 9), (5, 5)], G=3, KVH=2, D=20, BS=8, sm_scale=0.3),
    # decodes, speculative q_lens (short: split-KV), whole prompts, chunked prefill,
    # a q_len-0 sequence with cached K/V
    Case("mixed-spec", [(1, 1), (24, 24), (70, 24), (100, 3), (40, 0), (50, 7), (17, 2),
                        (300, 1)], G=4, KVH=2, D=64, BS=16, impls=GPU,
         tuning=dict(pallas_gpu=dict(num_partitions=3))),
    Case("mixed-g3-bf16", [(20, 20), (57, 13), (9, 1), (300, 1)], G=3, KVH=2, D=128, BS=8,
         dtype=BF16, impls=GPU),
    Case("mixed-g1", [(40, 40), (1030, 40), (64, 1), (96, 10)], G=1, KVH=2, D=64, BS=32,
         impls=GPU),                                                     # G=1: q_len 10 is short
    Case("mixed-bigpages", [(9, 9), (256, 9), (129, 1)], G=8, KVH=2, D=128, BS=128, dtype=BF16,
         impls=GPU),
    # several 16-row tiles per sequence; short sequences of up to 32 rows span two
    # tiles (only the first merges)
    Case("mixed-small-tiles", [(30, 30), (45, 5), (3, 1), (90, 17), (60, 9)], G=3, KVH=2, D=64,
         BS=16, impls=GPU, tuning=dict(pallas_gpu=dict(block_m=16, block_k=16, decode_rows=32))),
    Case("mixed-no-split", [(64, 64), (33, 1), (200, 40), (70, 1)], G=4, KVH=2, D=128, BS=32,
         dtype=BF16, impls=GPU, tuning=dict(pallas_gpu=dict(decode_rows=0))),
    Case("ragged-3-tiles", mixed(7, 90, 40), G=4, KVH=2, D=64, BS=16, impls=TPU,
         tuning=dict(pallas_tpu=dict(block_q=16, pages_per_compute_block=2))),
    Case("ragged-g8-bf16", mixed(5, 300, 24), G=8, KVH=1, D=128, BS=32, dtype=BF16, impls=TPU),
    Case("ragged-one-path", mixed(5, 70, 20), G=1, KVH=2, D=128, BS=16, dtype=BF16, impls=TPU,
         tuning=dict(pallas_tpu=dict(block_q=8, pages_per_compute_block=1))),   # block_q == small

    # --- quantized pools (int8, fp8 e4m3: a power-of-two scale column per row) ---
    Case("decode-smollm-int8", decode(17, 700), G=3, KVH=3, D=64, BS=16, kv_dtype=INT8,
         impls=REF_CPU),
    Case("mixed-int8", mixed(10, 400, 120), G=3, KVH=3, D=64, BS=16, kv_dtype=INT8, pad_tokens=5,
         pad_seqs=2, impls=REF_CPU),
    Case("mixed-fp8-bf16", mixed(8, 300, 100), G=4, KVH=2, D=128, BS=16, dtype=BF16, kv_dtype=FP8,
         pad_tokens=5, pad_seqs=2, impls=REF_CPU),
    Case("odd-d-fp8", [(40, 40), (33, 1), (70, 9), (5, 5)], G=3, KVH=2, D=20, BS=8, kv_dtype=FP8,
         sm_scale=0.3, impls=REF_CPU),
    Case("window5-cap-int8", [(300, 1), (150, 40), (37, 37), (9, 1), (64, 20), (5, 5)], G=2,
         KVH=2, D=64, BS=16, kv_dtype=INT8, sliding_window=5, **BIG_LOGITS,
         impls=REF_CPU + GPU + TPU,
         tuning=dict(pallas_gpu=dict(block_m=16, block_k=16, decode_rows=32),
                     pallas_tpu=dict(block_q=16, pages_per_compute_block=2))),
    Case("decode-int8-split", decode(5, 300), G=4, KVH=2, D=64, BS=16, kv_dtype=INT8,
         pad_tokens=2, pad_seqs=2, impls=GPU + TPU, tuning=dict(pallas_gpu=dict(num_partitions=3))),
    Case("mixed-fp8-bf16-gpu", [(20, 20), (57, 13), (9, 1), (300, 1)], G=3, KVH=2, D=128, BS=8,
         dtype=BF16, kv_dtype=FP8, impls=GPU + TPU),
    Case("mixed-int8-bigpages", [(9, 9), (256, 9), (129, 1)], G=8, KVH=2, D=128, BS=128,
         dtype=BF16, kv_dtype=INT8, impls=GPU),

    # --- Gemma's options: sliding window and logit soft cap ---
    # window 5 < block 16: a decode and a 40-token chunk far past several windows,
    # a whole prompt, short sequences inside one window; multi-tile chunks
    Case("window5-cap", [(300, 1), (150, 40), (37, 37), (9, 1), (64, 20), (5, 5)], G=2, KVH=2,
         D=64, BS=16, sliding_window=5, **BIG_LOGITS, impls=REF_CPU + GPU + TPU,
         tuning=dict(pallas_gpu=dict(block_m=16, block_k=16, decode_rows=32),
                     pallas_tpu=dict(block_q=16, pages_per_compute_block=2))),
    # window 40 > block 16 (not a multiple), bf16, default tilings
    Case("window40-cap-bf16", mixed(6, 300, 48), G=4, KVH=1, D=128, BS=16, dtype=BF16,
         sliding_window=40, **BIG_LOGITS, impls=REF_CPU + GPU + TPU),
    # window larger than every sequence: the global result (TPU: test_traced_layer_in_scan)
    Case("window-past-kv", mixed(6, 100, 30), G=3, KVH=2, D=64, BS=8, sliding_window=4096,
         impls=REF_CPU + GPU),
    # soft cap without a window (Gemma 2's global layers)
    Case("cap-only", mixed(6, 200, 40), G=2, KVH=2, D=64, BS=16, **BIG_LOGITS,
         impls=REF_CPU + GPU),
    # window == block size, GQA 4, decode-only: split-KV partitions over the window,
    # key tiles of half a page
    Case("window16-decode", decode(9, 600, longest=True), G=4, KVH=2, D=128, BS=16,
         dtype=BF16, sliding_window=16, pad_tokens=2, pad_seqs=2, impls=REF_CPU + GPU,
         tuning=dict(pallas_gpu=dict(num_partitions=3, block_k=8))),
    # window 1: every token sees only itself
    Case("window1", [(30, 30), (17, 1), (8, 3), (70, 6)], G=2, KVH=1, D=64, BS=8,
         sliding_window=1, impls=REF_CPU),
    # window 50 > block 32, bf16, a small cap
    Case("window50-cap20-bf16", [(64, 64), (33, 1), (200, 40), (70, 1)], G=4, KVH=2, D=128,
         BS=32, dtype=BF16, sliding_window=50, soft_cap=20.0, sm_scale=0.5, impls=REF_CPU),
    # window == block 8, GQA 3: chunks over long prefixes and long prompts (many
    # token tiles, each starting later)
    Case("window8-chunks-prompts", [(500, 37), (64, 48), (97, 1), (250, 200), (33, 2),
                                    (130, 130), (300, 300)], G=3, KVH=2, D=64, BS=8,
         sliding_window=8, pad_tokens=5, pad_seqs=2, impls=REF_CPU),
    Case("window7-bs1", mixed(8, 200, 50), G=1, KVH=4, D=64, BS=1, sliding_window=7,
         **BIG_LOGITS, impls=REF_CPU),
    Case("window-odd-d", [(40, 40), (33, 1), (70, 9), (5, 5)], G=3, KVH=2, D=20, BS=8,
         sliding_window=11, soft_cap=10.0, sm_scale=2.0, impls=REF_CPU),
]

assert len({c.id for c in CASES}) == len(CASES)


assert all(c.impls[:2] == REF_CPU for c in CASES if c.sliding_window or c.soft_cap)


def cases_for(impl: str) -> list[Case]:
    """The cases the tests of `impl` run: those listing it."""
    return [c for c in CASES if impl in c.impls]

"""A quantised GGUF's weight matrices kept in their own blocks, for the CPU decode kernels.

A Q4_0, Q4_1 or Q8_0 GGUF stores each matrix as blocks of 32 weights with a
scale (and, Q4_1, an offset): 5 to 8.5 bits a weight.  The loader dequantises
them into the engine's float32 params, which prefill steps multiply with XLA's
dot.  A decode step reads every weight once for a few tokens, so its time is the
time to read the weights; this module keeps the blocks as well, laid out for
the C++ skinny matmul (`pallas_kernels.cpu.register_block_weights`), which then
reads a registered weight's blocks instead of its float32 copy
(jpaged.runtime.weight_blocks).  Nothing changes numerically: each weight
dequantises to the float32 value the loader computed.

Host numpy only.
"""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType
from typing import Callable, Iterable

import numpy as np

from jpaged.core.model_config import ModelConfig
from jpaged.formats.gguf import read_gguf, tensor_target

BLOCK = 32  # weights per block, in every type read here
# ggml's type ids (gguf.GGMLQuantizationType): Q4_0, Q4_1, Q8_0.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_TYPES = (Q4_0, Q4_1, Q8_0)
# The matrices a step multiplies by (as [K, N] params: GGUF's [N, K] transposed), and
# the tied LM head (the embedding, multiplied as stored).  Experts are left out.
MATRICES = ("layers.wq", "layers.wk", "layers.wv", "layers.wo", "layers.w_gate", "layers.w_up",
            "layers.w_down", "lm_head")


@dataclasses.dataclass(frozen=True)
class BlockMatrix:
    """One matrix [n, k] (GGUF's layout: n rows of k) in blocks of 32 along k."""

    kind: str                   # "q4" (Q4_0 and Q4_1) or "q8" (Q8_0)
    codes: np.ndarray           # q4: uint8 [n, k / 2], byte t of a block holds its weights t
                                # (low nibble) and t + 16 (high); q8: int8 [n, k]
    scales: np.ndarray          # float32 [n, k / 32]
    offsets: np.ndarray | None  # q4: float32 [n, k / 32] (Q4_0's: -8 * scale); q8: None

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.scales, self.offsets) if a is not None)

    def dequantize(self) -> np.ndarray:
        """The float32 [n, k] matrix, as gguf.quants dequantises it."""
        n, k = self.shape
        if self.kind == "q8":
            q = self.codes.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
            return (q * self.scales[..., None]).reshape(n, k)
        packed = self.codes.reshape(n, k // BLOCK, BLOCK // 2)
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float32)
        return (q * self.scales[..., None] + self.offsets[..., None]).reshape(n, k)

    def rows(self, order: np.ndarray) -> "BlockMatrix":
        """The matrix with its rows reordered: row i is row order[i]."""
        return BlockMatrix(self.kind, self.codes[order], self.scales[order],
                           None if self.offsets is None else self.offsets[order])


def block_matrix(tensor_type: int, data: np.ndarray) -> BlockMatrix:
    """A GGUF tensor's raw bytes (uint8 [n, bytes per row]) of type Q4_0, Q4_1 or Q8_0."""
    n = data.shape[0]
    if tensor_type == Q8_0:  # a block: f16 scale, 32 x int8
        b = data.reshape(n, -1, 34)
        return BlockMatrix("q8", np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, -1),
                           _f16(b[..., 0:2]), None)
    if tensor_type == Q4_1:  # a block: f16 scale, f16 offset, 16 bytes of nibbles
        b = data.reshape(n, -1, 20)
        return BlockMatrix("q4", np.ascontiguousarray(b[..., 4:]).reshape(n, -1), _f16(b[..., 0:2]),
                           _f16(b[..., 2:4]))
    if tensor_type == Q4_0:  # a block: f16 scale, 16 bytes of nibbles holding q + 8
        b = data.reshape(n, -1, 18)
        scales = _f16(b[..., 0:2])
        # d * (q - 8) is exact in float32, and so is fma(d, q, -8 d): the same weight.
        return BlockMatrix("q4", np.ascontiguousarray(b[..., 2:]).reshape(n, -1), scales, -8.0 * scales)
    raise ValueError(f"GGUF tensor type {tensor_type} is not a block type ({BLOCK_TYPES})")


def _f16(pairs: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian float16 bytes -> float32 [...]."""
    return np.ascontiguousarray(pairs).view("<f2")[..., 0].astype(np.float32)


def read_block_matrices(path: str | os.PathLike, cfg: ModelConfig,
                        family_of: Callable[[str, Iterable[str]], ModuleType]
                        ) -> dict[tuple[str, int | None], BlockMatrix]:
    """The GGUF's Q4_0 / Q4_1 / Q8_0 matrices that a step multiplies by, keyed by
    (our name, layer or None), with rows in the params' order (llama.cpp's Q/K row
    permutation undone, as the loader does).  The embedding counts only when the LM
    head is tied to it.  Other tensor types, and tensors a family transforms beyond
    reordering rows, are left out: their matmuls read the float32 params.
    `family_of(architecture, tensor names)`: the model family (jpaged.models.gguf_family)."""
    meta, tensors = read_gguf(path)
    arch = str(meta.get("general.architecture"))
    family = family_of(arch, tensors)
    out: dict[tuple[str, int | None], BlockMatrix] = {}
    for name, tensor in tensors.items():
        if tensor.tensor_type not in BLOCK_TYPES or tensor.data.ndim != 2:
            continue
        ours, layer, transpose = tensor_target(name, family.GGUF_LAYER_NAMES, family.GGUF_GLOBAL_NAMES)
        tied_head = ours == "embed" and cfg.tie_word_embeddings
        if not ((ours in MATRICES and transpose) or tied_head):
            continue
        blocks = block_matrix(tensor.tensor_type, tensor.data)
        order = _row_order(family, ours, blocks.shape[0], cfg, arch)
        if order is None:
            continue
        out[(ours, layer)] = blocks if np.array_equal(order, np.arange(len(order))) else blocks.rows(order)
    return out


def _row_order(family: ModuleType, ours: str, n: int, cfg: ModelConfig, arch: str) -> np.ndarray | None:
    """How the family's from_gguf_tensor reorders the rows of a [n, k] tensor, found by
    applying it to the row numbers; None when it does more than reorder them."""
    order = family.from_gguf_tensor(ours, np.arange(n, dtype=np.float64)[:, None], cfg, arch)
    order = np.asarray(order).reshape(-1)
    if order.shape != (n,) or not np.array_equal(np.sort(order), np.arange(n)):
        return None
    return order.astype(np.int64)

"""Turns a scheduled batch into padded device arrays and runs the jitted step.

Shapes are padded to powers of two (rows, new tokens per row, block-table
width), so the number of compilations stays small and is counted.  The KV pool
is donated to every step: XLA writes the new K/V into the same buffer.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.decode import generate_step
from jpaged.kv_cache import create_kv_pool
from jpaged.model import ModelConfig
from jpaged.sampling import SamplingArrays
from jpaged.sequence import Sequence


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


@dataclasses.dataclass
class Row:
    """One row of a step: `num_new` tokens of `seq` starting at its computed count.
    num_new == 0 makes it a padding row (static batching keeps finished members)."""

    seq: Sequence
    num_new: int


class ModelRunner:
    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, model_cfg: ModelConfig, *,
                 num_blocks: int, block_size: int, kv_dtype: jnp.dtype, attention_impl: str,
                 max_model_len: int):
        self.params = params
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.kv_pool = create_kv_pool(model_cfg, num_blocks, block_size, kv_dtype)
        step = functools.partial(generate_step, graphdef, attention_impl=attention_impl)
        self._step = jax.jit(step, donate_argnums=(1,))
        self.compiled_shapes: set[tuple] = set()
        self.last_build_seconds = 0.0  # host time spent padding the last step's arrays

    @property
    def num_compilations(self) -> int:
        return len(self.compiled_shapes)

    def table_width(self, num_blocks: int) -> int:
        """Padded block-table width W for rows holding up to num_blocks blocks."""
        return min(bucket(num_blocks, 4), bucket(self.max_blocks_per_seq))

    def precompile(self, shapes: list[tuple[int, int, int]]) -> int:
        """Compiles the greedy step for each (B, Q, W) not compiled yet; returns how many.

        Each shape runs once on padding rows (q_lens 0): they read nothing and
        write only into the null block, so the pool's contents are unchanged.
        """
        new = 0
        for B, Q, W in shapes:
            key = (B, Q, W, jax.tree.structure(None))
            if key in self.compiled_shapes:
                continue
            zeros = functools.partial(np.zeros, dtype=np.int32)
            _, self.kv_pool = self._step(self.params, self.kv_pool, zeros((B, Q)), zeros((B, W)),
                                         zeros(B), zeros(B), None)
            self.compiled_shapes.add(key)
            new += 1
        jax.block_until_ready(self.kv_pool)
        return new

    def run(self, rows: list[Row], prefill: bool) -> np.ndarray:
        """One forward + sample over `rows`; returns the sampled token of each row."""
        t0 = time.perf_counter()
        B = bucket(len(rows))
        Q = bucket(max(r.num_new for r in rows), 8) if prefill else 1
        W = self.table_width(max(len(r.seq.block_table.block_ids) for r in rows))
        tokens = np.zeros((B, Q), np.int32)
        block_tables = np.zeros((B, W), np.int32)
        context_lens = np.zeros(B, np.int32)
        q_lens = np.zeros(B, np.int32)
        for i, row in enumerate(rows):
            seq = row.seq
            start = seq.num_computed_tokens
            ids = seq.block_table.block_ids
            block_tables[i, :len(ids)] = ids
            if row.num_new:
                tokens[i, :row.num_new] = seq.token_slice(start, start + row.num_new)
                context_lens[i], q_lens[i] = start, row.num_new
        sampling = self._sampling_arrays(rows, B)
        self.last_build_seconds = time.perf_counter() - t0
        self.compiled_shapes.add((B, Q, W, jax.tree.structure(sampling)))
        next_tokens, self.kv_pool = self._step(self.params, self.kv_pool, tokens, block_tables,
                                               context_lens, q_lens, sampling)
        return np.asarray(next_tokens)[:len(rows)]

    @staticmethod
    def _sampling_arrays(rows: list[Row], B: int) -> SamplingArrays | None:
        """None when every row is greedy: that step skips sampling entirely."""
        params = [r.seq.params for r in rows]
        if all(p.temperature == 0 for p in params):
            return None

        def column(values, dtype):
            out = np.zeros(B, dtype)
            out[:len(values)] = values
            return out
        filtered = any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params)
        return SamplingArrays(
            temperature=column([p.temperature for p in params], np.float32),
            seed=column([r.seq.seed & 0xFFFFFFFF for r in rows], np.uint32),
            step=column([len(r.seq.output_token_ids) for r in rows], np.int32),
            top_k=column([p.top_k for p in params], np.int32) if filtered else None,
            top_p=column([p.top_p for p in params], np.float32) if filtered else None)

"""A Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM2) in Flax NNX.

A step is one flat ragged batch of tokens [T]: the new tokens of several
sequences (prefill chunks and decode tokens alike) back to back.  Every matmul
runs over all T tokens at once; attention is the only place where sequences
matter, and it reads them through `StepMetadata` (per-token positions and K/V
slots, per-sequence block tables, lengths and query offsets).  The LM head runs
only on each sequence's last token.

The layer loop is unrolled at trace time over per-layer weight arrays by
default.  `scan_layers=True` runs a `lax.scan` over stacked weights instead:
it traces one layer, but XLA:CPU then copies each layer's slice of the stacked
weights before its matmuls, and on the CPU that costs more per step than it
saves in compile time (measured for SmolLM2: 1.5-2x slower decode steps, about
the same compile time; see benchmarks/README.md, "Layer loop").  The KV pool
is threaded through the layers: each writes its new K/V into the pool and
attention reads them back through the block tables; with the pool donated, XLA
updates it in place and never copies it (pool layout: see `jpaged.kv_pool`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.model_config import ModelConfig, rope_inv_freq, weight_shapes
from pallas_kernels import Backend, get_backend


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """Where each of a step's T flat tokens goes, and its S sequences: built on the host.

    positions[T]       position of each token in its sequence (RoPE)
    write_blocks[T]    pool block its K/V go to (the null block 0 for padding)
    write_offsets[T]   row within that block
    block_tables[S, W] physical block of each logical block, padded with 0
    kv_lens[S]         tokens in the cache after this step (cached + new)
    cu_q_lens[S + 1]   sequence s owns tokens cu_q_lens[s] .. cu_q_lens[s + 1] - 1
    logits_indices[S]  each sequence's last token this step: the row it samples from
    """

    positions: jax.Array
    write_blocks: jax.Array
    write_offsets: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    logits_indices: jax.Array


def rope_angles(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [T, 1, head_dim/2] of positions[T]: computed once per step."""
    angles = positions[:, None].astype(jnp.float32) * inv_freq
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x[T, heads, head_dim] (HF rotate_half layout)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


class Llama(nnx.Module):
    """Decoder-only Llama-family transformer over one flat ragged batch of tokens.

    `scan_layers=False` keeps one set of weight arrays per layer and unrolls the
    layer loop at trace time; `True` stacks them ([num_layers, ...]) and runs a
    `lax.scan` over layers (one layer traced; see the module docstring for its cost).
    """

    def __init__(self, cfg: ModelConfig, arrays: dict[str, Any], dtype: Any = jnp.float32,
                 scan_layers: bool = False):
        self.cfg = cfg
        self.scan_layers = scan_layers
        expected = weight_shapes(cfg)
        missing = sorted(set(expected) - set(arrays))
        if missing:
            raise ValueError(f"weights missing: {missing}")
        for name, shape in expected.items():
            if tuple(arrays[name].shape) != shape:
                raise ValueError(f"weight {name} has shape {tuple(arrays[name].shape)}, expected {shape}")
        as_param = lambda name: nnx.Param(jnp.asarray(arrays[name], dtype=dtype))  # noqa: E731
        self.embed = as_param("embed")
        self.final_norm = as_param("final_norm")
        self.lm_head = None if cfg.tie_word_embeddings else as_param("lm_head")
        layer_names = [n for n in expected if n.startswith("layers.")]
        if scan_layers:
            self.layers = nnx.Dict({n.split(".", 1)[1]: as_param(n) for n in layer_names})
        else:
            self.layers = nnx.List([
                nnx.Dict({n.split(".", 1)[1]: nnx.Param(jnp.asarray(arrays[n][i], dtype=dtype))
                          for n in layer_names})
                for i in range(cfg.num_layers)])
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg)))

    def _layer(self, h: jax.Array, w: dict[str, jax.Array], layer: jax.Array | int,
               kv_pool: jax.Array, meta: StepMetadata, rope: tuple[jax.Array, jax.Array],
               backend: Backend) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        T = h.shape[0]
        x = rms_norm(h, w["attn_norm"], cfg.rms_norm_eps)
        q, k, v = x @ w["wq"], x @ w["wk"], x @ w["wv"]
        if cfg.attention_bias:
            q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
        q = apply_rope(q.reshape(T, cfg.num_heads, cfg.head_dim), *rope)
        k = apply_rope(k.reshape(T, cfg.num_kv_heads, cfg.head_dim), *rope)
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        kv_pool = backend.write_kv(kv_pool, layer, k, v, meta.write_blocks, meta.write_offsets)
        attn = backend.attention(q, kv_pool, layer, meta.block_tables, meta.kv_lens,
                                 meta.cu_q_lens, sm_scale=None)
        h = h + attn.reshape(T, -1).astype(h.dtype) @ w["wo"]
        x = rms_norm(h, w["mlp_norm"], cfg.rms_norm_eps)
        h = h + (jax.nn.silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"]
        return h, kv_pool

    def __call__(self, tokens: jax.Array, meta: StepMetadata, kv_pool: jax.Array,
                 *, attention_impl: str = "reference", logits: str = "last"
                 ) -> tuple[jax.Array, jax.Array]:
        """Runs the decoder on tokens[T] and returns (logits, new kv_pool).

        `logits="last"` returns [S, vocab], one row per sequence from its token
        at meta.logits_indices (the only ones a step samples from: the LM head
        never runs on the other tokens); `"all"` returns [T, vocab].
        """
        backend = get_backend(attention_impl)
        h = self.embed[...][tokens]
        rope = rope_angles(meta.positions, self.inv_freq[...])
        if self.scan_layers:
            def body(carry, xs):
                (h, pool), (w, layer) = carry, xs
                return self._layer(h, w, layer, pool, meta, rope, backend), None

            stacked = {name: p[...] for name, p in self.layers.items()}
            (h, kv_pool), _ = jax.lax.scan(body, (h, kv_pool),
                                           (stacked, jnp.arange(self.cfg.num_layers)))
        else:
            for layer, weights in enumerate(self.layers):
                w = {name: p[...] for name, p in weights.items()}
                h, kv_pool = self._layer(h, w, layer, kv_pool, meta, rope, backend)
        if logits == "last":
            h = h[meta.logits_indices]
        h = rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps)
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return (h @ head).astype(jnp.float32), kv_pool


def split_model(model: Llama) -> tuple[nnx.GraphDef, nnx.State]:
    """Splits once at load time; the step functions take (graphdef, state)."""
    return nnx.split(model)


def forward(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array,
            meta: StepMetadata, kv_pool: jax.Array, *, attention_impl: str = "reference",
            logits: str = "last") -> tuple[jax.Array, jax.Array]:
    """Pure forward: (params, tokens, metadata, pool) -> (logits, new pool)."""
    model = nnx.merge(graphdef, params)
    return model(tokens, meta, kv_pool, attention_impl=attention_impl, logits=logits)



"""What every family shares: the step's metadata, norms, RoPE, the paged
attention call and the `Decoder` base (embedding, layer loop, LM head).

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
updates it in place and never copies it (pool layout: see `jpaged.runtime.kv_pool`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jpaged.core.kv_layout import kv_layout
from jpaged.core.model_config import ModelConfig, rope_inv_freq
from jpaged.models import stacked_layers, weight_shapes
from jpaged.models.merged import MERGED, merge_arrays, part_sizes, split_columns
from jpaged.layers import batch_invariant as batch_invariant_ops
from jpaged.layers import skinny_matmul
from jpaged.layers.lora import LoraBatch, LoraLayer, one_hot_slots
from jpaged.layers.sharding import POOL_SPEC
from pallas_kernels import Backend, get_backend
from pallas_kernels.reference import is_quantized


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
                       ([S * (k + 1)] when the step verifies k drafts per row:
                       jpaged.runtime.step_inputs)
    group_block_tables[G-1, S, W], group_write_blocks[G-1, T]: the hybrid KV
                       layout's groups 1.. (jpaged.core.kv_layout), None with one
                       group; the fields above without a group are group 0's.
    """

    positions: jax.Array
    write_blocks: jax.Array
    write_offsets: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    logits_indices: jax.Array
    group_block_tables: jax.Array | None = None
    group_write_blocks: jax.Array | None = None

    def for_group(self, group: int) -> "StepMetadata":
        """The metadata a layer of KV group `group` attends with (its block table and write blocks)."""
        if group == 0:
            return self
        return dataclasses.replace(self, block_tables=self.group_block_tables[group - 1],
                                   write_blocks=self.group_write_blocks[group - 1])


def rope_angles(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [T, 1, head_dim/2] of positions[T]: computed once per step."""
    angles = positions[:, None].astype(jnp.float32) * inv_freq
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x[T, heads, head_dim] (HF rotate_half layout)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0,
             mean_square: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """RMSNorm in fp32; Gemma scales by (offset + weight) with offset 1.
    `mean_square`: how the mean of squares is taken (batch_invariant's, or jnp.mean)."""
    x32 = x.astype(jnp.float32)
    ms = jnp.mean(x32 * x32, axis=-1, keepdims=True) if mean_square is None else mean_square(x32)
    x32 = x32 * jax.lax.rsqrt(ms + eps)
    return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


def paged_attention(cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array | int,
                    window: int | None, kv_pool: jax.Array, meta: StepMetadata, backend: Backend
                    ) -> tuple[jax.Array, jax.Array]:
    """Writes this step's k, v [T, kv_heads, head_dim] into the pool, then attends
    q [T, heads, head_dim] over each sequence's cached keys: (out [T, heads * head_dim], pool).
    Write first, then read: every query, the step's own tokens included, sees K/V as
    the pool stores them (rounded, in a bf16 or quantized pool), so how a sequence's
    tokens were grouped into steps (drafts, prefill chunks) never changes what they read.
    With a hybrid KV layout (meta.group_block_tables set) the layer reads and
    writes its group's blocks, at its slot within the group's pages."""
    if meta.group_block_tables is not None:
        group, layer = kv_layout(cfg).place(layer)
        meta = meta.for_group(group)
    rotation = kv_rotation(cfg.head_dim) if is_quantized(kv_pool.dtype) else None

    def write_and_attend(q, k, v, kv_pool, meta, layer=layer):
        if rotation is not None:  # scores are invariant; outliers are spread before quantizing
            q, k, v = (jnp.einsum("thd,de->the", x.astype(jnp.float32), rotation).astype(x.dtype)
                       for x in (q, k, v))
        kv_pool = backend.write_kv(kv_pool, layer, k, v, meta.write_blocks, meta.write_offsets)
        out = backend.attention(q, kv_pool, layer, meta.block_tables, meta.kv_lens, meta.cu_q_lens,
                                sm_scale=cfg.sm_scale, sliding_window=window,
                                soft_cap=cfg.attn_logit_softcap)
        if rotation is not None:
            out = jnp.einsum("the,de->thd", out.astype(jnp.float32), rotation).astype(out.dtype)
        return out, kv_pool

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("model", 1) == 1:
        out, kv_pool = write_and_attend(q, k, v, kv_pool, meta)
    else:
        # Under tensor parallelism each device attends with its own heads over
        # its own slice of the pool.  XLA cannot partition a custom call (the
        # C++ and Pallas kernels) and would gather the whole pool to one
        # device, so the write and the kernel run per device under shard_map.
        heads = P(None, "model", None)
        args, specs = (q, k, v, kv_pool, meta), (heads, heads, heads, POOL_SPEC, P())
        if not isinstance(layer, int):  # a scanned layer index: a traced scalar
            args, specs = args + (layer,), specs + (P(),)
        out, kv_pool = jax.shard_map(write_and_attend, mesh=mesh, check_vma=False, in_specs=specs,
                                     out_specs=(heads, POOL_SPEC))(*args)
    return out.reshape(q.shape[0], -1), kv_pool


@functools.cache
def kv_rotation(head_dim: int) -> np.ndarray:
    """The orthonormal matrix a quantized pool's K/V rows (and the queries) are rotated
    by: Sylvester's Hadamard / sqrt(head_dim) for a power-of-two head_dim, else a
    fixed random orthogonal matrix (built once per head_dim: every layer's trace uses it)."""
    if head_dim & (head_dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < head_dim:
            h = np.block([[h, h], [h, -h]])
        return (h / np.sqrt(head_dim)).astype(np.float32)
    q, r = np.linalg.qr(np.random.default_rng(0).standard_normal((head_dim, head_dim)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


def stacked_shape(a: Any) -> tuple[int, ...]:
    """The shape of a weight array, or of a list of per-layer arrays once stacked."""
    return (len(a), *a[0].shape) if isinstance(a, list) else tuple(a.shape)


def check_weights(arrays: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> None:
    missing = sorted(set(expected) - set(arrays))
    if missing:
        raise ValueError(f"weights missing: {missing}")
    for name, shape in expected.items():
        if stacked_shape(arrays[name]) != shape:
            raise ValueError(f"weight {name} has shape {stacked_shape(arrays[name])}, expected {shape}")


class Decoder(nnx.Module):
    """Embedding, a loop over layers and the LM head over one flat ragged batch.

    A family subclasses it with `layer()` (one block: norms, attention, MLP)
    and, where it differs, `embed_tokens()` and `norm_offset`.  Weights
    are named as the family's `weight_shapes(cfg)` (cfg.architecture); `layers.*` arrays carry a
    leading axis over the layers that hold them (`jpaged.models.stacked_layers`:
    all of them, but for a MoE model's MLP weights).  `scan_layers=False` keeps
    one set of arrays per layer and unrolls the loop at trace time; `True` keeps
    them stacked and runs a `lax.scan` (one layer traced), which needs every
    layer to attend alike and to hold the same weights.
    A `layers.*` entry of `arrays` may also be a list of per-layer arrays (dummy
    weights drawn for the unrolled loop), used as they are.
    `batch_invariant=True` takes every matmul, RMSNorm sum and attention from
    jpaged.layers.batch_invariant, so that a token's logits do not depend on
    the rest of its batch; families write their projections and norms with
    `linear` and `norm`, which follow it.  `merge_projections=True` holds
    wq|wk|wv and w_gate|w_up as one matrix each (jpaged.models.merged), their
    columns laid out for `tensor_parallel_size` column shards; families project
    with `linears` / `project_qkv`, which take either form.
    `matmul_impl="cpu"` multiplies by the weights with the C++ skinny kernel
    (jpaged.layers.skinny_matmul) in steps of at most STEP_MAX_TOKENS tokens.
    A layer may record values of its own in w["aux"] (a dict: a MoE layer's
    routed experts); `__call__(aux=True)` returns them stacked over the layers.
    """

    norm_offset = 0.0  # RMSNorm scales by (norm_offset + weight)

    def __init__(self, cfg: ModelConfig, arrays: dict[str, Any], dtype: Any = jnp.float32,
                 scan_layers: bool = False, batch_invariant: bool = False,
                 merge_projections: bool = False, tensor_parallel_size: int = 1, matmul_impl: str = "xla"):
        expected = weight_shapes(cfg)
        check_weights(arrays, expected)
        if merge_projections:
            arrays, expected = merge_arrays(cfg, arrays, expected, tensor_parallel_size)
        windows = {cfg.layer_window(i) for i in range(cfg.num_layers)}
        if scan_layers and len(windows) > 1:
            raise ValueError(f"layer_loop='scan' needs every layer to attend alike; {cfg.architecture} "
                             "mixes sliding-window and global layers: use layer_loop='unroll'")
        layer_names = [n for n in expected if n.startswith("layers.")]
        rows = {n: stacked_layers(cfg, n) for n in layer_names}  # the layers each array stacks
        if scan_layers and any(len(r) != cfg.num_layers for r in rows.values()):
            raise ValueError(f"layer_loop='scan' needs every layer alike; this {cfg.architecture} model has "
                             f"dense MLP layers {list(cfg.mlp_layers(moe=False))} among its mixture-of-experts "
                             "layers: use layer_loop='unroll'")
        if batch_invariant:
            batch_invariant_ops.check_available()
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.batch_invariant = batch_invariant
        self.cpu_matmul = matmul_impl == "cpu"  # steps of few tokens: jpaged.layers.skinny_matmul
        self.merged_shards = tensor_parallel_size if merge_projections else 0  # 0: separate weights
        as_param = lambda name: nnx.Param(jnp.asarray(arrays[name], dtype=dtype))  # noqa: E731
        self.embed = as_param("embed")
        self.final_norm = as_param("final_norm")
        self.lm_head = None if cfg.tie_word_embeddings else as_param("lm_head")
        if scan_layers:
            self.layers = nnx.Dict({n.split(".", 1)[1]: as_param(n) for n in layer_names})
        else:  # layer i holds the arrays that stack it (a MoE model's MLP weights: some layers each)
            self.layers = nnx.List([
                nnx.Dict({n.split(".", 1)[1]: nnx.Param(jnp.asarray(arrays[n][rows[n].index(i)], dtype=dtype))
                          for n in layer_names if i in rows[n]})
                for i in range(cfg.num_layers)])
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg)))
        local = cfg.rope_local_theta is not None
        self.inv_freq_local = nnx.Variable(jnp.asarray(rope_inv_freq(cfg, local=True))) if local else None

    def layer(self, h: jax.Array, w: dict[str, jax.Array], layer: jax.Array | int, kv_pool: jax.Array,
              meta: StepMetadata, rope: tuple[jax.Array, jax.Array], backend: Backend
              ) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return self.embed[...][tokens]

    def matmul(self, x: jax.Array, w: jax.Array, transpose_w: bool = False) -> jax.Array:
        """x @ w (w.T with `transpose_w`), batch-invariant in that mode; by the CPU
        skinny kernel where matmul_impl is "cpu" and the step has few tokens."""
        if self.batch_invariant:
            return batch_invariant_ops.matmul(x, w, transpose_w=transpose_w)
        if self.cpu_matmul and skinny_matmul.applies(x, w, transpose_w):
            return skinny_matmul.matmul(x, w, transpose_w)
        return x @ (w.T if transpose_w else w)

    def linear(self, x: jax.Array, w: dict[str, Any], name: str) -> jax.Array:
        """x @ w[name], plus each token's LoRA update when the step carries adapters
        (w["lora"], a jpaged.layers.lora.LoraLayer)."""
        y = self.matmul(x, w[name])
        lora = w.get("lora")
        return y if lora is None else y + lora.delta(x, name, self.matmul)

    def linears(self, x: jax.Array, w: dict[str, Any], merged: str) -> list[jax.Array]:
        """`linear` of x by each part of `merged` (a jpaged.models.merged.MERGED key:
        "wqkv", "w_gate_up"): one GEMM over the merged matrix, split back into its
        parts, where the model holds it merged.  Each part adds its own LoRA target's update."""
        parts = MERGED[merged]
        if merged not in w:
            return [self.linear(x, w, name) for name in parts]
        ys = split_columns(self.matmul(x, w[merged]), part_sizes(self.cfg, merged), self.merged_shards)
        lora = w.get("lora")
        return ys if lora is None else [y + lora.delta(x, name, self.matmul) for y, name in zip(ys, parts)]

    def project_qkv(self, x: jax.Array, w: dict[str, Any]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [T, heads * hd], k and v [T, kv_heads * hd] of x [T, d], biases added
        (cfg.attention_bias): the projections before the heads are split out."""
        q, k, v = self.linears(x, w, "wqkv")
        if self.cfg.attention_bias:
            biases = (split_columns(w["bqkv"], part_sizes(self.cfg, "bqkv"), self.merged_shards)
                      if "bqkv" in w else (w["bq"], w["bk"], w["bv"]))
            q, k, v = (y + b for y, b in zip((q, k, v), biases))
        return q, k, v

    def norm(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        """The family's RMSNorm of x over its last axis."""
        mean_square = batch_invariant_ops.mean_square if self.batch_invariant else None
        return rms_norm(x, weight, self.cfg.rms_norm_eps, self.norm_offset, mean_square)

    def final_norm_logits(self, h: jax.Array) -> jax.Array:
        """fp32 logits of h, soft-capped where the family caps them."""
        h = self.norm(h, self.final_norm[...])
        tied = self.lm_head is None  # the embedding [vocab, d], read transposed
        head = self.embed[...] if tied else self.lm_head[...]
        cap = self.cfg.final_logit_softcap
        if self.batch_invariant:  # the kernel caps: XLA would fuse the cap into the logprobs' ops differently
            return batch_invariant_ops.matmul(h, head, transpose_w=tied, soft_cap=cap).astype(jnp.float32)
        return soft_cap(self.matmul(h, head, transpose_w=tied).astype(jnp.float32), cap)

    def __call__(self, tokens: jax.Array, meta: StepMetadata, kv_pool: jax.Array,
                 *, attention_impl: str | Backend = "reference", logits: str = "last",
                 lora: LoraBatch | None = None, aux: bool = False) -> tuple[jax.Array, ...]:
        """Runs the decoder on tokens[T] and returns (logits, new kv_pool), and with
        `aux=True` a third output: what the layers recorded in w["aux"], each name
        stacked over the layers that recorded it (a MoE layer records its routed
        experts [T, k] as "experts": [L_moe, T, k]); {} for a dense model.

        `logits="last"` returns [S, vocab], one row per sequence from its token
        at meta.logits_indices (the only ones a step samples from: the LM head
        never runs on the other tokens); `"all"` returns [T, vocab].
        `attention_impl` names a pallas_kernels backend, or is a `Backend`
        itself (decode.score's dense one, which keeps no pool).  `lora`: the
        adapter slots and each token's slot (jpaged.layers.lora); None: the base model.
        """
        cfg = self.cfg
        backend = attention_impl if isinstance(attention_impl, Backend) else get_backend(attention_impl)
        if self.batch_invariant:
            backend = batch_invariant_ops.attention_backend(backend)
        h = self.embed_tokens(tokens)
        rope = rope_angles(meta.positions, self.inv_freq[...])
        local_rope = rope if self.inv_freq_local is None else rope_angles(meta.positions,
                                                                          self.inv_freq_local[...])
        onehot = None if lora is None else one_hot_slots(lora.token_slots, lora.weights.num_slots, h.dtype)
        if self.scan_layers:
            def body(carry, xs):
                (h, pool), (w, layer, lora_ab) = carry, xs
                w = {**w, "aux": {}}
                if lora_ab is not None:
                    w["lora"] = LoraLayer(*lora_ab, onehot)
                return self.layer(h, w, layer, pool, meta, rope, backend), w["aux"]

            if cfg.layer_window(0) is not None:  # every layer slides (checked in __init__)
                rope = local_rope
            stacked = {name: p[...] for name, p in self.layers.items()}
            lora_ab = None if lora is None else (lora.weights.a, lora.weights.b)
            (h, kv_pool), recorded = jax.lax.scan(body, (h, kv_pool),
                                                  (stacked, jnp.arange(cfg.num_layers), lora_ab))
        else:
            records = []  # each layer's w["aux"]
            for layer, weights in enumerate(self.layers):
                w = {name: p[...] for name, p in weights.items()}
                w["aux"] = {}
                if lora is not None:
                    w["lora"] = LoraLayer(*lora.weights.layer(layer), onehot)
                layer_rope = local_rope if cfg.layer_window(layer) is not None else rope
                h, kv_pool = self.layer(h, w, layer, kv_pool, meta, layer_rope, backend)
                records.append(w["aux"])
            recorded = {name: jnp.stack([r[name] for r in records if name in r])
                        for name in dict.fromkeys(n for r in records for n in r)}
        if logits == "last":
            h = h[meta.logits_indices]
        out = self.final_norm_logits(h), kv_pool
        return (*out, recorded) if aux else out

    def window(self, layer: jax.Array | int) -> int | None:
        """The static sliding window of `layer` (the same for all layers under scan)."""
        return self.cfg.layer_window(layer if isinstance(layer, int) else 0)


def split_model(model: Decoder) -> tuple[nnx.GraphDef, nnx.State]:
    """Splits once at load time; the step functions take (graphdef, state)."""
    return nnx.split(model)


def forward(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array,
            meta: StepMetadata, kv_pool: jax.Array, *, attention_impl: str | Backend = "reference",
            logits: str = "last", lora: LoraBatch | None = None, aux: bool = False) -> tuple[jax.Array, ...]:
    """Pure forward: (params, tokens, metadata, pool) -> (logits, new pool), and the
    layers' records with `aux=True` (see `Decoder.__call__`)."""
    model = nnx.merge(graphdef, params)
    return model(tokens, meta, kv_pool, attention_impl=attention_impl, logits=logits, lora=lora, aux=aux)

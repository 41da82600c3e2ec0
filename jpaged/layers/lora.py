"""LoRA adapters on the device: `max_loras` slots of low-rank weights beside the base model.

Every target projection (wq .. w_down) has, per layer and slot n, A [in, R] and
B [R, out] (R = max_lora_rank; an adapter of lower rank is zero-padded, its
scale already folded into B).  A token of slot s adds x @ A[s] @ B[s] to the
base projection; a base-model token has slot -1 and adds nothing.  One step
mixes slots freely: the update is computed for every slot at once and masked
with each token's one-hot slot (two einsums), which on this CPU beat gathering
each token's own matrices (benchmarks/bench_lora.py).  A step in which no row
uses an adapter carries no slots (StepInputs.lora_slots is None) and runs the
base program: it costs what it did before adapters existed.

Loading an adapter writes its arrays into a free slot with one jitted,
donated update (the slot index is traced), so loading, unloading and mixing
adapters never recompiles a step.  The host side (which name holds which slot)
is `jpaged.engine.lora_registry`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jpaged.core.lora_adapters import LORA_TARGETS, lora_module_shapes
from jpaged.core.model_config import ModelConfig

# Under tensor parallelism an update follows its base layer: a column-split layer
# (output split) splits B's output, a row-split one (input split) A's input.
ROW_SPLIT = ("wo", "w_down")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeights:
    """The slots' weights: a[name] [N, in, R], b[name] [N, R, out] per layer, as a
    tuple of per-layer arrays (unrolled layer loop) or stacked [L, N, ...] (scan),
    mirroring how the base weights are kept."""

    a: dict[str, tuple[jax.Array, ...] | jax.Array]
    b: dict[str, tuple[jax.Array, ...] | jax.Array]

    @property
    def stacked(self) -> bool:
        return not isinstance(next(iter(self.a.values())), tuple)

    @property
    def num_slots(self) -> int:
        a = next(iter(self.a.values()))
        return (a if self.stacked else a[0]).shape[-3]

    @property
    def max_rank(self) -> int:
        a = next(iter(self.a.values()))
        return (a if self.stacked else a[0]).shape[-1]

    def layer(self, i: int) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        """Layer i's (a, b) of an unrolled loop."""
        return {n: x[i] for n, x in self.a.items()}, {n: x[i] for n, x in self.b.items()}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraBatch:
    """What a forward pass applies adapters from: the slots and each flat token's slot [T]."""

    weights: LoraWeights
    token_slots: jax.Array


@dataclasses.dataclass(frozen=True)
class LoraLayer:
    """One layer's slots and the step's per-token one-hot slots [T, N] (all
    zeros for a base-model token): what a projection adds its update from."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    onehot: jax.Array

    def delta(self, x: jax.Array, name: str, matmul: Callable[[jax.Array, jax.Array], jax.Array] = jnp.matmul
              ) -> jax.Array:
        """x [T, in] -> [T, out]: each token's own slot's x @ A @ B, as two
        matmuls over all N slots' ranks, [in, N * R] and [N * R, out] (`matmul`:
        the model's, batch-invariant in that mode)."""
        a, b = self.a[name], self.b[name]                     # [N, in, R], [N, R, out]
        N, d_in, R = a.shape
        xa = matmul(x, a.transpose(1, 0, 2).reshape(d_in, N * R)).reshape(-1, N, R)
        xa = (xa * self.onehot[:, :, None]).reshape(-1, N * R)
        return matmul(xa, b.reshape(N * R, -1)).astype(x.dtype)


def token_slots(lora_slots: jax.Array, cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Each flat token's slot [T] from each row's lora_slots [S] (-1 for padding tokens)."""
    t = jnp.arange(num_tokens)
    row = jnp.searchsorted(cu_q_lens, t, side="right") - 1   # the non-empty row holding t
    valid = t < cu_q_lens[-1]
    return jnp.where(valid, lora_slots[jnp.clip(row, 0, lora_slots.shape[0] - 1)], -1)


def one_hot_slots(slots: jax.Array, num_slots: int, dtype: jnp.dtype) -> jax.Array:
    return jax.nn.one_hot(slots, num_slots, dtype=dtype)   # slot -1: a row of zeros


def create_lora_weights(cfg: ModelConfig, max_loras: int, max_rank: int, dtype: jnp.dtype, *,
                        stacked: bool, mesh: jax.sharding.Mesh | None = None) -> LoraWeights:
    """Zeroed slots for every target of `cfg` (placed on `mesh` when given)."""
    L = cfg.num_layers
    shapes = lora_module_shapes(cfg)

    def make(name: str, shape: tuple[int, ...], spec: P) -> tuple[jax.Array, ...] | jax.Array:
        full = (L, *shape) if stacked else shape
        sharding = None if mesh is None else NamedSharding(mesh, P(*([None] * (len(full) - len(spec))), *spec))
        zeros = functools.partial(jnp.zeros, full, dtype, device=sharding)
        return zeros() if stacked else tuple(zeros() for _ in range(L))

    a = {n: make(n, (max_loras, shapes[n][0], max_rank), _spec(n, "a")) for n in LORA_TARGETS}
    b = {n: make(n, (max_loras, max_rank, shapes[n][1]), _spec(n, "b")) for n in LORA_TARGETS}
    return LoraWeights(a, b)


def _spec(name: str, which: str) -> P:
    """The PartitionSpec of a slot array [N, in, R] (a) or [N, R, out] (b)."""
    if name in ROW_SPLIT:
        return P(None, "model", None) if which == "a" else P()
    return P(None, None, "model") if which == "b" else P()


@functools.partial(jax.jit, donate_argnums=0)
def _write_slot(weights: LoraWeights, slot: jax.Array, a: dict[str, jax.Array], b: dict[str, jax.Array]
                ) -> LoraWeights:
    """weights with slot `slot` holding a[name] [L, in, R], b[name] [L, R, out]."""
    def put(stack, new):
        if isinstance(stack, tuple):
            return tuple(_put_layer(s, n) for s, n in zip(stack, new))
        return jax.vmap(_put_layer)(stack, new)

    def _put_layer(s, n):
        return jax.lax.dynamic_update_index_in_dim(s, n.astype(s.dtype), slot, axis=0)

    return LoraWeights({k: put(weights.a[k], a[k]) for k in weights.a},
                       {k: put(weights.b[k], b[k]) for k in weights.b})


def write_slot(weights: LoraWeights, slot: int, modules: dict[str, tuple[np.ndarray, np.ndarray]]
               ) -> LoraWeights:
    """weights (donated) with `slot` holding `modules` (target -> A [L, in, r], B [L, r, out],
    r <= the slots' rank; a target it lacks is zeroed).  One program for every slot."""
    L = weights.a["wq"].shape[0] if weights.stacked else len(weights.a["wq"])
    R = weights.max_rank
    a, b = {}, {}
    for name in weights.a:
        a_w = weights.a[name] if weights.stacked else weights.a[name][0]
        b_w = weights.b[name] if weights.stacked else weights.b[name][0]
        fan_in, fan_out = a_w.shape[-2], b_w.shape[-1]
        a[name] = np.zeros((L, fan_in, R), np.float32)
        b[name] = np.zeros((L, R, fan_out), np.float32)
        if name in modules:
            a_new, b_new = modules[name]
            r = a_new.shape[-1]
            a[name][..., :r], b[name][:, :r] = a_new, b_new
    shardings = jax.tree.map(lambda x: x.sharding, weights)
    out = _write_slot(weights, jnp.int32(slot), a, b)
    return jax.tree.map(jax.device_put, out, shardings)   # a no-op unless the update moved a shard

"""Checks on weights handed to a running engine (LLM.update_params): a tree that
matches what the compiled step programs were built for, so nothing recompiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def check_same_structure(old: nnx.State, new: nnx.State) -> None:
    """ValueError naming the first difference in tree, shape, dtype or sharding."""
    old_paths = jax.tree_util.tree_flatten_with_path(old)[0]
    new_paths = jax.tree_util.tree_flatten_with_path(new)[0]
    if jax.tree.structure(old) != jax.tree.structure(new):
        have = {jax.tree_util.keystr(k) for k, _ in new_paths}
        want = {jax.tree_util.keystr(k) for k, _ in old_paths}
        raise ValueError(f"params tree differs: missing {sorted(want - have)[:5]}, "
                         f"unexpected {sorted(have - want)[:5]}")
    for (path, a), (_, b) in zip(old_paths, new_paths):
        name = jax.tree_util.keystr(path)
        if not isinstance(b, jax.Array):
            raise ValueError(f"params{name} is a {type(b).__name__}, not a jax.Array")
        if b.is_deleted():
            raise ValueError(f"params{name} was deleted (donated to another computation?)")
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise ValueError(f"params{name} is {b.dtype}{list(b.shape)}, expected {a.dtype}{list(a.shape)}")
        if a.sharding != b.sharding:
            raise ValueError(f"params{name} has sharding {b.sharding}, expected {a.sharding}")


class NonFiniteParamsError(ValueError):
    """Weights handed to the engine hold NaN or Inf (LLM.update_params(check_finite=True))."""


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    """One bool per array: every element finite (integer arrays always are)."""
    return jnp.stack([jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
                      for x in leaves])


def check_finite_params(params: nnx.State) -> None:
    """NonFiniteParamsError naming the first array with a NaN or Inf: one jitted
    reduction over every array (compiled once per tree structure), one bool
    vector back to the host."""
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    if not paths:
        return
    ok = np.asarray(jax.device_get(_all_finite([x for _, x in paths])))
    if not ok.all():
        bad = [jax.tree_util.keystr(k) for (k, _), good in zip(paths, ok) if not good]
        raise NonFiniteParamsError(f"params{bad[0]} holds NaN or Inf ({len(bad)} of {len(paths)} arrays do); "
                                   "pass check_finite=False to load them anyway")

"""A quantised GGUF's blocks (jpaged.loading.gguf_blocks) registered for the params
dequantised from them: a CPU decode step's skinny matmuls then read ~5 bits a
weight (Q4_0, Q4_1) or ~8.5 (Q8_0) rather than 32, and compute the same sums of the
same float32 weights (pallas_kernels.cpu.register_block_weights).

The kernel finds a weight's blocks by the address of the params array it is
given, so the compiled programs do not change: registered or not, the program is
the same, and a step without registered blocks reads the float32 params.  A
registration is valid only while those arrays hold exactly the dequantised
weights: the runner releases it whenever its params are replaced (update_params,
sleep) and registers again when the same weights come back (waking from level 1).
Registered are the single-device float32 arrays a step multiplies by as they
are: layer matrices held per layer (the unrolled loop; a scanned loop hands the
kernel slices of its stacked arrays) and the tied or separate LM head.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.loading.gguf_blocks import BlockMatrix
from pallas_kernels import cpu

log = logging.getLogger(__name__)


class RegisteredBlocks:
    """The blocks registered for one params tree; `release()` forgets them all."""

    def __init__(self, params: nnx.State, blocks: dict[tuple[str, int | None], BlockMatrix]):
        self.params = params
        self._addresses: list[int] = []
        self.nbytes = 0
        for (name, layer), matrix in blocks.items():
            weight = _param_array(params, name, layer)
            if weight is None or not _fits(weight, name, matrix):
                continue
            self._addresses.append(cpu.register_block_weights(weight, matrix.kind, matrix.codes, matrix.scales,
                                                              matrix.offsets, transposed=name == "embed"))
            self.nbytes += matrix.nbytes

    def __len__(self) -> int:
        return len(self._addresses)

    def release(self) -> None:
        for address in self._addresses:
            cpu.unregister_block_weights(address)
        self._addresses = []

    def __del__(self) -> None:
        # Before the params it holds can be freed: no later array at their
        # addresses may be read as these blocks.
        self.release()


def register_weight_blocks(params: nnx.State, blocks: dict[tuple[str, int | None], BlockMatrix] | None
                           ) -> RegisteredBlocks | None:
    """Registers `blocks` for the arrays of `params` they were dequantised into; None
    when there are none to register or the CPU kernels are unavailable."""
    if not blocks or not cpu.available():
        return None
    registered = RegisteredBlocks(params, blocks)
    if not len(registered):
        return None
    log.info("GGUF blocks: %d weight matrices read as blocks in decode steps (%.0f MB)",
             len(registered), registered.nbytes / 1e6)
    return registered


def _param_array(params: nnx.State, name: str, layer: int | None) -> jax.Array | None:
    """The params' own array for (name, layer), None where the params hold it
    otherwise (stacked for a scanned loop, merged with others, absent)."""
    try:
        if layer is None:
            leaf = params[name]
        else:
            layers = params["layers"]
            short = name.split(".", 1)[1]
            if layer not in layers or short not in layers[layer]:
                return None
            leaf = layers[layer][short]
    except (KeyError, TypeError):
        return None
    array = leaf[...] if isinstance(leaf, nnx.Variable) else leaf
    return array if isinstance(array, jax.Array) else None


def _fits(weight: jax.Array, name: str, matrix: BlockMatrix) -> bool:
    """Whether `weight` is the float32 matrix the blocks hold, as the step reads it:
    [K, N] (GGUF's [N, K] transposed), or [N, K] for the tied head (the embedding)."""
    n, k = matrix.shape
    want = (n, k) if name == "embed" else (k, n)
    return (weight.dtype == jnp.float32 and weight.shape == want and len(weight.addressable_shards) == 1
            and weight.is_fully_addressable and next(iter(weight.devices())).platform == "cpu")

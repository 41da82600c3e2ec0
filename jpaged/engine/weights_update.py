"""New weights for `EngineCore.update_params`, checked before anything changes:
read from a path when given one, merged into the engine's layout (merge_projections),
and held to the running weights' tree, shapes, dtypes and shardings (so that no
step recompiles) and, optionally, to finite values."""

from __future__ import annotations

import os
from typing import Any

import ml_collections
from flax import nnx

from jpaged.core.model_config import ModelConfig
from jpaged.engine.setup import params_from_path
from jpaged.layers.sharding import Mesh, tensor_parallel_size
from jpaged.models.merged import merge_params
from jpaged.runtime.params import check_finite_params, check_same_structure


def incoming_params(params: nnx.State | str | os.PathLike, current: nnx.State, cfg: ml_collections.ConfigDict,
                    base: ModelConfig, mesh: Mesh | None, scan_layers: bool, check_finite: bool) -> Any:
    """`params` (a tree, an orbax checkpoint of one, or a HF directory or .gguf file of
    the same model) as the engine's weights: ValueError when they do not fit
    `current`, NonFiniteParamsError for a NaN/Inf array with `check_finite`."""
    if isinstance(params, (str, os.PathLike)):
        params = params_from_path(params, cfg, base, current, mesh, scan_layers)
    params = merge_params(params, current, tensor_parallel_size(mesh))
    check_same_structure(current, params)
    if check_finite:
        check_finite_params(params)
    return params

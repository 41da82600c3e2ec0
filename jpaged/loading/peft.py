"""LoRA adapters on the host: PEFT adapter directories (and a trainer's arrays) as numpy.

A PEFT adapter directory (what `peft_model.save_pretrained(dir)` writes) holds
`adapter_config.json` and `adapter_model.safetensors`, whose tensors are named

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A[.<adapter>].weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B[.<adapter>].weight   [out, r]

PEFT computes y = x W^T + scale * (x A^T) B^T with scale = lora_alpha / r
(lora_alpha / sqrt(r) under `use_rslora`; `rank_pattern` / `alpha_pattern` override
r and alpha per module).  `load_peft_adapter` turns that into our layout: per
target weight (`LORA_TARGETS`, the names of `jpaged.models.weight_shapes`) A
[L, in, rank] and B [L, rank, out] in float32 with the scale folded into B, so
x @ A[l] @ B[l] is the layer's delta.  Ranks are zero-padded to the adapter's
largest and layers it does not touch are zeros.  Anything we could not apply
exactly (DoRA, biases, extra trained modules, embeddings, lm_head, ...) is a
`ValueError` at load time naming the file and the problem.

Host only: numpy and json, no jax, torch or peft.  The GGUF loader un-permutes
llama.cpp's Q/K rows, so these HF-layout adapters apply to GGUF models as well.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
from typing import Any

import numpy as np

from jpaged.core.model_config import ModelConfig
from jpaged.loading.weights import read_safetensors

LORA_TARGETS: tuple[str, ...] = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
PEFT_MODULES: dict[str, str] = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
                                "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"

# base_model.model.<module>.lora_A[.<adapter name>].weight, <module> ending in layers.{i}.<block>.<proj>
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>(?:[\w.]*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
                  r"(?P<proj>\w+))\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight")
# adapter_config.json fields whose (truthy) value changes the adapter's forward pass
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)", "lora_bias": "a bias on lora_B (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "layer_replication": "layer_replication", "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)", "use_qalora": "QALoRA (use_qalora)",
    "arrow_config": "Arrow routing (arrow_config)", "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)", "use_bdlora": "block-diagonal LoRA (use_bdlora)",
}
_NAME = re.compile(r"[A-Za-z0-9_\-./:]+")


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One adapter in our layout (see the module docstring); arrays are read-only."""

    name: str
    path: str   # the directory it was read from ("" for lora_from_arrays)
    rank: int   # the largest rank over its modules; every module is padded to it
    modules: dict[str, tuple[np.ndarray, np.ndarray]]  # target -> (A [L, in, rank], B [L, rank, out] * scale)


def lora_module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """target -> (in, out) of its base weight, as `weight_shapes` gives it per layer."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
            "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}


# ================================================================= PEFT directories
def load_peft_adapter(name: str, path: str | os.PathLike, cfg: ModelConfig, *, max_rank: int) -> LoraAdapter:
    """Reads a PEFT LoRA adapter directory for a model of `cfg` (ranks up to max_rank)."""
    root = pathlib.Path(path)
    if not root.is_dir():
        raise ValueError(f"{root}: LoRA adapter directory not found")
    config = _read_config(root / CONFIG_FILE)
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        hint = ("; it holds adapter_model.bin, a pickle, which jpaged does not load: re-save the adapter with "
                "save_pretrained(..., safe_serialization=True)" if (root / "adapter_model.bin").is_file() else "")
        raise ValueError(f"{weights}: missing{hint}")
    pieces = _read_pieces(weights, config, cfg, max_rank)
    return _assemble(name, str(root), pieces, cfg)


def _read_config(path: pathlib.Path) -> dict[str, Any]:
    """adapter_config.json, checked for what jpaged can apply."""
    if not path.is_file():
        raise ValueError(f"{path}: missing; a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type is {config.get('peft_type')!r}; jpaged loads LoRA adapters only (LORA)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias is {config['bias']!r}; jpaged applies adapters without biases (bias 'none')")
    for field, what in _UNSUPPORTED.items():
        if config.get(field):
            raise ValueError(f"{path}: {what} is not supported ({field}={config[field]!r}); jpaged applies plain LoRA")
    for field in ("r", "lora_alpha"):
        value = config.get(field, 8)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{path}: {field} is {value!r}, not a positive number")
    for field in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(field) or {}, dict):
            raise ValueError(f"{path}: {field} is {config[field]!r}, not a JSON object")
    _check_targets(path, config.get("target_modules"))
    return config


def _check_targets(path: pathlib.Path, targets: Any) -> None:
    """target_modules names only modules jpaged can adapt (validation only: the tensors decide)."""
    if targets is None or targets == "all-linear":
        return
    if isinstance(targets, str):  # PEFT fullmatches the regex against each module name
        try:
            bad = [m for m in ("model.embed_tokens", "lm_head") if re.fullmatch(targets, m)]
        except re.error as e:
            raise ValueError(f"{path}: target_modules {targets!r} is not a regular expression ({e})") from None
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        bad = [t for t in targets if t.rsplit(".", 1)[-1] not in PEFT_MODULES]
    else:
        raise ValueError(f"{path}: target_modules is {targets!r}, not a list of names or a regex")
    if bad:
        raise ValueError(f"{path}: target_modules includes {bad}, which jpaged cannot adapt; "
                         f"it applies LoRA to {sorted(PEFT_MODULES)} only")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """peft.utils.other.get_pattern_key: the first key that is a regex suffix of `module`."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _module_scale(config: dict[str, Any], module: str) -> tuple[int, float]:
    """(configured rank, scale) of one PEFT module."""
    r = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", 8))
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
    return r, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def _read_pieces(path: pathlib.Path, config: dict[str, Any], cfg: ModelConfig, max_rank: int
                 ) -> dict[str, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """target -> layer -> (A [in, r], B [r, out] * scale) from the safetensors file, checked."""
    pairs: dict[tuple[str, int, str], dict[str, np.ndarray]] = {}
    unknown = []
    for key, tensor in read_safetensors(path).items():
        m = _KEY.fullmatch(key)
        if m is None or m["proj"] not in PEFT_MODULES:
            unknown.append(key)
            continue
        pair = pairs.setdefault((m["module"], int(m["layer"]), m["proj"]), {})
        if m["ab"] in pair:
            raise ValueError(f"{path}: two lora_{m['ab']} tensors for {m['module']}")
        pair[m["ab"]] = tensor
    if unknown:
        raise ValueError(f"{path}: tensors that are not lora_A/lora_B of {sorted(PEFT_MODULES)}: "
                         f"{unknown[:6]}{' ...' if len(unknown) > 6 else ''}")
    if not pairs:
        raise ValueError(f"{path}: no LoRA tensors")
    layers = config.get("layers_to_transform")
    layers = None if layers is None else {layers} if isinstance(layers, int) else set(layers)
    shapes = lora_module_shapes(cfg)
    pieces: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for (module, layer, proj), pair in sorted(pairs.items()):
        where = f"{path}: {module}"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where} has lora_{''.join(pair)} but no lora_{'B' if 'A' in pair else 'A'}")
        if layer >= cfg.num_layers:
            raise ValueError(f"{where}: layer {layer}, but the model has {cfg.num_layers} layers")
        if layers is not None and layer not in layers:
            raise ValueError(f"{where}: layer {layer} is not in layers_to_transform {sorted(layers)}")
        target = PEFT_MODULES[proj]
        a, b = pair["A"], pair["B"]
        r, scale = _module_scale(config, module)
        _check_pair(where, a.T, b.T, shapes[target], r, max_rank)
        pieces.setdefault(target, {})[layer] = (a.T.astype(np.float32), b.T.astype(np.float32) * np.float32(scale))
    return pieces


def _check_pair(where: str, a: np.ndarray, b: np.ndarray, shape: tuple[int, int], r: int | None, max_rank: int
                ) -> None:
    """One layer's A [in, r] and B [r, out] against the base weight's (in, out), rank r and max_rank."""
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"{where}: A {a.shape} and B {b.shape} are not both matrices")
    if a.shape[0] != shape[0] or b.shape[1] != shape[1]:
        raise ValueError(f"{where}: A [in, r] {a.shape} and B [r, out] {b.shape} do not fit the base "
                         f"model's weight (in {shape[0]}, out {shape[1]})")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{where}: the ranks of A ({a.shape[1]}) and B ({b.shape[0]}) disagree")
    if r is not None and a.shape[1] != r:
        raise ValueError(f"{where}: rank {a.shape[1]} in the file, but adapter_config.json gives r={r}")
    if a.shape[1] > max_rank:
        raise ValueError(f"{where}: rank {a.shape[1]} is above the limit {max_rank} (the config field "
                         f"max_lora_rank; raise it to load this adapter)")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError(f"{where}: non-finite values (inf or nan)")


def _assemble(name: str, path: str, pieces: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]],
              cfg: ModelConfig) -> LoraAdapter:
    """Stacks checked per-layer pieces into [L, in, rank] / [L, rank, out], zero-padded."""
    rank = max(a.shape[1] for layers in pieces.values() for a, _ in layers.values())
    shapes, modules = lora_module_shapes(cfg), {}
    for target in LORA_TARGETS:
        if target not in pieces:
            continue
        (n_in, n_out), L = shapes[target], cfg.num_layers
        a_all, b_all = np.zeros((L, n_in, rank), np.float32), np.zeros((L, rank, n_out), np.float32)
        for layer, (a, b) in pieces[target].items():
            a_all[layer, :, :a.shape[1]], b_all[layer, :b.shape[0]] = a, b
        a_all.flags.writeable = b_all.flags.writeable = False
        modules[target] = (a_all, b_all)
    return LoraAdapter(name=name, path=path, rank=rank, modules=modules)


# ================================================================= a trainer's arrays
def lora_from_arrays(name: str, modules: dict[str, tuple[np.ndarray, np.ndarray]], cfg: ModelConfig, *,
                     max_rank: int) -> LoraAdapter:
    """An adapter from arrays already in our layout (A [L, in, r], B [L, r, out], scale folded
    into B), with the checks `load_peft_adapter` makes."""
    where, shapes = f"LoRA adapter {name!r}", lora_module_shapes(cfg)
    if not modules:
        raise ValueError(f"{where}: no modules")
    pieces: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for target, (a, b) in modules.items():
        if target not in shapes:
            raise ValueError(f"{where}: unknown target {target!r}; LoRA applies to {list(LORA_TARGETS)}")
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if a.ndim != 3 or b.ndim != 3 or a.shape[0] != cfg.num_layers or b.shape[0] != cfg.num_layers:
            raise ValueError(f"{where}: {target} A {a.shape} and B {b.shape} are not [num_layers={cfg.num_layers}, "
                             f"in, r] and [num_layers, r, out]")
        for layer in range(cfg.num_layers):
            _check_pair(f"{where}: {target}", a[layer], b[layer], shapes[target], None, max_rank)
        pieces[target] = dict(enumerate(zip(a, b)))
    return _assemble(name, "", pieces, cfg)


# ================================================================= --lora-modules
def parse_lora_modules(spec: str | dict | None) -> dict[str, str]:
    """name -> adapter path from "name=path,name2=path2" (or a dict; ""/None -> {})."""
    if not spec:
        return {}
    if isinstance(spec, dict):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = []
        for entry in filter(str.strip, spec.split(",")):
            name, eq, path = entry.partition("=")
            if not eq:
                raise ValueError(f"LoRA module {entry.strip()!r} is not name=path")
            items.append((name, path))
    else:
        raise ValueError(f"LoRA modules {spec!r}: expected 'name=path,...' or a dict")
    out: dict[str, str] = {}
    for name, path in items:
        if not isinstance(name, str) or not isinstance(path, str):
            raise ValueError(f"LoRA module {name!r}={path!r}: name and path must be strings")
        name, path = name.strip(), path.strip()
        if not _NAME.fullmatch(name):
            raise ValueError(f"LoRA module name {name!r} is empty or has characters other than letters, digits "
                             f"and _-./:")
        if not path:
            raise ValueError(f"LoRA module {name!r} has an empty path")
        if name in out:
            raise ValueError(f"LoRA module name {name!r} is given twice")
        out[name] = path
    return out

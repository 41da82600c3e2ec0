"""Nothing lost to damaged caches: damage is detected, rebuilt and reported, never loaded.

* Converted-weights cache (`jpaged.loading.weights`): a flipped byte in any file of an
  entry (orbax's data and metadata files, config.json, tokenizer.json,
  meta.json) or an edit of config.json makes the next load warn, rebuild and
  return exactly the arrays of a fresh conversion, with `from_cache` False and
  a `cache_note` saying why; a flip inside orbax's large data files (which only
  the per-array checksums cover) names the damaged array.
* Temp folders of interrupted cache writes are removed when their writer is
  dead (or, when it cannot be checked, when old); a live writer's are kept.
* Truncated or garbage GGUF and safetensors files raise a ValueError that names
  the file and says so.
* The compiled CPU kernel (`pallas_kernels.cpu`): a truncated or altered
  cached library, or one without its digest, is rebuilt and never reaches
  dlopen -- also in a fresh process, where a truncated library used to die of
  SIGBUS on every start.  The library comes from this session's real build
  (`cpu.available()`); rebuilds run through a stand-in compiler that copies it,
  so they take milliseconds instead of a 30-60 s g++ run.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import time
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jpaged.loading import weight_cache

from jpaged.loading import weights
from jpaged.formats.gguf import read_gguf
from jpaged.loading.weight_cache import CacheEntryDamaged, read_cache, remove_stale_tmp_dirs
from jpaged.loading.weights import load_gguf, load_hf_dir, load_weights

REPO = pathlib.Path(__file__).resolve().parents[2]
FEW = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ============================================================ weights cache
@pytest.fixture(scope="module")
def hf_dir(tiny_llama_dir, tmp_path_factory) -> pathlib.Path:
    """The tiny Llama checkpoint plus a small tokenizer.json, so entries hold one too."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    path = tmp_path_factory.mktemp("hf") / "llama"
    shutil.copytree(tiny_llama_dir, path)
    backend = Backend(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def reference(hf_dir) -> dict[str, np.ndarray]:
    """A conversion that never touched a cache."""
    return load_weights(str(hf_dir), load_format="hf", use_cache=False).arrays


@pytest.fixture(scope="module")
def pristine(hf_dir, tmp_path_factory) -> pathlib.Path:
    """A cache dir holding one freshly written entry, to copy before damaging it."""
    cache = tmp_path_factory.mktemp("pristine")
    assert not _load(hf_dir, cache).from_cache
    return cache


def _load(hf_dir: pathlib.Path, cache: pathlib.Path) -> weights.LoadedWeights:
    return load_weights(str(hf_dir), load_format="hf", use_cache=True, cache_dir=cache)


def _entry(cache: pathlib.Path) -> pathlib.Path:
    (entry,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    return entry


def _files(entry: pathlib.Path) -> list[str]:
    return sorted(p.relative_to(entry).as_posix() for p in entry.rglob("*") if p.is_file())


def _flip(path: pathlib.Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 1 << bit
    path.write_bytes(bytes(data))


def _assert_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _assert_rebuilt(hf_dir, cache, reference, damaged: str) -> str:
    """The next load rebuilds with the fresh conversion's arrays; the one after reads the cache."""
    again = _load(hf_dir, cache)
    assert not again.from_cache, f"damaged {damaged} was loaded"
    assert again.cache_note.startswith("cache entry damaged (") and again.cache_note.endswith("): rebuilt")
    _assert_equal(again.arrays, reference)
    assert again.tokenizer is not None and again.tokenizer.encode("w5 w7") == [5, 7]
    third = _load(hf_dir, cache)
    assert third.from_cache and third.cache_note == ""
    _assert_equal(third.arrays, reference)
    return again.cache_note


def test_intact_entry_loads_from_cache(hf_dir, pristine, reference, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(pristine, cache)
    lw = _load(hf_dir, cache)
    assert lw.from_cache and lw.cache_note == ""
    _assert_equal(lw.arrays, reference)
    meta = json.loads((_entry(cache) / "meta.json").read_text())
    assert set(meta["arrays"]) == set(reference)
    assert {"config.json", "tokenizer.json"} <= set(meta["files"])


def test_every_file_flipped_is_rebuilt(hf_dir, pristine, reference, tmp_path, caplog):
    """One byte in the middle of each file of the entry, in turn."""
    files = _files(_entry(pristine))
    assert {"config.json", "tokenizer.json", "meta.json"} <= set(files)
    assert sum(f.startswith("arrays/") for f in files) >= 5  # orbax data + metadata files
    for i, rel in enumerate(files):
        cache = tmp_path / f"cache{i}"
        shutil.copytree(pristine, cache)
        entry = _entry(cache)
        _flip(entry / rel, (entry / rel).stat().st_size // 2, bit=3)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jpaged.loading.weights"):
            note = _assert_rebuilt(hf_dir, cache, reference, rel)
        warned = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
        assert len(warned) == 1 and str(entry) in warned[0], (rel, warned)
        if rel != "meta.json":  # a damaged meta.json cannot vouch for the names in it
            assert rel in note or "arrays/" in note, (rel, note)


@FEW
@given(data=st.data())
def test_random_flip_is_rebuilt(hf_dir, pristine, reference, tmp_path, data):
    files = _files(_entry(pristine))
    rel = data.draw(st.sampled_from(files), label="file")
    size = (_entry(pristine) / rel).stat().st_size
    offset = data.draw(st.integers(0, size - 1), label="offset")
    bit = data.draw(st.integers(0, 7), label="bit")
    cache = tmp_path / f"cache-{time.monotonic_ns()}"
    shutil.copytree(pristine, cache)
    _flip(_entry(cache) / rel, offset, bit)
    _assert_rebuilt(hf_dir, cache, reference, f"{rel} byte {offset} bit {bit}")


def test_config_edit_is_rebuilt(hf_dir, pristine, reference, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(pristine, cache)
    config = _entry(cache) / "config.json"
    text = config.read_text()
    assert '"num_layers": 2,' in text
    config.write_text(text.replace('"num_layers": 2,', '"num_layers": 3,'))  # same size, valid, wrong
    assert "config.json checksum mismatch" in _assert_rebuilt(hf_dir, cache, reference, "config.json")


def test_flip_in_array_data_names_the_array(hf_dir, reference, tmp_path, monkeypatch):
    """Large orbax data files are covered by the per-array checksums alone (no second
    read of the file); a limit of 0 makes every data file count as large."""
    monkeypatch.setattr(weight_cache, "_WHOLE_FILE_LIMIT", 0)
    cache = tmp_path / "cache"
    _load(hf_dir, cache)
    entry = _entry(cache)
    meta = json.loads((entry / "meta.json").read_text())
    unhashed = [rel for rel, (_, crc) in meta["files"].items() if crc is None]
    biggest = max(unhashed, key=lambda rel: (entry / rel).stat().st_size)
    _flip(entry / biggest, (entry / biggest).stat().st_size // 2, bit=5)
    with pytest.raises(CacheEntryDamaged, match=r"arrays/(\S+ checksum mismatch| unreadable)"):
        read_cache(entry)
    note = _assert_rebuilt(hf_dir, cache, reference, biggest)
    assert "arrays/" in note


def test_truncated_and_missing_files_are_rebuilt(hf_dir, pristine, reference, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(pristine, cache)
    entry = _entry(cache)
    data = max(_files(entry), key=lambda rel: (entry / rel).stat().st_size)
    with open(entry / data, "r+b") as f:
        f.truncate((entry / data).stat().st_size - 1)
    assert f"{data} has" in _assert_rebuilt(hf_dir, cache, reference, data)
    (_entry(cache) / "tokenizer.json").unlink()
    assert "tokenizer.json is missing" in _assert_rebuilt(hf_dir, cache, reference, "tokenizer.json")


# ============================================================ stale temp folders
def _make_tmp(cache: pathlib.Path, name: str, age_s: float = 0.0) -> pathlib.Path:
    path = cache / name
    (path / "arrays").mkdir(parents=True)
    (path / "arrays" / "data").write_bytes(b"x" * 1000)
    then = time.time() - age_s
    for p in (path / "arrays" / "data", path / "arrays", path):
        os.utime(p, (then, then))
    return path


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_stale_tmp_dirs(tmp_path):
    host, hour = weight_cache._host_id(), 3600.0
    other_host = "ffffffff" if host != "ffffffff" else "eeeeeeee"  # its PIDs mean nothing here
    dead = _make_tmp(tmp_path, f".tmp-hf-0123abcd-{host}-{_dead_pid()}-89abcdef")
    live_old = _make_tmp(tmp_path, f".tmp-hf-0123abcd-{host}-{os.getpid()}-89abcdef", age_s=5 * hour)
    foreign_new = _make_tmp(tmp_path, f".tmp-hf-0123abcd-{other_host}-1-01234567")
    foreign_old = _make_tmp(tmp_path, f".tmp-hf-0123abcd-{other_host}-1-76543210", age_s=2 * hour)
    legacy_new = _make_tmp(tmp_path, ".tmp-gguf-08611e7c2c81d7ce281c9828-1a2b3c4d")
    legacy_old = _make_tmp(tmp_path, ".tmp-gguf-08611e7c2c81d7ce281c9828-4d3c2b1a", age_s=2 * hour)
    entry = _make_tmp(tmp_path, "hf-0123abcd", age_s=5 * hour)  # a cache entry is never touched
    removed = remove_stale_tmp_dirs(tmp_path)
    assert sorted(removed) == sorted([dead, foreign_old, legacy_old])
    for kept in (live_old, foreign_new, legacy_new, entry):
        assert kept.is_dir(), kept
    assert remove_stale_tmp_dirs(tmp_path / "missing") == []


def test_interrupted_write_is_cleaned_up_on_next_load(hf_dir, tmp_path):
    """A process that died mid-write (here: exits with its temp folder in place) leaves
    a folder that the next load_weights removes before touching the cache."""
    cache = tmp_path / "cache"
    script = ("import pathlib, sys; from jpaged.loading.weight_cache import _tmp_name; "
              "p = pathlib.Path(sys.argv[1]) / _tmp_name('hf-0123abcd'); (p / 'arrays').mkdir(parents=True); "
              "(p / 'arrays' / 'data').write_bytes(bytes(4096)); print(p)")
    out = subprocess.run([sys.executable, "-c", script, str(cache)], capture_output=True, text=True,
                         check=True, cwd=REPO)
    leftover = pathlib.Path(out.stdout.strip())
    assert leftover.is_dir()
    _load(hf_dir, cache)
    assert not leftover.exists()
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp")]


# ============================================================ truncated / garbage model files
def _write_tiny_gguf(path: pathlib.Path) -> None:
    """A complete one-layer llama GGUF, every tensor a multiple of 32 bytes so the
    file has no trailing padding: any truncation cuts into tensor data."""
    import gguf

    hidden, ffn, vocab, heads, kv_heads = 16, 32, 32, 2, 1
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (kv_heads * head_dim, hidden),
              "blk.0.attn_v.weight": (kv_heads * head_dim, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
              "blk.0.ffn_down.weight": (hidden, ffn)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_tiny_gguf(path)
    cfg, arrays, _ = load_gguf(path)  # the intact file loads
    assert cfg.num_layers == 1 and arrays["layers.wq"].shape == (1, 16, 16)
    return path


@FEW
@given(data=st.data())
def test_truncated_gguf_is_a_clear_error(tiny_gguf, tmp_path, data):
    full = tiny_gguf.read_bytes()
    length = data.draw(st.one_of(st.integers(0, 64), st.integers(0, len(full) - 1)), label="length")
    path = tmp_path / f"cut-{length}.gguf"
    path.write_bytes(full[:length])
    with pytest.raises(ValueError, match=r"truncated or not a GGUF file \(") as err:
        load_weights(str(path), cache_dir=tmp_path / "cache")
    assert str(err.value).startswith(f"{path}: ")


@FEW
@given(garbage=st.binary(min_size=0, max_size=400), header=st.booleans())
def test_garbage_gguf_is_a_clear_error(tmp_path, garbage, header):
    path = tmp_path / "garbage.gguf"
    path.write_bytes((b"GGUF" + struct.pack("<I", 3) if header else b"") + garbage)
    with pytest.raises(ValueError) as err:  # garbage can parse as an empty GGUF: then no model
        load_gguf(path)
    assert str(err.value).startswith(f"{path}: "), err.value


def test_gguf_tensor_past_the_end(tiny_gguf, tmp_path):
    """The header parses but the data is cut: named as such, not a reshape error."""
    full = tiny_gguf.read_bytes()
    path = tmp_path / "short.gguf"
    path.write_bytes(full[:-4])
    with pytest.raises(ValueError, match=r"truncated or not a GGUF file \(tensor data ends at byte"):
        read_gguf(path)


@FEW
@given(data=st.data())
def test_truncated_safetensors_is_a_clear_error(hf_dir, tmp_path, data):
    (original,) = hf_dir.glob("*.safetensors")
    full = original.read_bytes()
    length = data.draw(st.one_of(st.integers(0, 16), st.integers(0, len(full) - 1)), label="length")
    path = tmp_path / f"hf-{length}"
    path.mkdir(exist_ok=True)
    shutil.copy(hf_dir / "config.json", path / "config.json")
    (path / original.name).write_bytes(full[:length])
    with pytest.raises(ValueError, match=r"truncated or not a safetensors file \(") as err:
        load_hf_dir(path)
    assert str(path / original.name) in str(err.value)


# ============================================================ compiled CPU kernel
def _kernel():
    from pallas_kernels import cpu
    if not cpu.available():
        pytest.skip(f"CPU kernel unavailable: {cpu.unavailable_reason()}")
    return cpu


@pytest.fixture(scope="module")
def fake_cxx(tmp_path_factory) -> dict[str, str]:
    """Environment for a stand-in compiler: `--version` answers as the real one (so the
    library's cache key is unchanged), a build copies this session's real library
    and appends a line to a log."""
    cpu = _kernel()
    good = cpu._build()  # verified and already loaded by available()
    root = tmp_path_factory.mktemp("fake-cxx")
    script = root / "cxx"
    script.write_text('#!/bin/sh\n'
                      'if [ "$1" = "--version" ]; then exec "$REAL_CXX" --version; fi\n'
                      'echo build >> "$FAKE_CXX_LOG"\n'
                      'out=""; while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done\n'
                      'exec cp "$GOOD_SO" "$out"\n')
    script.chmod(0o755)
    return {"CXX": str(script), "REAL_CXX": cpu._compiler(), "GOOD_SO": str(good),
            "FAKE_CXX_LOG": str(root / "log")}


@contextmanager
def _kernel_cache(fake_cxx: dict[str, str], cache: pathlib.Path):
    """The stand-in compiler and a fresh cache dir, for this process's _build calls."""
    log = pathlib.Path(fake_cxx["FAKE_CXX_LOG"])
    log.unlink(missing_ok=True)
    with mock.patch.dict(os.environ, {**fake_cxx, "JPAGED_CACHE_DIR": str(cache)}):
        yield


def _builds(fake_cxx: dict[str, str]) -> int:
    log = pathlib.Path(fake_cxx["FAKE_CXX_LOG"])
    return len(log.read_text().splitlines()) if log.exists() else 0


def _assert_good(cpu, lib: pathlib.Path, fake_cxx: dict[str, str]) -> None:
    assert cpu._damage(lib) == ""
    assert lib.read_bytes() == pathlib.Path(fake_cxx["GOOD_SO"]).read_bytes()


DAMAGE = {
    "truncated to half": lambda lib: lib.write_bytes(lib.read_bytes()[:lib.stat().st_size // 2]),
    "last byte cut": lambda lib: lib.write_bytes(lib.read_bytes()[:-1]),
    "empty": lambda lib: lib.write_bytes(b""),
    "byte flipped": lambda lib: _flip(lib, lib.stat().st_size // 3, bit=2),
    "no digest": lambda lib: (lib.with_name(lib.name + ".sha256")).unlink(),
    "wrong digest": lambda lib: (lib.with_name(lib.name + ".sha256")).write_text("0" * 64 + "\n"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_kernel_is_rebuilt(fake_cxx, tmp_path, damage):
    cpu = _kernel()
    with _kernel_cache(fake_cxx, tmp_path):
        lib = cpu._build()
        assert _builds(fake_cxx) == 1 and lib.parent == tmp_path / "kernels"
        assert cpu._build() == lib and _builds(fake_cxx) == 1  # intact: no rebuild
        DAMAGE[damage](lib)
        assert cpu._damage(lib)
        assert cpu._build() == lib and _builds(fake_cxx) == 2
        _assert_good(cpu, lib, fake_cxx)
        assert not list(lib.parent.glob("*.tmp"))


@settings(max_examples=10, deadline=None)
@given(offset=st.integers(0, 10**9), bit=st.integers(0, 7))
def test_any_flipped_kernel_byte_is_caught(fake_cxx, tmp_path_factory, offset, bit):
    cpu = _kernel()
    cache = tmp_path_factory.mktemp("kernel-flip")
    with _kernel_cache(fake_cxx, cache):
        lib = cpu._build()
        _flip(lib, offset % lib.stat().st_size, bit)
        assert "sha256 differs" in cpu._damage(lib) or "ELF" in cpu._damage(lib)
        cpu._build()
        _assert_good(cpu, lib, fake_cxx)


_CHILD = ("import json; from pallas_kernels import cpu; "
          "print(json.dumps({'ok': cpu.available(), 'reason': cpu.unavailable_reason()}))")


@pytest.mark.parametrize("damage", ["truncated to half", "byte flipped"])
def test_fresh_process_rebuilds_damaged_kernel(fake_cxx, tmp_path, damage):
    """What used to die of SIGBUS on every start: a new process loading a damaged library."""
    cpu = _kernel()
    with _kernel_cache(fake_cxx, tmp_path):
        lib = cpu._build()
        DAMAGE[damage](lib)
        env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]  # -7 would be SIGBUS
    assert json.loads(proc.stdout.splitlines()[-1]) == {"ok": True, "reason": ""}
    assert "rebuilding" in proc.stderr
    assert _builds(fake_cxx) == 2
    _assert_good(cpu, lib, fake_cxx)


def test_stale_kernel_temp_files_are_removed(fake_cxx, tmp_path):
    cpu = _kernel()
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    old, fresh = kernels / "paged_attention_cpu-x.so.abc.tmp", kernels / "paged_attention_cpu-x.so.def.tmp"
    for p in (old, fresh):
        p.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    with _kernel_cache(fake_cxx, tmp_path):
        cpu._build()
    assert not old.exists() and fresh.exists()  # a build that may still be running keeps its file

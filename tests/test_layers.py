"""Layering: the host side (scheduling, blocks, requests, config) imports no device stack.

Checked in a fresh interpreter: in this one, other test modules have long since
imported jax."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOST_MODULES = ("jpaged.scheduler", "jpaged.stats", "jpaged.block_manager", "jpaged.prefix_cache", "jpaged.sequence",
                "jpaged.request_parsing", "jpaged.config", "jpaged.swap_space", "jpaged.model_config",
                "jpaged.rounding")
DEVICE_PACKAGES = ("jax", "flax", "pallas_kernels")


def imported_packages(modules: tuple[str, ...]) -> set[str]:
    """Top-level packages loaded by importing `modules` in a fresh interpreter run from
    this checkout (ahead of any installed copy of jpaged)."""
    code = (f"import sys\nfor m in {list(modules)!r}: __import__(m)\n"
            "assert sys.modules['jpaged'].__file__.startswith(sys.argv[1]), sys.modules['jpaged'].__file__\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_host_modules_import_no_device_stack():
    loaded = imported_packages(HOST_MODULES)
    assert "jpaged" in loaded
    assert not loaded & set(DEVICE_PACKAGES), sorted(loaded & set(DEVICE_PACKAGES))


def test_loaders_import_no_device_stack():
    """Reading a GGUF file, tokenizing or loading weights into numpy needs no jax either
    (the orbax cache brings it in only when used)."""
    loaded = imported_packages(("jpaged.gguf", "jpaged.tokenizer", "jpaged.weights"))
    assert not loaded & set(DEVICE_PACKAGES), sorted(loaded & set(DEVICE_PACKAGES))


def test_importing_the_library_leaves_jax_config_alone():
    """jax's process-wide settings are the program's: importing jpaged.decode or
    the engine changes none of them (the compilation cache is set only when asked)."""
    code = ("import jax\nbefore = dict(jax.config.values)\nimport jpaged.decode, jpaged.engine\n"
            "changed = sorted(k for k, v in jax.config.values.items() if before.get(k) != v)\n"
            "assert not changed, changed\nprint('ok')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

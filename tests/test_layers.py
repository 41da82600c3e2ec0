"""Layering: the host side (scheduling, blocks, requests, config) imports no device stack.

Checked in a fresh interpreter: in this one, other test modules have long since
imported jax."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOST_PACKAGES = ("core", "structured", "speculative")  # every module in these imports no device stack
LOADER_PACKAGES = ("loading", "tokenizer")  # nor do these, unless the orbax cache is used
DEVICE_PACKAGES = ("jax", "flax", "pallas_kernels")


def package_modules(*packages: str) -> tuple[str, ...]:
    """Every module of the given jpaged subpackages, found on disk (a new module is checked too)."""
    return tuple(f"jpaged.{pkg}" + ("" if f.stem == "__init__" else f".{f.stem}")
                 for pkg in packages for f in sorted((ROOT / "jpaged" / pkg).glob("*.py")))


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
    modules = package_modules(*HOST_PACKAGES)
    assert "jpaged.core.scheduler" in modules
    loaded = imported_packages(modules)
    assert "jpaged" in loaded
    assert not loaded & set(DEVICE_PACKAGES), sorted(loaded & set(DEVICE_PACKAGES))


def test_loaders_import_no_device_stack():
    """Reading a GGUF file, tokenizing or loading weights into numpy needs no jax either
    (the orbax cache brings it in only when used)."""
    loaded = imported_packages(package_modules(*LOADER_PACKAGES))
    assert not loaded & set(DEVICE_PACKAGES), sorted(loaded & set(DEVICE_PACKAGES))


def test_importing_the_library_leaves_jax_config_alone():
    """jax's process-wide settings are the program's: importing jpaged.decode or
    the engine changes none of them (the compilation cache is set only when asked)."""
    code = ("import jax\nbefore = dict(jax.config.values)\nimport jpaged.decode, jpaged.engine.llm\n"
            "changed = sorted(k for k, v in jax.config.values.items() if before.get(k) != v)\n"
            "assert not changed, changed\nprint('ok')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

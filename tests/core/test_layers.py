"""Layering: every import points down the package floors, there is no import
cycle, the host side (scheduling, blocks, requests, config) imports no device
stack, and no module grows past 500 lines.

The floors, top to bottom (docs/design.md says the same):

    entrypoints > engine, decode > runtime > loading > models > layers > tokenizer
    > formats > core > structured, speculative

A module may import its own package and any package on a lower floor; an import
inside a function counts too (a lazy import is still a dependency).  The
no-device-stack checks run in a fresh interpreter: in this one, other test
modules have long since imported jax."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOST_PACKAGES = ("core", "structured", "speculative")  # every module in these imports no device stack
LOADER_PACKAGES = ("loading", "tokenizer")  # nor do these, unless the orbax cache is used
DEVICE_PACKAGES = ("jax", "flax", "pallas_kernels")


FLOORS = (("entrypoints",), ("engine", "decode"), ("runtime",), ("loading",), ("models",), ("layers",),
          ("tokenizer",), ("formats",), ("core",), ("structured", "speculative"))
FLOOR = {pkg: len(FLOORS) - i for i, floor in enumerate(FLOORS) for pkg in floor}


def jpaged_imports() -> dict[str, list[tuple[str, int]]]:
    """Each jpaged module's imports of other jpaged modules (module, line): every
    `import` and absolute `from` statement in the file, in functions too."""
    imports = {}
    for path in sorted((ROOT / "jpaged").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found += [(node.module, node.lineno)] + [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
        imports[module] = [(name, line) for name, line in found if name.startswith("jpaged.")]
    return imports


def package(module: str) -> str | None:
    """The subpackage (or top-level module: decode) a jpaged module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_package_has_a_floor():
    packages = {package(m) for m in jpaged_imports()} - {None}
    assert packages <= set(FLOOR), f"put {sorted(packages - set(FLOOR))} on a floor in FLOORS"


def test_imports_point_down_the_floors():
    upward = [f"{module}:{line} imports {name}" for module, names in jpaged_imports().items()
              for name, line in names
              if package(module) in FLOOR and package(name) in FLOOR
              and FLOOR[package(name)] > FLOOR[package(module)]]
    assert not upward, "imports up a floor:\n" + "\n".join(sorted(set(upward)))


def test_no_import_cycles():
    imports = jpaged_imports()
    graph = {m: {name for name, _ in names if name in imports and name != m} for m, names in imports.items()}
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan: strongly connected components of more than one module
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_see_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    """The two checks above fail on a planted upward import and cycle."""
    pkg = tmp_path / "jpaged"
    for sub, body in (("core", "from jpaged.engine.b import x\n"), ("engine", "import jpaged.core.a\n")):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / ("a.py" if sub == "core" else "b.py")).write_text(body)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="jpaged.core.a:1 imports jpaged.engine.b"):
        test_imports_point_down_the_floors()
    with pytest.raises(AssertionError, match="jpaged.core.a <-> jpaged.engine.b|jpaged.engine.b <-> jpaged.core.a"):
        test_no_import_cycles()


def package_modules(*packages: str) -> tuple[str, ...]:
    """Every module of the given jpaged subpackages and theirs, found on disk (a new module is checked too)."""
    return tuple(".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for pkg in packages for f in sorted((ROOT / "jpaged" / pkg).rglob("*.py")))


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


MAX_MODULE_LINES = 500  # a module that grows past this has a collaborator waiting to be split out


def test_no_module_is_over_the_line_limit():
    """Every jpaged module stays readable in one sitting (the kernels, in
    pallas_kernels, and the C++ source are not jpaged modules)."""
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in (ROOT / "jpaged").rglob("*.py")}
    over = {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not over, f"over {MAX_MODULE_LINES} lines: {over}"

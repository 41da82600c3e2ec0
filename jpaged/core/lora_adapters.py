"""LoRA adapters, host side: the projections they may target and their shapes,
the one rule for an adapter's name (given at start in lora_modules, or at run
time to load_lora_adapter), and the lora_modules spec "name=path,..."."""

from __future__ import annotations

import re
from typing import Any

from jpaged.core.model_config import ModelConfig

# The projections an adapter may target, in jpaged's names (PEFT's: jpaged.loading.peft_config.PEFT_MODULES).
LORA_TARGETS: tuple[str, ...] = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def lora_module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """target -> (in, out) of its base weight, as `weight_shapes` gives it per layer."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
            "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}


# Adapter names, at start (lora_modules) and at run time (/v1/load_lora_adapter,
# LLM.load_lora_adapter): one rule.  A name is a "model" in requests, a label
# value in /metrics (joined with ","), a log field: 1 to 128 letters, digits
# and _-./: ("org/name:v1.2"), never "..", nor starting or ending with "/".
ADAPTER_NAME_RULE = "1 to 128 characters, each a letter, a digit or one of _-./:, without '..' or a leading or " \
    "trailing '/'"
_ADAPTER_NAME = re.compile(r"(?!/)(?!.*\.\.)[A-Za-z0-9_\-./:]{1,128}(?<!/)")


def adapter_name_error(name: Any) -> str | None:
    """Why `name` cannot name an adapter (see ADAPTER_NAME_RULE), or None if it can."""
    if not isinstance(name, str):
        return f"an adapter name is a string, not {type(name).__name__}"
    if not _ADAPTER_NAME.fullmatch(name):
        shown = repr(name) if len(name) <= 64 else f"{name[:64]!r}... ({len(name):,} characters)"
        return f"adapter name {shown} is not {ADAPTER_NAME_RULE}"
    return None


def check_adapter_name(name: Any) -> str:
    """`name`, or ValueError saying why it cannot name an adapter."""
    error = adapter_name_error(name)
    if error:
        raise ValueError(error)
    return name


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
        if adapter_name_error(name):
            raise ValueError(f"LoRA module name {name!r} is not {ADAPTER_NAME_RULE}")
        if not path:
            raise ValueError(f"LoRA module {name!r} has an empty path")
        if name in out:
            raise ValueError(f"LoRA module name {name!r} is given twice")
        out[name] = path
    return out

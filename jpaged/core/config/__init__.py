"""The engine's configuration: typed pydantic sections (sections.py: model
loading, KV cache, scheduling, runtime, parallel, speculative, LoRA, sampling
defaults, server), seen on the command line and in configs/*.py as one flat
ml_collections ConfigDict (flat.py) whose every field can be overridden as
`--config.field=value`.

A config is checked once, before anything loads: `apply_overrides` builds it
from the defaults (a misspelt field names the nearest real one) and
`validate_config` checks every field's type and range and the fields against
each other, the model path and this machine (checks.py).  Either raises
`ConfigError`, whose message is one line, `<field>: <what is wrong>; <what is
allowed>`.  Validation reads no weights (at most a model file's first 4 bytes)
and takes milliseconds, so a bad setting fails before minutes of weight
conversion.  `sections(cfg)` is a checked config's typed view.
"""

from typing import Any, Mapping

from jpaged.core.config.checks import auto_load_format, model_path, readable_formats
from jpaged.core.config.errors import ConfigError
from jpaged.core.config.flat import (DEPRECATED_FIELDS, FIELDS, FieldSpec, apply_overrides, default_config,
                                     sections, validate_config)
from jpaged.core.config.help import config_help
from jpaged.core.config.sections import (ATTENTION_IMPLS, DTYPES, EMBEDDED_FILE, EMBEDDED_MODEL, EMBEDDED_PACKAGE,
                                         KV_CACHE_DTYPES, LAYER_LOOPS, LOAD_FORMATS, LOGPROBS_MODES,
                                         MATMUL_IMPLS,
                                         MAX_SPECULATIVE_TOKENS, PREEMPTION_MODES, PREFIX_CACHE_INDEXES, SCHEDULERS,
                                         SPECULATIVE_METHODS, CacheConfig, EngineConfig, LoadConfig, LoRAConfig,
                                         ParallelConfig, RuntimeConfig, SamplingDefaults, SchedulerConfig,
                                         ServerConfig, SpeculativeConfig, lora_slot_count)
from jpaged.core.kv_layout import KV_LAYOUTS


def lora_slots(cfg: Mapping[str, Any]) -> int:
    """Adapter slots the engine keeps on the device (0: adapters off), of a flat config."""
    return lora_slot_count(cfg["max_loras"], cfg["lora_modules"])


__all__ = [
    "ATTENTION_IMPLS", "DEPRECATED_FIELDS", "DTYPES", "EMBEDDED_FILE", "EMBEDDED_MODEL", "EMBEDDED_PACKAGE", "FIELDS",
    "KV_CACHE_DTYPES", "KV_LAYOUTS", "LAYER_LOOPS", "LOAD_FORMATS", "LOGPROBS_MODES", "MATMUL_IMPLS", "MAX_SPECULATIVE_TOKENS",
    "PREEMPTION_MODES", "PREFIX_CACHE_INDEXES", "SCHEDULERS", "SPECULATIVE_METHODS", "CacheConfig", "ConfigError",
    "EngineConfig", "FieldSpec", "LoRAConfig", "LoadConfig", "ParallelConfig", "RuntimeConfig", "SamplingDefaults",
    "SchedulerConfig", "ServerConfig", "SpeculativeConfig", "apply_overrides", "auto_load_format", "config_help",
    "default_config", "lora_slots", "model_path", "readable_formats", "sections", "validate_config",
]

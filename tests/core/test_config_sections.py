"""The config's typed sections (jpaged/core/config/sections.py): each flat field
lives in exactly one section, the choice tuples are the Literals' arguments, a
bad choice or range is refused by pydantic and reported as the one-line
ConfigError, `sections(cfg)` is the typed view the scheduler and the runner take,
and the command line's help lists every field from the sections."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import get_args

import pydantic
import pytest

from jpaged.core import config
from jpaged.core.config import (FIELDS, CacheConfig, ConfigError, EngineConfig, SchedulerConfig, apply_overrides,
                                config_help, default_config, sections)
from jpaged.core.config.help import field_help
from jpaged.core.config.sections import section_types


def typed(**overrides) -> EngineConfig:
    return sections(apply_overrides(default_config(), None, **overrides))


def test_every_flat_field_is_in_one_section_with_the_same_default():
    names = [name for section in section_types().values() for name in section.model_fields]
    assert len(names) == len(set(names)) and sorted(names) == sorted(default_config().keys())
    engine, flat = EngineConfig(), default_config()
    for name, spec in FIELDS.items():
        value = getattr(getattr(engine, spec.section), name)
        assert value == flat[name] and type(value) is type(flat[name]), name
        assert spec.description, f"{name} has no description"


def test_choice_tuples_are_read_off_the_literals():
    for tuple_name, section, name in [("SCHEDULERS", "scheduler", "scheduler"), ("DTYPES", "load", "dtype"),
                                      ("KV_CACHE_DTYPES", "cache", "kv_cache_dtype"),
                                      ("ATTENTION_IMPLS", "runtime", "attention_impl"),
                                      ("PREEMPTION_MODES", "scheduler", "preemption_mode"),
                                      ("KV_LAYOUTS", "cache", "kv_layout"),
                                      ("SPECULATIVE_METHODS", "speculative", "speculative_method")]:
        annotation = section_types()[section].model_fields[name].annotation
        assert getattr(config, tuple_name) == get_args(annotation), tuple_name
        assert FIELDS[name].choices == get_args(annotation)


def test_a_choice_outside_the_literal_is_one_line():
    with pytest.raises(ConfigError) as e:
        typed(scheduler="fifo")
    assert str(e.value) == "scheduler: 'fifo' is not allowed; one of: continuous, static"
    assert e.value.field == "scheduler"
    with pytest.raises(ConfigError, match=r"^kv_layout: 3 \(int\) is not a string; one of: auto, shared$"):
        typed(kv_layout=3)
    with pytest.raises(pydantic.ValidationError):  # the section itself refuses it too
        SchedulerConfig(scheduler="fifo")


def test_ranges_are_the_fields_bounds():
    with pytest.raises(ConfigError, match=r"^block_size: 257 is not allowed; an integer in \[1, 256\]$"):
        typed(block_size=257)
    with pytest.raises(ConfigError, match=r"^kv_memory_fraction: 0.0 is not allowed; a number in \(0, 1\]$"):
        typed(kv_memory_fraction=0.0)
    with pytest.raises(ConfigError, match=r"^num_blocks: 1 is not allowed; 0 \(sized from kv_memory_fraction\)"):
        typed(num_blocks=1)
    with pytest.raises(ConfigError, match=r"^xla_step_options: 'graphs' is not allowed; "):
        typed(xla_step_options="graphs")
    with pytest.raises(pydantic.ValidationError):
        CacheConfig(block_size=0)
    assert typed(block_size=256, kv_memory_fraction=1.0).cache.block_size == 256


def test_cross_field_rules_are_the_sections_validators():
    message = ("max_num_batched_tokens: 8 is less than max_num_seqs (16); at least max_num_seqs: every running "
               "sequence's decode token must fit in one step")
    with pytest.raises(ConfigError) as e:
        typed(max_num_seqs=16, max_num_batched_tokens=8)
    assert str(e.value) == message
    with pytest.raises(pydantic.ValidationError, match=re.escape(message)):
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=8)
    with pytest.raises(ConfigError, match=r"^dtype: 'bfloat16' with batch_invariant; "):
        typed(batch_invariant=True, dtype="bfloat16")


def test_sections_is_the_typed_view_and_resolved_fills_in_the_autos():
    engine = typed(max_num_seqs=4, block_size=32, speculative_method="ngram", num_speculative_tokens=3,
                   lora_modules="", max_loras=2, dtype="bfloat16")
    assert (engine.scheduler.max_num_seqs, engine.cache.block_size) == (4, 32)
    assert engine.speculative.width == 3 and typed().speculative.width == 0
    assert engine.lora.slots == 2 and typed().lora.slots == 0
    with pytest.raises(pydantic.ValidationError):  # frozen
        engine.cache.block_size = 8
    resolved = engine.resolved(num_blocks=100, attention_impl="reference", scan_layers=True)
    assert resolved.cache.num_blocks == 100 and resolved.cache.kv_cache_dtype == "bfloat16"
    assert (resolved.runtime.attention_impl, resolved.runtime.layer_loop) == ("reference", "scan")
    assert engine.cache.num_blocks == 0 and resolved.scheduler == engine.scheduler
    assert typed(kv_cache_dtype="int8").resolved(num_blocks=2, attention_impl="cpu",
                                                  scan_layers=False).cache.kv_cache_dtype == "int8"


def test_help_lists_every_field_with_its_type_default_and_description():
    text = config_help()
    for name, spec in FIELDS.items():
        assert field_help(name) in text
        assert f"--config.{name} (" in text and f"default {spec.default!r}" in field_help(name)
        assert spec.description in field_help(name) and spec.allowed in field_help(name)
    assert "--config.block_size (int, default 16; an integer in [1, 256]): Tokens per KV block." in text
    assert "--config.scheduler (str, default 'continuous'; one of: continuous, static): " in text
    assert "[scheduler] " in text and "[cache] " in text


def test_jpaged_batch_help_shows_every_field(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "from jpaged.entrypoints.main import main; main()",
                           "batch", "--helpfull"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = re.sub(r"\s", "", proc.stdout)  # absl wraps the lines
    for name in FIELDS:
        assert re.sub(r"\s", "", field_help(name)) in out, name

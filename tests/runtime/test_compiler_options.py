"""config.xla_step_options (jpaged.core.xla_options): parsed once, handed to XLA
with every step program, part of every program's cache key; on the CPU XLA checks
the GPU options and ignores them, so the tokens stay the same."""

from __future__ import annotations

import jax
import pytest

from helpers import random_prompts
from jpaged.core.config import ConfigError, apply_overrides, default_config, validate_config
from jpaged.core.sequence import SamplingParams
from jpaged.core.xla_options import PRESETS, options_text, parse_xla_options

ENGINE = dict(num_blocks=59, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
PROMPTS = random_prompts([5, 9, 6, 13], seed=31)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
GPU_DECODE = "command_buffer dynamic_slice_fusion xla_gpu_autotune_level=0"


@pytest.fixture(autouse=True, scope="module")
def no_xla_cache_writes():
    """Programs compiled here are not served from JAX's persistent cache (such a
    program is not written to the program cache: see compilation._watch_xla_cache)."""
    old = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old)


def tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_parse_presets_pairs_and_values():
    assert parse_xla_options("") == {}
    options = parse_xla_options("command_buffer dynamic_slice_fusion xla_gpu_graph_min_graph_size=3 xla_a=false "
                                "xla_b=TRUE xla_c=-2 xla_d=FUSION,WHILE")
    assert options == {**PRESETS["command_buffer"], **PRESETS["dynamic_slice_fusion"],
                       "xla_gpu_graph_min_graph_size": 3,  # a later word wins
                       "xla_a": False, "xla_b": True, "xla_c": -2, "xla_d": "FUSION,WHILE"}
    assert "WHILE" in options["xla_gpu_enable_command_buffer"].split(",")
    assert options_text({"b": 1, "a": True}) == "a=True b=1"
    for bad in ("graphs", "xla_a", "xla_a=", "--xla_a=1", "gpu_a=1", "=1"):
        with pytest.raises(ValueError, match="neither a preset"):
            parse_xla_options(bad)


def test_config_rejects_a_bad_word_in_one_line():
    with pytest.raises(ConfigError) as e:
        validate_config(apply_overrides(default_config(), None, xla_step_options="command_buffer graphs"))
    assert str(e.value).startswith("xla_step_options: 'command_buffer graphs' is not allowed; ")
    assert "\n" not in str(e.value)


def test_options_reach_xla(make_tiny_llm):
    """A value of the wrong type for a real XLA option is XLA's error, raised when
    the program is built: the options were handed to the compile."""
    llm = make_tiny_llm(**ENGINE, xla_step_options="xla_gpu_graph_min_graph_size=many")
    with pytest.raises(Exception, match="xla_gpu_graph_min_graph_size"):
        llm.precompile(max_num_tokens=4)
    llm = make_tiny_llm(**ENGINE, xla_step_options="xla_gpu_no_such_option=1")
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
        llm.precompile(max_num_tokens=4)


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_cpu_ignores_gpu_options_same_tokens(make_tiny_llm, layer_loop):
    plain = tokens(make_tiny_llm(**ENGINE, layer_loop=layer_loop))
    gpu = make_tiny_llm(**ENGINE, layer_loop=layer_loop, xla_step_options=GPU_DECODE)
    assert gpu.runner._programs.compiler_options == parse_xla_options(GPU_DECODE)
    assert tokens(gpu) == plain


def test_options_are_part_of_the_cache_key(make_tiny_llm, tmp_path):
    """A program built with other options is never loaded; one built with the same is."""
    def engine(options: str):
        return make_tiny_llm(**ENGINE, compilation_cache=True, cache_dir=str(tmp_path), xla_step_options=options)
    plain = engine("")
    reference = tokens(plain)
    plain.runner.wait_for_programs()
    assert plain.program_build["programs_compiled"] > 0
    gpu = engine(GPU_DECODE)
    assert gpu.num_compilations == 0  # nothing preloaded: its programs' keys differ
    assert tokens(gpu) == reference
    gpu.runner.wait_for_programs()
    assert gpu.program_build["programs_loaded"] == 0 < gpu.program_build["programs_compiled"]
    assert options_text(parse_xla_options(GPU_DECODE)) in gpu.runner._programs._base_key
    again = engine(GPU_DECODE)
    assert again.num_compilations == gpu.num_compilations  # its own entries, preloaded
    assert tokens(again) == reference
    assert again.program_build["programs_compiled"] == 0

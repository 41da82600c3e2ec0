"""Step programs (jpaged.runtime.compilation): a warm start loads every program
from <cache_dir>/programs and traces nothing, any change to what a program
depends on misses, a damaged entry is rebuilt, a step runs padded to a larger
ready bucket while its own is built, and precompile can run in the background."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from helpers import random_prompts
from jpaged.core.sequence import SamplingParams
from jpaged.entrypoints.metrics import format_summary, summarize
from jpaged.runtime import compilation

# The finer ladder, and a padded step's own bucket built in the background (the
# suite's tiny engines skip that build: helpers.TINY_ENGINE), which these tests follow.
ENGINE = dict(num_blocks=61, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, buckets_per_octave=8,
              build_padded_buckets=True)
RUNGS = 4  # precompile(): buckets 4, 8, 16, 32 of (4, 8, 16, 18, ..., 32)
PROMPTS = random_prompts([5, 9, 6, 13], seed=23)  # the first step: 33 tokens, 32 then 1 (buckets 32, 4)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def no_xla_cache():
    """JAX's persistent cache off in this module: a compile it serves is not
    written to the program cache (see compilation._watch_xla_cache), and the
    suite's cache outlives the run (a machine's earlier runs may hold these
    engines' programs), so the counts below would depend on it."""
    jax.config.update("jax_enable_compilation_cache", False)
    jax_cache.reset_cache()  # JAX decides once per process whether to read it
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    jax_cache.reset_cache()


@pytest.fixture(scope="module")
def reference(make_tiny_llm):
    """Tokens of the exact buckets: an engine with no program cache, nothing precompiled."""
    return [o.token_ids for o in make_tiny_llm(**ENGINE).generate(PROMPTS, GREEDY)]


def cached_engine(make_tiny_llm, cache_dir, **overrides):
    return make_tiny_llm(**{**ENGINE, "compilation_cache": True, "cache_dir": str(cache_dir), **overrides})


def run(llm, prompts=PROMPTS):
    tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    llm.runner.wait_for_programs()
    return tokens


def entries(cache_dir):
    return sorted((cache_dir / "programs").glob("*/*.program"))  # a folder per engine


def test_warm_start_loads_every_program(make_tiny_llm, tmp_path, reference):
    first = cached_engine(make_tiny_llm, tmp_path)
    assert run(first) == reference
    built = first.program_build
    assert built["programs_loaded"] == 0 and built["programs_compiled"] == first.num_compilations > 0
    assert len(entries(tmp_path)) == first.num_compilations

    second = cached_engine(make_tiny_llm, tmp_path)
    assert second.num_compilations == first.num_compilations  # preloaded when the engine was built
    outs = second.generate(PROMPTS, GREEDY)
    assert second.stats.compile_seconds == 0  # the run itself waited for no program
    assert [o.token_ids for o in outs] == reference
    loaded = second.program_build
    assert loaded["programs_compiled"] == 0 and loaded["trace_lower_s"] == 0
    assert loaded["programs_loaded"] == second.num_compilations == first.num_compilations
    text = format_summary(summarize(outs, second, 1.0))
    assert re.search(rf"compilations \(compile time\) +{second.num_compilations} \(\d+\.\d s\)\n", text)
    assert f"({second.num_compilations} of {second.num_compilations} from disk)" in text


def test_changed_key_misses(make_tiny_llm, tmp_path, monkeypatch):
    """Another pool layout, or another source of the engine's code: nothing loads."""
    run(cached_engine(make_tiny_llm, tmp_path))
    assert entries(tmp_path)
    other_blocks = cached_engine(make_tiny_llm, tmp_path, block_size=8)
    run(other_blocks)
    assert other_blocks.program_build["programs_loaded"] == 0
    monkeypatch.setattr(compilation, "code_fingerprint", lambda: "edited source")
    other_code = cached_engine(make_tiny_llm, tmp_path)
    run(other_code)
    assert other_code.program_build["programs_loaded"] == 0 < other_code.program_build["programs_compiled"]


def test_damaged_entries_are_rebuilt(make_tiny_llm, tmp_path, reference, caplog):
    first = cached_engine(make_tiny_llm, tmp_path)
    assert first.precompile() == RUNGS
    truncated, flipped, foreign, intact = entries(tmp_path)
    truncated.write_bytes(truncated.read_bytes()[:-100])
    data = bytearray(flipped.read_bytes())
    data[-10] ^= 0xFF
    flipped.write_bytes(bytes(data))
    foreign.write_bytes(intact.read_bytes())  # a valid entry, of another key
    with caplog.at_level(logging.WARNING, logger=compilation.__name__):
        second = cached_engine(make_tiny_llm, tmp_path)  # preloads the intact entry, skips the others
        assert second.precompile() == RUNGS - 1
        assert run(second) == reference
    warnings = [r.getMessage() for r in caplog.records if "unusable" in r.getMessage()]
    assert len(warnings) == 3, warnings
    assert second.program_build["programs_loaded"] == 1  # the intact one
    third = cached_engine(make_tiny_llm, tmp_path)  # the rebuilt entries were rewritten
    third.precompile()
    assert third.program_build == {**third.program_build, "programs_compiled": 0, "programs_loaded": RUNGS}


def test_unserializable_program_still_runs(make_tiny_llm, tmp_path, reference, monkeypatch, caplog):
    def refuse(exe):
        raise ValueError("Compilation does not support serialization")
    monkeypatch.setattr(compilation.serialize_executable, "serialize", refuse)
    with caplog.at_level(logging.WARNING, logger=compilation.__name__):
        assert run(cached_engine(make_tiny_llm, tmp_path)) == reference
    assert any("cannot serialize" in r.getMessage() for r in caplog.records)
    assert not entries(tmp_path)


def test_larger_bucket_gives_the_same_tokens(make_tiny_llm):
    """After precompile() only the power-of-two buckets are ready: a step of 18 to
    30 tokens runs padded to 32 (its own bucket built meanwhile), with the tokens
    of its own bucket (which a fresh engine builds and waits for)."""
    llm = make_tiny_llm(**ENGINE)
    assert llm.precompile() == RUNGS
    prompts = random_prompts([7, 12], seed=24)  # a prefill of 19 tokens: bucket 20
    first = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=1))]
    assert llm.stats.token_slots == 32  # it ran padded to 32
    llm.runner.wait_for_programs()
    assert (20, 4) in [k[:2] for k in llm.runner.compiled_shapes]  # and its own bucket was built
    exact = run(make_tiny_llm(**ENGINE), prompts)
    assert first == [t[:1] for t in exact]
    assert run(llm, prompts) == exact


def test_background_precompile(make_tiny_llm, reference):
    llm = make_tiny_llm(**ENGINE)
    assert llm.precompile(background=True) == RUNGS
    assert llm.num_compilations < RUNGS  # it returned before building them
    assert llm.precompile(background=True) == 0  # in flight already
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    llm.runner.wait_for_programs()
    assert llm.num_compilations >= RUNGS


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread priorities are per thread on Linux only")
def test_background_builds_run_below_the_serving_threads(make_tiny_llm):
    make_tiny_llm(**ENGINE).precompile(background=True)
    builders = [t for t in threading.enumerate() if t.name.startswith("jpaged-programs")]
    assert builders
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for t in builders:  # every engine's builder, this one's included
        assert os.getpriority(os.PRIO_PROCESS, t.native_id) >= max(own, compilation.BACKGROUND_NICE)

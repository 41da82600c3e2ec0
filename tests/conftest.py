"""Shared, expensive fixtures: tiny random HF checkpoints and one embedded SmolLM2 engine.

Everything here is session-scoped so the whole suite builds each model once.
The tiny checkpoints are not cached by jpaged (HF dirs are read memory-mapped),
so they need no cache dir; the embedded model uses the default converted-weights
cache so that repeated runs skip the GGUF conversion.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
from importlib.metadata import version

# XLA's CPU backend at LLVM -O0 without its expensive passes, for this process and
# the servers and scripts it starts: the suite compiles hundreds of step programs
# (most of its cold time) and runs each for a few tokens, so compile time is what
# matters here.  The programs compute the same HLO; set before jax starts its backend.
_TEST_XLA_FLAGS = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
# XLA:CPU's older IR emitters instead of its fusion emitters: cold, the suite's
# programs compile about 30 % faster (measured on three compile-heavy modules:
# 116 s -> 78 s).  Only on jaxlib 0.10, where the flag is known to exist: XLA
# aborts on an unknown flag.
if version("jaxlib").startswith("0.10."):
    _TEST_XLA_FLAGS.append("--xla_cpu_use_fusion_emitters=false")

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_TEST_XLA_FLAGS]).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# Four simulated CPU devices for the sharding tests (tests/runtime/test_sharding.py), set
# before jax initialises its backend in any test worker; everything else runs on
# the first device as before.
jax.config.update("jax_num_cpu_devices", 4)


def _pin_worker_to_its_cores() -> None:
    """Puts each xdist worker, every thread of it, on a share of the cores of its own
    (one core each on 2 cores), when there are no more workers than cores.

    Unpinned, two workers on a 2-core machine run four busy threads on two cores:
    XLA's intra-op pool, which our CPU kernels split a step's work over, has a
    thread per core in each worker. A step split in two then waits for the half
    whose core the other worker took. The suite's times pinned and unpinned are in
    benchmarks/README.md ("make test's time").

    The backend starts first, so its pools keep their thread per core: the
    kernels' thread-count tests still split work over two threads (on one core).
    Threads and processes started later inherit the share."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and count.isdigit() and hasattr(os, "sched_setaffinity")):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if int(count) > len(cpus):
        return
    jax.devices()  # the backend and its thread pools, sized to every core
    share = set(cpus[int(worker[2:]) % int(count)::int(count)])  # 2 workers on 4 cores: {0, 2} and {1, 3}
    for thread_id in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(thread_id), share)


_pin_worker_to_its_cores()

from helpers import MIN_COMPILE_SECONDS, SMOLLM_ENGINE, TINY_ENGINE, import_torch, with_tokenizer
from jpaged.loading.weight_cache import default_cache_dir

# The suite is an entry point, like the CLI: engines of the same shapes in
# different modules (and later runs) reuse compiled steps.
jax.config.update("jax_compilation_cache_dir", str(default_cache_dir() / "xla"))
# Programs that take over 0.1 s to compile, not only JAX's default of over 1 s:
# the suite builds many engines of the same shapes (make_tiny_llm in most
# modules), and the tiny model's step programs (under 1 s each) would otherwise
# compile again for each one; from the cache a repeat costs its tracing only
# (~0.3 s, not ~2 s).  Eager single ops (a few ms each) stay out: writing them
# costs more than it saves.
jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)

# Tiny models: 2 layers, GQA (4 query heads over 2 KV heads), vocabulary 256.
TINY_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                   bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _randomize(model, torch, seed: int) -> None:
    """Weights with real spread: matrices N(0, 0.2), norms 1 + N(0, 0.1), biases N(0, 0.1).

    Transformers' init (std 0.02, norms 1, biases 0) gives nearly flat logits,
    whose argmax flips on rounding noise; spread-out weights make greedy decoding
    decisive, so an exact token comparison is meaningful rather than flaky.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)


def _make_tiny(kind: str, root: pathlib.Path):
    torch = import_torch()
    import transformers

    if kind == "qwen2":  # q/k/v bias, tied embeddings
        cfg = transformers.Qwen2Config(**TINY_COMMON, tie_word_embeddings=True, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":  # q/k norms, head_dim set apart from hidden_size / heads
        cfg = transformers.Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif kind == "gemma2":  # alternating window-8 and global layers, both soft caps
        cfg = transformers.Gemma2Config(**{**TINY_COMMON, "num_hidden_layers": 4}, head_dim=16,
                                        sliding_window=8, query_pre_attn_scalar=24,
                                        attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                                        attn_implementation="eager")
        model = transformers.Gemma2ForCausalLM(cfg)
    elif kind == "gemma3":  # q/k norms, 2 sliding layers per global one, local RoPE base
        cfg = transformers.Gemma3TextConfig(
            **{**TINY_COMMON, "num_hidden_layers": 3}, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}},
            attn_implementation="eager")
        model = transformers.Gemma3ForCausalLM(cfg)
    elif kind == "qwen3_moe":  # 4 experts, top-2 renormalised, q/k norms; layer 0 dense (mlp_only_layers)
        cfg = transformers.Qwen3MoeConfig(**TINY_COMMON, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0])
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif kind == "mixtral":  # 4 experts, top-2, in every layer
        cfg = transformers.MixtralConfig(**{**TINY_COMMON, "intermediate_size": 32}, num_local_experts=4,
                                         num_experts_per_tok=2, tie_word_embeddings=False)
        model = transformers.MixtralForCausalLM(cfg)
    else:  # llama 3 RoPE scaling, untied lm_head
        cfg = transformers.LlamaConfig(**TINY_COMMON, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)
        model = transformers.LlamaForCausalLM(cfg)
    _randomize(model, torch, seed=TINY_KINDS.index(kind))
    model = model.float().eval()
    out = root / kind
    model.save_pretrained(out, safe_serialization=True)
    return out, model


@pytest.fixture
def keep_signal_handlers():
    """batch.run installs SIGINT / SIGTERM handlers: put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-hf")


def _tiny_fixture(kind: str):
    """A session fixture `tiny_<kind>`: (checkpoint dir, HF torch model) of a tiny
    random checkpoint (see _make_tiny for what each one exercises)."""
    @pytest.fixture(scope="session", name=f"tiny_{kind}")
    def fixture(tiny_root):
        return _make_tiny(kind, tiny_root)
    return fixture


TINY_KINDS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3_moe", "mixtral")
tiny_llama, tiny_qwen2, tiny_qwen3, tiny_gemma2, tiny_gemma3, tiny_qwen3_moe, tiny_mixtral = \
    map(_tiny_fixture, TINY_KINDS)


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_llama):
    return str(tiny_llama[0])


@pytest.fixture(scope="session")
def tiny_llama_tok_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama plus a byte-level tokenizer and a plain chat template, for
    tests that take text but do not test the model (see helpers.with_tokenizer)."""
    return str(with_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("tiny-tok") / "llama"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    """A shared engine on the tiny Llama (greedy default, 24 new tokens)."""
    from jpaged.engine.llm import LLM
    return LLM(model=tiny_llama_dir, **TINY_ENGINE)


@pytest.fixture(scope="session")
def make_tiny_llm(tiny_llama_dir):
    """Factory for engines on the tiny Llama with overrides of TINY_ENGINE."""
    from jpaged.engine.llm import LLM

    def make(**overrides):
        return LLM(model=tiny_llama_dir, **{**TINY_ENGINE, **overrides})
    return make


@pytest.fixture(scope="session")
def smollm_llm():
    from jpaged.engine.llm import LLM
    return LLM(**SMOLLM_ENGINE)


# The longest modules first.  Under xdist's --dist loadfile each worker takes the
# next module in collection order when it is free, so a long module collected
# last (alphabetically: test_server*, test_sharding) would run alone at the end
# on one worker while the other idles; started first, the short ones fill in
# around them.  Roughly longest first; modules not named keep their place after.
LONG_MODULES = ("test_serve_batch.py", "test_server.py", "test_structured_server.py", "test_serve_batch_failures.py",
                "test_sharding.py",
                "test_hf_parity.py", "test_moe.py", "test_moe_ep.py", "test_moe_stats.py", "test_speculative_decoding.py", "test_request_parsing.py", "test_weights.py", "test_server_data_parallel.py",
                "test_server_hardening.py", "test_ray_serve.py", "test_startup_matrix.py", "test_async_scheduling.py",
                "test_compilation.py", "test_device_check.py", "test_gpu_probe.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return LONG_MODULES.index(name) if name in LONG_MODULES else len(LONG_MODULES)
    items.sort(key=rank)  # stable: tests keep their order within a module


# Opt-in: JPAGED_TEST_COMPILE_PROFILE=<path> writes, per xdist worker, the seconds
# each test spent tracing, lowering and compiling in this process (JAX's compile
# events), one JSON line per test: <path>.<worker>.  Cold-run profiling only.
_COMPILE_PROFILE = os.environ.get("JPAGED_TEST_COMPILE_PROFILE")
if _COMPILE_PROFILE:
    import collections
    import json

    _compile_seconds: collections.Counter = collections.Counter()
    _current_test = ["(collection)"]

    def _on_duration(event: str, duration: float, **_: object) -> None:
        if event.startswith("/jax/core/compile/"):
            _compile_seconds[(_current_test[0], event.rsplit("/", 1)[-1])] += duration

    jax.monitoring.register_event_duration_secs_listener(_on_duration)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _current_test[0] = item.nodeid
        yield

    def pytest_sessionfinish(session):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{_COMPILE_PROFILE}.{worker}", "w") as f:
            for (test, event), secs in sorted(_compile_seconds.items()):
                f.write(json.dumps({"test": test, "event": event, "seconds": round(secs, 3)}) + "\n")

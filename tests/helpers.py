"""Shared test helpers and engine settings (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import socket

import numpy as np
import pytest


def import_torch():
    """torch for the reference side, on one thread: on a shared, loaded CPU its
    default thread pool oversubscribes the cores and runs ~8x slower."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    return torch


# Engine settings for the tiny Llama: small pool and lengths keep compiles cheap, and
# so does the power-of-two ladder (buckets_per_octave=1: a few programs per engine;
# tests of the finer default ladder ask for it).  A step whose bucket is not built runs
# padded to a larger built one and builds nothing more (build_padded_buckets=False):
# most engines here run a few steps, and a background build of a decode bucket after
# the prefill's cost more than the steps it would have saved (tests of the background
# builds ask for them).
# Prefix caching is off so that these tests exercise plain paging (tests turn it on
# where they mean to; tests/core/test_prefix_cache.py covers it in depth).
# Attention is the engine's default ("auto": the C++ kernel on the CPU), as users run
# it.  The jnp reference stays the oracle: the kernel tests compare every kernel with
# it, and test_engine_kernels compares the engine's tokens on each kernel with the
# reference's.  At the suite's XLA level 0 a tiny step on the reference took ~10 ms
# (its gathers and selects, unoptimised) against ~0.7 ms on the kernel, and the
# suite's many short generates spent most of their time there.
FEW_PROGRAMS = dict(buckets_per_octave=1, min_step_tokens=8, build_padded_buckets=False)
TINY_ENGINE = dict(load_format="hf", max_model_len=128, block_size=16, num_blocks=64,
                   max_num_seqs=8, max_num_batched_tokens=128, attention_impl="auto",
                   enable_prefix_caching=False, **FEW_PROGRAMS)


def assert_all_blocks_free(llm) -> None:
    """After a generate(): no block is referenced by a sequence any more.  With the
    prefix cache on, finished blocks may stay cached, but only as evictable ones."""
    bm = getattr(llm, "block_manager", None)
    if bm is not None:
        assert bm.num_used_blocks == 0
        assert bm.num_free_blocks == llm.num_blocks - 1
    if bm is None or not llm.config.enable_prefix_caching:
        assert llm.allocator.num_free_blocks == llm.num_blocks - 1
        assert not any(llm.allocator.is_allocated(b) for b in range(llm.num_blocks))


def random_prompts(lengths, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids 3.., avoiding bos/eos/pad)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


# The embedded SmolLM2: one engine for the whole session.  Unlike the tiny models'
# steps, its steps run long enough for XLA's optimizing backend to pay off, so
# its step programs are built at XLA level 2 (xla_step_options: per program; the
# suite's process-wide XLA_FLAGS stay at level 0, conftest.py), with its 30 layers
# in a lax.scan (one layer traced and compiled).  Measured on this 2-core VM, an
# engine's first 4 x 32 tokens and then 4 x 32 more: level 0 unrolled (before)
# 35.3 + 18.2 s, level 0 scanned 32.1 + 28.7 s, level 2 scanned 9.0 + 6.2 s.
# The layer loop is the same code for every model: the unrolled one (the default)
# is checked against transformers and against the scan on the tiny models
# (test_hf_parity, test_flat_weights, test_compiler_options, test_lora).
SMOLLM_STEP_XLA = dict(layer_loop="scan", xla_step_options="xla_backend_optimization_level=2")
SMOLLM_ENGINE = dict(dtype="float32", max_model_len=256, block_size=16, num_blocks=96,
                     max_num_seqs=8, max_num_batched_tokens=256, attention_impl="auto",
                     buckets_per_octave=1, min_step_tokens=8, **SMOLLM_STEP_XLA)


def config_flags(fields: dict) -> list[str]:
    """Engine settings as command-line overrides (scripts, the CLI, the server)."""
    return [f"--config.{k}={v}" for k, v in fields.items()]


SMOLLM_FLAGS = config_flags(SMOLLM_ENGINE)


def with_tokenizer(model_dir: str, dest: pathlib.Path) -> pathlib.Path:
    """A copy of a tiny checkpoint plus a byte-level tokenizer (its 256 tokens are
    the model's vocabulary) and a plain chat template, so it can take text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    shutil.copytree(model_dir, dest)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(dest / "tokenizer.json"))
    (dest / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    return dest


# The persistent compilation cache keeps programs that took longer than this to
# compile (conftest.py): the tiny model's steps, not eager single ops.
MIN_COMPILE_SECONDS = 0.1


def tiny_gguf_writer(path: pathlib.Path, arch: str, config, head_dims: bool = True):
    """A gguf.GGUFWriter for `arch` holding a tiny transformers config's header as
    convert_hf_to_gguf writes it (lengths, block and head counts, RMS eps, F32): what
    the GGUF twins of tests/loading/test_gguf_families.py and tests/models/test_moe.py
    share; each adds its architecture's own keys, the vocabulary and the tensors."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    if head_dims:
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    return w


def cached_compiles_env(env: dict | None = None) -> dict:
    """The environment for a subprocess (a script, the CLI, a server) that compiles
    into the suite's persistent compilation cache (conftest.py) with the suite's
    threshold, on as many simulated devices as the suite: a program's key (JAX's
    and jpaged's) holds the device count, so only then do the subprocess and the
    pytest process reuse each other's programs of the same shapes."""
    import jax
    return {**(os.environ if env is None else env),
            "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(MIN_COMPILE_SECONDS),
            "JAX_NUM_CPU_DEVICES": str(jax.config.jax_num_cpu_devices)}


def free_port() -> int:
    """A free TCP port on the loopback address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """{sample name with its labels (model_name left out): value} of a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def make_peft_adapter(hf_model, path: pathlib.Path, seed: int, **lora_config):
    """Saves a random PEFT LoRA adapter of `hf_model` to `path` (init_lora_weights=False: B is
    not zero, and spread 8x so that it changes greedy tokens); returns the PEFT model."""
    import copy

    import peft
    torch = import_torch()
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(init_lora_weights=False, **lora_config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(8.0)
    model.save_pretrained(path)
    return model


@contextlib.contextmanager
def serve_in_thread(app, timeout: float = 60.0):
    """`app` under uvicorn on a free local port, in a daemon thread, ready (GET /health
    is 200) when this yields its base URL; stopped on exit."""
    import asyncio
    import threading
    import time
    import urllib.request

    import uvicorn
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", access_log=False,
                                           log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
                if r.status == 200:
                    break
        except OSError:
            pass  # not listening (or not ready) yet
        assert time.monotonic() < deadline, "the server did not get ready"
        time.sleep(0.1)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout)

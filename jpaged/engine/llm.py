"""The offline engine: `LLM(config).generate(prompts)`, like vLLM's LLM class.

Each step: the scheduler picks up to max_num_batched_tokens tokens (decodes and
prefill chunks), the model runner runs one jitted forward + sample over them as
one flat ragged batch (one host<->device round trip), and the engine appends
tokens, applies stop conditions and frees finished sequences.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading
import time
from typing import Any, Iterable, Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm
from flax import nnx

import pallas_kernels
from jpaged.core.config import (KV_CACHE_DTYPES, LAYER_LOOPS, PREEMPTION_MODES, ConfigError, apply_overrides,
                           default_config, validate_config)
from jpaged.core.block_manager import BlockManager
from jpaged.runtime.distributed import broadcast_step
from jpaged.runtime.kv_pool import block_shape, bytes_per_block, num_blocks_for
from jpaged.models import build_model
from jpaged.models.base import split_model
from jpaged.runtime.model_runner import ModelRunner, PendingStep, StepResult
from jpaged.core.scheduler import Scheduler, SchedulerOutput
from jpaged.runtime.sharding import (Mesh, bytes_per_device, check_heads, make_mesh, replicate_kv_heads,
                             shard_params, tensor_parallel_size)
from jpaged.core.stats import EngineStats
from jpaged.core.request_parsing import default_sampling_params
from jpaged.runtime.sampling import TokenLogprobs
from jpaged.core.sequence import SamplingParams, Sequence, Status, TokenLogprob
from jpaged.core.swap_space import HostSwapSpace, swap_capacity_blocks
from jpaged.loading.weights import default_cache_dir, load_weights

log = logging.getLogger(__name__)

PROMPT_KEYS = {"prompt", "messages", "cache_salt"}  # of a chat prompt dict given to generate()

# Config names -> pallas_kernels backend names.
ATTENTION_IMPLS = {"reference": "reference", "cpu": "cpu", "pallas_gpu": "gpu", "pallas_tpu": "tpu"}


def resolve_kv_cache_dtype(name: str, dtype: jnp.dtype) -> jnp.dtype:
    """The KV pool's dtype: "auto" follows the model dtype."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return dtype if name == "auto" else jnp.dtype(name)


def resolve_attention_impl(name: str) -> tuple[str, str]:
    """(the impl that will really run, why it differs from the one asked for or "")."""
    if name == "auto":
        return pallas_kernels.default_impl(), ""
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {sorted(ATTENTION_IMPLS) + ['auto']}, got {name!r}")
    impl = ATTENTION_IMPLS[name]
    if impl == "cpu":
        from pallas_kernels import cpu
        if not cpu.available():  # the backend would fall back to the reference on every call
            return "reference", f"cpu kernel unavailable: {cpu.unavailable_reason()}"
    return impl, ""


def use_compilation_cache(directory: pathlib.Path) -> None:
    """Points JAX's persistent compilation cache (a process-wide setting) at
    `directory`, unless the program has already chosen one: only asked for
    (config `compilation_cache`, on in the CLI's configs), never on import."""
    current = jax.config.jax_compilation_cache_dir
    if current and pathlib.Path(current) != directory:
        log.info("keeping the program's compilation cache %s (not %s)", current, directory)
        return
    jax.config.update("jax_compilation_cache_dir", str(directory))


def resolve_layer_loop(name: str) -> bool:
    """True to scan over stacked layers.  "auto": unrolled on every backend for now
    (see benchmarks/README.md, "Layer loop", for the measurements behind it)."""
    if name not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {name!r}")
    return name == "scan"


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | error | abort
    error: str | None
    ttft_ms: float | None
    latency_ms: float
    # Every sample of the request (SamplingParams.n); the fields above are samples[0].
    samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    index: int = 0              # position of the request in the prompts given to generate()
    # SamplingParams.logprobs / prompt_logprobs (samples[i]["logprobs"] for each sample)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def record_logprobs(seq: Sequence, num_new: int, token: int, result: StepResult, row: int,
                    offset: int) -> None:
    """Appends what `result` holds for seq (row `row`; its tokens from flat index
    `offset`) before the step advances it: the prompt logprobs its tokens
    predicted, and its sampled token's logprob when the step completes it."""
    p, start = seq.params, seq.num_computed_tokens
    if result.prompt_logprobs is not None and seq.needs_prompt_logprobs:
        for j in range(num_new):
            target = start + j + 1  # the prompt position token j predicts
            if target == len(seq.prompt_logprobs) and target < len(seq.prompt_token_ids):
                seq.prompt_logprobs.append(token_logprob(result.prompt_logprobs, offset + j,
                                                         seq.prompt_token_ids[target], p.prompt_logprobs))
    if result.logprobs is not None and p.logprobs is not None and start + num_new >= seq.num_tokens:
        seq.logprobs.append(token_logprob(result.logprobs, row, token, p.logprobs))


def check_same_structure(old: nnx.State, new: nnx.State) -> None:
    """ValueError naming the first difference in tree, shape, dtype or sharding."""
    old_paths = jax.tree_util.tree_flatten_with_path(old)[0]
    new_paths = jax.tree_util.tree_flatten_with_path(new)[0]
    if jax.tree.structure(old) != jax.tree.structure(new):
        have = {jax.tree_util.keystr(k) for k, _ in new_paths}
        want = {jax.tree_util.keystr(k) for k, _ in old_paths}
        raise ValueError(f"params tree differs: missing {sorted(want - have)[:5]}, "
                         f"unexpected {sorted(have - want)[:5]}")
    for (path, a), (_, b) in zip(old_paths, new_paths):
        name = jax.tree_util.keystr(path)
        if not isinstance(b, jax.Array):
            raise ValueError(f"params{name} is a {type(b).__name__}, not a jax.Array")
        if b.is_deleted():
            raise ValueError(f"params{name} was deleted (donated to another computation?)")
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise ValueError(f"params{name} is {b.dtype}{list(b.shape)}, expected {a.dtype}{list(a.shape)}")
        if a.sharding != b.sharding:
            raise ValueError(f"params{name} has sharding {b.sharding}, expected {a.sharding}")


def token_logprob(lp: TokenLogprobs, row: int, token_id: int, k: int) -> TokenLogprob:
    top = tuple((int(i), float(v)) for i, v in zip(lp.top_ids[row, :k], lp.top_values[row, :k])
                if np.isfinite(v))  # filtered-out tokens (processed mode) have probability 0
    return TokenLogprob(token_id, float(lp.chosen[row]), top)


@dataclasses.dataclass
class StartedStep:
    """A step between LLM.start_step() and finish_step()."""
    out: SchedulerOutput
    pending: PendingStep | None
    error: Exception | None
    start: float


def sampling_per_prompt(prompts: list, sampling_params: SamplingParams | list[SamplingParams] | None,
                        default: SamplingParams) -> list[SamplingParams]:
    """generate()'s sampling argument as one SamplingParams per prompt."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or default] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError("one SamplingParams per prompt, or a single one for all")
    return list(sampling_params)


class EngineStalled(RuntimeError):
    """A step could schedule nothing while requests waited (they were failed)."""


class LLM:
    """Loads a model, sizes the KV pool and serves batches of requests."""

    def __init__(self, config: ml_collections.ConfigDict | None = None, *, mesh: Mesh | None = None,
                 **overrides: Any):
        """`mesh`: the (1, tensor_parallel_size) devices of this engine; by default the
        first tensor_parallel_size devices (none: one device, unsharded).  A
        data-parallel router (jpaged.engine.router) gives each replica its own."""
        cfg = apply_overrides(default_config(), config, **overrides)
        validate_config(cfg)  # one line per problem, before anything loads
        self.mesh = self._mesh(cfg, mesh)
        self.config = cfg
        self.scan_layers = resolve_layer_loop(cfg.layer_loop)
        self.dtype = jnp.dtype(cfg.dtype)
        self.kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, self.dtype)
        if cfg.compilation_cache:
            use_compilation_cache(pathlib.Path(cfg.cache_dir or default_cache_dir()) / "xla")
        loaded = load_weights(cfg.model, load_format=cfg.load_format, dtype=cfg.dtype,
                              cache_dir=cfg.cache_dir or None)
        self.loaded = loaded
        tp = tensor_parallel_size(self.mesh)
        check_heads(loaded.config, tp)
        self.model_config, arrays = replicate_kv_heads(loaded.config, loaded.arrays, tp)
        self.tokenizer = loaded.tokenizer
        self.graphdef, self.params = split_model(build_model(self.model_config, arrays, self.dtype,
                                                             scan_layers=self.scan_layers))
        if self.mesh is not None:
            self.params = shard_params(self.params, self.model_config, self.mesh)
        weight_bytes = sum(a.nbytes for a in arrays.values()) // tp
        loaded.arrays = arrays = {}  # the device copy in self.params is the one we keep
        self.num_blocks = num_blocks_for(
            self.model_config, block_size=cfg.block_size, dtype=self.kv_dtype,
            num_blocks=cfg.num_blocks, kv_memory_fraction=cfg.kv_memory_fraction,
            weight_bytes=weight_bytes, max_num_seqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len, num_shards=tp)
        if jax.process_count() > 1:  # free memory differs by host: process 0's size for all
            self.num_blocks = int(broadcast_step(self.num_blocks))
            if cfg.preemption_mode == "swap":
                raise ConfigError("preemption_mode", "swap keeps blocks in process 0's host memory, "
                                  "which the other processes cannot read", "recompute in a multi-process run")
        self.attention_impl, self.attention_note = resolve_attention_impl(cfg.attention_impl)
        if self.attention_note:
            log.warning("attention_impl=%s: %s; running the reference", cfg.attention_impl, self.attention_note)
        self.totals = EngineStats()  # since start; block manager and scheduler count into it too
        self.block_manager = self._make_block_manager(self.num_blocks)
        self.allocator = self.block_manager.allocator
        self.swap_space = self._make_swap_space(cfg.preemption_mode)
        self.runner = ModelRunner(self.graphdef, self.params, self.model_config,
                                  num_blocks=self.num_blocks, block_size=cfg.block_size,
                                  kv_dtype=self.kv_dtype, attention_impl=self.attention_impl,
                                  max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                                  max_num_batched_tokens=cfg.max_num_batched_tokens,
                                  swap_space=self.swap_space, logprobs_mode=cfg.logprobs_mode,
                                  mesh=self.mesh)
        self.scheduler = Scheduler(self.block_manager, policy=cfg.scheduler,
                                   max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   preemption_mode=cfg.preemption_mode, swap_space=self.swap_space,
                                   token_buckets=self.runner.token_buckets, stats=self.totals)
        self._rng = np.random.default_rng(cfg.seed)
        self._next_id = 0
        self._next_child_id = 0  # samples 1..n-1 get negative ids
        self.weights_version = 0  # update_params() count: part of every prefix-cache key
        self._active: dict[int, Sequence] = {}
        self._generate_base = EngineStats()  # totals when the last generate() began
        self._idle_state: tuple | None = None  # scheduler state after the last step that ran nothing

    @staticmethod
    def _mesh(cfg: ml_collections.ConfigDict, mesh: Mesh | None) -> Mesh | None:
        if mesh is not None:
            if mesh.shape["model"] != cfg.tensor_parallel_size or mesh.shape["data"] != 1:
                raise ValueError(f"mesh {dict(mesh.shape)} is not one replica of tensor_parallel_size="
                                 f"{cfg.tensor_parallel_size}")
            return mesh
        if cfg.data_parallel_size > 1:
            raise ConfigError("data_parallel_size", f"{cfg.data_parallel_size} replicas need a router",
                              "build the engine with jpaged.engine.router.create_engine (one LLM is one replica)")
        return make_mesh(cfg.tensor_parallel_size) if cfg.tensor_parallel_size > 1 else None

    def follow(self) -> None:
        """Processes other than 0 of a multi-process run (jpaged.runtime.distributed): run
        the steps process 0 schedules until it calls close()."""
        if jax.process_index() == 0:
            raise RuntimeError("process 0 schedules; follow() is for the other processes")
        self.runner.follow()

    def close(self) -> None:
        """Process 0 of a multi-process run: releases the processes in follow()."""
        self.runner.stop_followers()

    def memory_per_device(self) -> dict[str, tuple[int, int]]:
        """(weight bytes, KV pool bytes) held on each of this engine's devices."""
        weights, pool = bytes_per_device(self.params), bytes_per_device(self.runner.kv_pool)
        return {d: (weights.get(d, 0), pool.get(d, 0)) for d in sorted({*weights, *pool})}

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (only between generate() calls)."""
        if self.scheduler.has_work:
            raise RuntimeError("reset_prefix_cache() needs an idle engine")
        self._new_block_manager()

    def _new_block_manager(self, num_blocks: int | None = None) -> None:
        """A fresh block manager (empty prefix cache); no sequence may hold blocks."""
        self.block_manager = self._make_block_manager(num_blocks or self.num_blocks)
        self.allocator = self.block_manager.allocator
        self.scheduler.block_manager = self.block_manager

    def _make_block_manager(self, num_blocks: int) -> BlockManager:
        cfg = self.config
        return BlockManager(num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching,
                            index=cfg.prefix_cache_index, stats=self.totals)

    def _make_swap_space(self, preemption_mode: str) -> HostSwapSpace:
        """Host memory for swapped-out blocks: swap_space_gb in swap mode, none otherwise."""
        cfg = self.config
        block_bytes = bytes_per_block(self.model_config, cfg.block_size, self.kv_dtype)
        capacity = swap_capacity_blocks(cfg.swap_space_gb, block_bytes) if preemption_mode == "swap" else 0
        return HostSwapSpace(capacity, block_shape(self.model_config, cfg.block_size), self.kv_dtype)

    # ----------------------------------------------------------------- requests
    def default_sampling_params(self) -> SamplingParams:
        return default_sampling_params(self.config)

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * bytes_per_block(self.model_config, self.config.block_size, self.kv_dtype)

    def _eos_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids) if self.tokenizer is not None else set()

    def add_request(self, prompt_token_ids: list[int] | None, params: SamplingParams,
                    prompt: str | None = None, error: str | None = None) -> int:
        """Queues one request; an invalid one is finished at once with an error."""
        request_id = self._next_id
        self._next_id += 1
        prompt_token_ids = list(prompt_token_ids or [])
        error = error or self._validate(prompt_token_ids, params)
        # A request that fails draws no seed: its neighbours' draws do not depend on it.
        seed = 0 if error else params.seed if params.seed is not None else int(self._rng.integers(2**31))
        seq = Sequence(request_id, prompt_token_ids, params, prompt=prompt, seed=seed,
                       weights_version=self.weights_version)
        self._active[request_id] = seq
        if error:
            seq.finish("error", error)
            return request_id
        for i in range(1, params.n):  # parallel samples: seeds seed + i, forked after prefill
            self._next_child_id -= 1
            child = Sequence(self._next_child_id, seq.prompt_token_ids, params, prompt=prompt,
                             seed=seed + i, weights_version=self.weights_version)
            child.group = seq.group
            seq.group.append(child)
            seq.forks.append(child)
            self._active[child.seq_id] = child
        self.scheduler.add(seq)
        return request_id

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> str | None:
        """Why add_request() would fail this request at once, or None: lets a server
        answer bad input before queueing it.  Reads only the config and pool size."""
        return self._validate(list(prompt_token_ids), params)

    def _validate(self, ids: list[int], params: SamplingParams) -> str | None:
        try:
            params.validate()
        except (ValueError, TypeError) as e:
            return str(e)
        vocab = self.model_config.vocab_size
        if not ids:
            return "empty prompt: at least one token is required"
        if len(ids) >= self.config.max_model_len:
            return (f"prompt has {len(ids)} tokens; max_model_len is {self.config.max_model_len} "
                    "(room is needed for at least one generated token)")
        not_ints = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
        if not_ints:
            return f"token ids must be integers, got {not_ints[:8]}"
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            return f"token ids outside the vocabulary [0, {vocab}): {bad[:8]}"
        if params.n > self.config.max_num_seqs:
            return f"n={params.n} samples exceed max_num_seqs={self.config.max_num_seqs}"
        if self.block_manager.blocks_for(len(ids) + 1) > self.num_blocks - 1:
            return f"prompt needs more KV blocks than the pool has ({self.num_blocks - 1})"
        return None

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int] | None, str | None]:
        """(prompt text, token ids, error) for a raw string, token ids, or a chat
        request {"messages": [...]} / {"prompt": "user message"}."""
        try:
            if isinstance(prompt, dict):
                messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
                # Special-token strings in message contents stay text: a user cannot forge turns.
                text, ids = self._require_tokenizer().encode_chat(messages, add_generation_prompt=True)
                return text, ids, None
            if isinstance(prompt, str):
                return prompt, self._require_tokenizer().encode(prompt), None
            ids = list(prompt)
            not_ints = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
            if not_ints:
                return None, None, f"token ids must be integers, got {not_ints[:8]}"
            return None, [int(t) for t in ids], None
        except Exception as e:  # one bad request must not take the batch down
            return None, None, f"invalid prompt: {type(e).__name__}: {e}"

    def tokenize(self, prompt: Any) -> list[int]:
        """Prompt token ids exactly as generate() builds them (chat template for a
        {"prompt"} / {"messages"} dict); ValueError for a prompt generate() would fail."""
        _, ids, error = self._tokenize(prompt)
        if error:
            raise ValueError(error)
        return ids

    def has_unfinished_requests(self) -> bool:
        """Whether step() has requests left to run (waiting, running or swapped out)."""
        return self.scheduler.has_work

    def get_sequence(self, request_id: int) -> Sequence | None:
        """The live Sequence of a request added with add_request() (its tokens and block
        table), until step() returns it finished; None after that.  Read it only."""
        return self._active.get(request_id)

    def install_pool(self, num_blocks: int, preemption_mode: str) -> None:
        """Experiments: an empty pool of num_blocks blocks (at most the device pool's,
        whose arrays stay) and preemption_mode, with a fresh host swap space sized by
        swap_space_gb in swap mode.  Only on an idle engine."""
        if self.scheduler.has_work:
            raise RuntimeError("install_pool() needs an idle engine")
        if not 2 <= num_blocks <= self.num_blocks:
            raise ValueError(f"num_blocks={num_blocks} must be in [2, {self.num_blocks}]")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        self.config.preemption_mode = self.scheduler.preemption_mode = preemption_mode
        self._new_block_manager(num_blocks)
        self.swap_space = self._make_swap_space(preemption_mode)
        self.scheduler.swap_space = self.runner.swap_space = self.swap_space

    def update_params(self, params: nnx.State, *, in_flight: str = "abort") -> None:
        """Swaps in new weights: the same tree, shapes, dtypes and shardings as
        `self.params` (else ValueError), so no step recompiles.

        The prefix cache is dropped: its K/V came from the old weights (new
        requests key the cache by a new weights version, so nothing computed
        before can be shared with them).  `in_flight` says what happens to
        unfinished requests: "abort" ends them (finish_reason "abort"); "keep"
        lets them go on with the new weights on top of the K/V computed so far
        with the old ones.  The engine keeps a reference to `params`: a trainer
        that donates them to its own update step deletes the engine's weights too.
        """
        if in_flight not in ("abort", "keep"):
            raise ValueError(f"in_flight must be 'abort' or 'keep', got {in_flight!r}")
        check_same_structure(self.params, params)
        if in_flight == "abort":
            self.abort([rid for rid, seq in self._active.items() if seq.group[0] is seq])
        self.params = self.runner.params = params
        self.weights_version += 1
        self.block_manager.drop_cached()

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return self.tokenizer

    def precompile(self, max_num_tokens: int | None = None) -> int:
        """Compiles, before a workload arrives, the greedy step of every bucket of
        the step-size ladder up to max_num_tokens tokens (default: the whole
        ladder, up to max_num_batched_tokens).  Sampling steps compile on first
        use.  Returns the number of new compilations."""
        return self.runner.precompile(max_num_tokens)

    # -------------------------------------------------------------------- steps
    def step(self) -> list[Sequence]:
        """Runs one scheduled step; returns sequences that finished in it (with
        finish_reason "error" for those a failed step took down).

        An exception inside the step fails only the sequences it involved (their
        blocks are freed) and the engine stays usable; see `_recover`.  A step
        that can make no progress while requests wait raises EngineStalled."""
        return self.finish_step(self.start_step())

    def start_step(self) -> StartedStep:
        """step()'s first half: schedules and dispatches the step to the device
        without waiting for it.  finish_step() must follow before the next one."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        try:
            return StartedStep(out, self.runner.launch(out), None, t0)
        except Exception as e:  # noqa: BLE001 - reported by finish_step
            return StartedStep(out, None, e, t0)

    def finish_step(self, started: StartedStep) -> list[Sequence]:
        """step()'s second half: waits for the device, then appends tokens, applies
        stop conditions and frees what finished (returned)."""
        out, t0 = started.out, started.start
        try:
            if started.error is not None:
                raise started.error
            result = self.runner.collect(started.pending)
        except Exception as e:  # noqa: BLE001 - one bad step must not poison the engine
            self._recover(out, e)
            result = StepResult(np.zeros(0, np.int32))
        prefill = any(s.seq.status is Status.PREFILLING for s in out.scheduled)
        eos = self._eos_ids()
        offset = 0  # of the sequence's first token in the step's flat batch
        for row, (s, token) in enumerate(zip(out.scheduled, result.tokens)):
            try:
                record_logprobs(s.seq, s.num_new, int(token), result, row, offset)
                self._advance(s.seq, s.num_new, int(token), eos)
            except Exception as e:  # noqa: BLE001 - pinned to this sequence
                log.exception("request %d failed after its step", s.seq.seq_id)
                self.scheduler.fail(s.seq, f"internal error: {type(e).__name__}: {e}")
            offset += s.num_new
        self._record(out, prefill, time.perf_counter() - t0)
        running = {id(s) for s in self.scheduler.running}
        finished = [s for s in self._active.values() if s.is_done and id(s) not in running]
        for seq in finished:
            del self._active[seq.seq_id]
        if finished or out.scheduled or out.swap_out or out.swap_in or not self.scheduler.has_work:
            self._idle_state = None
        else:  # an empty step may still move state (a preemption, a fork): stalled only if not
            state = self._scheduler_state()
            if state == self._idle_state:
                self._stalled()
            self._idle_state = state
        return finished

    def _scheduler_state(self) -> tuple:
        """Everything schedule() decides from: equal before and after a step that ran
        nothing means every later schedule() runs nothing too."""
        sched = self.scheduler
        return (self.block_manager.num_free_blocks,
                *((id(s), s.status, s.num_computed_tokens, len(s.block_table.block_ids), len(s.forks))
                  for q in (sched.waiting, sched.running, sched.swapped) for s in q))

    def _recover(self, out: SchedulerOutput, error: Exception) -> None:
        """Fails every sequence the step involved and frees their blocks.  If the
        exception struck after the donated pool was consumed, the pool is rebuilt
        empty: the prefix cache is dropped and the other running sequences
        recompute their K/V (as after a recompute preemption)."""
        message = f"step failed: {type(error).__name__}: {error}"
        log.error("%s (failing %d sequences)", message, len(out.scheduled))
        involved = [s.seq for s in out.scheduled] + [r.seq for r in (*out.swap_out, *out.swap_in)]
        for seq in dict.fromkeys(involved):
            if not seq.is_done:
                self.scheduler.fail(seq, message)
        if self.runner.restore_pool():
            log.error("the KV pool was lost with the failed step: recomputing %d running sequences",
                      len(self.scheduler.running))
            self.scheduler.requeue_running()
            self._new_block_manager()

    def _stalled(self) -> None:
        """Two steps in a row scheduled nothing, finished nothing and left the
        scheduler's state unchanged: schedule() is deterministic, so every later
        step would do the same.  Fail what waits (freeing everything) and raise,
        rather than spin."""
        sched = self.scheduler
        state = (f"{len(sched.waiting)} waiting, {len(sched.running)} running, {len(sched.swapped)} swapped; "
                 f"{self.block_manager.num_free_blocks} free blocks, max_num_batched_tokens "
                 f"{self.config.max_num_batched_tokens}, max_num_seqs {self.config.max_num_seqs}")
        message = f"engine stalled: a step could schedule nothing ({state})"
        for seq in [*sched.waiting, *sched.running, *sched.swapped]:
            sched.fail(seq, message)
        raise EngineStalled(message)

    def abort(self, request_ids: Iterable[int]) -> None:
        """Ends the given requests (every sample) now and frees what they hold;
        they finish with finish_reason "abort"."""
        for rid in request_ids:
            for s in self._group(rid):
                if not s.is_done:
                    self.scheduler.fail(s, "aborted", reason="abort")
                self._active.pop(s.seq_id, None)

    def finish_sample(self, request_id: int, index: int, reason: str = "stop") -> None:
        """Ends sample `index` of a request now with `reason` and frees what it
        holds; its other samples go on.  For a server that sees a stop string in
        one sample's text: computing that sample further would be wasted.  Like a
        sample that hits max_tokens, the next step() returns it as finished.  A
        finished or unknown sample is left as it is."""
        group = self._group(request_id)
        if not 0 <= index < len(group) or group[index].is_done:
            return
        leader, sample = group[0], group[index]
        if sample in leader.forks:  # not forked yet: it holds no blocks
            leader.forks.remove(sample)
            sample.finish(reason)
        elif sample is leader and leader.forks:  # failing it now would end its pending forks too
            raise ValueError(f"sample 0 of request {request_id} cannot finish before its prompt is prefilled")
        else:
            self.scheduler.fail(sample, None, reason=reason)

    def _group(self, request_id: int) -> list[Sequence]:
        """The samples of a request while any is active ([] after): sample 0 leaves
        _active when step() returns it finished, and its siblings may still run."""
        seq = self._active.get(request_id)
        if seq is None:
            seq = next((s for s in self._active.values() if s.group[0].seq_id == request_id), None)
        return seq.group if seq is not None else []

    def _advance(self, seq: Sequence, num_new: int, token: int, eos: set[int]) -> None:
        seq.num_computed_tokens += num_new
        self.block_manager.cache_full_blocks(seq)
        if seq.num_computed_tokens < seq.num_tokens:
            return  # a prefill chunk: its sample is not the next token
        seq.output_token_ids.append(token)
        seq.status = Status.DECODING
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        p = seq.params
        if token in p.stop_token_ids or (token in eos and not p.ignore_eos):
            reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            reason = "length"
        else:
            return
        seq.finish(reason)
        self.scheduler.finish(seq)

    def _record(self, out: SchedulerOutput, prefill: bool, step_seconds: float) -> None:
        s, t = self.totals, self.runner.timing
        s.steps += bool(out.scheduled)
        s.prefill_steps += prefill
        device_seconds = t.swap + t.copy + t.forward
        s.device_seconds += device_seconds
        s.compile_seconds += t.compile
        s.host_seconds += step_seconds - device_seconds - t.compile
        s.swap_seconds += t.swap
        if out.swap_out or out.swap_in:
            host = self.swap_space
            s.swapped_out_bytes += sum(len(r.block_ids) for r in out.swap_out) * host.block_bytes
            s.swapped_in_bytes += sum(len(r.block_ids) for r in out.swap_in) * host.block_bytes
        s.tokens_scheduled += out.num_tokens
        if out.scheduled:
            s.token_slots += self.runner.token_bucket(out.num_tokens)
        bm = self.block_manager
        s.peak_blocks_used = max(s.peak_blocks_used, bm.num_used_blocks)
        bs = self.config.block_size
        s.slots_allocated += bm.num_used_blocks * bs
        # Shared blocks hold tokens of several sequences: cap at the slots held.
        s.slots_filled += min(bm.num_used_blocks * bs,
                              sum(min(q.num_computed_tokens, len(q.block_table.block_ids) * bs)
                                  for q in self.scheduler.running))
        s.swap_blocks_peak = max(s.swap_blocks_peak, self.swap_space.num_used_blocks)

    def begin_generate(self) -> None:
        """Starts the window that `stats` reports (generate() calls it)."""
        self.totals.reset_peaks()
        self._generate_base = self.totals.snapshot()

    @property
    def stats(self) -> EngineStats:
        """What the last (or the running) generate() call did; `totals` holds
        everything since the engine started."""
        return self.totals.since(self._generate_base)

    # --------------------------------------------------------------- batch API
    def generate(self, prompts: Iterable[Any], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order.

        A prompt is a raw string, a list of token ids, or a chat request
        {"messages": [...]} / {"prompt": "a user message"} (rendered with the
        model's chat template).  A request that cannot run (bad input, or a step
        that failed under it) comes back with finish_reason "error".
        """
        outputs = list(self.generate_iter(prompts, sampling_params, use_tqdm=use_tqdm))
        return sorted(outputs, key=lambda o: o.index)

    def generate_iter(self, prompts: Iterable[Any],
                      sampling_params: SamplingParams | list[SamplingParams] | None = None,
                      *, use_tqdm: bool = False, stop: threading.Event | None = None
                      ) -> Iterator[RequestOutput]:
        """generate(), yielding each request's output as soon as it (every sample)
        finishes; `output.index` is its position in `prompts`.  Closing the
        iterator early, or setting `stop` (checked before every step, so a
        signal handler may set it), aborts the requests that have not finished."""
        prompts = list(prompts)
        sampling_params = sampling_per_prompt(prompts, sampling_params, self.default_sampling_params())
        self.begin_generate()
        index = {self._add_prompt(p, sp): i for i, (p, sp) in enumerate(zip(prompts, sampling_params))}
        pending = {rid: len(self._active[rid].group) for rid in index}
        try:
            with tqdm.tqdm(total=len(index), desc="requests", disable=not use_tqdm) as bar:
                while pending and not (stop is not None and stop.is_set()):
                    for seq in self.step():
                        rid = seq.group[0].seq_id
                        if rid not in pending:
                            continue  # a request added through add_request by someone else
                        pending[rid] -= 1
                        if not pending[rid]:
                            del pending[rid]
                            bar.update(1)
                            yield self.request_output(seq.group[0], index[rid])
        finally:
            self.abort(pending)  # closed early, or an exception: nothing stays queued

    def _add_prompt(self, prompt: Any, params: SamplingParams) -> int:
        return self.add_request(*self.prepare_prompt(prompt, params))

    def prepare_prompt(self, prompt: Any, params: SamplingParams
                       ) -> tuple[list[int] | None, SamplingParams, str | None, str | None]:
        """The arguments of add_request() for a prompt as generate() takes it:
        (token ids, params, prompt text, error)."""
        text, token_ids, error = self._tokenize(prompt)
        unknown = sorted(set(prompt) - PROMPT_KEYS) if isinstance(prompt, dict) else []
        if unknown:  # e.g. sampling fields, which would otherwise be silently ignored
            error = (f"unknown prompt keys {unknown}: a prompt dict takes {sorted(PROMPT_KEYS)}; "
                     "sampling settings go in SamplingParams")
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            salt = prompt["cache_salt"]
            if isinstance(salt, str):
                params = dataclasses.replace(params, cache_salt=salt)
            else:
                error = f"cache_salt must be a string, got {type(salt).__name__} {salt!r}"
        return token_ids, params, text, error

    def cached_prefix_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Prompt tokens a new request would find in the prefix cache now (a router's
        question: changes nothing)."""
        probe = Sequence(-1, list(prompt_token_ids), params, weights_version=self.weights_version)
        return len(self.block_manager.match(probe)[1]) * self.config.block_size

    def outstanding_tokens(self) -> int:
        """Tokens this engine still owes its unfinished requests: prompt tokens not
        computed yet plus the most each sequence may still generate."""
        return sum(max(0, s.num_tokens - s.num_computed_tokens)
                   + max(0, s.params.max_tokens - len(s.output_token_ids))
                   for s in self._active.values() if not s.is_done)

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None or not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def request_output(self, seq: Sequence, index: int = 0) -> RequestOutput:
        """The RequestOutput of a finished request (seq: its first sample)."""
        ms = lambda t: None if t is None else 1000 * (t - seq.arrival_time)  # noqa: E731
        p = seq.params
        samples = [dict(text=self._decode(s.output_token_ids), token_ids=list(s.output_token_ids),
                        finish_reason=s.finish_reason) for s in seq.group]
        if p.logprobs is not None:
            for sample, s in zip(samples, seq.group):
                sample["logprobs"] = list(s.logprobs)
        last = max((s.finish_time for s in seq.group if s.finish_time is not None), default=None)
        return RequestOutput(
            request_id=seq.seq_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            text=samples[0]["text"], token_ids=samples[0]["token_ids"], finish_reason=seq.finish_reason,
            error=seq.error, ttft_ms=ms(seq.first_token_time), latency_ms=ms(last),
            samples=samples, num_cached_tokens=seq.num_cached_tokens, index=index,
            logprobs=samples[0].get("logprobs"),
            prompt_logprobs=list(seq.prompt_logprobs) if p.prompt_logprobs is not None else None)

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling step programs since the engine started."""
        return self.runner.compile_seconds

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """The step-size ladder: each bucket is one compiled program."""
        return self.runner.token_buckets

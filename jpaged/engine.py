"""The offline engine: `LLM(config).generate(prompts)`, like vLLM's LLM class.

Each step: the scheduler picks rows, the model runner runs one batched jitted
forward + sample over all of them (one host<->device round trip), and the
engine appends tokens, applies stop conditions and frees finished sequences.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm

import pallas_kernels
from jpaged.config import default_config
from jpaged.block_manager import BlockManager, CacheCounters
from jpaged.kv_cache import (HostSwapSpace, bytes_per_block, copy_blocks, gather_blocks, num_blocks_for,
                              scatter_blocks, swap_capacity_blocks)
from jpaged.model import Llama, split_model
from jpaged.model_runner import ModelRunner, bucket
from jpaged.scheduler import PreemptionCounters, Scheduler
from jpaged.sequence import SamplingParams, Sequence, Status
from jpaged.weights import default_cache_dir, load_weights

ATTENTION_IMPLS = {"reference": "reference", "cpu": "cpu", "pallas_gpu": "gpu", "pallas_tpu": "tpu"}


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


def resolve_kv_cache_dtype(name: str, dtype: jnp.dtype) -> jnp.dtype:
    """The KV pool's dtype: "auto" follows the model dtype."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return dtype if name == "auto" else jnp.dtype(name)


def resolve_attention_impl(name: str) -> str:
    if name == "auto":
        return pallas_kernels.default_impl()
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {sorted(ATTENTION_IMPLS) + ['auto']}, got {name!r}")
    return ATTENTION_IMPLS[name]


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | error
    error: str | None
    ttft_ms: float | None
    latency_ms: float
    # Every sample of the request (SamplingParams.n); the fields above are samples[0].
    samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class StepStats:
    """Accumulated over a generate() call; the summary table is derived from these."""

    steps: int = 0
    prefill_steps: int = 0
    device_seconds: float = 0.0
    host_seconds: float = 0.0
    peak_blocks_used: int = 0
    slots_allocated: int = 0  # summed over steps
    slots_filled: int = 0
    # Prefix cache (this generate() call): see BlockManager.CacheCounters.
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    cache_hit_blocks: int = 0
    shared_blocks_peak: int = 0
    evictions: int = 0
    cow_copies: int = 0
    # Preemption (this generate() call): see Scheduler.PreemptionCounters.
    preemptions: int = 0
    recompute_preemptions: int = 0
    swap_preemptions: int = 0
    swap_fallbacks: int = 0        # swap victims recomputed because the host pool was full
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    swap_seconds: float = 0.0      # device<->host copies (part of device_seconds)
    swap_blocks_peak: int = 0      # most host blocks in use at once

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def kv_waste(self) -> float:
        return 1.0 - self.slots_filled / self.slots_allocated if self.slots_allocated else 0.0


class LLM:
    """Loads a model, sizes the KV pool and serves batches of requests."""

    def __init__(self, config: ml_collections.ConfigDict | None = None, **overrides: Any):
        cfg = default_config()
        if config is not None:
            cfg.update(config)
        cfg.update(overrides)
        self.config = cfg
        self.dtype = jnp.dtype(cfg.dtype)
        self.kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, self.dtype)
        if cfg.compilation_cache:
            xla_cache = pathlib.Path(cfg.cache_dir or default_cache_dir()) / "xla"
            jax.config.update("jax_compilation_cache_dir", str(xla_cache))
        loaded = load_weights(cfg.model, load_format=cfg.load_format, dtype=cfg.dtype,
                              cache_dir=cfg.cache_dir or None)
        self.loaded = loaded
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.graphdef, self.params = split_model(Llama(loaded.config, loaded.arrays, self.dtype))
        weight_bytes = sum(a.nbytes for a in loaded.arrays.values())
        loaded.arrays = {}  # the device copy in self.params is the one we keep
        self.num_blocks = num_blocks_for(
            self.model_config, block_size=cfg.block_size, dtype=self.kv_dtype,
            num_blocks=cfg.num_blocks, kv_memory_fraction=cfg.kv_memory_fraction,
            weight_bytes=weight_bytes, max_num_seqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len)
        self.attention_impl = resolve_attention_impl(cfg.attention_impl)
        self.block_manager = BlockManager(self.num_blocks, cfg.block_size,
                                          enable_prefix_caching=cfg.enable_prefix_caching,
                                          index=cfg.prefix_cache_index)
        self.allocator = self.block_manager.allocator
        self.runner = ModelRunner(self.graphdef, self.params, self.model_config,
                                  num_blocks=self.num_blocks, block_size=cfg.block_size,
                                  kv_dtype=self.kv_dtype, attention_impl=self.attention_impl,
                                  max_model_len=cfg.max_model_len)
        block_shape = tuple(self.runner.kv_pool.shape[1:])
        block_bytes = bytes_per_block(self.model_config, cfg.block_size, self.kv_dtype)
        self.swap_space = HostSwapSpace(
            swap_capacity_blocks(cfg.swap_space_gb, block_bytes) if cfg.preemption_mode == "swap" else 0,
            block_shape, self.runner.kv_pool.dtype)
        self.scheduler = Scheduler(self.block_manager, policy=cfg.scheduler,
                                   max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   preemption_mode=cfg.preemption_mode, swap_space=self.swap_space)
        self._rng = np.random.default_rng(cfg.seed)
        self._next_id = 0
        self._next_child_id = 0  # samples 1..n-1 get negative ids
        self._active: dict[int, Sequence] = {}
        self.stats = StepStats()
        self._cache_base = CacheCounters()
        self._preempt_base = PreemptionCounters()

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (only between generate() calls)."""
        if self.scheduler.has_work:
            raise RuntimeError("reset_prefix_cache() needs an idle engine")
        cfg = self.config
        self.block_manager = BlockManager(self.num_blocks, cfg.block_size,
                                          enable_prefix_caching=cfg.enable_prefix_caching,
                                          index=cfg.prefix_cache_index)
        self.allocator = self.block_manager.allocator
        self.scheduler.block_manager = self.block_manager
        self.scheduler.allocator = self.allocator
        self._cache_base = CacheCounters()

    # ----------------------------------------------------------------- requests
    def default_sampling_params(self) -> SamplingParams:
        c = self.config
        return SamplingParams(max_tokens=c.max_new_tokens, temperature=c.temperature,
                              top_p=c.top_p, top_k=c.top_k)

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
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**31))
        seq = Sequence(request_id, prompt_token_ids or [], params, self.config.block_size,
                       prompt=prompt, seed=seed)
        self._active[request_id] = seq
        error = error or self._validate(seq)
        if error:
            seq.finish("error", error)
            return request_id
        for i in range(1, params.n):  # parallel samples: seeds seed + i, forked after prefill
            self._next_child_id -= 1
            child = Sequence(self._next_child_id, seq.prompt_token_ids, params,
                             self.config.block_size, prompt=prompt, seed=seed + i)
            child.sample_index, child.group = i, seq.group
            seq.group.append(child)
            seq.forks.append(child)
            self._active[child.seq_id] = child
        self.scheduler.add(seq)
        return request_id

    def _validate(self, seq: Sequence) -> str | None:
        try:
            seq.params.validate()
        except ValueError as e:
            return str(e)
        ids, vocab = seq.prompt_token_ids, self.model_config.vocab_size
        if not ids:
            return "empty prompt: at least one token is required"
        if len(ids) >= self.config.max_model_len:
            return (f"prompt has {len(ids)} tokens; max_model_len is {self.config.max_model_len} "
                    "(room is needed for at least one generated token)")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            return f"token ids outside the vocabulary [0, {vocab}): {bad[:8]}"
        if seq.params.n > self.config.max_num_seqs:
            return f"n={seq.params.n} samples exceed max_num_seqs={self.config.max_num_seqs}"
        if seq.block_table.blocks_needed(len(ids) + 1) > self.num_blocks - 1:
            return f"prompt needs more KV blocks than the pool has ({self.num_blocks - 1})"
        return None

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int] | None, str | None]:
        """(prompt text, token ids, error) for a raw string, token ids, or a chat
        request {"messages": [...]} / {"prompt": "user message"}."""
        try:
            if isinstance(prompt, dict):
                messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
                text = self._require_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
                return text, self.tokenizer.encode(text, add_special_tokens=False), None
            if isinstance(prompt, str):
                return prompt, self._require_tokenizer().encode(prompt), None
            ids = list(prompt)
            not_ints = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
            if not_ints:
                return None, None, f"token ids must be integers, got {not_ints[:8]}"
            return None, [int(t) for t in ids], None
        except Exception as e:  # one bad request must not take the batch down
            return None, None, f"invalid prompt: {type(e).__name__}: {e}"

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return self.tokenizer

    def precompile(self, *, max_num_seqs: int | None = None, max_context: int | None = None,
                   prompt_len: int | None = None) -> int:
        """Compiles, before a workload arrives, every step shape it can meet.

        Decode: each row bucket up to `max_num_seqs` (default: the config's) x
        each block-table width up to `max_context` tokens (default:
        max_model_len).  Prefill, when `prompt_len` is given: each row bucket x
        each new-token bucket up to min(prompt_len, max_num_batched_tokens) x
        each width up to prompt_len, less the shapes that cannot fit one step's
        token budget.  Greedy steps only (sampling steps compile on
        first use).  Returns the number of new compilations.  An online server
        calls this once at start-up so that no request waits on the compiler.
        """
        cfg, runner = self.config, self.runner
        bs, budget = cfg.block_size, cfg.max_num_batched_tokens
        rows = [1 << i for i in range(bucket(min(max_num_seqs or cfg.max_num_seqs,
                                                 cfg.max_num_seqs)).bit_length())]

        def widths(tokens: int) -> list[int]:
            return sorted({runner.table_width(k) for k in range(1, -(-tokens // bs) + 1)})

        context = min(max_context or cfg.max_model_len, cfg.max_model_len)
        shapes = [(b, 1, w) for b in rows for w in widths(context)]
        if prompt_len:
            chunk = min(prompt_len, budget, cfg.max_model_len)
            q_buckets = sorted({bucket(q, 8) for q in range(1, chunk + 1)})
            # Fewest tokens of a step in bucket (b, q): its longest row has at
            # least q // 2 + 1 (bucket 8: 1), its other b // 2 rows at least 1.
            shapes += [(b, q, w) for b in rows for q in q_buckets for w in widths(prompt_len)
                       if (1 if q == 8 else q // 2 + 1) + b // 2 <= budget]
        return runner.precompile(shapes)

    # -------------------------------------------------------------------- steps
    def step(self) -> list[Sequence]:
        """Runs one scheduled step; returns sequences that finished in it."""
        t0 = time.perf_counter()
        rows, prefill = self.scheduler.schedule()
        swap_out, swap_in = self.scheduler.take_swaps()
        copies = self.block_manager.take_copies()
        device_seconds = 0.0
        if swap_out or swap_in:  # before the copies and the forward rewrite victims' blocks
            t1 = time.perf_counter()
            self._swap(swap_out, swap_in)
            device_seconds += time.perf_counter() - t1
            self.stats.swap_seconds += time.perf_counter() - t1
        if copies:  # copy-on-write, before the forward writes into the copies
            t1 = time.perf_counter()
            self.runner.kv_pool = copy_blocks(self.runner.kv_pool, copies)
            device_seconds += time.perf_counter() - t1
        if rows:
            t1 = time.perf_counter()
            next_tokens = self.runner.run(rows, prefill)
            # Building the padded arrays is host work, the rest of run() waits on the device.
            device_seconds += time.perf_counter() - t1 - self.runner.last_build_seconds
            eos = self._eos_ids()
            for row, token in zip(rows, next_tokens):
                if row.num_new:
                    self._advance(row.seq, row.num_new, int(token), eos)
        self._record(rows, prefill, device_seconds, time.perf_counter() - t0)
        running = {id(s) for s in self.scheduler.running}
        finished = [s for s in self._active.values() if s.is_done and id(s) not in running]
        for seq in finished:
            del self._active[seq.seq_id]
        return finished

    def _swap(self, swap_out, swap_in) -> None:
        """One jitted gather of every victim's blocks (device -> host pool), then one
        jitted, donated scatter of every resumed sequence's blocks into its new ones."""
        host, s = self.swap_space, self.stats
        if swap_out:
            ids = [b for r in swap_out for b in r.block_ids]
            host.store([x for r in swap_out for x in r.slots], gather_blocks(self.runner.kv_pool, ids))
            s.swapped_out_bytes += len(ids) * host.block_bytes
        if swap_in:
            ids = [b for r in swap_in for b in r.block_ids]
            data = host.load([x for r in swap_in for x in r.slots])
            self.runner.kv_pool = scatter_blocks(self.runner.kv_pool, ids, data)
            s.swapped_in_bytes += len(ids) * host.block_bytes

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

    def _record(self, rows, prefill: bool, device_seconds: float, step_seconds: float) -> None:
        s = self.stats
        s.steps += bool(rows)
        s.prefill_steps += bool(rows) and prefill
        s.device_seconds += device_seconds
        s.host_seconds += step_seconds - device_seconds
        bm = self.block_manager
        s.peak_blocks_used = max(s.peak_blocks_used, bm.num_used_blocks)
        bs = self.config.block_size
        s.slots_allocated += bm.num_used_blocks * bs
        # Shared blocks hold tokens of several sequences: cap at the slots held.
        s.slots_filled += min(bm.num_used_blocks * bs,
                              sum(min(q.num_computed_tokens, len(q.block_table.block_ids) * bs)
                                  for q in self.scheduler.running))
        c = bm.counters.minus(self._cache_base)
        s.prompt_tokens, s.cached_prompt_tokens = c.prompt_tokens, c.cached_tokens
        s.cache_hit_blocks, s.evictions, s.cow_copies = c.hit_blocks, c.evictions, c.cow_copies
        s.shared_blocks_peak = max(s.shared_blocks_peak, bm.num_shared_blocks)
        p = self.scheduler.counters.minus(self._preempt_base)
        for f in dataclasses.fields(p):
            setattr(s, f.name, getattr(p, f.name))
        s.swap_blocks_peak = max(s.swap_blocks_peak, self.swap_space.num_used_blocks)

    # --------------------------------------------------------------- batch API
    def generate(self, prompts: Iterable[Any], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order.

        A prompt is a raw string, a list of token ids, or a chat request
        {"messages": [...]} / {"prompt": "a user message"} (rendered with the
        model's chat template).
        """
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        ids = []
        self.stats = StepStats()
        self._cache_base = dataclasses.replace(self.block_manager.counters)
        self._preempt_base = dataclasses.replace(self.scheduler.counters)
        for prompt, params in zip(prompts, sampling_params):
            text, token_ids, error = self._tokenize(prompt)
            if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
                params = dataclasses.replace(params, cache_salt=str(prompt["cache_salt"]))
            ids.append(self.add_request(token_ids, params, prompt=text, error=error))
        done: dict[int, Sequence] = {}
        remaining = {i: len(self._active[i].group) for i in ids}
        with tqdm.tqdm(total=len(ids), desc="requests", disable=not use_tqdm) as bar:
            while remaining:
                for seq in self.step():
                    done[seq.seq_id] = seq
                    rid = seq.group[0].seq_id
                    remaining[rid] -= 1
                    if not remaining[rid]:
                        del remaining[rid]
                        bar.update(1)
        return [self._output(done[i]) for i in ids]

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None or not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _output(self, seq: Sequence) -> RequestOutput:
        ms = lambda t: None if t is None else 1000 * (t - seq.arrival_time)  # noqa: E731
        samples = [dict(text=self._decode(s.output_token_ids), token_ids=list(s.output_token_ids),
                        finish_reason=s.finish_reason) for s in seq.group]
        last = max((s.finish_time for s in seq.group if s.finish_time is not None), default=None)
        return RequestOutput(
            request_id=seq.seq_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            text=samples[0]["text"], token_ids=samples[0]["token_ids"], finish_reason=seq.finish_reason,
            error=seq.error, ttft_ms=ms(seq.first_token_time), latency_ms=ms(last),
            samples=samples, num_cached_tokens=seq.num_cached_tokens)

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

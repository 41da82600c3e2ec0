"""Owns the device state (weights, KV pool) and runs one scheduled step.

A step's tokens are one flat ragged array `[T]` (prefill chunks and decode
tokens mixed); T comes from one small ladder of buckets (powers of two from
`min_tokens` up to max_num_batched_tokens) and the number of sequences S is a
function of T, and the block-table width is fixed at max_model_len /
block_size, so each bucket of the ladder is exactly one compiled program.
Programs are compiled ahead of time (`jit(...).lower(...).compile()`), timed,
and counted.  The KV pool is donated to every step: XLA writes the new K/V
into the same buffer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.decode import generate_step, generate_step_with_logprobs
from jpaged.runtime.distributed import broadcast_step
from jpaged.runtime.kv_pool import copy_blocks, create_kv_pool, gather_blocks, scatter_blocks
from jpaged.core.model_config import ModelConfig
from jpaged.models.base import StepMetadata
from jpaged.core.rounding import cdiv, next_pow2
from jpaged.runtime.sampling import SamplingArrays, TokenLogprobs
from jpaged.core.scheduler import ScheduledSeq, SchedulerOutput
from jpaged.core.sequence import MAX_LOGPROBS
from jpaged.runtime.sharding import Mesh, pool_sharding, put, replicated
from jpaged.core.swap_space import HostSwapSpace


def token_buckets(max_num_batched_tokens: int, max_num_seqs: int) -> tuple[int, ...]:
    """The step-size ladder: powers of two from min(8, max_num_seqs rounded up), then
    the budget itself.  Steps of up to 8 tokens cost about the same on every
    backend (the weights' memory traffic dominates), so they share one program."""
    min_tokens = min(8, next_pow2(max_num_seqs))
    top = max(max_num_batched_tokens, 1)
    ladder = [b for b in (1 << i for i in range(top.bit_length() + 1)) if min_tokens <= b < top]
    return tuple(ladder + [top])


@dataclasses.dataclass
class StepResult:
    """What one step computed, as numpy: a row per scheduled sequence, and for
    prompt logprobs a row per flat token (None when no sequence asked)."""

    tokens: np.ndarray
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None


@dataclasses.dataclass
class PendingStep:
    """A launched step: its device outputs (None when it ran no forward)."""
    outputs: tuple | None
    num_seqs: int
    start: float


@dataclasses.dataclass
class StepTiming:
    """Seconds of the last launch() + collect(): host array building, block moves, forward."""
    build: float = 0.0
    swap: float = 0.0
    copy: float = 0.0
    forward: float = 0.0
    compile: float = 0.0


class ModelRunner:
    """`mesh` (a (1, tp) jax.sharding.Mesh, or None for one device): params must
    already be sharded on it (jpaged.runtime.sharding.shard_params); the pool is split on
    its kv-head axis and every step's inputs and outputs have fixed shardings."""

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, model_cfg: ModelConfig, *,
                 num_blocks: int, block_size: int, kv_dtype: jnp.dtype, attention_impl: str,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 swap_space: HostSwapSpace | None = None, logprobs_mode: str = "raw",
                 mesh: Mesh | None = None):
        self.params = params
        self.mesh = mesh
        self.block_size = block_size
        self.table_width = cdiv(max_model_len, block_size)
        self.max_num_seqs = max_num_seqs
        self.token_buckets = token_buckets(max_num_batched_tokens, max_num_seqs)
        self._new_pool = functools.partial(create_kv_pool, model_cfg, num_blocks, block_size, kv_dtype,
                                           sharding=None if mesh is None else pool_sharding(mesh))
        self.kv_pool = self._new_pool()
        self.swap_space = swap_space
        step = functools.partial(generate_step, graphdef, attention_impl=attention_impl)
        self._step = self._jit(step, num_host_args=3, num_outputs=1)
        # Steps where a sequence wants logprobs run this variant (its own programs).
        step = functools.partial(generate_step_with_logprobs, graphdef, attention_impl=attention_impl,
                                 num_logprobs=MAX_LOGPROBS, logprobs_mode=logprobs_mode)
        self._step_with_logprobs = self._jit(step, num_host_args=4, num_outputs=3)
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self.compile_seconds = 0.0
        self.timing = StepTiming()

    def _jit(self, step, num_host_args: int, num_outputs: int):
        """The step jitted with the pool donated; on a mesh, with every input's and
        output's sharding fixed (host arrays and results replicated, the pool split
        on heads), so the donated pool never meets a resharding."""
        if self.mesh is None:
            return jax.jit(step, donate_argnums=(1,))
        rep, pool = replicated(self.mesh), pool_sharding(self.mesh)
        params = jax.tree.map(lambda x: x.sharding, self.params)
        return jax.jit(step, donate_argnums=(1,), in_shardings=(params, pool) + (rep,) * num_host_args,
                       out_shardings=(rep,) * num_outputs + (pool,))

    def _mesh_context(self):
        """Traces a step under the mesh, where the attention kernels find it."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    # ----------------------------------------------------------------- shapes
    @property
    def num_compilations(self) -> int:
        return len(self._compiled)

    @property
    def compiled_shapes(self) -> list[tuple]:
        return sorted(self._compiled, key=str)

    def executables(self) -> list[jax.stages.Compiled]:
        """The compiled step programs (for memory analysis)."""
        return list(self._compiled.values())

    @property
    def programs(self) -> dict[tuple, jax.stages.Compiled]:
        """Each compiled step program by its key (tokens, sequences, sampling
        structure, variant): what benchmarks inspect (HLO, memory)."""
        return dict(self._compiled)

    def token_bucket(self, num_tokens: int) -> int:
        for b in self.token_buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest step bucket {self.token_buckets[-1]}")

    def seq_bucket(self, num_tokens_bucket: int) -> int:
        """Sequences per step: every sequence has at least one token."""
        return min(num_tokens_bucket, next_pow2(self.max_num_seqs))

    def _executable(self, args: tuple) -> jax.stages.Compiled:
        """The program for a step's shapes; `args` (pool, tokens, meta, sampling[,
        prompt_targets]) with prompt_targets selects the logprobs variant."""
        tokens, meta, sampling = args[1], args[2], args[3]
        variant = "tokens" if len(args) == 4 else "logprobs" if args[4] is None else "prompt_logprobs"
        key = (tokens.shape[0], meta.kv_lens.shape[0], jax.tree.structure(sampling), variant)
        exe = self._compiled.get(key)
        if exe is None:
            t0 = time.perf_counter()
            step = self._step if variant == "tokens" else self._step_with_logprobs
            with self._mesh_context():
                exe = step.lower(self.params, *args).compile()
            dt = time.perf_counter() - t0
            self.compile_seconds += dt
            self.timing.compile += dt
            self._compiled[key] = exe
        return exe

    def precompile(self, max_num_tokens: int | None = None) -> int:
        """Compiles the greedy step of every bucket up to max_num_tokens (default:
        all) not compiled yet; returns how many were compiled."""
        before = self.num_compilations
        for T in self.token_buckets:
            if max_num_tokens is None or T <= next_pow2(max_num_tokens):
                self._executable((self.kv_pool, *self._padding_batch(T), None))
        return self.num_compilations - before

    def _padding_batch(self, T: int) -> tuple[np.ndarray, StepMetadata]:
        S, zeros = self.seq_bucket(T), functools.partial(np.zeros, dtype=np.int32)
        meta = StepMetadata(positions=zeros(T), write_blocks=zeros(T), write_offsets=zeros(T),
                            block_tables=zeros((S, self.table_width)), kv_lens=zeros(S),
                            cu_q_lens=zeros(S + 1), logits_indices=zeros(S))
        return zeros(T), meta

    # ------------------------------------------------------------------- step
    def restore_pool(self) -> bool:
        """After a failed step: a pool the step had already donated is gone, so
        allocate a fresh (zeroed) one.  True when that happened (its contents,
        every sequence's K/V, are lost)."""
        if not self.kv_pool.is_deleted():
            return False
        self.kv_pool = self._new_pool()
        return True

    def launch(self, out: SchedulerOutput) -> PendingStep:
        """Applies the step's block moves, then dispatches one forward + sample over
        its tokens without waiting for it (a data-parallel router launches every
        replica's step before collecting any).  In a multi-process run, process 0
        first sends the step's host arrays to the others (see `follow`)."""
        self.timing = StepTiming()
        if out.swap_out or out.swap_in:  # before copies and the forward rewrite blocks
            t0 = time.perf_counter()
            self._swap(out)
            self.timing.swap = time.perf_counter() - t0
        t0 = time.perf_counter()
        host = self._host_inputs(out.scheduled) if out.scheduled else None
        self.timing.build = time.perf_counter() - t0
        if self.leads_followers and (host is not None or out.block_copies):
            broadcast_step(("step", out.block_copies, host))
        return self._run(out.block_copies, host, len(out.scheduled))

    def _host_inputs(self, scheduled: list[ScheduledSeq]) -> tuple:
        """(tokens, meta, sampling[, prompt_targets]): the step's numpy inputs."""
        tokens, meta = self._build(scheduled)
        host = (tokens, meta, self._sampling_arrays(scheduled, meta.kv_lens.shape[0]))
        if any(s.seq.params.logprobs is not None or s.seq.params.prompt_logprobs is not None
               for s in scheduled):
            host += (self._prompt_targets(scheduled, tokens.shape[0]),)
        return host

    def _run(self, block_copies: list[tuple[int, int]], host: tuple | None, num_seqs: int) -> PendingStep:
        """The device work of a step, the same in every process: copy-on-write, then
        the jitted forward + sample (dispatched, not waited for)."""
        if block_copies:  # copy-on-write, before the forward writes into the copies
            t0 = time.perf_counter()
            self.kv_pool = copy_blocks(self.kv_pool, block_copies)
            self.timing.copy = time.perf_counter() - t0
        if host is None:
            return PendingStep(None, 0, time.perf_counter())
        if jax.process_count() > 1:  # every process passes the same global (replicated) arrays
            host = jax.tree.map(lambda x: put(x, replicated(self.mesh)), host)
        args = (self.kv_pool, *host)
        exe = self._executable(args)
        t0 = time.perf_counter()
        outputs = exe(self.params, *args)
        self.kv_pool = outputs[-1]
        return PendingStep(outputs[:-1], num_seqs, t0)

    # ------------------------------------------------------------- multi-host
    @property
    def leads_followers(self) -> bool:
        """Whether this is process 0 of a multi-process run (others run `follow`)."""
        return jax.process_count() > 1 and jax.process_index() == 0

    def follow(self) -> None:
        """Processes other than 0: runs every step process 0 launches, with the host
        arrays it broadcasts, until it sends "stop" (`stop_followers`)."""
        while True:
            command, block_copies, host = broadcast_step(None)
            if command == "stop":
                return
            num_seqs = 0 if host is None else host[1].kv_lens.shape[0]
            self.collect(self._run(block_copies, host, num_seqs))

    def stop_followers(self) -> None:
        if self.leads_followers:
            broadcast_step(("stop", [], None))

    def collect(self, pending: PendingStep) -> StepResult:
        """Waits for a launched step; the sampled token of each scheduled sequence
        (and logprobs when one of them asked)."""
        if pending.outputs is None:
            return StepResult(np.zeros(0, np.int32))
        result = StepResult(*jax.device_get(pending.outputs))
        self.timing.forward = time.perf_counter() - pending.start
        result.tokens = result.tokens[:pending.num_seqs]
        return result

    @staticmethod
    def _prompt_targets(scheduled: list[ScheduledSeq], T: int) -> np.ndarray | None:
        """The token after each flat token, when a prefilling sequence owes prompt
        logprobs (else None: the LM head runs only on the last tokens)."""
        if not any(s.seq.needs_prompt_logprobs for s in scheduled):
            return None
        targets, end = np.zeros(T, np.int32), 0
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            nxt = seq.token_slice(start + 1, start + s.num_new + 1)
            targets[end:end + len(nxt)] = nxt
            end += s.num_new
        return targets

    def _build(self, scheduled: list[ScheduledSeq]) -> tuple[np.ndarray, StepMetadata]:
        """The step's flat host arrays: each token's id, position and (block, offset)."""
        n = sum(s.num_new for s in scheduled)
        T = self.token_bucket(n)
        S, bs = self.seq_bucket(T), self.block_size
        tokens, positions = np.zeros(T, np.int32), np.zeros(T, np.int32)
        write_blocks, write_offsets = np.zeros(T, np.int32), np.zeros(T, np.int32)
        block_tables = np.zeros((S, self.table_width), np.int32)
        kv_lens, cu_q_lens = np.zeros(S, np.int32), np.full(S + 1, n, np.int32)
        logits_indices = np.zeros(S, np.int32)
        end = 0
        for i, s in enumerate(scheduled):
            seq, start, k = s.seq, s.seq.num_computed_tokens, s.num_new
            ids = seq.block_table.block_ids
            block_tables[i, :len(ids)] = ids
            pos = np.arange(start, start + k, dtype=np.int32)
            tokens[end:end + k] = seq.token_slice(start, start + k)
            positions[end:end + k] = pos
            write_blocks[end:end + k] = block_tables[i, pos // bs]
            write_offsets[end:end + k] = pos % bs
            cu_q_lens[i] = end
            end += k
            kv_lens[i] = start + k
            logits_indices[i] = end - 1
        meta = StepMetadata(positions=positions, write_blocks=write_blocks,
                            write_offsets=write_offsets, block_tables=block_tables,
                            kv_lens=kv_lens, cu_q_lens=cu_q_lens, logits_indices=logits_indices)
        return tokens, meta

    def _swap(self, out: SchedulerOutput) -> None:
        """One jitted gather of every victim's blocks (device -> host pool), then one
        jitted, donated scatter of every resumed sequence's blocks into its new ones."""
        host = self.swap_space
        if out.swap_out:
            ids = [b for r in out.swap_out for b in r.block_ids]
            host.store([x for r in out.swap_out for x in r.slots], gather_blocks(self.kv_pool, ids))
        if out.swap_in:
            ids = [b for r in out.swap_in for b in r.block_ids]
            data = host.load([x for r in out.swap_in for x in r.slots])
            self.kv_pool = scatter_blocks(self.kv_pool, ids, data)

    @staticmethod
    def _sampling_arrays(scheduled: list[ScheduledSeq], S: int) -> SamplingArrays | None:
        """None when every sequence is greedy: that step skips sampling entirely."""
        params = [s.seq.params for s in scheduled]
        if all(p.temperature == 0 for p in params):
            return None

        def column(values, dtype):
            out = np.zeros(S, dtype)
            out[:len(values)] = values
            return out
        filtered = any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params)
        return SamplingArrays(
            temperature=column([p.temperature for p in params], np.float32),
            seed=column([s.seq.seed & 0xFFFFFFFF for s in scheduled], np.uint32),
            step=column([len(s.seq.output_token_ids) for s in scheduled], np.int32),
            top_k=column([p.top_k for p in params], np.int32) if filtered else None,
            top_p=column([p.top_p for p in params], np.float32) if filtered else None)

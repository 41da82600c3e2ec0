"""Owns the device state (weights, KV pool) and runs one scheduled step.

A step's tokens are one flat ragged array `[T]` (prefill chunks and decode
tokens mixed); T comes from one ladder of buckets (`token_buckets`: powers of
two up to 16 tokens, then eighths of an octave, up to max_num_batched_tokens)
and the number of sequences S is a function of T, and the block-table width is
fixed at max_model_len / block_size, so each bucket of the ladder is exactly
one compiled program.  The KV pool is donated to every step: XLA writes the new
K/V into the same buffer.

The programs belong to a `StepPrograms` (jpaged.runtime.compilation): built
ahead of time from shapes, timed and counted, and with the config's
`compilation_cache` kept on disk, so that a warm start loads them without
tracing.  A step whose bucket has no program yet runs padded to the smallest
larger bucket that has one (same StepInputs structure; padding never changes a
token) while its own bucket is built in the background; only when no larger one
is ready does the step wait for a build.  `precompile` builds the power-of-two
rungs of the ladder (and its top), now or in the background.

Everything per request that the step consumes is one `StepInputs` pytree,
built by `build_step_inputs` (jpaged.runtime.step_inputs, the seam a new
feature adds a field to); its structure picks the program (greedy or sampled,
filtered or not, with logprobs or not), and the step returns a `StepResult`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.runtime.buckets import min_step_tokens, precompile_buckets, token_buckets
from jpaged.runtime.step import run_step
from jpaged.runtime.compilation import BuildStats, StepPrograms, program_key, shape_specs
from jpaged.runtime.distributed import broadcast_step
from jpaged.runtime.kv_pool import copy_blocks, create_kv_pool, gather_blocks, pool_dtype, scatter_blocks
from jpaged.layers.lora import LoraWeights, create_lora_weights, write_slot
from jpaged.core.config import EngineConfig
from jpaged.core.kv_layout import KVLayout
from jpaged.core.model_config import ModelConfig
from jpaged.core.rounding import cdiv, next_pow2
from jpaged.core.scheduler import ScheduledSeq, SchedulerOutput
from jpaged.core.sequence import MAX_LOGPROBS
from jpaged.core.swap_space import HostSwapSpace
from jpaged.layers.sharding import Mesh, pool_sharding, put, replicated
from jpaged.loading.gguf_blocks import BlockMatrix
from jpaged.runtime.step_inputs import StepInputs, StepResult, build_step_inputs, padding_step_inputs
from jpaged.runtime.weight_blocks import RegisteredBlocks, register_weight_blocks

# StepResult lives with StepInputs (the step's pytrees in and out); importable from here too.
__all__ = ["ModelRunner", "PendingStep", "StepResult", "StepTiming", "token_buckets"]


def _to_devices(host: Any, specs: Any) -> Any:
    """Host arrays placed as `specs` (a tree of ShapeDtypeStructs) says: each one
    with its sharding, so that the step programs built for them take them as they are."""
    return jax.tree.map(lambda x, spec: jax.device_put(x, spec.sharding), host, specs)


Weights = tuple[nnx.State, LoraWeights | None]


def _weighted_step(graphdef: nnx.GraphDef, treedef: Any, weights: Weights | list[jax.Array], kv_pool: jax.Array,
                   inputs: StepInputs, **static: Any) -> tuple[StepResult, jax.Array]:
    """run_step with the base weights and the LoRA slots passed as one argument:
    the (params, lora) tree itself (`treedef` None), or its flat list of leaves,
    the tree's `treedef` closed over (static, part of the program)."""
    params, lora = weights if treedef is None else jax.tree.unflatten(treedef, weights)
    return run_step(graphdef, params, kv_pool, inputs, lora=lora, **static)


@dataclasses.dataclass
class StepTiming:
    """Seconds of the last launch() + collect(): host array building, block moves, forward."""
    build: float = 0.0
    swap: float = 0.0
    copy: float = 0.0
    forward: float = 0.0
    compile: float = 0.0  # waiting for a program to be built or loaded


@dataclasses.dataclass
class PendingStep:
    """A launched step: its device outputs (None when it ran no forward), the
    token slots it computed (T of the bucket it ran in: a larger one than its own
    while that is built) and its timing."""
    outputs: StepResult | None
    num_seqs: int
    start: float
    token_slots: int = 0
    timing: StepTiming | None = None


class ModelRunner:
    """`config`: the engine's sections, resolved (EngineConfig.resolved): the pool
    (cache), the step ladder (scheduler), the compiled step (runtime), the LoRA
    slots and the drafts' width.  `mesh` (a (1, tp) Mesh, or None for one device):
    params are already sharded on it; the pool is split on its kv-head axis and
    every step's inputs and outputs have fixed shardings.

    runtime.flat_weights: a step hands its program the weights as one flat list of
    arrays kept between steps (their tree structure closed over), not the
    (nnx.State, LoraWeights) tree every call flattens (SmolLM2 unrolled, 273
    leaves, 2-core CPU VM: a median 22.5 ms a call with the tree, 1.4 ms with the
    list); rebuilt when `params` or `lora` is replaced."""

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, model_cfg: ModelConfig, config: EngineConfig,
                 *, layout: KVLayout | None = None, mesh: Mesh | None = None, swap_space: HostSwapSpace | None = None,
                 program_cache_dir: pathlib.Path | None = None,
                 weight_blocks: dict[tuple[str, int | None], BlockMatrix] | None = None):
        cache, sched, runtime = config.cache, config.scheduler, config.runtime
        if not cache.num_blocks or "auto" in (cache.kv_cache_dtype, runtime.attention_impl, runtime.layer_loop):
            raise ValueError("ModelRunner takes a resolved config (EngineConfig.resolved): no 'auto', num_blocks set")
        # A quantised GGUF's blocks (jpaged.runtime.weight_blocks): registered for the
        # params they were dequantised into, released whenever params are replaced.
        self._block_matrices = weight_blocks
        self.registered_blocks: RegisteredBlocks | None = None
        self.params = params
        self.registered_blocks = register_weight_blocks(params, weight_blocks)
        # LoRA adapters' device slots (jpaged.layers.lora); None: adapters off.
        dtype, scan_layers = jax.tree.leaves(params)[0].dtype, runtime.layer_loop == "scan"
        self.lora = (create_lora_weights(model_cfg, config.lora.slots, config.lora.max_lora_rank, dtype,
                                         stacked=scan_layers, mesh=mesh) if config.lora.slots else None)
        self.num_speculative_tokens = config.speculative.width  # the drafts' width K (speculative decoding)
        self.mesh, self.swap_space = mesh, swap_space
        self.block_size = block_size = cache.block_size
        self.table_width = cdiv(sched.max_model_len, block_size)
        self.kv_groups = layout.num_groups if layout else 1  # block tables per sequence (jpaged.core.kv_layout)
        self.max_num_seqs = sched.max_num_seqs
        self.vocab_size = model_cfg.vocab_size  # the logit masks' width
        self.build_padded_buckets = sched.build_padded_buckets
        self.token_buckets = token_buckets(sched.max_num_batched_tokens, sched.max_num_seqs, sched.buckets_per_octave,
                                           min_step_tokens(sched.min_step_tokens, runtime.attention_impl))
        self._new_pool = functools.partial(create_kv_pool, model_cfg, cache.num_blocks, block_size,
                                           pool_dtype(cache.kv_cache_dtype),
                                           sharding=None if mesh is None else pool_sharding(mesh),
                                           layers_per_page=layout.layers_per_page if layout else None)
        self.kv_pool = self._new_pool()
        # Asynchronous scheduling: each step reads the previous one's sampled tokens from a device buffer ([S]).
        self.chained = sched.async_scheduling
        self._token_buffer = self._new_token_buffer() if self.chained else None
        self._last_launched: StepResult | None = None
        self._last_collected = 0.0  # perf_counter when the last step's result arrived
        # One jitted step; each structure of its StepInputs is a program of its own.
        static = dict(attention_impl=runtime.attention_impl, num_logprobs=MAX_LOGPROBS,
                      logprobs_mode=runtime.logprobs_mode)
        self._weights_treedef = jax.tree.structure(self.weights) if runtime.flat_weights else None
        self._step = self._jit(functools.partial(_weighted_step, graphdef, self._weights_treedef, **static))
        self._programs = StepPrograms(
            self._step, self.step_weights(), self.kv_pool, model_config=model_cfg, mesh=mesh,
            cache_dir=program_cache_dir, mesh_context=self._mesh_context, compiler_options=runtime.compiler_options,
            static={**static, "block_size": block_size, "table_width": self.table_width, "donate": (1,),
                    "graphdef": graphdef, "num_speculative_tokens": self.num_speculative_tokens,
                    "weights_treedef": self._weights_treedef})
        self._programs.preload()  # a warm start: every program this engine built before, before any step
        self.timing = StepTiming()
        # Sleep mode (release/restore): 0 awake, else the level; what restore() puts back.
        self.sleep_level = 0
        self._host_params = self._host_lora = self._asleep_specs = self._lora_specs = None

    @property
    def weights(self) -> Weights:
        """What a step reads besides the pool and its inputs: the base weights and the adapter slots."""
        return self.params, self.lora

    @property
    def params(self) -> nnx.State:
        return self._params

    @params.setter
    def params(self, value: nnx.State) -> None:
        if self.registered_blocks is not None and value is not self.registered_blocks.params:
            self.registered_blocks.release()  # the blocks are not these weights
            self.registered_blocks = None
        self._params, self._weight_leaves = value, None

    @property
    def lora(self) -> LoraWeights | None:
        return self._lora

    @lora.setter
    def lora(self, value: LoraWeights | None) -> None:
        self._lora, self._weight_leaves = value, None

    def step_weights(self) -> Weights | list[jax.Array]:
        """The weights as the step programs take them: `weights`, or with
        flat_weights its leaves (flattened once per replacement of params or lora)."""
        if self._weights_treedef is None:
            return self.weights
        if self._weight_leaves is None:
            leaves, treedef = jax.tree.flatten(self.weights)
            if treedef != self._weights_treedef:
                raise ValueError(f"the weights' tree changed: {treedef} is not the step programs' "
                                 f"{self._weights_treedef}")
            self._weight_leaves = leaves
        return self._weight_leaves

    def write_lora_slot(self, slot: int, modules: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Puts one adapter's arrays (target -> A [L, in, r], B [L, r, out]) into `slot`
        (a target it lacks is zeroed): one jitted update, no step recompiles."""
        if self.sleep_level:
            raise RuntimeError("the engine is asleep: call wake_up() before changing LoRA adapters")
        if self.lora is None:
            raise ValueError("this engine keeps no LoRA slots (max_loras = 0)")
        self.lora = write_slot(self.lora, slot, modules)

    def _jit(self, step):
        """step(step_weights(), kv_pool, inputs) -> (result, kv_pool) jitted with the pool
        donated; on a mesh, with every input's and output's sharding fixed (the
        StepInputs and the StepResult replicated whole, whatever their fields,
        the pool split on heads), so the donated pool never meets a resharding."""
        if self.mesh is None:
            return jax.jit(step, donate_argnums=(1,))
        rep, pool = replicated(self.mesh), pool_sharding(self.mesh)
        weights = jax.tree.map(lambda x: x.sharding, self.step_weights())
        return jax.jit(step, donate_argnums=(1,), in_shardings=(weights, pool, rep),
                       out_shardings=(rep, pool))

    def _mesh_context(self):
        """Traces a step under the mesh, where the attention kernels find it."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    # ----------------------------------------------------------------- shapes
    @property
    def num_compilations(self) -> int:
        """Programs ready (compiled here or loaded from disk)."""
        return len(self._programs.ready)

    @property
    def compile_seconds(self) -> float:
        """Seconds spent getting programs ready, in any thread (loads included)."""
        return self._programs.stats.total_seconds

    @property
    def build_stats(self) -> BuildStats:
        """compile_seconds split: trace+lower, XLA compile, loads; programs compiled vs loaded."""
        return self._programs.stats

    @property
    def compiled_shapes(self) -> list[tuple]:
        return sorted(self._programs.ready, key=str)

    def executables(self) -> list[jax.stages.Compiled]:
        """The compiled step programs (for memory analysis)."""
        return list(self._programs.ready.values())

    @property
    def programs(self) -> dict[tuple, jax.stages.Compiled]:
        """Each compiled step program by its key (tokens, sequences, StepInputs
        structure): what benchmarks inspect (HLO, memory)."""
        return self._programs.ready

    def wait_for_programs(self) -> None:
        """Waits for the programs being built in the background."""
        self._programs.wait()

    def token_bucket(self, num_tokens: int) -> int:
        for b in self.token_buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest step bucket {self.token_buckets[-1]}")

    def seq_bucket(self, num_tokens_bucket: int) -> int:
        """Sequences per step: every sequence has at least one token."""
        return min(num_tokens_bucket, next_pow2(self.max_num_seqs))

    def _executable(self, inputs: StepInputs) -> jax.stages.Compiled:
        """The program for a step's inputs: one per bucket (T, S) and pytree
        structure (which optional fields are present: sampling, its filters,
        logprobs, prompt logprobs, ...); waits for it when it is not ready."""
        exe, waited = self._programs.program(inputs)
        self.timing.compile += waited
        return exe

    def precompile(self, max_num_tokens: int | None = None, *, background: bool = False,
                   max_speculative_tokens: int = 0) -> int:
        """Builds the greedy step of the power-of-two buckets up to max_num_tokens'
        bucket, and that bucket (default: up to the top of the ladder), and the
        greedy draft-verifying step of those up to max_speculative_tokens' bucket,
        that are not ready yet; returns how many it built, or with `background`
        queued on the builder thread (returning at once).  An engine with LoRA
        slots also builds each of those with adapters applied."""
        def inputs(T: int, K: int = 0, lora: bool = False) -> StepInputs:
            return self._with_token_buffer(padding_step_inputs(T, self.seq_bucket(T), self.table_width,
                                                               chained=self.chained, num_speculative_tokens=K,
                                                               kv_groups=self.kv_groups, lora=lora))
        shapes = [(T, 0) for T in precompile_buckets(self.token_buckets, max_num_tokens)]
        if self.num_speculative_tokens and max_speculative_tokens:
            shapes += [(T, self.num_speculative_tokens)
                       for T in precompile_buckets(self.token_buckets, max_speculative_tokens) if T > 1]
        variants = (False, True) if self.lora is not None else (False,)
        steps = [inputs(T, K, lora) for lora in variants for T, K in shapes]
        return self._programs.precompile(steps, background)

    # ------------------------------------------------------------------- step
    def restore_pool(self, failed: PendingStep | None = None) -> bool:
        """After a failed step: a pool the step had already donated is gone, so
        allocate a fresh (zeroed) one.  True when that happened (its contents,
        every sequence's K/V, are lost)."""
        if self.chained and failed is not None and failed.outputs is self._last_launched:
            # Its token buffer (the chain's head) may hold the failure: nothing will read its tokens.
            self._token_buffer = self._new_token_buffer()
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
        inputs = self._step_inputs(out.scheduled) if out.scheduled else None
        self.timing.build = time.perf_counter() - t0
        if self.leads_followers and (inputs is not None or out.block_copies):
            # (without this process's token buffer: each process chains its own)
            host = inputs if inputs is None else dataclasses.replace(inputs, prev_tokens=None)
            broadcast_step(("step", out.block_copies, host))
        return self._run(out.block_copies, inputs, len(out.scheduled))

    def _step_inputs(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        """The step's numpy inputs, padded to its bucket, or to a larger ready one
        while its own is not ready (see _ready_bucket)."""
        T = self.token_bucket(sum(s.num_new for s in scheduled))
        inputs = self._padded_inputs(scheduled, T)
        larger = self._ready_bucket(inputs)
        return inputs if larger == T else self._padded_inputs(scheduled, larger)

    def _padded_inputs(self, scheduled: list[ScheduledSeq], T: int) -> StepInputs:
        return self._with_token_buffer(build_step_inputs(
            scheduled, num_tokens=T, num_seqs=self.seq_bucket(T), block_size=self.block_size,
            table_width=self.table_width, vocab_size=self.vocab_size, chained=self.chained,
            num_speculative_tokens=self.num_speculative_tokens, kv_groups=self.kv_groups))

    def _new_token_buffer(self) -> jax.Array:
        zeros = np.zeros(self.seq_bucket(self.token_buckets[-1]), np.int32)
        return jnp.asarray(zeros) if self.mesh is None else put(zeros, replicated(self.mesh))

    def _with_token_buffer(self, inputs: StepInputs) -> StepInputs:
        """Chained steps read the previous step's sampled tokens (this process's own
        buffer: it is never broadcast to the other processes of a multi-process run)."""
        return inputs if not self.chained else dataclasses.replace(inputs, prev_tokens=self._token_buffer)

    def _ready_bucket(self, inputs: StepInputs) -> int:
        """The bucket to run `inputs` in now: its own when ready (or loadable from
        disk, which traces nothing), else the smallest larger ready bucket of the
        same structure, its own queued on the builder (unless build_padded_buckets
        is off); its own (to be built, or waited for) when none is ready.  Padding
        is masked out of every real token's attention and sampling, so the bucket
        never changes a token."""
        T, S, structure = program_key(inputs)
        if self._programs.is_ready((T, S, structure)) or self._programs.on_disk(inputs):
            return T
        larger = next((b for b in self.token_buckets
                       if b > T and self._programs.is_ready((b, self.seq_bucket(b), structure))), None)
        if larger is not None and self.build_padded_buckets:
            self._programs.submit(inputs)
        return T if larger is None else larger

    def _run(self, block_copies: list[tuple[int, int]], inputs: StepInputs | None,
             num_seqs: int) -> PendingStep:
        """The device work of a step, the same in every process: copy-on-write, then
        the jitted forward + sample (dispatched, not waited for)."""
        if block_copies:  # copy-on-write, before the forward writes into the copies
            t0 = time.perf_counter()
            self.kv_pool = copy_blocks(self.kv_pool, block_copies)
            self.timing.copy = time.perf_counter() - t0
        if inputs is None:
            return PendingStep(None, 0, time.perf_counter(), timing=self.timing)
        if jax.process_count() > 1:  # every process passes the same global (replicated) arrays
            inputs = jax.tree.map(lambda x: put(x, replicated(self.mesh)), inputs)
        inputs = self._with_token_buffer(inputs)
        exe = self._executable(inputs)
        t0 = time.perf_counter()
        outputs, self.kv_pool = exe(self.step_weights(), self.kv_pool, inputs)
        if self.chained:
            self._token_buffer, outputs.token_buffer = outputs.token_buffer, None
        self._last_launched = outputs
        return PendingStep(outputs, num_seqs, t0, inputs.num_tokens, self.timing)

    # ------------------------------------------------------------- sleep mode
    def release(self, level: int) -> None:
        """Frees this runner's device memory for someone else (a trainer between
        rollouts: LLM.sleep).  The KV pool is deleted (no request is left to read
        it); the LoRA slots are copied to host memory (small, and the adapters'
        files may be gone); the weights are copied to host memory at level 1 and
        dropped at level 2, where update_params gives the next ones.

        `params` and `kv_pool` become their jax.ShapeDtypeStructs (shape, dtype,
        sharding) meanwhile: what the compiled programs were built for, what new
        weights are checked against, and what restore() rebuilds, so no step
        recompiles.  The weights are dropped, not deleted: the caller may hold the
        same arrays (update_params keeps a reference to the trainer's), and those
        stay where they are; arrays only the engine held are freed."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self._host_params = jax.device_get(self.params) if level == 1 else None
        self._host_lora = None if self.lora is None else jax.device_get(self.lora)
        self._asleep_specs, self._lora_specs = shape_specs(self.params), shape_specs(self.lora)
        pool_spec = shape_specs(self.kv_pool)
        self.kv_pool.delete()
        self.params, self.kv_pool, self.sleep_level = self._asleep_specs, pool_spec, level
        self.lora = self._token_buffer = self._last_launched = None

    def restore(self) -> None:
        """Undoes release(): the weights given while asleep (`params` replaced, as
        update_params does) or else the host copy of level 1, put back with their
        shardings; the LoRA slots; a zeroed pool (and token buffer).  RuntimeError,
        changing nothing, at level 2 when no new weights came."""
        if not self.sleep_level:
            return
        if self.params is self._asleep_specs and self._host_params is None:
            raise RuntimeError("wake_up() after sleep(level=2) needs new weights: call update_params(params) first")
        if self.params is self._asleep_specs:
            self.params = _to_devices(self._host_params, self._asleep_specs)
            # level 1's copy of the weights, which the blocks hold
            self.registered_blocks = register_weight_blocks(self.params, self._block_matrices)
        if self._host_lora is not None:
            self.lora = _to_devices(self._host_lora, self._lora_specs)
        self.kv_pool = self._new_pool()
        if self.chained:
            self._token_buffer = self._new_token_buffer()
        self._host_params = self._host_lora = self._asleep_specs = self._lora_specs = None
        self.sleep_level = 0

    # ------------------------------------------------------------- multi-host
    @property
    def leads_followers(self) -> bool:
        """Whether this is process 0 of a multi-process run (others run `follow`)."""
        return jax.process_count() > 1 and jax.process_index() == 0

    def follow(self) -> None:
        """Processes other than 0: runs every step process 0 launches, with the
        StepInputs it broadcasts, until it sends "stop" (`stop_followers`)."""
        while True:
            command, block_copies, inputs = broadcast_step(None)
            if command == "stop":
                return
            num_seqs = 0 if inputs is None else inputs.num_seqs
            self.collect(self._run(block_copies, inputs, num_seqs))

    def stop_followers(self) -> None:
        if self.leads_followers:
            broadcast_step(("stop", [], None))

    def collect(self, pending: PendingStep) -> StepResult:
        """Waits for a launched step; the sampled token of each scheduled sequence
        (and logprobs when one of them asked)."""
        if pending.outputs is None:
            return StepResult(np.zeros(0, np.int32))
        result = jax.device_get(pending.outputs)
        # The device's share: from the launch, or (a chained step queued behind the
        # one before it) from when that one's result was in.
        done = time.perf_counter()
        pending.timing.forward = done - max(pending.start, self._last_collected)
        self._last_collected = done
        result.tokens = result.tokens[:pending.num_seqs]
        if result.nan_rows is not None:
            result.nan_rows = result.nan_rows[:pending.num_seqs]
        if result.num_accepted is not None:
            result.num_accepted = result.num_accepted[:pending.num_seqs]
        return result

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

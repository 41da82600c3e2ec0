"""The engine core: requests in, one step at a time, request deltas out (vLLM V1's
`EngineCore`).

`EngineCore.step()` is schedule -> launch -> collect -> `Scheduler.update_from_output`
-> the output processor's deltas.  Around that loop it owns the requests, recovery from a failed
step, pause/resume, sleep/wake, update_params and the LoRA verbs.  Its
collaborators are built once by `components` (config, weights, pool size):
`InputProcessor` (checked token ids), `Scheduler` and `BlockManager` (which tokens
run, where their K/V lives; the scheduler also applies each step's output),
`ModelRunner` (the device), `OutputProcessor` (stop conditions, request outputs)
and `StepStats`.  `jpaged.engine.llm.LLM` is the façade users call.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterable

import jax
import ml_collections
import numpy as np
from flax import nnx

from jpaged.core.config import apply_overrides, default_config, validate_config
from jpaged.core.progress import ProgressCheck
from jpaged.core.scheduler import SchedulerOutput
from jpaged.core.sequence import SamplingParams, Sequence, Status
from jpaged.core.step_output import StepOutput
from jpaged.engine.lora_manager import UnknownLoraError
from jpaged.engine.recovery import fail_step
from jpaged.engine.request_output import RequestDelta
from jpaged.engine.components import build_components
from jpaged.engine.setup import engine_mesh
from jpaged.engine.started_step import PAUSE_MODES, StartedStep
from jpaged.engine.weights_update import incoming_params
from jpaged.layers.sharding import Mesh

log = logging.getLogger(__name__)


class EngineCore:
    """Loads a model, sizes the KV pool and runs requests step by step."""

    def __init__(self, config: ml_collections.ConfigDict | None = None, *, mesh: Mesh | None = None,
                 **overrides: Any):
        """`mesh`: the (1, tensor_parallel_size) devices of this engine; by default the
        first tensor_parallel_size devices (none: one device, unsharded).  A
        data-parallel router (jpaged.engine.router) gives each replica its own."""
        cfg = apply_overrides(default_config(), config, **overrides)
        validate_config(cfg)  # one line per problem, before anything loads
        self.config = cfg
        self.mesh = engine_mesh(cfg, mesh)
        parts = build_components(cfg, self.mesh)
        self.loaded, self.model_config, self.tokenizer = parts.model.loaded, parts.model.model_config, parts.model.tokenizer
        self.graphdef, self.params = parts.model.graphdef, parts.model.params
        self.scan_layers, self.dtype, self.kv_dtype = parts.scan_layers, parts.dtype, parts.kv_dtype
        self.attention_impl, self.attention_note = parts.attention_impl, parts.attention_note
        self.kv_layout, self.num_blocks = parts.kv_layout, parts.num_blocks
        self.step_stats = parts.step_stats
        self.totals = self.step_stats.totals  # since start; block manager and scheduler count into it too
        self.block_manager, self.swap_space, self.runner = parts.block_manager, parts.swap_space, parts.runner
        self.lora, self.speculator, self.outputs = parts.lora, parts.speculator, parts.outputs
        self.scheduler, self.grammars, self.inputs = parts.scheduler, parts.grammars, parts.inputs
        self.progress = ProgressCheck(self.scheduler, self.block_manager)
        self._rng = np.random.default_rng(cfg.seed)
        self._next_id = 0
        self._next_child_id = 0  # samples 1..n-1 get negative ids
        self.weights_version = 0  # update_params() count: part of every prefix-cache key
        self._active: dict[int, Sequence] = {}
        self._touched: list[Sequence] = []  # ran in a step completed since step() last returned
        # async_scheduling: the step on the device whose tokens the host does not have yet.
        self.async_scheduling = cfg.async_scheduling
        self._in_flight: StartedStep | None = None
        # pause(): its mode while paused, and the requests added meanwhile (scheduled on resume).
        self._pause: str | None = None
        self._held: list[Sequence] = []
        self._stashed: list[Sequence] = []  # finished in the step pause() completed: the next step returns them

    def add_request(self, prompt_token_ids: list[int] | None, params: SamplingParams,
                    prompt: str | None = None, error: str | None = None, *, request_id: int | None = None) -> int:
        """Queues one request; an invalid one is finished at once with an error.
        `request_id`: a router's id for it (unused here), by default the next one."""
        self._check_awake()  # (sleep mode)
        request_id = self._next_id if request_id is None else request_id
        self._next_id = max(self._next_id, request_id + 1)
        prompt_token_ids = list(prompt_token_ids or [])
        error = error or self.inputs.validate(prompt_token_ids, params) or self._lora_error(params)
        # A request that fails draws no seed: its neighbours' draws do not depend on it.
        seed = 0 if error else params.seed if params.seed is not None else int(self._rng.integers(2**31))
        lora_slot, lora_key = (-1, None) if error else self.lora.binding(params.lora)
        seq = Sequence(request_id, prompt_token_ids, params, prompt=prompt, seed=seed,
                       weights_version=self.weights_version, lora_slot=lora_slot, lora_key=lora_key)
        self._active[request_id] = seq
        if not error and params.structured is not None:
            try:
                seq.grammar = self.grammars.grammar(params.structured)
            except ValueError as e:
                error = str(e)
        if error:
            seq.finish("error", error)
            return request_id
        for i in range(1, params.n):  # parallel samples: seeds seed + i, forked after prefill
            self._next_child_id -= 1
            child = Sequence(self._next_child_id, seq.prompt_token_ids, params, prompt=prompt,
                             seed=seed + i, weights_version=self.weights_version,
                             lora_slot=lora_slot, lora_key=lora_key)
            child.grammar = seq.grammar.fork() if seq.grammar is not None else None
            child.group = seq.group
            seq.group.append(child)
            seq.forks.append(child)
            self._active[child.seq_id] = child
        if self._pause is not None:
            self._held.append(seq)
        else:
            self.scheduler.add(seq)
        return request_id

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> str | None:
        """Why add_request() would fail this request at once, or None: lets a server
        answer bad input before queueing it.  Reads only the config, the pool size
        and which LoRA adapters are loaded."""
        return self.inputs.validate(list(prompt_token_ids), params) or self._lora_error(params)

    def _lora_error(self, params: SamplingParams) -> str | None:
        try:
            self.lora.binding(params.lora)
        except UnknownLoraError as e:
            return str(e)
        return None

    def has_unfinished_requests(self) -> bool:
        """Whether step() has requests left to run (waiting, running or swapped out)
        or to return (failed at admission, aborted): loop on step() while it is True.
        While paused, requests that wait for resume() do not count: step() cannot run them."""
        can_run = self.scheduler.has_work and self._pause in (None, "wait")
        return (can_run or self._in_flight is not None or bool(self._stashed)
                or any(s.is_done for s in self._active.values()))

    def get_sequence(self, request_id: int) -> Sequence | None:
        """The live Sequence of a request added with add_request() (its tokens and block
        table), until step() returns it finished; None after that.  Read it only."""
        return self._active.get(request_id)

    def abort(self, request_ids: Iterable[int]) -> None:
        """Ends the given requests (every sample not finished yet) now and frees what
        they hold: they finish with finish_reason "abort", and the next step()
        returns each of them once, like any finished request."""
        for rid in list(request_ids):
            for s in self._group(rid):
                if not s.is_done:
                    self.scheduler.fail(s, "aborted", reason="abort")

    def finish_sample(self, request_id: int, index: int, reason: str = "stop") -> None:
        """Ends sample `index` of a request now with `reason` and frees what it
        holds; its other samples go on.  Like a sample that hits max_tokens, the
        next step() returns it as finished.  A finished or unknown sample is left
        as it is."""
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

    # -------------------------------------------------------------- weights
    def update_params(self, params: nnx.State | str | os.PathLike | None = None, *,
                      lora: dict[str, dict] | None = None, in_flight: str = "abort",
                      check_finite: bool = True) -> None:
        """Swaps in new weights without recompiling anything (docs/rl.md): `params` has
        the tree, shapes, dtypes and shardings of `self.params` (else ValueError;
        with merge_projections, the separate q/k/v and gate/up weights are merged),
        or is a path (an orbax checkpoint of the tree, or a HF directory or .gguf
        file of the same model); `check_finite` names an array holding NaN/Inf
        (NonFiniteParamsError).  The engine keeps a reference to `params`.  The
        prefix cache is dropped.  Unfinished requests: `in_flight` "abort" ends
        them, "keep" goes on over the K/V computed with the old weights (as vLLM),
        "recompute" prefills them again under the new ones.  `lora` updates loaded
        adapters alone: name -> {target: (A [L, in, r], B [L, r, out])}, the scale
        folded into B; only their requests and cached K/V are affected."""
        if in_flight not in ("abort", "keep", "recompute"):
            raise ValueError(f"in_flight must be 'abort', 'keep' or 'recompute', got {in_flight!r}")
        if params is None and lora is None:
            raise ValueError("update_params needs params, lora, or both")
        if params is not None:
            params = incoming_params(params, self.params, self.config, self.loaded.config, self.mesh,
                                     self.scan_layers, check_finite)
        for name in lora or {}:
            self.lora.binding(name)  # UnknownLoraError before anything changes
        if in_flight == "abort":
            self.abort([rid for rid, seq in self._active.items() if seq.group[0] is seq
                        and (params is not None or seq.params.lora in (lora or {}))])
        for name, modules in (lora or {}).items():
            self.lora.update(name, modules)
        if params is not None:
            if in_flight == "recompute":
                self._stashed += self._complete_in_flight(drafting=True)  # its tokens are the old weights'
                self.scheduler.requeue_all()
            self.params = self.runner.params = params
            self.weights_version += 1
            self.block_manager.drop_cached()

    # ------------------------------------------------------- pause and resume
    def pause(self, mode: str = "keep") -> None:
        """Stops the engine taking on work, e.g. while a trainer swaps the weights
        (docs/rl.md).  Unfinished requests: mode "abort" ends them now, "keep"
        freezes them (K/V and all) until resume(), "wait" lets them run to their
        end.  Requests added while paused wait for resume(); step() still returns
        what finished, and has_unfinished_requests() turns False once step() can
        run nothing.  Pausing a paused engine changes its mode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        # No step stays in flight: what it finishes, the next step() returns.
        self._stashed += self._complete_in_flight(drafting=True)
        if mode == "abort":
            self.abort([rid for rid, seq in self._active.items() if seq.group[0] is seq])
        self._pause = mode

    def resume(self) -> None:
        """Schedules again: frozen requests go on (on their K/V, or recomputed if
        update_params(in_flight="recompute") dropped it), held ones start."""
        self._pause = None
        for seq in self._held:
            if not seq.is_done:  # (aborted while held)
                self.scheduler.add(seq)
        self._held = []

    @property
    def is_paused(self) -> bool:
        return self._pause is not None

    # ------------------------------------------------------------ LoRA adapters
    def load_lora_adapter(self, name: str, path: str) -> None:
        """Loads a PEFT LoRA directory under `name` into a free slot (no step recompiles);
        requests name it with SamplingParams.lora.  ValueError naming the file and the
        problem for a bad adapter, a name in use, or no free slot (max_loras)."""
        self._single_process("load_lora_adapter")
        self.lora.load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Frees the adapter's slot; its unfinished requests end (finish_reason "abort")."""
        self._single_process("unload_lora_adapter")
        self.lora.binding(name)  # UnknownLoraError
        self.abort([rid for rid, seq in self._active.items() if seq.group[0] is seq and seq.params.lora == name])
        self.lora.unload(name)

    @property
    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapters: name -> the directory it was read from."""
        return {name: lora.path for name, lora in self.lora.adapters.items()}

    def lora_weights(self) -> tuple[Any, dict[str, int]]:
        """The adapter slots' device arrays (jpaged.layers.lora.LoraWeights, or None when
        adapters are off) and each loaded adapter's slot: what `decode.score(...,
        lora=, lora_slots=)` takes to score under an adapter."""
        return self.runner.lora, {name: lora.slot for name, lora in self.lora.adapters.items()}

    @staticmethod
    def _single_process(what: str) -> None:
        if jax.process_count() > 1:
            raise ValueError(f"{what} at run time is single-process only: list the adapters in "
                             "lora_modules, which every process loads at start")

    # ------------------------------------------------------------- sleep mode
    def sleep(self, level: int = 1) -> None:
        """Frees this engine's accelerator memory between rollouts (vLLM's LLM.sleep;
        docs/rl.md).  Level 1: the pool is released, the weights and LoRA slots go
        to host memory.  Level 2: the weights are dropped too; update_params()
        while asleep gives the next ones.  Nothing recompiles; the prefix cache
        goes with the pool.  ValueError with unfinished requests; a no-op when asleep."""
        if self.is_sleeping:
            return
        self.check_can_sleep()
        self.runner.release(level)
        self.params = self.runner.params  # the weights' ShapeDtypeStructs: what update_params checks against
        self.block_manager.drop_cached()

    def check_can_sleep(self) -> None:
        """ValueError when sleep() may not run now: several processes, or unfinished
        requests (a paused engine's frozen ones included) or a step in flight."""
        if jax.process_count() > 1:
            raise ValueError("sleep() is single-process only")
        if self.has_unfinished_requests() or self.scheduler.has_work or self._in_flight is not None:
            raise ValueError("sleep() with unfinished requests: step() until has_unfinished_requests() "
                             "is False, or abort() them first")

    def wake_up(self) -> None:
        """Undoes sleep(): the weights (the ones update_params gave while asleep, else
        level 1's host copy) back on the devices with their shardings, the LoRA
        slots, and an empty pool.  RuntimeError after sleep(level=2) without
        update_params.  Waking an awake engine is a no-op."""
        self.runner.restore()
        self.params = self.runner.params

    @property
    def is_sleeping(self) -> bool:
        return self.runner.sleep_level > 0

    def _check_awake(self) -> None:
        if self.is_sleeping:
            raise RuntimeError("the engine is asleep: call wake_up() first")

    # ---------------------------------------------------------------- steps
    def step(self) -> list[RequestDelta]:
        """Runs one scheduled step; returns the requests' deltas (jpaged.engine.request_output):
        each "delta" request it ran, and each request that finished, its output
        in its last delta (finish_reason "error" for those a failed step took
        down).  With async_scheduling the step is launched and the previous one,
        still on the device until now, is completed: the deltas are of that one.

        An exception inside the step fails only the sequences it involved (their
        blocks are freed) and the engine stays usable (jpaged.engine.recovery).  A step
        that can make no progress while requests wait raises EngineStalled."""
        return self.finish_step(self.start_step())

    def drain(self) -> None:
        """Completes the step in flight, if any (asynchronous scheduling: a request that
        stops on EOS or a stop string leaves the step launched after its last token on
        the device; its row for that request is discarded).  generate() calls it, so it
        returns with the engine idle.  What finishes in it, the next step() returns."""
        self._stashed += self._complete_in_flight(drafting=True)

    def start_step(self) -> StartedStep:
        """step()'s first half: schedules the step and dispatches it to the device
        without waiting for it.  finish_step() must follow before the next one.

        Once dispatched, the step's tokens count as computed and each sequence it
        completes gets a PLACEHOLDER for the token it samples: the next schedule()
        sees the state after this step before its tokens are known."""
        t0 = time.perf_counter()
        stashed, self._stashed = self._stashed, []
        if self._pause in ("abort", "keep"):  # frozen: nothing runs
            return StartedStep(SchedulerOutput([], [], [], []), None, None, t0, finished=stashed, paused=True)
        running = self.scheduler.running
        # (synchronously every token is known: proposing costs no overlap)
        drafting = self.speculator.wants_tokens(running) if self.async_scheduling else self.speculator.active(running)
        early = stashed + self._complete_in_flight(drafting)
        out = self.scheduler.schedule(self.speculator.propose(self.scheduler.running) if drafting else None)
        prefill = any(s.seq.status is Status.PREFILLING for s in out.scheduled)
        try:
            pending = self.runner.launch(out)
        except Exception as e:  # noqa: BLE001 - reported by finish_step
            return StartedStep(out, None, e, t0, prefill, early)
        self.scheduler.on_launched(out)
        return StartedStep(out, pending, None, t0, prefill, early)

    def finish_step(self, started: StartedStep) -> list[RequestDelta]:
        """step()'s second half: waits for the device, then puts the sampled tokens
        in, applies stop conditions, frees what finished and returns the deltas.
        With async_scheduling a step with a forward stays on the device until the
        next call: this one completes the step launched before it."""
        finished = self._finish(started)
        touched, self._touched = self._touched, []
        requests = dict.fromkeys(s.group[0] for s in (*touched, *finished))
        return self.outputs.deltas(requests, is_active=lambda s: self._active.get(s.seq_id) is s)

    def _finish(self, started: StartedStep) -> list[Sequence]:
        """finish_step's completion of a step: the sequences that finished."""
        if started.paused:  # what finished before the pause, and what it aborted
            return started.finished + self._take_finished()
        if not self.async_scheduling:
            return started.finished + self._complete(started)
        previous, self._in_flight = self._in_flight, None
        finished = started.finished + (self._complete(previous) if previous is not None else [])
        if started.pending is not None and started.pending.outputs is not None:
            self._in_flight = started
            return finished
        return finished + self._complete(started)

    def _complete_in_flight(self, drafting: bool) -> list[Sequence]:
        """Asynchronous scheduling: completes the step in flight now when the next
        one needs its tokens (such steps run one at a time): when it samples for a
        constrained sequence, whose next mask needs that token, when it verified
        drafts (how many tokens it emits is not known before), or when the next
        step is `drafting` (proposals start from each sequence's last token).
        Returns what finished in it."""
        started = self._in_flight
        if started is None or not (drafting or any(
                s.drafts or (s.seq.grammar is not None and s.output_index is not None)
                for s in started.out.scheduled)):
            return []
        self._in_flight = None
        return self._complete(started)

    def _complete(self, started: StartedStep) -> list[Sequence]:
        """Waits for a launched step and applies its output; returns what finished."""
        output = self._collect(started)
        self.scheduler.update_from_output(started.out, output)
        self._touched += (s.seq for s in started.out.scheduled)
        self._record(started, output)
        finished = self._take_finished()
        self.progress.after_step(started.out, finished)
        return finished

    def _collect(self, started: StartedStep) -> StepOutput:
        """The step's output on the host; a failed step fails its sequences (fail_step)."""
        try:
            if started.error is not None:
                raise started.error
            output = StepOutput.of(self.runner.collect(started.pending))
        except Exception as e:  # noqa: BLE001 - one bad step must not poison the engine
            fail_step(self.scheduler, self.runner, self.block_manager, started.out, e, started.pending)
            return StepOutput.empty()
        if output.nan_rows is not None and output.nan_rows.any():
            log.warning("NaN logits in this step for requests %s: their tokens are garbage (NaN weights?)",
                        [s.seq.group[0].seq_id for s, nan in zip(started.out.scheduled, output.nan_rows)
                         if nan][:8])
        return output

    def _record(self, started: StartedStep, output: StepOutput) -> None:
        pending = started.pending
        self.step_stats.record(started.out, prefill=started.prefill, started_at=started.start,
                               timing=pending.timing if pending is not None else self.runner.timing,
                               block_manager=self.block_manager,
                               token_slots=pending.token_slots if pending is not None else 0,
                               running=self.scheduler.running, swap_space=self.swap_space,
                               expert_load=output.expert_load)

    def _take_finished(self) -> list[Sequence]:
        """The finished sequences step() has not returned yet (out of _active)."""
        running = {id(s) for s in self.scheduler.running}
        # A sequence that ended while a step of its is on the device waits for that token.
        finished = [s for s in self._active.values()
                    if s.is_done and id(s) not in running and s.num_known_tokens == s.num_tokens]
        for seq in finished:
            del self._active[seq.seq_id]
            self.speculator.release(seq)
        return finished

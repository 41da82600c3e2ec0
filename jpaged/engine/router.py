"""Data parallelism: N engine replicas on disjoint devices behind one router.

`create_engine(config)` returns an `LLM` when data_parallel_size is 1, else a
`DataParallelLLM`: one (data, model) mesh of dp x tp devices, one `LLM` per
row, each with its own weights, KV pool, allocator, prefix cache and scheduler.

Routing: a request goes to the replica where it costs least, counting the
tokens that replica already owes (prompt tokens not yet computed plus the most
each sequence may still generate) plus the prompt tokens this request would
compute there (its prompt minus its prefix-cache hit).  With equal loads that
is the replica with the longest hit; with no hit anywhere, the one with the
fewest outstanding tokens.  Each step launches every busy replica's forward
before waiting for any, so replicas on different devices run at once.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Iterable, Iterator

import jax
import ml_collections

from jpaged.core.config import ConfigError, apply_overrides, default_config, validate_config
from jpaged.core.sequence import SamplingParams, Sequence
from jpaged.core.stats import EngineSnapshot, EngineStats
from jpaged.engine import protocol
from jpaged.engine.llm import LLM, RequestOutput
from jpaged.engine.request_output import RequestDelta
from jpaged.engine.protocol import Engine
from jpaged.layers.sharding import make_mesh, replica_meshes


def create_engine(config: ml_collections.ConfigDict | None = None, **overrides: Any) -> Engine:
    """The engine a config asks for: one LLM, or data_parallel_size of them behind a router."""
    cfg = apply_overrides(default_config(), config, **overrides)
    return DataParallelLLM(cfg) if cfg.data_parallel_size > 1 else LLM(cfg)


@dataclasses.dataclass
class ReplicaLoad:
    """What the router sent one replica since begin_generate(), for the run summary
    (the replica's own counters are in its snapshot)."""
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prefix-cache hits seen when routing
    output_tokens: int = 0         # returned by step()


class DataParallelLLM:
    """The `Engine` interface over data_parallel_size `LLM` replicas.  Request ids are
    the router's: each replica queues a request under the same id."""

    def __init__(self, config: ml_collections.ConfigDict | None = None, **overrides: Any):
        cfg = apply_overrides(default_config(), config, **overrides)
        validate_config(cfg)
        if jax.process_count() > 1:
            raise ConfigError("data_parallel_size", f"{cfg.data_parallel_size} replicas in a multi-process "
                              "run are not supported", "1 across processes (tensor_parallel_size spans them)")
        self.config = cfg
        self.mesh = make_mesh(cfg.tensor_parallel_size, cfg.data_parallel_size)
        self.replicas = [LLM(cfg, mesh=m) for m in replica_meshes(self.mesh)]
        self.loads = [ReplicaLoad() for _ in self.replicas]
        first = self.replicas[0]  # every replica loads, tokenizes and validates alike
        self.loaded, self.tokenizer, self.model_config = first.loaded, first.tokenizer, first.model_config
        self.attention_impl, self.attention_note = first.attention_impl, first.attention_note
        self.kv_dtype, self.grammars = first.kv_dtype, first.grammars  # (replicas share compiled constraints)
        self._next_id = 0
        # Unfinished requests: id -> its replica.
        self._requests: dict[int, int] = {}

    # -------------------------------------------------------------- routing
    def route(self, prompt_token_ids: list[int], params: SamplingParams) -> tuple[int, int]:
        """(the replica a request goes to, its prefix-cache hit there in tokens): see
        the module docstring."""
        hits = [r.cached_prefix_tokens(prompt_token_ids, params) for r in self.replicas]
        costs = [r.snapshot().outstanding_tokens + len(prompt_token_ids) - hit
                 for r, hit in zip(self.replicas, hits)]
        i = costs.index(min(costs))
        return i, hits[i]

    # ------------------------------------------------------------- requests
    def add_request(self, prompt_token_ids: list[int] | None, params: SamplingParams,
                    prompt: str | None = None, error: str | None = None) -> int:
        """Routes and queues one request; returns its id."""
        ids = list(prompt_token_ids or [])
        error = error or self.check_request(ids, params)
        i, hit = self.route(ids, params) if error is None else (0, 0)
        load = self.loads[i]
        load.requests += 1
        load.prompt_tokens += len(ids)
        load.cached_prompt_tokens += hit
        rid = self._next_id
        self._next_id += 1
        self.replicas[i].add_request(ids, params, prompt=prompt, error=error, request_id=rid)
        self._requests[rid] = i
        return rid

    def _replica(self, request_id: int) -> LLM | None:
        i = self._requests.get(request_id)
        return self.replicas[i] if i is not None else None

    def get_sequence(self, request_id: int) -> Sequence | None:
        replica = self._replica(request_id)
        return replica.get_sequence(request_id) if replica is not None else None

    def abort(self, request_ids: Iterable[int]) -> None:
        """LLM.abort on each request's replica: the next step() returns them once."""
        for rid in request_ids:
            replica = self._replica(rid)
            if replica is not None:
                replica.abort([rid])

    def finish_sample(self, request_id: int, index: int, reason: str = "stop") -> None:
        replica = self._replica(request_id)
        if replica is not None:
            replica.finish_sample(request_id, index, reason)

    def default_sampling_params(self) -> SamplingParams:
        return self.replicas[0].default_sampling_params()

    def prepare_prompt(self, prompt: Any, params: SamplingParams
                       ) -> tuple[list[int] | None, SamplingParams, str | None, str | None]:
        return self.replicas[0].prepare_prompt(prompt, params)

    def tokenize(self, prompt: Any) -> list[int]:
        return self.replicas[0].tokenize(prompt)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> str | None:
        return self.replicas[0].check_request(prompt_token_ids, params)

    # ---------------------------------------------------------------- steps
    def step(self) -> list[RequestDelta]:
        """One step of every replica, launched together: their deltas.  An idle
        replica's step schedules nothing and costs no device work, but it still
        returns requests that failed at admission.  Every launched step is
        finished before an exception of one (EngineStalled) is raised."""
        started = [r.start_step() for r in self.replicas]
        deltas, error = [], None
        for i, (r, s) in enumerate(zip(self.replicas, started)):
            try:
                done = r.finish_step(s)
            except Exception as e:  # noqa: BLE001 - raised once the other replicas are done
                error = error or e
                continue
            for delta in done:
                self.loads[i].output_tokens += sum(len(sample.token_ids) for sample in delta.samples)
                if delta.finished:
                    self._requests.pop(delta.request_id, None)
            deltas += done
        if error is not None:
            raise error
        return deltas

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def precompile(self, max_num_tokens: int | None = None, *, background: bool = False) -> int:
        return sum(r.precompile(max_num_tokens, background=background) for r in self.replicas)

    def drain(self) -> None:
        """LLM.drain on every replica: none keeps a step in flight."""
        for r in self.replicas:
            r.drain()

    def follow(self) -> None:
        """A data-parallel engine runs in one process (__init__ refuses several): there is
        no process 0 to follow."""
        raise RuntimeError("follow() is for the processes of a multi-process run; a data-parallel "
                           "engine runs in one process")

    def close(self) -> None:
        for r in self.replicas:
            r.close()

    def reset_prefix_cache(self) -> None:
        """Forgets every replica's cached blocks (only between generate() calls)."""
        for r in self.replicas:
            r.reset_prefix_cache()

    # ------------------------------------------------ RL: pause, sleep, weights
    def pause(self, mode: str = "keep") -> None:
        """LLM.pause on every replica."""
        for r in self.replicas:
            r.pause(mode)

    def resume(self) -> None:
        for r in self.replicas:
            r.resume()

    @property
    def is_paused(self) -> bool:
        return self.replicas[0].is_paused

    def sleep(self, level: int = 1) -> None:
        """LLM.sleep on every replica: checked on each first, so that none sleeps if one cannot."""
        for r in self.replicas:
            r.check_can_sleep()
        for r in self.replicas:
            r.sleep(level)

    def wake_up(self) -> None:
        for r in self.replicas:
            r.wake_up()

    @property
    def is_sleeping(self) -> bool:
        return self.replicas[0].is_sleeping

    def update_params(self, params: Any, **kwargs: Any) -> None:
        """LLM.update_params on every replica: a path (each replica places its own copy
        on its devices), or a params tree already placed for one replica's mesh only
        when there is one replica."""
        if params is not None and not isinstance(params, (str, os.PathLike)) and len(self.replicas) > 1:
            raise ValueError("a data-parallel engine takes new weights as a path (each replica loads "
                             "its own copy onto its devices)")
        for r in self.replicas:
            r.update_params(params, **kwargs)

    # ---------------------------------------------------------- LoRA adapters
    @property
    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapters (every replica holds the same ones): name -> directory."""
        return self.replicas[0].lora_adapters

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Loads the adapter into every replica; if one refuses it, none keeps it."""
        done = []
        try:
            for r in self.replicas:
                r.load_lora_adapter(name, path)
                done.append(r)
        except Exception:
            for r in done:
                r.unload_lora_adapter(name)
            raise

    def unload_lora_adapter(self, name: str) -> None:
        for r in self.replicas:
            r.unload_lora_adapter(name)

    # ------------------------------------------------------------ batch API
    def generate(self, prompts: Iterable[Any], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        return protocol.generate(self, prompts, sampling_params, use_tqdm=use_tqdm)

    def generate_iter(self, prompts: Iterable[Any],
                      sampling_params: SamplingParams | list[SamplingParams] | None = None,
                      *, use_tqdm: bool = False, stop: threading.Event | None = None
                      ) -> Iterator[RequestOutput]:
        return protocol.generate_iter(self, prompts, sampling_params, use_tqdm=use_tqdm, stop=stop)

    # ----------------------------------------------------------- reporting
    def begin_generate(self) -> None:
        """Starts the window that `stats` and replica_summary() report."""
        for r in self.replicas:
            r.begin_generate()
        self.loads = [ReplicaLoad() for _ in self.replicas]

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot.combine([r.snapshot() for r in self.replicas])

    @property
    def stats(self) -> EngineStats:
        """The last generate() call's statistics, summed over replicas (peaks too:
        the replicas' pools are disjoint)."""
        return EngineStats.sum([r.stats for r in self.replicas])

    @property
    def totals(self) -> EngineStats:
        return EngineStats.sum([r.totals for r in self.replicas])

    @property
    def num_blocks(self) -> int:
        """Blocks of every replica's pool, each counting its null block."""
        return sum(r.num_blocks for r in self.replicas)

    @property
    def kv_pool_bytes(self) -> int:
        return sum(r.kv_pool_bytes for r in self.replicas)

    @property
    def num_compilations(self) -> int:
        return sum(r.num_compilations for r in self.replicas)

    @property
    def compile_seconds(self) -> float:
        return sum(r.compile_seconds for r in self.replicas)

    @property
    def program_build(self) -> dict[str, float]:
        builds = [r.program_build for r in self.replicas]
        return {k: sum(b[k] for b in builds) for k in builds[0]}

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return self.replicas[0].token_buckets

    def memory_per_device(self) -> dict[str, tuple[int, int]]:
        return {d: m for r in self.replicas for d, m in r.memory_per_device().items()}

    def replica_summary(self) -> list[dict[str, Any]]:
        """Per replica: its devices and what it was sent and did since begin_generate()."""
        return [dict(replica=i, devices=list(r.memory_per_device()), **dataclasses.asdict(load),
                     steps=r.stats.steps, peak_kv_blocks=r.stats.peak_blocks_used)
                for i, (r, load) in enumerate(zip(self.replicas, self.loads))]

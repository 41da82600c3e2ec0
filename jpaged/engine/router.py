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
import threading
from typing import Any, Iterable, Iterator

import jax
import ml_collections
import tqdm

from jpaged.core.config import ConfigError, apply_overrides, default_config, validate_config
from jpaged.engine.llm import LLM, RequestOutput, sampling_per_prompt
from jpaged.core.sequence import SamplingParams, Sequence
from jpaged.runtime.sharding import make_mesh, replica_meshes
from jpaged.core.stats import EngineStats


def create_engine(config: ml_collections.ConfigDict | None = None, **overrides: Any) -> LLM | DataParallelLLM:
    """The engine a config asks for: one LLM, or data_parallel_size of them behind a router."""
    cfg = apply_overrides(default_config(), config, **overrides)
    return DataParallelLLM(cfg) if cfg.data_parallel_size > 1 else LLM(cfg)


@dataclasses.dataclass
class ReplicaLoad:
    """What the router sent one replica, for the run summary."""
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prefix-cache hits seen when routing
    output_tokens: int = 0         # of finished requests, every sample


class DataParallelLLM:
    """`LLM`'s batch interface over data_parallel_size replicas."""

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
        first = self.replicas[0]
        self.loaded, self.tokenizer, self.model_config = first.loaded, first.tokenizer, first.model_config
        self.attention_impl, self.attention_note = first.attention_impl, first.attention_note

    # -------------------------------------------------------------- routing
    def route(self, prompt_token_ids: list[int], params: SamplingParams) -> tuple[int, int]:
        """(the replica a request goes to, its prefix-cache hit there in tokens): see
        the module docstring."""
        hits = [r.cached_prefix_tokens(prompt_token_ids, params) for r in self.replicas]
        costs = [r.outstanding_tokens() + len(prompt_token_ids) - hit for r, hit in zip(self.replicas, hits)]
        i = costs.index(min(costs))
        return i, hits[i]

    def add_request(self, prompt_token_ids: list[int] | None, params: SamplingParams,
                    prompt: str | None = None, error: str | None = None) -> tuple[int, int]:
        """Routes and queues one request: (replica, its request id there)."""
        ids = list(prompt_token_ids or [])
        i, hit = self.route(ids, params) if ids and error is None else (0, 0)
        load = self.loads[i]
        load.requests += 1
        load.prompt_tokens += len(ids)
        load.cached_prompt_tokens += hit
        return i, self.replicas[i].add_request(ids, params, prompt=prompt, error=error)

    def step(self) -> list[tuple[int, Sequence]]:
        """One step of every replica, launched together: (replica, finished sequence).
        An idle replica's step schedules nothing and costs no device work, but it
        still returns requests that failed at admission."""
        started = [r.start_step() for r in self.replicas]
        return [(i, seq) for i, (r, s) in enumerate(zip(self.replicas, started)) for seq in r.finish_step(s)]

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    # ------------------------------------------------------------ batch API
    def generate(self, prompts: Iterable[Any], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        outputs = list(self.generate_iter(prompts, sampling_params, use_tqdm=use_tqdm))
        return sorted(outputs, key=lambda o: o.index)

    def generate_iter(self, prompts: Iterable[Any],
                      sampling_params: SamplingParams | list[SamplingParams] | None = None,
                      *, use_tqdm: bool = False, stop: threading.Event | None = None
                      ) -> Iterator[RequestOutput]:
        """LLM.generate_iter over the replicas: outputs as requests finish."""
        prompts = list(prompts)
        sampling_params = sampling_per_prompt(prompts, sampling_params, self.default_sampling_params())
        for r in self.replicas:
            r.begin_generate()
        self.loads = [ReplicaLoad() for _ in self.replicas]
        first = self.replicas[0]  # every replica tokenizes alike
        index = {self.add_request(*first.prepare_prompt(p, sp)): i
                 for i, (p, sp) in enumerate(zip(prompts, sampling_params))}
        pending = {key: len(self.replicas[key[0]].get_sequence(key[1]).group) for key in index}
        try:
            with tqdm.tqdm(total=len(index), desc="requests", disable=not use_tqdm) as bar:
                while pending and not (stop is not None and stop.is_set()):
                    for i, seq in self.step():
                        key = (i, seq.group[0].seq_id)
                        if key not in pending:
                            continue
                        pending[key] -= 1
                        if not pending[key]:
                            del pending[key]
                            bar.update(1)
                            output = self.replicas[i].request_output(seq.group[0], index[key])
                            output.request_id = index[key]  # replica ids collide; the prompt index does not
                            self.loads[i].output_tokens += sum(len(x["token_ids"]) for x in output.samples)
                            yield output
        finally:
            for i, r in enumerate(self.replicas):
                r.abort([rid for (j, rid) in pending if j == i])

    def close(self) -> None:
        for r in self.replicas:
            r.close()

    def default_sampling_params(self) -> SamplingParams:
        return self.replicas[0].default_sampling_params()

    def precompile(self, max_num_tokens: int | None = None) -> int:
        return sum(r.precompile(max_num_tokens) for r in self.replicas)

    # ----------------------------------------------------------- reporting
    @property
    def stats(self) -> EngineStats:
        """The last generate() call's statistics, summed over replicas (peaks too:
        the replicas' pools are disjoint)."""
        return sum_stats([r.stats for r in self.replicas])

    @property
    def totals(self) -> EngineStats:
        return sum_stats([r.totals for r in self.replicas])

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
    def token_buckets(self) -> tuple[int, ...]:
        return self.replicas[0].token_buckets

    def memory_per_device(self) -> dict[str, tuple[int, int]]:
        return {d: m for r in self.replicas for d, m in r.memory_per_device().items()}

    def replica_summary(self) -> list[dict[str, Any]]:
        """Per replica: its devices and what it was sent and did in the last generate()."""
        return [dict(replica=i, devices=list(r.memory_per_device()), **dataclasses.asdict(load),
                     steps=r.stats.steps, peak_kv_blocks=r.stats.peak_blocks_used)
                for i, (r, load) in enumerate(zip(self.replicas, self.loads))]


def sum_stats(parts: list[EngineStats]) -> EngineStats:
    return EngineStats(**{f.name: sum(getattr(p, f.name) for p in parts)
                          for f in dataclasses.fields(EngineStats)})

"""A request and its lifecycle: WAITING -> PREFILLING -> DECODING -> DONE.

Preemption sends a running sequence back to WAITING (recompute: its K/V is
dropped) or to SWAPPED (its computed blocks wait in host memory); either way it
resumes where it left off."""

from __future__ import annotations

import dataclasses
import enum
import time

from jpaged.kv_cache import BlockTable


class Status(enum.Enum):
    WAITING = enum.auto()
    PREFILLING = enum.auto()
    DECODING = enum.auto()
    SWAPPED = enum.auto()   # preempted, K/V in host memory (swap_slots)
    DONE = enum.auto()


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding controls (vLLM semantics: top_k <= 0 disables top-k)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1                      # parallel samples of this prompt (share its prefill)
    cache_salt: str | None = None   # prefix-cache namespace: no reuse across salts
    adapter_id: str | int | None = None  # part of the prefix-cache key (LoRA etc.)

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")


class Sequence:
    """One request: its tokens, its block table and its timings."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, seed: int = 0):
        self.seq_id = seq_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed  # resolved per-request seed
        self.status = Status.WAITING
        self.block_table = BlockTable()
        self.num_computed_tokens = 0  # tokens whose K/V are in the pool
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        # Prefix caching and parallel sampling.
        self.num_cached_tokens = 0     # prompt tokens reused from the cache at first admission
        self.block_keys: list = []     # prefix-index handle of each full, computed block
        self.forks: list[Sequence] = []  # samples 1..n-1, forked once the prompt is prefilled
        self.sample_index = 0
        self.group: list[Sequence] = [self]  # all samples of this request, in order
        # Preemption.
        self.num_preemptions = 0
        self.swap_slots: list[int] = []   # host swap-space slots holding its blocks
        self.swap_status: Status | None = None  # status to resume with after swap-in

    @property
    def extra_keys(self) -> tuple:
        """Prefix-cache key parts besides the tokens."""
        return (self.params.adapter_id, self.params.cache_salt)

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before the next sample: a request with pending forks
        stops one short, so that every sample computes the last prompt token itself."""
        return self.num_tokens - 1 if self.forks else self.num_tokens

    @property
    def num_seats(self) -> int:
        return 1 + len(self.forks)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a decode step
        needs one token of it per row)."""
        n = len(self.prompt_token_ids)
        head = self.prompt_token_ids[start:end] if start < n else []
        return head + self.output_token_ids[max(start - n, 0):max(end - n, 0)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_done(self) -> bool:
        return self.status is Status.DONE

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = Status.DONE
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.perf_counter()

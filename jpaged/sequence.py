"""A request and its lifecycle: WAITING -> PREFILLING -> DECODING -> DONE."""

from __future__ import annotations

import dataclasses
import enum
import time

from jpaged.kv_cache import BlockTable


class Status(enum.Enum):
    WAITING = enum.auto()
    PREFILLING = enum.auto()
    DECODING = enum.auto()
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

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")


class Sequence:
    """One request: its tokens, its block table and its timings."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams,
                 block_size: int, prompt: str | None = None, seed: int = 0):
        self.seq_id = seq_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed  # resolved per-request seed
        self.status = Status.WAITING
        self.block_table = BlockTable(block_size)
        self.num_computed_tokens = 0  # tokens whose K/V are in the pool
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

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

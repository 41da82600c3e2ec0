"""A request and its lifecycle: WAITING -> PREFILLING -> DECODING -> DONE.

Preemption sends a running sequence back to WAITING (recompute: its K/V is
dropped) or to SWAPPED (its computed blocks wait in host memory); either way it
resumes where it left off."""

from __future__ import annotations

import dataclasses
import enum
import numbers
import time
from typing import Any

from jpaged.core.block_manager import BlockTable
from jpaged.core.bounds import FLOAT32_MAX, INT32_MAX, is_finite, is_int
from jpaged.structured.spec import StructuredOutputs


class Status(enum.Enum):
    WAITING = enum.auto()
    PREFILLING = enum.auto()
    DECODING = enum.auto()
    SWAPPED = enum.auto()   # preempted, K/V in host memory (swap_slots)
    DONE = enum.auto()


# SamplingParams.output_kind's choices.
OUTPUT_KINDS = ("final", "delta")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding controls (vLLM semantics: top_k <= 0 disables top-k)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Strings that end a sample where its text first contains one; the text
    # returned stops before it (OpenAI semantics).
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1                      # parallel samples of this prompt (share its prefill)
    cache_salt: str | None = None   # prefix-cache namespace: no reuse across salts
    lora: str | None = None         # the name of a loaded LoRA adapter; None: the base model
    # Log-probabilities (fp32): of each generated token plus its `logprobs` best
    # alternatives, and of each prompt token plus `prompt_logprobs` alternatives.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # A constraint on the output (JSON schema, regex, choice, grammar): every
    # sample's tokens are masked to those the constraint allows next.
    structured: StructuredOutputs | None = None
    # What step() returns for the request (jpaged.engine.request_output): "final", one
    # delta holding everything once it has finished (generate()); "delta", one per
    # step it ran in, with each sample's new tokens, text and logprobs (a server
    # that streams).
    output_kind: str = "final"
    # Routing capture (a mixture-of-experts model): the output also holds the experts
    # each token was routed to in each MoE layer (RequestOutput.routed_experts), to
    # replay in training; its prompt is then computed whole (no prefix-cache reuse).
    capture_routes: bool = False

    def validate(self) -> None:
        """Raises ValueError naming the first bad field: its type, range and, for
        what goes to the device (top_k as int32, the seeds of all n samples as
        uint32, temperature and top_p as float32), that it fits there."""
        _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        _check_real("temperature", self.temperature, 0.0, FLOAT32_MAX)
        _check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -INT32_MAX, INT32_MAX, allowed="an integer (<= 0 disables top-k)")
        _check_int("n", self.n, 1, INT32_MAX)
        if self.seed is not None:  # samples 0..n-1 draw with seeds seed..seed+n-1
            _check_int("seed", self.seed, 0, UINT32_MAX - (self.n if is_int(self.n) else 1) + 1,
                       allowed="null or an integer in [0, 2**32 - n]")
        if not isinstance(self.stop_token_ids, (tuple, list)) or not all(map(is_int, self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        if (not isinstance(self.stop, (tuple, list)) or not all(isinstance(s, str) for s in self.stop)
                or len(self.stop) > MAX_STOP_STRINGS):
            raise ValueError(f"stop must be a list of at most {MAX_STOP_STRINGS} strings, got {self.stop!r}")
        if not isinstance(self.capture_routes, bool):
            raise ValueError(f"capture_routes must be true or false, got {self.capture_routes!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS,
                           allowed=f"null or an integer in [0, {MAX_LOGPROBS}]")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutputs):
                raise ValueError(f"structured must be a StructuredOutputs, got {type(self.structured).__name__}")
            self.structured.validate()
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        if self.lora is not None and not isinstance(self.lora, str):
            raise ValueError(f"lora must be an adapter's name (a string) or null, got {self.lora!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(self.cache_salt).__name__} "
                             f"{self.cache_salt!r}")


UINT32_MAX = 2**32 - 1  # per-sample seeds are uint32 on the device
MAX_STOP_STRINGS = 16  # per request (the OpenAI API allows 4; vLLM any number)
MAX_LOGPROBS = 20  # alternatives a step computes per token (vLLM's default max_logprobs)


def default_sampling_params(config: Any) -> SamplingParams:
    """The config's sampling defaults (fields of the same names), which each request may override."""
    return SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature,
                          top_p=config.top_p, top_k=config.top_k)


# Asynchronous scheduling: an output token whose step is still on the device.  It
# holds the token's place (counts, positions, blocks) until the step's result
# replaces it; the next step reads the real value on the device.
PLACEHOLDER = -1


def _check_int(name: str, value: object, low: int, high: int, allowed: str | None = None) -> None:
    if not is_int(value) or not low <= value <= high:
        raise ValueError(f"{name} must be {allowed or f'an integer in [{low}, {high}]'}, got {value!r}")


def _check_real(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool) and is_finite(value)
          and (low < value if low_open else low <= value) and value <= high)
    if not ok:
        bound = "(" if low_open else "["
        raise ValueError(f"{name} must be a finite number in {bound}{low:g}, {high:g}], got {value!r}")


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the best alternatives at its position
    ((token id, logprob) pairs, best first; tokens of zero probability left out)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Sequence:
    """One request: its tokens, its block table and its timings."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, seed: int = 0, weights_version: int = 0,
                 lora_slot: int = -1, lora_key: tuple | None = None):
        self.seq_id = seq_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed  # resolved per-request seed
        self.weights_version = weights_version  # K/V of other versions must never be shared
        # LoRA: the device slot of its adapter (-1: the base model), and the adapter's
        # identity for the prefix cache ((name, load serial): a reload never shares).
        self.lora_slot, self.lora_key = lora_slot, lora_key
        self.status = Status.WAITING
        self.block_table = BlockTable()
        self.group_tables: list[BlockTable] = []  # the other KV layer groups' (jpaged.core.kv_layout)
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
        self.group: list[Sequence] = [self]  # all samples of this request, in order
        # Log-probabilities, when asked for: one entry per generated token, and per
        # prompt token (None for the first, which nothing predicts).
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] = [None] if params.prompt_logprobs is not None else []
        # params.capture_routes: routes[p], the experts [L_moe, k] token p went to, set
        # when a step computes position p (a recomputed or rejected draft's overwritten).
        self.routes: list = []
        # The output's text as it grows, for stop strings and streaming (a SampleText,
        # made by the engine's output processor on the sample's first token when it
        # has params.stop or streams); None: decoded once at the end.
        self.text = None
        # Output deltas (jpaged.engine.request_output): tokens handed out so far, and
        # whether the prompt logprobs and (first sample) the request's output were.
        self.num_emitted = 0
        self.prompt_logprobs_emitted = False
        self.output_emitted = False
        # Structured outputs: this sample's grammar matcher (jpaged.structured.grammar),
        # advanced by each of its tokens; None when unconstrained.
        self.grammar = None
        # Asynchronous scheduling: the row that samples this sequence's last token in
        # the step launched last (read while that token is a PLACEHOLDER), and
        # whether that token is its last one (max_tokens or max_model_len reached).
        self.sample_row = 0
        self.awaits_last_token = False
        # Preemption.
        self.swap_slots: list[int] = []   # host swap-space slots holding its blocks
        self.swap_status: Status | None = None  # status to resume with after swap-in
        self.swapped_tables: list[list[bool]] = []  # per group: which swapped blocks were not null

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute: such a prefill must not skip cached tokens."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def owes_routes(self) -> bool:
        """Routes to capture of tokens before the next sample not in yet: its prefill
        must not skip cached tokens (they would have none), and forks wait for them."""
        return self.params.capture_routes and len(self.routes) < self.prefill_target

    @property
    def extra_keys(self) -> tuple:
        """Prefix-cache key parts besides the tokens."""
        return (self.lora_key, self.params.cache_salt, self.weights_version)

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
    def num_known_tokens(self) -> int:
        """Tokens whose values the host knows: all but the trailing PLACEHOLDERs (at
        most one per step in flight)."""
        n, out = self.num_tokens, self.output_token_ids
        while n > len(self.prompt_token_ids) and out[n - len(self.prompt_token_ids) - 1] == PLACEHOLDER:
            n -= 1
        return n

    @property
    def is_done(self) -> bool:
        return self.status is Status.DONE

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = Status.DONE
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.perf_counter()

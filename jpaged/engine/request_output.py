"""What `EngineCore.step()` hands back: per-request deltas, and a request's whole
output in its last one (vLLM's `RequestOutput` with its DELTA and FINAL_ONLY
kinds).  A request's SamplingParams.output_kind says which it gets: "delta" (a
server that streams), one `RequestDelta` per step in which it ran, with the
tokens, text and logprobs each sample added; "final" (generate()), one delta
when it has finished, holding everything.  The text comes from the engine's
output processor (jpaged.engine.output_processor), which also applies stop
strings, so a streamed answer's pieces add up to the library's text.  Host
code: no jax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jpaged.core.sequence import TokenLogprob


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
    # SamplingParams.capture_routes: the experts [num_tokens - 1, L_moe, k] (int32) each
    # token but the last (prompt, then output) was routed to in each MoE layer
    # (samples[i]["routed_experts"] for each sample)
    routed_experts: np.ndarray | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for d in (out, *out["samples"]):
            if d.get("routed_experts") is not None:
                d["routed_experts"] = d["routed_experts"].tolist()
        return out


@dataclasses.dataclass
class SampleDelta:
    """What one sample (of SamplingParams.n) added since the request's last delta."""
    token_ids: list[int]
    text: str                      # released text: never a character or stop string still incomplete
    logprobs: list[TokenLogprob]   # one per new token when SamplingParams.logprobs asks, else []
    finish_reason: str | None      # stop | length | error | abort once the sample has ended, else None


@dataclasses.dataclass
class RequestDelta:
    """One request's progress in one step()."""
    request_id: int
    samples: list[SampleDelta]
    started: bool                  # a sample has left the waiting queue
    error: str | None = None
    num_cached_tokens: int = 0     # prompt tokens found in the prefix cache at admission
    first_token_time: float | None = None  # perf_counter() of its first sampled token
    # SamplingParams.prompt_logprobs: in the first delta with tokens, else None.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    output: RequestOutput | None = None  # the whole output, in the request's last delta

    @property
    def finished(self) -> bool:
        """Every sample has ended: this is the request's last delta."""
        return self.output is not None

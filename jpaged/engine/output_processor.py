"""Sampled tokens in, finished requests out: stop conditions (EOS, stop token
ids, stop strings, length), logprobs bookkeeping and the `RequestOutput`s that
generate() returns.

Stop strings are matched on the sample's text as it grows, with the same
`SampleText` the HTTP server streams with, so the Python API, the batch CLI
and the server cut a sample at the same place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jpaged.core.scheduler import ScheduledSeq
from jpaged.core.sequence import Sequence, TokenLogprob
from jpaged.runtime.model_runner import StepResult
from jpaged.runtime.sampling import TokenLogprobs
from jpaged.tokenizer.detokenizer import SampleText


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

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def token_logprob(lp: TokenLogprobs, row: int, token_id: int, k: int) -> TokenLogprob:
    top = tuple((int(i), float(v)) for i, v in zip(lp.top_ids[row, :k], lp.top_values[row, :k])
                if np.isfinite(v))  # filtered-out tokens (processed mode) have probability 0
    return TokenLogprob(token_id, float(lp.chosen[row]), top)


def record_logprobs(seq: Sequence, s: ScheduledSeq, token: int, result: StepResult, row: int,
                    offset: int) -> None:
    """Appends what `result` holds for seq (row `row`; its tokens from flat index
    `offset`): the prompt logprobs its tokens predicted, and its sampled token's
    logprob when the row samples one."""
    p = seq.params
    if result.prompt_logprobs is not None and seq.needs_prompt_logprobs:
        for j in range(s.num_new):
            target = s.start + j + 1  # the prompt position token j predicts
            if target == len(seq.prompt_logprobs) and target < len(seq.prompt_token_ids):
                seq.prompt_logprobs.append(token_logprob(result.prompt_logprobs, offset + j,
                                                         seq.prompt_token_ids[target], p.prompt_logprobs))
    if result.logprobs is not None and p.logprobs is not None and s.output_index is not None:
        seq.logprobs.append(token_logprob(result.logprobs, row, token, p.logprobs))


class OutputProcessor:
    """Decides when a sample ends and shapes finished requests."""

    def __init__(self, tokenizer: Any, *, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = set(tokenizer.eos_token_ids) if tokenizer is not None else set()

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None or not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def finish_reason(self, seq: Sequence, token: int, num_output: int) -> str | None:
        """Why seq ends with `token`, its num_output-th output token, or None."""
        p = seq.params
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            return "stop"
        if p.stop:
            text = self._stop_text(seq)
            text.push([token])
            if text.stopped:
                return "stop"
        return "length" if self.reached_length(seq, num_output) else None

    def reached_length(self, seq: Sequence, num_output: int) -> bool:
        """Whether the num_output-th output token is seq's last (max_tokens, max_model_len)."""
        return num_output >= seq.params.max_tokens or len(seq.prompt_token_ids) + num_output >= self.max_model_len

    def _stop_text(self, seq: Sequence) -> SampleText:
        if seq.stop_text is None:
            seq.stop_text = SampleText(self.decode, seq.params.stop)
        return seq.stop_text

    def sample_text(self, seq: Sequence) -> str:
        """A finished sample's text: cut before its first stop string, if any."""
        if seq.stop_text is None:
            return self.decode(seq.output_token_ids)
        seq.stop_text.finish()
        return seq.stop_text.text

    def request_output(self, seq: Sequence, index: int = 0) -> RequestOutput:
        """The RequestOutput of a finished request (seq: its first sample)."""
        ms = lambda t: None if t is None else 1000 * (t - seq.arrival_time)  # noqa: E731
        p = seq.params
        samples = [dict(text=self.sample_text(s), token_ids=list(s.output_token_ids),
                        finish_reason=s.finish_reason) for s in seq.group]
        if p.logprobs is not None:
            for sample, s in zip(samples, seq.group):
                sample["logprobs"] = list(s.logprobs)
        last = max((s.finish_time for s in seq.group if s.finish_time is not None), default=None)
        return RequestOutput(
            request_id=seq.seq_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            text=samples[0]["text"], token_ids=samples[0]["token_ids"], finish_reason=seq.finish_reason,
            error=seq.error, ttft_ms=ms(seq.first_token_time), latency_ms=ms(last),
            samples=samples, num_cached_tokens=seq.num_cached_tokens, index=index,
            logprobs=samples[0].get("logprobs"),
            prompt_logprobs=list(seq.prompt_logprobs) if p.prompt_logprobs is not None else None)

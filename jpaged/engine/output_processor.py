"""Sampled tokens in, request deltas out: stop conditions (EOS, stop token ids,
stop strings, length), detokenizing, logprobs bookkeeping and the
`RequestDelta`s / `RequestOutput`s that step() and generate() return
(jpaged.engine.request_output).

Text is made here and nowhere else.  A sample whose text is needed as it grows
(stop strings, or a request that streams: output_kind "delta") pushes each token
into a `SampleText` (incremental detokenizing, stop strings held back and cut);
the others are decoded once, when they finish.  So the Python API, the batch
CLI and the server cut a sample at the same place, and a stream's pieces add up
to the library's text.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from jpaged.core.scheduler import ScheduledSeq
from jpaged.core.sequence import Sequence, Status, TokenLogprob
from jpaged.runtime.model_runner import StepResult
from jpaged.runtime.sampling import TokenLogprobs
from jpaged.engine.request_output import RequestDelta, RequestOutput, SampleDelta
from jpaged.tokenizer.detokenizer import SampleText

__all__ = ["OutputProcessor", "RequestDelta", "RequestOutput", "SampleDelta", "record_logprobs", "token_logprob"]


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
        text = self._text(seq)
        if text is not None:
            text.push([token])
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            return "stop"
        if text is not None and text.stopped:
            return "stop"
        return "length" if self.reached_length(seq, num_output) else None

    def reached_length(self, seq: Sequence, num_output: int) -> bool:
        """Whether the num_output-th output token is seq's last (max_tokens, max_model_len)."""
        return num_output >= seq.params.max_tokens or len(seq.prompt_token_ids) + num_output >= self.max_model_len

    def _text(self, seq: Sequence) -> SampleText | None:
        """seq's growing text, when it is needed before the sample ends (stop strings,
        streaming); None otherwise (sample_text decodes it once at the end)."""
        if seq.text is None and (seq.params.stop or seq.params.output_kind == "delta"):
            seq.text = SampleText(self.decode, seq.params.stop)
        return seq.text

    def sample_text(self, seq: Sequence) -> str:
        """A finished sample's text: cut before its first stop string, if any."""
        if seq.text is None:
            return self.decode(seq.output_token_ids)
        seq.text.finish()
        return seq.text.text

    def deltas(self, requests: Iterable[Sequence], is_active: Callable[[Sequence], bool]) -> list[RequestDelta]:
        """The deltas of these requests (their first samples) after a step; a sample
        has ended once `is_active` is False for it.  A "final" request has one, when
        every sample has ended; a "delta" one, one per call."""
        out = []
        for leader in requests:
            if leader.output_emitted:  # (a step completed after its last token still ran it)
                continue
            done = [not is_active(s) for s in leader.group]
            if all(done) or leader.params.output_kind == "delta":
                out.append(self._delta(leader, done))
        return out

    def _delta(self, leader: Sequence, done: list[bool]) -> RequestDelta:
        output = self.request_output(leader) if all(done) else None
        leader.output_emitted = output is not None
        texts = [sample["text"] for sample in output.samples] if output is not None else [""] * len(done)
        samples = [self._sample_delta(s, d, text) for s, d, text in zip(leader.group, done, texts)]
        delta = RequestDelta(leader.seq_id, samples, started=any(s.status is not Status.WAITING for s in leader.group),
                             error=next((s.error for s in leader.group if s.error), None),
                             num_cached_tokens=leader.num_cached_tokens, first_token_time=leader.first_token_time,
                             output=output)
        if leader.params.prompt_logprobs is not None and not leader.prompt_logprobs_emitted and (
                any(s.token_ids for s in samples)):  # complete once a sample has a token
            delta.prompt_logprobs = list(leader.prompt_logprobs)
            leader.prompt_logprobs_emitted = True
        return delta

    def _sample_delta(self, seq: Sequence, done: bool, final_text: str) -> SampleDelta:
        """`final_text`: the sample's whole text when the request has ended."""
        # Only tokens the host knows: not a PLACEHOLDER of a step still on the device.
        start, known = seq.num_emitted, seq.num_known_tokens - len(seq.prompt_token_ids)
        tokens = seq.output_token_ids[start:known]
        seq.num_emitted = start + len(tokens)
        if seq.text is not None:  # what it released since the last delta (all of it, once done)
            if done:
                seq.text.finish()
            text = seq.text.take()
        else:  # (decoded once, whole, when the request ended)
            text = final_text
        return SampleDelta(list(tokens), text, seq.logprobs[start:start + len(tokens)],
                           seq.finish_reason if done else None)

    def request_output(self, seq: Sequence, index: int = 0) -> RequestOutput:
        """The RequestOutput of a finished request (seq: its first sample)."""
        ms = lambda t: None if t is None else 1000 * (t - seq.arrival_time)  # noqa: E731
        p = seq.params
        samples = [dict(text=self.sample_text(s), token_ids=list(s.output_token_ids),
                        finish_reason=s.finish_reason) for s in seq.group]
        if p.logprobs is not None:
            for sample, s in zip(samples, seq.group):
                sample["logprobs"] = list(s.logprobs)
        if p.capture_routes:
            for sample, s in zip(samples, seq.group):
                sample["routed_experts"] = np.array(s.routes[:s.num_tokens - 1], np.int32)
        last = max((s.finish_time for s in seq.group if s.finish_time is not None), default=None)
        return RequestOutput(
            request_id=seq.seq_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            text=samples[0]["text"], token_ids=samples[0]["token_ids"], finish_reason=seq.finish_reason,
            error=seq.error, ttft_ms=ms(seq.first_token_time), latency_ms=ms(last),
            samples=samples, num_cached_tokens=seq.num_cached_tokens, index=index,
            logprobs=samples[0].get("logprobs"), routed_experts=samples[0].get("routed_experts"),
            prompt_logprobs=list(seq.prompt_logprobs) if p.prompt_logprobs is not None else None)

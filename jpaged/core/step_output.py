"""What a step sends back to the host, as numpy (vLLM V1's `ModelRunnerOutput`),
and what the scheduler needs to turn it into tokens: the stop conditions it is
given (the engine's output processor) and the logprob bookkeeping.

No jax here: the runner's device result is fetched and converted once
(jpaged.engine.core), and `Scheduler.update_from_output` reads only this.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

from jpaged.core.scheduler_output import ScheduledSeq
from jpaged.core.sequence import Sequence, TokenLogprob


@dataclasses.dataclass
class LogprobRows:
    """Log-probabilities of chosen tokens and their best alternatives, per row."""
    chosen: np.ndarray      # [R]
    top_ids: np.ndarray     # [R, k], best first
    top_values: np.ndarray  # [R, k]

    @classmethod
    def of(cls, rows: Any) -> LogprobRows | None:
        """From any object with these three fields (the runner's fetched result)."""
        return None if rows is None else cls(np.asarray(rows.chosen), np.asarray(rows.top_ids),
                                             np.asarray(rows.top_values))

    def token_logprob(self, row: int, token_id: int, k: int) -> TokenLogprob:
        top = tuple((int(i), float(v)) for i, v in zip(self.top_ids[row, :k], self.top_values[row, :k])
                    if np.isfinite(v))  # filtered-out tokens (processed mode) have probability 0
        return TokenLogprob(token_id, float(self.chosen[row]), top)


@dataclasses.dataclass
class StepOutput:
    """One completed step: a row per scheduled sequence (tokens [S], or [S, K + 1]
    when drafts were verified, row s emitting tokens[s, :num_accepted[s] + 1]),
    and for prompt logprobs a row per flat token."""
    tokens: np.ndarray
    logprobs: LogprobRows | None = None
    prompt_logprobs: LogprobRows | None = None
    nan_rows: np.ndarray | None = None  # [S] bool: the row's logits held a NaN
    num_accepted: np.ndarray | None = None
    expert_load: np.ndarray | None = None     # a MoE model's [L_moe, E]
    routed_experts: np.ndarray | None = None  # [T, L_moe, k] per flat token, when a row captures routes

    @classmethod
    def empty(cls) -> StepOutput:
        """A step that produced nothing (it failed, or ran no forward)."""
        return cls(np.zeros(0, np.int32))

    @classmethod
    def of(cls, result: Any) -> StepOutput:
        """From the runner's fetched result (same fields, numpy leaves)."""
        return cls(np.asarray(result.tokens), LogprobRows.of(result.logprobs),
                   LogprobRows.of(result.prompt_logprobs),
                   *(None if x is None else np.asarray(x) for x in (
                       result.nan_rows, result.num_accepted, result.expert_load, result.routed_experts)))

    def row_tokens(self, row: int, verified_drafts: bool) -> list[int]:
        """The tokens row `row` emitted: its sampled token, or (drafts verified) its
        accepted drafts and the token after them."""
        token = self.tokens[row]
        if self.num_accepted is None:
            return [int(token)]
        if not verified_drafts:
            return [int(token[0])]
        return token[:int(self.num_accepted[row]) + 1].tolist()

    def record_logprobs(self, s: ScheduledSeq, token: int, row: int, offset: int) -> None:
        """Appends to s.seq what this step holds for it (row `row`; its tokens from
        flat index `offset`): the prompt logprobs its tokens predicted, and its
        sampled token's logprob when the row samples one."""
        seq, p = s.seq, s.seq.params
        if self.prompt_logprobs is not None and seq.needs_prompt_logprobs:
            for j in range(s.num_new):
                target = s.start + j + 1  # the prompt position token j predicts
                if target == len(seq.prompt_logprobs) and target < len(seq.prompt_token_ids):
                    seq.prompt_logprobs.append(self.prompt_logprobs.token_logprob(
                        offset + j, seq.prompt_token_ids[target], p.prompt_logprobs))
        if self.logprobs is not None and p.logprobs is not None and s.output_index is not None:
            seq.logprobs.append(self.logprobs.token_logprob(row, token, p.logprobs))


    def record_routes(self, s: ScheduledSeq, offset: int) -> None:
        """Sets s.seq's routes at the positions this step computed for it (its
        tokens from flat index `offset`), when it captures them."""
        if self.routed_experts is None or not s.seq.params.capture_routes:
            return
        routes, end = s.seq.routes, s.start + s.num_new
        routes.extend([None] * (end - len(routes)))
        routes[s.start:end] = list(self.routed_experts[offset:offset + s.num_new])


class StopConditions(Protocol):
    """When a sample ends (the engine's output processor: EOS, stop ids and
    strings, length); the scheduler asks, it does not know the tokenizer."""

    def finish_reason(self, seq: Sequence, token: int, num_output: int) -> str | None: ...

    def reached_length(self, seq: Sequence, num_output: int) -> bool: ...

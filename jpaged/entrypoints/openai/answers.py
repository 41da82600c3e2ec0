"""How each generation route shapes a GenerationRun into its answer (an Answer):
a whole response body, or the SSE chunks of a stream (jpaged.entrypoints.openai.serving
runs the request).  /v1/completions (with echo and its logprobs' offsets),
/v1/chat/completions (with tool calls parsed out of the text, streamed or
whole), and /generate (the batch CLI's output lines).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jpaged.core.sequence import TokenLogprob
from jpaged.entrypoints.openai.responses import (chat_choice, chat_chunk_choice, chat_logprobs, completion_choice,
                                                 completion_logprobs, envelope, token_logprob_json,
                                                 tool_calls_finish_reason, with_routes)
from jpaged.entrypoints.openai.serving import Answer, ChoiceUpdate, GenerationRun
from jpaged.entrypoints.openai.state import ServerState
from jpaged.structured.tool_parser import ToolCallStreamParser


class CompletionAnswer(Answer):
    """/v1/completions.  With echo the prompt leads each choice, in the body and in
    the choice's first chunk (which waits for the prompt's logprobs)."""

    def __init__(self, run: GenerationRun, state: ServerState, prompt_texts: list[str]):
        super().__init__(run, state, prompt_texts)
        self._started = [False] * len(run.samples)  # streaming: the choice had a chunk
        self._offsets = [0] * len(run.samples)      # streaming: its token strings' length so far

    def _echo(self, c: int) -> str:
        return self.prompt_texts[c // self.run.n] if self.run.gen.echo else ""

    def _logprobs(self, c: int, logprobs: list[TokenLogprob], echo: bool, offset: int) -> dict[str, Any] | None:
        """The choice's `logprobs` of these tokens, led by the prompt's with echo."""
        if self.run.gen.params.logprobs is None:
            return None
        ids, entries = [lp.token_id for lp in logprobs], list(logprobs)
        if echo:
            request = self.run.submission.requests[c // self.run.n]
            prompt = self.run.prompt_logprobs[c // self.run.n] or [None] * len(request.prompt_token_ids)
            ids, entries = request.prompt_token_ids + ids, prompt + entries
        if self.run.gen.params.logprobs == 0:  # as vLLM: the token's own entry, no alternatives
            entries = [lp if lp is None or lp.top else dataclasses.replace(lp, top=((lp.token_id, lp.logprob),))
                       for lp in entries]
        return completion_logprobs(ids, entries, self.state.token_text, offset)

    def body(self) -> dict[str, Any]:
        run = self.run
        choices = [completion_choice(c, self._echo(c) + s.text, run.finish_reasons[c],
                                     self._logprobs(c, run.logprobs[c], run.gen.echo, 0), run.routes[c])
                   for c, s in enumerate(run.samples)]
        return envelope(self.id, "text_completion", run.gen.model, choices, run.usage())

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return envelope(self.id, "text_completion", self.run.gen.model, choices, None,
                        with_usage=self.run.gen.include_usage)

    def chunk(self, update: ChoiceUpdate) -> dict[str, Any]:
        c = update.index
        echo, self._started[c] = self.run.gen.echo and not self._started[c], True
        logprobs = self._logprobs(c, update.logprobs, echo, self._offsets[c])
        if logprobs is not None:
            self._offsets[c] += sum(map(len, logprobs["tokens"]))
        text = (self._echo(c) if echo else "") + update.text
        return self._chunk([completion_choice(c, text, update.finish_reason, logprobs, update.routes)])

    def usage_chunk(self) -> dict[str, Any]:
        return envelope(self.id, "text_completion", self.run.gen.model, [], self.run.usage())


class ChatAnswer(Answer):
    prefix = "chatcmpl"

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        return None if self.run.gen.params.logprobs is None else chat_logprobs(logprobs, self.state.token_text)

    def __init__(self, run: GenerationRun, state: ServerState, prompt_texts: list[str]):
        super().__init__(run, state, prompt_texts)
        # Streaming with tools: each choice's text goes through a tool-call parser; the
        # logprobs of tokens it holds back wait for the choice's next chunk.
        tools = run.gen.declared_tools
        self._tool_parsers = [ToolCallStreamParser(tools) for _ in run.samples] if tools is not None else None
        self._held_logprobs: list[list[TokenLogprob]] = [[] for _ in run.samples]

    def body(self) -> dict[str, Any]:
        run = self.run
        choices = [chat_choice(c, s.text, run.finish_reasons[c], self._logprobs(run.logprobs[c]),
                               run.gen.declared_tools, run.routes[c])
                   for c, s in enumerate(run.samples)]
        return envelope(self.id, "chat.completion", run.gen.model, choices, run.usage())

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return envelope(self.id, "chat.completion.chunk", self.run.gen.model, choices, None,
                        with_usage=self.run.gen.include_usage)

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk([chat_chunk_choice(c, {"role": "assistant", "content": ""}, None)])
                for c in range(len(self.run.samples))]

    def chunks(self, update: ChoiceUpdate) -> list[dict[str, Any]]:
        if self._tool_parsers is None:
            delta = {"content": update.text} if update.text else {}
            return [self._chunk([chat_chunk_choice(update.index, delta, update.finish_reason,
                                                   self._logprobs(update.logprobs), update.routes)])]
        parser = self._tool_parsers[update.index]
        deltas = parser.feed(update.text) + (parser.finish() if update.finish_reason else [])
        reason = tool_calls_finish_reason(update.finish_reason, parser.calls)
        held = self._held_logprobs[update.index]
        held += update.logprobs
        if reason is None and not deltas:  # nothing to show yet: no empty chunk per token
            return []
        if reason is not None:  # the finish in a chunk of its own
            deltas.append({})
        logprobs, held[:] = self._logprobs(list(held)), []
        last = len(deltas) - 1  # the finish's chunk (with the routes), or the last one so far
        return [self._chunk([chat_chunk_choice(update.index, delta, reason if i == last else None,
                                               logprobs if i == 0 else None, update.routes if i == last else None)])
                for i, delta in enumerate(deltas)]

    def usage_chunk(self) -> dict[str, Any]:
        return envelope(self.id, "chat.completion.chunk", self.run.gen.model, [], self.run.usage())


class GenerateAnswer(Answer):
    """/generate: the shape of the batch CLI's output lines."""

    def body(self) -> dict[str, Any]:
        run, params = self.run, self.run.gen.params
        samples = [dict(text=s.text, token_ids=list(s.token_ids), finish_reason=run.finish_reasons[c])
                   for c, s in enumerate(run.samples)]
        if params.logprobs is not None:
            for sample, logprobs in zip(samples, run.logprobs):
                sample["logprobs"] = [token_logprob_json(lp) for lp in logprobs]
        samples = [with_routes(sample, routes) for sample, routes in zip(samples, run.routes)]
        body = {**samples[0], "samples": samples, "usage": run.usage()}
        if params.prompt_logprobs is not None:
            body["prompt_logprobs"] = [token_logprob_json(lp) for lp in run.prompt_logprobs[0] or []]
        return body

"""Prompts in, checked token ids out: tokenizing (chat template included) and
the checks a request must pass before it is queued.

A bad prompt becomes an error for that request alone, never an exception
that would take a batch down.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jpaged.core.rounding import cdiv
from jpaged.core.sequence import SamplingParams
from jpaged.structured import tools as structured_tools
from jpaged.structured.grammar import GrammarCompiler

PROMPT_KEYS = {"prompt", "messages", "tools", "cache_salt"}  # of a chat prompt dict given to generate()


@dataclasses.dataclass
class PreparedPrompt:
    """The arguments of LLM.add_request() for one prompt."""
    token_ids: list[int] | None
    params: SamplingParams
    text: str | None
    error: str | None


class InputProcessor:
    """Turns what generate() takes into token ids and says why a request cannot run."""

    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 block_size: int, num_blocks: int, grammars: GrammarCompiler | None = None,
                 has_experts: bool = False):
        """`grammars`: compiles structured-output constraints (None: the model has no
        tokenizer, and a constrained request is refused); `has_experts`: a mixture-of-
        experts model (else SamplingParams.capture_routes is refused)."""
        self.has_experts = has_experts
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.num_blocks = num_blocks

    def prepare(self, prompt: Any, params: SamplingParams) -> PreparedPrompt:
        """A raw string, a list of token ids, or a chat request {"messages": [...]} /
        {"prompt": "a user message"} (rendered with the model's chat template),
        optionally with "tools" (OpenAI function tools, jpaged.structured.tools)
        and a "cache_salt"."""
        text, token_ids, error = self._tokenize(prompt)
        unknown = sorted(set(prompt) - PROMPT_KEYS) if isinstance(prompt, dict) else []
        if unknown:  # e.g. sampling fields, which would otherwise be silently ignored
            error = (f"unknown prompt keys {unknown}: a prompt dict takes {sorted(PROMPT_KEYS)}; "
                     "sampling settings go in SamplingParams")
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            salt = prompt["cache_salt"]
            if isinstance(salt, str):
                params = dataclasses.replace(params, cache_salt=salt)
            else:
                error = f"cache_salt must be a string, got {type(salt).__name__} {salt!r}"
        return PreparedPrompt(token_ids, params, text, error)

    def tokenize(self, prompt: Any) -> list[int]:
        """Prompt token ids exactly as prepare() builds them; ValueError for a prompt
        that prepare() would fail."""
        _, ids, error = self._tokenize(prompt)
        if error:
            raise ValueError(error)
        return ids

    def validate(self, ids: list[int], params: SamplingParams) -> str | None:
        """Why this request cannot run, or None.  Reads only the config and pool size."""
        try:
            params.validate()
        except (ValueError, TypeError) as e:
            return str(e)
        if params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer, and this model has none: use stop_token_ids"
        if not ids:
            return "empty prompt: at least one token is required"
        if len(ids) >= self.max_model_len:
            return (f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                    "(room is needed for at least one generated token)")
        error = _check_token_ids(ids)
        if error:
            return error
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:8]}"
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"stop_token_ids outside the vocabulary [0, {self.vocab_size}): {bad[:8]}"
        if params.capture_routes and not self.has_experts:
            return "capture_routes needs a mixture-of-experts model; this one has no experts to route to"
        if params.n > self.max_num_seqs:
            return f"n={params.n} samples exceed max_num_seqs={self.max_num_seqs}"
        if cdiv(len(ids) + 1, self.block_size) > self.num_blocks - 1:
            return f"prompt needs more KV blocks than the pool has ({self.num_blocks - 1})"
        if params.structured is not None:
            if self.grammars is None:
                return "structured outputs need a tokenizer, and this model has none"
            return self.grammars.check(params.structured)
        return None

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int] | None, str | None]:
        """(prompt text, token ids, error)."""
        error = _check_prompt_type(prompt)
        if error:
            return None, None, error
        try:
            if isinstance(prompt, dict):
                messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
                # Special-token strings in message contents stay text: a user cannot forge turns.
                text, ids = structured_tools.encode_chat_with_tools(self._require_tokenizer(), messages,
                                                                    prompt.get("tools"))
                return text, ids, None
            if isinstance(prompt, str):
                return prompt, self._require_tokenizer().encode(prompt), None
            ids = list(prompt)
            error = _check_token_ids(ids)
            return (None, None, error) if error else (None, [int(t) for t in ids], None)
        except Exception as e:  # one bad request must not take the batch down
            return None, None, f"invalid prompt: {type(e).__name__}: {e}"

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return self.tokenizer


def _check_prompt_type(prompt: Any) -> str | None:
    """Why `prompt` is not a prompt generate() takes, or None: bytes are not token
    ids (list(b"hi") would read as [104, 105]), and text must be valid Unicode
    (a lone surrogate, e.g. from a JSON "\\ud800", has no UTF-8 encoding)."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        return (f"prompt is {type(prompt).__name__}: pass a str (decode it first) or a list of "
                "integer token ids")
    if isinstance(prompt, str):
        return unicode_error(prompt, "prompt")
    if isinstance(prompt, dict):
        texts = [("prompt", prompt.get("prompt"))]
        messages = prompt.get("messages")
        if isinstance(messages, list):
            texts += [(f"messages[{i}].content", m.get("content")) for i, m in enumerate(messages)
                      if isinstance(m, dict)]
        for where, text in texts:
            error = unicode_error(text, where) if isinstance(text, str) else None
            if error:
                return error
        return None
    if isinstance(prompt, (int, float, type(None))) or not hasattr(prompt, "__iter__"):
        return (f"prompt is {type(prompt).__name__}: a prompt is a str, a list of integer token ids, "
                "or a dict with \"prompt\" or \"messages\"")
    return None


def unicode_error(text: str, where: str = "prompt") -> str | None:
    """An error naming the first lone surrogate of `text`, or None when it is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"{where} is not valid Unicode (lone surrogate {ascii(text[e.start])} at character "
                f"{e.start})")
    return None


def _check_token_ids(ids: list) -> str | None:
    not_ints = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
    return f"token ids must be integers, got {not_ints[:8]}" if not_ints else None

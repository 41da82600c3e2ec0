"""llguidance matchers: a constraint compiled once per engine, a matcher per sample.

`GrammarCompiler` is built once per engine from its tokenizer (an
`LLTokenizer` over the same `tokenizers` JSON, its vocabulary the model's
logits width, its EOS the tokenizer's end-of-generation ids).  It checks a
request's constraint before the request is queued (a bad schema, a regex
that does not parse, a constraint no output satisfies: that request's
error) and keeps the compiled grammars of recent constraints.  `Grammar` is
one sample's matcher: `fill(mask, row)` writes the bitmask of the tokens it
allows next into row `row` of a [S, ceil(vocab / 32)] int32 array (bit j of
word w allows token 32 w + j; the jitted step sets the others to -inf), and
`accept(token)` advances it.  A sample's matcher sees only its known tokens,
so preemption (recompute or swap) leaves it as it is.  Host code: no jax.
"""

from __future__ import annotations

import collections
import re
import threading
from typing import Any

import numpy as np

from jpaged.structured.spec import StructuredOutputs

CACHED_GRAMMARS = 256  # compiled constraints kept (LRU), shared by requests with the same one


def mask_words(vocab_size: int) -> int:
    """int32 words of one row of the bitmask."""
    return (vocab_size + 31) // 32


class Grammar:
    """One sample's matcher (see the module docstring)."""

    def __init__(self, matcher: Any, spec: StructuredOutputs):
        self._matcher = matcher
        self.spec = spec

    def fill(self, mask: np.ndarray, row: int) -> None:
        """Writes the tokens allowed next into mask[row] (int32, C-contiguous)."""
        import llguidance.numpy
        llguidance.numpy.fill_next_token_bitmask(self._matcher, mask, row)

    def accept(self, token: int) -> bool:
        """Advances past `token`; False when the constraint does not allow it (the
        matcher is then in error, and the sample should end)."""
        return bool(self._matcher.consume_token(token)) and not self._matcher.is_error()

    @property
    def is_finished(self) -> bool:
        """The constraint is complete and allows nothing more (EOS consumed, or a
        grammar with no continuation)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def fork(self) -> Grammar:
        """An independent copy in the same state (another sample of the request)."""
        return Grammar(self._matcher.deep_copy(), self.spec)


class GrammarCompiler:
    """Compiles constraints for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.vocab_size = vocab_size
        self._source = tokenizer
        self._ll_tokenizer: Any = None  # built on first use (~0.2 s for a 50k vocabulary)
        self._grammars: collections.OrderedDict[StructuredOutputs, str] = collections.OrderedDict()
        self._lock = threading.Lock()  # the HTTP server checks requests on its own threads

    @property
    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._source.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=list(self._source.eos_token_ids) or None)
            return self._ll_tokenizer

    def check(self, spec: StructuredOutputs) -> str | None:
        """Why this constraint cannot run, or None (it compiles and admits an output)."""
        try:
            spec.validate()
            self._compiled(spec)
        except ValueError as e:
            return str(e)
        return None

    def grammar(self, spec: StructuredOutputs) -> Grammar:
        """A fresh matcher for `spec`; ValueError saying what is wrong with it."""
        spec.validate()
        return Grammar(self._matcher(self._compiled(spec), spec), spec)

    def _matcher(self, text: str, spec: StructuredOutputs) -> Any:
        import llguidance
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind} constraint: {_first_line(matcher.get_error())}")
        return matcher

    def _compiled(self, spec: StructuredOutputs) -> str:
        """llguidance's grammar text for `spec`, checked once per constraint (it
        compiles, and its first token can be something other than an end): LRU-cached,
        so a request's check and its samples' matchers share the work."""
        with self._lock:
            if spec in self._grammars:
                self._grammars.move_to_end(spec)
                return self._grammars[spec]
        import llguidance
        text = self._grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(text, self._tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"invalid {spec.kind} constraint: {_first_line(error)}")
        matcher = self._matcher(text, spec)
        mask = np.zeros((1, mask_words(self.vocab_size)), np.int32)
        Grammar(matcher, spec).fill(mask, 0)
        allowed = set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist())
        if not allowed - set(self._tokenizer.eos_tokens) and not matcher.is_accepting():
            raise ValueError(f"the {spec.kind} constraint admits no output ({spec.describe()})")
        with self._lock:
            self._grammars[spec] = text
            while len(self._grammars) > CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return text

    @staticmethod
    def _grammar_text(spec: StructuredOutputs) -> str:
        from llguidance import LLMatcher, grammar_from, regex_to_lark
        try:
            if spec.kind == "json":
                return LLMatcher.grammar_from_json_schema(spec.json)
            if spec.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"})
            if spec.kind == "regex":  # \d and \w are ASCII, as in JSON Schema and JavaScript
                return LLMatcher.grammar_from_lark(f"start: /{regex_to_lark(spec.regex, 'dw')}/")
            if spec.kind == "choice":
                return grammar_from("choice", list(spec.choice))
            return grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to it
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid {spec.kind} constraint: {_first_line(str(e))}") from None


def _first_line(message: str) -> str:
    """llguidance's multi-line message on one line, without its caret drawings."""
    lines = [" ".join(line.split()) for line in message.strip().splitlines()]
    lines = [line for line in lines if line.strip("^ ") and not re.match(r"\d+ \|", line)]
    return "; ".join(dict.fromkeys(lines))[:400] if lines else "unknown error"

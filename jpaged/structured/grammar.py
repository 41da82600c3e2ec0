"""llguidance matchers: a constraint compiled once per engine, a matcher per sample.

`GrammarCompiler` is built once per engine from its tokenizer (an
`LLTokenizer` over the same `tokenizers` JSON, its vocabulary the model's
logits width, its EOS the tokenizer's end-of-generation ids).  It checks a
request's constraint before the request is queued (a bad schema, a regex
that does not parse, a constraint no output satisfies, one beyond
`limits.LIMITS`: that request's error) and keeps the compiled grammars of
recent constraints, and the errors of those that failed.  A constraint's
first compile runs in `sandbox` (a worker process that may crash, under a
time budget); only one that compiled there is compiled in this process.  `Grammar` is
one sample's matcher: `fill(mask, row)` writes the bitmask of the tokens it
allows next into row `row` of a [S, ceil(vocab / 32)] int32 array (bit j of
word w allows token 32 w + j; the jitted step sets the others to -inf), and
`accept(token)` advances it.  A sample's matcher sees only its known tokens,
so preemption (recompute or swap) leaves it as it is.  Host code: no jax.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import re
import threading
import time
from typing import Any

import numpy as np

from jpaged.structured import limits, sandbox
from jpaged.structured.sandbox import Busy, CompileSandbox
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
        self._state: _Shared | None = None  # bound on first use
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
        return self._check_by(spec, time.monotonic() + limits.LIMITS.compile_seconds)

    def check_async(self, spec: StructuredOutputs) -> concurrent.futures.Future[str | None]:
        """check(spec) on the compiler's own threads (LIMITS.concurrent_compiles of
        them), its wait for a compiler counted from now: a server awaits this rather
        than hold one of its request threads while a constraint compiles."""
        shared = self._shared
        with shared.lock:
            cached = shared.compiled.get(spec)
        if cached is not None:
            done: concurrent.futures.Future[str | None] = concurrent.futures.Future()
            done.set_result(cached if isinstance(cached, str) else None)
            return done
        return shared.pool.submit(self._check_by, spec, time.monotonic() + limits.LIMITS.compile_seconds)

    def _check_by(self, spec: StructuredOutputs, wait_until: float) -> str | None:
        compiled = self._entry(spec, wait_until)
        return compiled if isinstance(compiled, str) else None

    def grammar(self, spec: StructuredOutputs) -> Grammar:
        """A fresh matcher for `spec`; ValueError saying what is wrong with it."""
        compiled = self._entry(spec, time.monotonic() + limits.LIMITS.compile_seconds)
        if isinstance(compiled, str):
            raise ValueError(compiled)
        return Grammar(new_matcher(self._tokenizer, compiled.text, spec), spec)

    def _entry(self, spec: StructuredOutputs, wait_until: float) -> _Compiled | str:
        """`spec`'s checked grammar text or its error, compiled once per constraint and
        LRU-cached, errors included (a request's check and its samples' matchers
        share the work; a constraint that failed is not compiled again).  The first
        compile is checked against the limits, then compiled in the sandbox (a
        compiler free by `wait_until`, then the time budget), and only then here;
        a request beside it with the same constraint waits for it."""
        shared = self._shared
        while True:
            with shared.lock:
                if spec in shared.compiled:
                    shared.compiled.move_to_end(spec)
                    return shared.compiled[spec]
                pending = shared.compiling.get(spec)
                if pending is None:
                    shared.compiling[spec] = threading.Event()
                    break
            pending.wait()  # (the other caller's compile ends within its budgets)
            with shared.lock:
                given_up = spec not in shared.compiled and time.monotonic() >= wait_until
            if given_up:  # the other caller's compile was refused (busy, or over the limits)
                return sandbox.busy_message(limits.LIMITS.concurrent_compiles)
        try:
            compiled = self._first_compile(spec, wait_until)
        except Busy as e:  # not the constraint's fault: not remembered
            return str(e)
        finally:
            with shared.lock:
                shared.compiling.pop(spec).set()
        return compiled

    def _first_compile(self, spec: StructuredOutputs, wait_until: float) -> _Compiled | str:
        """The grammar text or the error (cached), or Busy."""
        try:
            spec.validate()  # the limits: before llguidance sees it
        except ValueError as e:  # not cached: cheap to say again, and the spec may be large
            return str(e)
        try:
            error = self._shared.sandbox.compile(spec, wait_until)
            if error:
                raise ValueError(error)
            # Safe here now: the same code compiled it there, on half this process's stack.
            compiled: _Compiled | str = _Compiled(compile_check(self._tokenizer, spec, self.vocab_size))
        except ValueError as e:
            compiled = str(e)
        except (RuntimeError, TypeError, OverflowError, MemoryError) as e:
            # An llguidance surprise: still this request's error, not the server's.
            compiled = f"invalid {spec.kind} constraint: {type(e).__name__}: {_first_line(str(e))}"
        shared = self._shared
        with shared.lock:
            shared.compiled[spec] = compiled
            while len(shared.compiled) > CACHED_GRAMMARS:
                shared.compiled.popitem(last=False)
        return compiled

    @property
    def _shared(self) -> _Shared:
        """What this process's compilers of the same tokenizer share (data-parallel
        replicas each load it): the cache, the compile threads, the sandbox."""
        with self._lock:
            if self._state is None:
                text = self._source.backend.to_str()
                key = (hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(), self.vocab_size,
                       tuple(self._source.eos_token_ids))
                with _SHARED_LOCK:
                    if key not in _SHARED:
                        _SHARED[key] = _Shared(text, self.vocab_size, list(self._source.eos_token_ids))
                    self._state = _SHARED[key]
            return self._state


class _Shared:
    """The compiled constraints of one tokenizer (grammar text, or why it cannot run),
    the first compiles in flight, check_async's threads and the sandbox."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self.compiled: collections.OrderedDict[StructuredOutputs, _Compiled | str] = collections.OrderedDict()
        self.compiling: dict[StructuredOutputs, threading.Event] = {}
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(limits.LIMITS.concurrent_compiles,
                                                          thread_name_prefix="jpaged-grammar")
        self.sandbox = CompileSandbox(tokenizer_json, vocab_size, eos_token_ids, limits.LIMITS.concurrent_compiles)


_SHARED: dict[tuple[str, int, tuple[int, ...]], _Shared] = {}
_SHARED_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class _Compiled:
    text: str  # llguidance's grammar text of a constraint that compiles


def new_matcher(tokenizer: Any, text: str, spec: StructuredOutputs) -> Any:
    """A matcher for grammar `text` under llguidance's limits; ValueError when it is in error."""
    import llguidance
    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=limits.parser_limits())
    if matcher.is_error():
        raise ValueError(f"invalid {spec.kind} constraint: {_first_line(matcher.get_error())}")
    return matcher


def compile_check(tokenizer: Any, spec: StructuredOutputs, vocab_size: int) -> str:
    """llguidance's grammar text for `spec`, checked to compile for `tokenizer` (an
    LLTokenizer) under llguidance's limits and to admit a first token other than
    an end; ValueError saying what is wrong.  (The sandbox runs this first; this
    process then runs it again on what passed there.)"""
    import llguidance
    text = grammar_text(spec)
    error = llguidance.LLMatcher.validate_grammar(text, tokenizer, limits=limits.parser_limits())
    if error and not error.startswith("WARNING"):
        raise ValueError(f"invalid {spec.kind} constraint: {_first_line(error)}")
    grammar = Grammar(new_matcher(tokenizer, text, spec), spec)
    mask = np.zeros((1, mask_words(vocab_size)), np.int32)
    grammar.fill(mask, 0)
    allowed = set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist())
    if not allowed - set(tokenizer.eos_tokens) and not grammar._matcher.is_accepting():
        raise ValueError(f"the {spec.kind} constraint admits no output ({spec.describe()})")
    if grammar.error:  # e.g. a first Earley row past max_items_in_row
        raise ValueError(f"invalid {spec.kind} constraint: {_first_line(grammar.error)}")
    return text


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar text for `spec` (not yet compiled)."""
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
    except (ValueError, TypeError, RecursionError) as e:
        raise ValueError(f"invalid {spec.kind} constraint: {_first_line(str(e))}") from None


def _first_line(message: str) -> str:
    """llguidance's multi-line message on one line, without its caret drawings."""
    lines = [" ".join(line.split()) for line in message.strip().splitlines()]
    lines = [line for line in lines if line.strip("^ ") and not re.match(r"\d+ \|", line)
             and line != "<non-verbose/>"]  # (llguidance's mark for verbose_errors=False)
    return "; ".join(dict.fromkeys(lines))[:400] if lines else "unknown error"

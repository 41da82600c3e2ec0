"""Generated tokens to text as they arrive, with stop strings.

A server streams text token by token, but text is not token-local: one UTF-8
character can span several byte-level tokens, and a tokenizer may render a
token differently at the start of a string (SentencePiece drops the leading
space).  `IncrementalDetokenizer` decodes a short window of recent tokens and
releases only the text that is final, so the pieces concatenate to the full
decode of all tokens.  `StopStrings` holds back any tail that could be the
start of a stop string, so a streamed response never shows text that a stop
string later cuts.  Host code: no jax.

Not `tokenizers.decoders.DecodeStream` (same windowed scheme, in Rust), because as of
tokenizers 0.23: it needs a `tokenizers.Tokenizer` where this takes any `decode`
callable (the server's, which also serves models without a tokenizer); it has no
flush, so a character cut off by the end of generation is never shown where the
full decode shows U+FFFD; and it raises "Invalid prefix encountered" when byte-
fallback tokens (SentencePiece `<0xNN>`) that already decoded turn into an invalid
UTF-8 sequence, which a model can emit (tests/tokenizer/test_gguf_tokenizers.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Decodes tokens one push at a time (vLLM's windowed scheme)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix_offset = 0  # start of the context window re-decoded each time
        self._read_offset = 0    # tokens before this one have released their text

    def push(self, token_ids: Sequence[int]) -> str:
        """The text that `token_ids` make final (may be "" while a character is incomplete)."""
        self._tokens.extend(token_ids)
        prefix = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new (a special token) or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return full[len(prefix):]

    def flush(self) -> str:
        """The text still held at the end of the sequence (an incomplete character
        decodes to U+FFFD, as in a decode of every token)."""
        prefix = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._tokens)
        return full[len(prefix):] if full.startswith(prefix) else ""


class StopStrings:
    """Finds the first stop string in a growing text; releases only text that
    can no longer become part of one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._text = ""
        self._released = 0  # characters of _text handed out so far
        self.stopped = False

    def feed(self, text: str) -> str:
        """Adds text; returns what may be shown now.  After a stop string, the text
        before it is released and `stopped` is set; later feeds return ""."""
        if self.stopped:
            return ""
        self._text += text
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self._text) - self._held_tail())

    def flush(self) -> str:
        """Everything not yet released (the sequence ended without a stop string)."""
        return "" if self.stopped else self._release(len(self._text))

    def _first_stop(self) -> int | None:
        # A stop string cannot start in released text: that tail was held back.
        hits = [i for i in (self._text.find(s, self._released) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held_tail(self) -> int:
        """Length of the longest tail of the unreleased text that begins a stop string."""
        pending = self._text[self._released:]
        for n in range(min(len(pending), max((len(s) - 1 for s in self.stops), default=0)), 0, -1):
            if any(s.startswith(pending[-n:]) for s in self.stops):
                return n
        return 0

    def _release(self, end: int) -> str:
        out = self._text[self._released:end]
        self._released = max(self._released, end)
        return out


class SampleText:
    """One generated sample as text: tokens in, released text out, stopped at
    the first stop string; counts the tokens it consumed (those after a stop
    string are not part of the answer)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self._detok = IncrementalDetokenizer(decode)
        self._stops = StopStrings(stops)
        self.token_ids: list[int] = []
        self.text = ""
        self._taken = 0         # characters of text handed out by take()
        self._finished = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def stopped(self) -> bool:
        """A stop string ended the sample."""
        return self._stops.stopped

    def push(self, token_ids: Sequence[int]) -> str:
        """New text released by these tokens; tokens after a stop string are ignored."""
        out = []
        for token in token_ids:
            if self.stopped:
                break
            self.token_ids.append(token)
            out.append(self._stops.feed(self._detok.push([token])))
        return self._emit("".join(out))

    def finish(self) -> str:
        """The rest of the text once the engine finished the sample ("" when called again)."""
        if self.stopped or self._finished:
            return ""
        self._finished = True
        tail = self._stops.feed(self._detok.flush())
        return self._emit(tail + self._stops.flush())

    def take(self) -> str:
        """The text released since the last take()."""
        out, self._taken = self.text[self._taken:], len(self.text)
        return out

    def _emit(self, piece: str) -> str:
        self.text += piece
        return piece

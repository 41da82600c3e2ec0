"""Where message content lies in a rendered chat: what `Tokenizer.encode_chat` needs to
keep content as plain text while the template's own markers become control tokens.

The template is rendered a second time with each content string replaced by an
unguessable placeholder (`with_placeholders`); `align_contents` then finds each
content's span in the real render by matching it against that skeleton.
"""

from __future__ import annotations

import bisect
import re
import secrets
from typing import Any


def fresh_nonce(text: str) -> str:
    """A random tag for placeholders; random so content cannot contain or forge one."""
    while True:
        nonce = secrets.token_hex(8)
        if nonce not in text:
            return nonce


def _placeholder(nonce: str, k: int) -> str:
    # Letters and digits only: survives `trim`, `tojson`, `split` and friends unchanged.
    return f"JPAGED{nonce}C{k}E"


def placeholder_regex(nonce: str) -> re.Pattern[str]:
    return re.compile(f"JPAGED{nonce}C([0-9]+)E")


def with_placeholders(messages: list[dict[str, Any]], nonce: str
                       ) -> tuple[list[dict[str, Any]], list[str]]:
    """Copies of `messages` with each non-empty content string replaced by a placeholder.

    Returns (copies, contents) where placeholder k stands for contents[k]. Empty
    strings stay: there is nothing in them to protect, and templates often branch on
    emptiness (an assistant turn with only tool calls).
    """
    contents: list[str] = []

    def hold(s: str) -> str:
        if not s:
            return s
        contents.append(s)
        return _placeholder(nonce, len(contents) - 1)

    copies = []
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            copies.append(message)  # the template reports it
            continue
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": hold(content)}
        elif isinstance(content, list):
            message = {**message, "content": [_hold_part(n, part, hold) for part in content]}
        copies.append(message)
    return copies, contents


def _hold_part(n: int, part: Any, hold: Any) -> dict[str, Any]:
    """A content part with its text held; only text parts are supported."""
    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ValueError(f"message {n}: content part of type {kind!r} is not supported "
                         "(only {'type': 'text', 'text': str} parts)")
    return {**part, "text": hold(part["text"])}


def strings_in(value: Any, key: Any = None, depth: int = 0) -> list[str]:
    """Every string in a JSON-like value, dict keys included (a template may write them)."""
    if isinstance(value, str):
        return [value]
    if depth > 32:  # deeper than any message a template renders; refuse rather than recurse on
        raise ValueError(f"message field {key!r} is nested too deeply")
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in strings_in(k, key, depth + 1) + strings_in(v, key, depth + 1)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in strings_in(v, key, depth + 1)]
    return []


def _content_variants(content: str) -> list[str]:
    """How a template may have written `content`: as is, or trimmed (`| trim`, `.strip('\\n')`)."""
    variants = [content, content.strip(), content.lstrip(), content.rstrip(),
                content.strip("\n"), content.lstrip("\n"), content.rstrip("\n")]
    return list(dict.fromkeys(variants))


def align_contents(text: str, skeleton: str, placeholder: re.Pattern[str], contents: list[str]
                    ) -> list[tuple[int, int]] | None:
    """Spans of `text` holding message content, or None if `text` is not `skeleton` filled in.

    `skeleton` is template pieces and placeholders, t0 P t1 P ... tn; `text` must be
    t0 x t1 x ... tn with each x a variant of its placeholder's content. Variants can
    make several splits fit, so every reachable position is kept (at most a few per
    placeholder) and the first split that uses all of `text` wins, untrimmed preferred.
    """
    parts = placeholder.split(skeleton)
    pieces, slots = parts[0::2], [int(k) for k in parts[1::2]]
    if not text.startswith(pieces[0]):
        return None
    # position in text -> spans that got there, as a linked list (span, previous).
    frontier: dict[int, Any] = {len(pieces[0]): None}
    for slot, piece in zip(slots, pieces[1:]):
        reached: dict[int, Any] = {}
        for pos, path in frontier.items():
            for variant in _content_variants(contents[slot]):
                end = pos + len(variant)
                if text.startswith(variant, pos) and text.startswith(piece, end):
                    reached.setdefault(end + len(piece), ((pos, end), path))
        if not reached:
            return None
        frontier = reached
    if len(text) not in frontier:
        return None
    spans, path = [], frontier[len(text)]
    while path is not None:
        span, path = path
        if span[1] > span[0]:
            spans.append(span)
    return spans[::-1]


def strip_span(text: str, span: tuple[int, int]) -> tuple[int, int]:
    """`span` without surrounding whitespace: what an lstrip/rstrip added token absorbed."""
    start, end = span
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def overlaps(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    """Whether `span` shares a character with any of the sorted, disjoint `spans`."""
    start, end = span
    k = bisect.bisect_left(spans, (end,)) - 1  # the last span starting before `end`
    return start < end and k >= 0 and spans[k][1] > start


def complement(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The non-empty gaps between sorted, disjoint `spans` in [0, length)."""
    gaps, pos = [], 0
    for start, end in spans:
        if start > pos:
            gaps.append((pos, start))
        pos = end
    if pos < length:
        gaps.append((pos, length))
    return gaps

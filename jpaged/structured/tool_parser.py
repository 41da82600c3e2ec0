"""Tool calls read out of an answer, whole (`parse_tool_calls`) or streamed
(`ToolCallStreamParser`), in the Hermes format of jpaged.structured.tools:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Only declared functions are called (`DeclaredTools`): a block naming a function
the request's `tools` do not list stays text, so a user who gets the model to
repeat a `<tool_call>` cannot make it call anything else.  Under tool_choice
"auto" a block is a call only when its arguments also validate against the
function's `parameters`; under "required" or a named function ("forced") the
grammar already made them valid, so the arguments stream as they are generated,
and a call cut short (max_tokens, a stop string) is still reported, with the
arguments as far as they got (`ToolCall.complete` false), as vLLM does.

A call's `arguments` is the model's own text of the arguments object (what
streams, so that the streamed and the whole answer agree), or, under "auto" when
that text is not the object alone, the object as compact JSON.  Host code: no jax.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any

from jpaged.structured.schemas import SchemaValidator

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The start of a block's JSON up to its arguments, name first (the grammar of a forced
# call writes it so): the name is known, and what follows is the arguments' text.
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(arguments|parameters)"\s*:\s*')


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: `arguments` is the arguments object as JSON text; a call cut short
    (`complete` false) has the text as far as it got."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=lambda: "call_" + secrets.token_hex(12))
    complete: bool = True

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class DeclaredTools:
    """The functions a request declared (jpaged.structured.tools.validate_tools'
    dicts) and whether tool_choice forced a call ("required" or a named function:
    the grammar then made every call's arguments valid)."""

    def __init__(self, functions: list[dict[str, Any]], forced: bool = False):
        self.forced = forced
        self._parameters = {f["name"]: f["parameters"] for f in functions}
        self._validators: dict[str, SchemaValidator] = {}  # built when a call first needs one

    def declares(self, name: str) -> bool:
        return name in self._parameters

    def admits(self, name: str, arguments: dict[str, Any]) -> bool:
        """Whether a call of `name` with `arguments` may be returned: a declared
        function, and (unless forced) arguments valid against its parameters."""
        if not self.declares(name):
            return False
        if self.forced:
            return True
        if name not in self._validators:
            self._validators[name] = SchemaValidator(self._parameters[name])
        return self._validators[name].valid(arguments)


def parse_tool_calls(text: str, tools: DeclaredTools) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of an answer.  A block runs from `<tool_call>` to the first
    `</tool_call>` after it (as vLLM's Hermes parser reads it), or is cut short by
    the next `<tool_call>` or the end of the text.  A block is a call when its JSON
    is an object with a string "name" and an object "arguments" (or "parameters")
    that `tools` admits; forced, a final block cut short is a call once its name
    is whole.  Everything else, malformed blocks and calls of undeclared functions
    included, is the content, stripped (None if blank)."""
    pieces, _ = _split(text, final=True)
    content, calls = "", []
    for piece in pieces:
        call = _read_call(piece, tools) if isinstance(piece, _Block) else None
        if call is not None:
            calls.append(call)
        else:
            content += piece.raw if isinstance(piece, _Block) else piece
    return content.strip() or None, calls


# ---------------------------------------------------------------- reading
@dataclasses.dataclass(frozen=True)
class _Block:
    raw: str    # the block's text, tags included: the content it stays when it is no call
    body: str   # its text between `<tool_call>` and where it ends
    cut: bool   # ended by the end of the text (no `</tool_call>`, no next block)


def _split(text: str, final: bool) -> tuple[list[str | _Block], str]:
    """`text` as text pieces and blocks in order, and the tail not yet decidable
    (a block still open, or what may begin `<tool_call>`); with `final`, the text
    is all there is and nothing is held back.  The one reading shared by the whole
    and the streamed parser, so that they agree."""
    pieces: list[str | _Block] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            held = 0 if final else _partial_suffix(text[pos:], OPEN)
            pieces.append(text[pos:len(text) - held])
            return pieces, text[len(text) - held:]
        pieces.append(text[pos:start])
        body_end, block_end = _block_end(text, start)
        cut = body_end < 0
        if cut:
            if not final:
                return pieces, text[start:]
            body_end = block_end = len(text)
        pieces.append(_Block(text[start:block_end], text[start + len(OPEN):body_end], cut))
        pos = block_end


def _block_end(text: str, start: int) -> tuple[int, int]:
    """Where the body of the block opened at `start` ends, and the block: at its
    `</tool_call>` (the block includes it), or cut short by the next `<tool_call>`
    (which begins the next block); (-1, -1) when neither has arrived."""
    close = text.find(CLOSE, start + len(OPEN))
    reopen = text.find(OPEN, start + len(OPEN))
    if reopen >= 0 and (close < 0 or reopen < close):
        return reopen, reopen
    return (close, close + len(CLOSE)) if close >= 0 else (-1, -1)


def _read_call(block: _Block, tools: DeclaredTools) -> ToolCall | None:
    """The call `block` makes, or None when it stays text."""
    body = block.body[:len(block.body) - _partial_tag(block.body)] if block.cut else block.body
    obj = _json_object(body)
    head = HEAD.match(body)
    name = _head_name(head)
    if tools.forced and name is not None and tools.declares(name):
        # The grammar wrote it: the arguments' text is what follows the head, less the
        # closing brace of the call's object once that object is whole.
        rest = body[head.end():].rstrip()
        whole = (obj is not None and set(obj) == {"name", head.group(2)} and obj["name"] == name
                 and isinstance(obj[head.group(2)], dict) and rest.endswith("}"))
        return ToolCall(name, rest[:-1].rstrip() if whole else rest, complete=whole)
    if obj is None or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    arguments = obj.get(key)
    if not isinstance(arguments, dict) or not tools.admits(obj["name"], arguments):
        return None
    return ToolCall(obj["name"], _arguments_text(body, head, obj, key))


def _arguments_text(body: str, head: re.Match[str] | None, obj: dict[str, Any], key: str) -> str:
    """The model's text of the arguments object when the body is {"name", key} in
    that order (as a forced call writes it), else the object as compact JSON."""
    if head is not None and head.group(2) == key and set(obj) == {"name", key}:
        text = body[head.end():].rstrip()[:-1].rstrip()  # less the call object's "}"
        try:
            if json.loads(text) == obj[key]:
                return text
        except (ValueError, RecursionError):
            pass
    # vLLM's Hermes parser writes arguments the same way (json.dumps' separators).
    return json.dumps(obj[key], ensure_ascii=False)


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _head_name(head: re.Match[str] | None) -> str | None:
    if head is None:
        return None
    try:
        name = json.loads(head.group(1))
    except ValueError:  # an escape that is not JSON's
        return None
    return name if isinstance(name, str) else None


# -------------------------------------------------------------- streaming
@dataclasses.dataclass
class _OpenCall:
    """A forced call being streamed: its header is sent, and `sent` of its arguments."""

    index: int
    id: str
    name: str
    head_end: int  # where the arguments' text begins in the block's body
    sent: str = ""


class ToolCallStreamParser:
    """parse_tool_calls for a stream: `feed(delta)` and then `finish()` return
    OpenAI chat-chunk deltas, {"content": text} for text and, per call, a header
    {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}
    then {"tool_calls": [{"index", "function": {"arguments": fragment}}]}.

    Text that may begin a `<tool_call>` is held back until it is known not to; a
    block is held until its name is whole and declared.  Forced, the header then
    goes out and the arguments follow as they are generated (less a tail that may
    still turn out to be the call object's closing brace or a tag).  Under "auto"
    a block is held until it ends, since only then can its arguments be checked
    against the function's parameters; a block that is no call is then text.
    Whitespace is held until text follows it, so that the content sent, joined,
    is exactly parse_tool_calls' content, and `calls` its calls."""

    def __init__(self, tools: DeclaredTools) -> None:
        self.tools = tools
        self._pending = ""       # text not yet decidable
        self._space = ""         # whitespace held until text follows it
        self._sent_text = False  # leading whitespace is dropped, as parse_tool_calls strips it
        self._open: _OpenCall | None = None
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Deltas for what `delta` (with what was held) decides."""
        pieces, self._pending = _split(self._pending + delta, final=False)
        return self._deltas(pieces) + self._stream_open_block()

    def finish(self) -> list[dict[str, Any]]:
        """Deltas for what is held: a final block cut short is read as
        parse_tool_calls reads it; trailing whitespace is dropped."""
        pieces, self._pending = _split(self._pending, final=True)
        out = self._deltas(pieces)
        self._space = ""  # trailing: parse_tool_calls strips it
        return out

    def _deltas(self, pieces: list[str | _Block]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, str):
                out += self._text(piece)
                continue
            call = _read_call(piece, self.tools)
            if self._open is not None:  # (the first block of these pieces: the one being streamed)
                out += self._close(call)
            elif call is not None:
                out += self._header(call.id, call.name) + self._arguments(call.arguments)
                self.calls.append(call)
            else:
                out += self._text(piece.raw)
        return out

    def _stream_open_block(self) -> list[dict[str, Any]]:
        """Forced: the header of the open block once its name is whole and declared,
        and its arguments as far as they are certain."""
        if not (self.tools.forced and self._pending.startswith(OPEN)):
            return []
        body = self._pending[len(OPEN):]
        out: list[dict[str, Any]] = []
        if self._open is None:
            head = HEAD.match(body)
            name = _head_name(head)
            if name is None or not self.tools.declares(name) or not body[head.end():].strip():
                return []  # (the head's trailing whitespace is only known once something follows it)
            call_id = ToolCall(name, "").id
            out += self._header(call_id, name)
            self._open = _OpenCall(len(self.calls), call_id, name, head.end())
        certain = _certain_arguments(body[self._open.head_end:])
        return out + self._arguments(certain[len(self._open.sent):])

    def _close(self, call: ToolCall | None) -> list[dict[str, Any]]:
        """The streamed call's block has ended: the rest of its arguments."""
        open_call, self._open = self._open, None
        assert open_call is not None
        # Forced, a block whose head named a declared function reads as its call, and
        # what was sent of its arguments begins them; were it not so, what was sent stands.
        if call is None or call.name != open_call.name or not call.arguments.startswith(open_call.sent):
            call = ToolCall(open_call.name, open_call.sent, complete=False)
        self.calls.append(dataclasses.replace(call, id=open_call.id))
        return self._arguments(call.arguments[len(open_call.sent):], open_call.index)

    def _header(self, call_id: str, name: str) -> list[dict[str, Any]]:
        return [{"tool_calls": [{"index": len(self.calls), "id": call_id, "type": "function",
                                 "function": {"name": name, "arguments": ""}}]}]

    def _arguments(self, fragment: str, index: int | None = None) -> list[dict[str, Any]]:
        if not fragment:
            return []
        if index is None:
            index = self._open.index if self._open is not None else len(self.calls)
        if self._open is not None:
            self._open.sent += fragment
        return [{"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}]

    def _text(self, text: str) -> list[dict[str, Any]]:
        text = self._space + text
        if not self._sent_text:
            text = text.lstrip()
        core = text.rstrip()
        self._space = text[len(core):]
        if not core:
            return []
        self._sent_text = True
        return [{"content": core}]


def _certain_arguments(rest: str) -> str:
    """Of the arguments' text so far, the part that is theirs whatever comes next:
    less a tail that may begin a tag, and less whitespace around a "}" that may be
    the call object's own closing brace."""
    rest = rest[:len(rest) - _partial_tag(rest)].rstrip()
    return rest[:-1].rstrip() if rest.endswith("}") else rest


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of `text` that may begin `</tool_call>` or `<tool_call>`."""
    return max(_partial_suffix(text, CLOSE), _partial_suffix(text, OPEN))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0

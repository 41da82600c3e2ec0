"""OpenAI tool calls in the Hermes format: prompts, constraints and parsers.

The format: a tool call is a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one per call, blocks back to back, and the tools are listed to the model in
the system message inside <tools></tools> (one JSON object per line).  It is
the format of the Qwen 2 / 2.5 / 3, SmolLM2 / 3, Hermes 2 / 3 (NousResearch)
families.  Other families' formats (Llama 3's bare JSON, Mistral's
[TOOL_CALLS]) are not parsed.

- `validate_tools`: an OpenAI `tools` list checked, as function dicts.
- `tool_choice_constraint`: "required" or a named function as a grammar
  (jpaged.structured.spec) forcing `<tool_call>` blocks whose JSON matches the
  function's `parameters` schema (llguidance's Lark with inline `%json`).
- `messages_for_template`: a chat with tools for a template that does not
  render them itself (SmolLM2's): the tools in the system message, earlier
  calls and results as Hermes text.
- `parse_tool_calls` and `ToolCallStreamParser`: the calls in an answer, whole
  or streamed (OpenAI's `tool_calls` and `delta.tool_calls`).
Host code: no jax.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any

from jpaged.structured.spec import StructuredOutputs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's `tools` ([{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}]) as function dicts {"name", "description",
    "parameters"}; ValueError naming the bad field (`tools[1].function.name ...`)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of function tools")
    functions, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f'{where}.type must be "function" (the only tool type jpaged calls)')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ValueError(f"{where}.function.strict must be true or false")
        functions.append({"name": name, "description": description or "", "parameters": parameters})
    return functions


def tool_choice_constraint(functions: list[dict[str, Any]], tool_choice: Any,
                           parallel: bool = True) -> StructuredOutputs | None:
    """The constraint `tool_choice` puts on the answer: None for "none" / "auto";
    for "required", one or more `<tool_call>` blocks of any of the functions (one
    when not `parallel`: OpenAI's parallel_tool_calls false); for
    {"type": "function", "function": {"name": X}}, exactly one block calling X."""
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        return StructuredOutputs(grammar=_calls_grammar(functions, repeat=parallel))
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
            and isinstance(tool_choice.get("function"), dict)
            and isinstance(tool_choice["function"].get("name"), str)):
        raise ValueError('tool_choice must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}')
    name = tool_choice["function"]["name"]
    chosen = [f for f in functions if f["name"] == name]
    if not chosen:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    return StructuredOutputs(grammar=_calls_grammar(chosen, repeat=False))


def _calls_grammar(functions: list[dict[str, Any]], repeat: bool) -> str:
    """Lark (llguidance) for `<tool_call>` blocks whose JSON is {"name": one of the
    functions, "arguments": that function's parameters}."""
    # Each function's parameters sit under the root's $defs and are referenced from
    # there: nested in place, their own "#/$defs/..." references (pydantic writes
    # them) would point at the wrong root.
    defs = {f"tool{i}": _rebased(f["parameters"], f"#/$defs/tool{i}") for i, f in enumerate(functions)}
    schema = {"$defs": defs,
              "anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": {"const": f["name"]}, "arguments": {"$ref": f"#/$defs/tool{i}"}}}
                        for i, f in enumerate(functions)]}
    more = ' ("\\n" call)*' if repeat else ""
    return f'start: call{more}\ncall: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n'


# Keywords whose values are JSON data, not schemas (a "$ref" key there is data),
# and keywords whose values map names to schemas (a name there is no keyword).
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased(schema: Any, base: str) -> Any:
    """`schema` moved to the JSON pointer `base`: its local references ("#" and
    "#/...") made relative to `base`, and its root's "$id" / "$schema" dropped (an
    "$id" would re-root the rewritten references)."""
    def subschema(node: Any) -> Any:
        if isinstance(node, list):  # allOf / anyOf / oneOf / prefixItems
            return [subschema(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
                out[key] = base + value[1:]
            elif key in DATA_KEYWORDS:
                out[key] = value
            elif key in NAMED_SCHEMAS and isinstance(value, dict):
                out[key] = {name: subschema(v) for name, v in value.items()}
            else:
                out[key] = subschema(value)
        return out
    if not isinstance(schema, dict):
        return schema
    return subschema({k: v for k, v in schema.items() if k not in ("$id", "$schema")})


def tool_system_prompt(functions: list[dict[str, Any]]) -> str:
    """The Hermes / Qwen 2.5 system text that lists the tools and the call format."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE)


def messages_for_template(messages: list[dict[str, Any]], functions: list[dict[str, Any]] | None,
                          template_handles_tools: bool) -> list[dict[str, Any]]:
    """The chat to render.  A template that renders tools gets the messages as they
    are (content None as ""); otherwise the tools join the system message, and
    earlier assistant `tool_calls` and `tool` results become Hermes text."""
    if template_handles_tools:
        return [{**m, "content": m.get("content") or ""} for m in messages]
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [_call_block(c.get("function", {})) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [content, *blocks]))})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # one user turn for consecutive results
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": content})
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if functions:
        prompt = tool_system_prompt(functions)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def encode_chat_with_tools(tokenizer: Any, messages: list[dict[str, Any]], tools: Any,
                           add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """(text, ids) of a chat with OpenAI `tools` (None: none), as every route renders
    it: by the chat template when it renders `tools`, else in the Hermes format
    (messages_for_template).  ValueError naming a bad tool (`tools[0]...`)."""
    functions = validate_tools(tools) if tools else None
    native = bool(functions) and tokenizer.renders_tools
    messages = messages_for_template(messages, functions, native)
    extra = {"tools": [{"type": "function", "function": f} for f in functions]} if native else {}
    return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, **extra)


def _call_block(function: dict[str, Any]) -> str:
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass  # written as the client sent it
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


# ---------------------------------------------------------------- parsing
@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: `arguments` is the arguments object as compact JSON text."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of an answer.  A block runs from `<tool_call>` to the first
    `</tool_call>` after it (as vLLM's Hermes parser reads it); one cut short, by
    the next `<tool_call>` or the end of the text, counts when its JSON is whole
    (a model may stop before the closing tag).  A block whose body is a JSON
    object with a string "name" and an object "arguments" (or "parameters") is a
    call; everything else, malformed blocks included, is the content, stripped
    (None if blank)."""
    pieces, _ = _split(text, final=True)
    content = "".join(p for p in pieces if isinstance(p, str)).strip()
    return content or None, [p for p in pieces if isinstance(p, ToolCall)]


def _split(text: str, final: bool) -> tuple[list[str | ToolCall], str]:
    """`text` as text pieces and calls in order, and the tail not yet decidable
    (a block still open, or what may begin `<tool_call>`); with `final`, the
    text is all there is and nothing is held back.  The one reading shared by
    the whole and the streamed parser, so that they agree."""
    pieces: list[str | ToolCall] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            held = 0 if final else _partial_suffix(text[pos:], OPEN)
            pieces.append(text[pos:len(text) - held])
            return pieces, text[len(text) - held:]
        pieces.append(text[pos:start])
        body_end, block_end = _block_end(text, start)
        if body_end < 0:
            if not final:
                return pieces, text[start:]
            body_end = block_end = len(text)
        call = _parse_call(text[start + len(OPEN):body_end])
        pieces.append(call if call is not None else text[start:block_end])
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


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters"))
    if not isinstance(arguments, dict):
        return None
    # vLLM's Hermes parser writes arguments the same way (json.dumps' separators).
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStreamParser:
    """parse_tool_calls for a stream: `feed(delta)` and then `finish()` return
    OpenAI chat-chunk deltas, {"content": text} for text and, per call, a header
    {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}
    then {"tool_calls": [{"index", "function": {"arguments"}}]}.  Text that may
    begin a `<tool_call>` is held back until it is known, and a block until it
    ends; whitespace is held until text follows it, so that the content sent,
    joined, is exactly parse_tool_calls' content, and `calls` its calls."""

    def __init__(self) -> None:
        self._pending = ""       # text not yet decidable
        self._space = ""         # whitespace held until text follows it
        self._sent_text = False  # leading whitespace is dropped, as parse_tool_calls strips it
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Deltas for what `delta` (with what was held) decides."""
        pieces, self._pending = _split(self._pending + delta, final=False)
        return self._deltas(pieces)

    def finish(self) -> list[dict[str, Any]]:
        """Deltas for what is held: an unclosed final block is a call when its JSON
        is whole; trailing whitespace is dropped."""
        pieces, self._pending = _split(self._pending, final=True)
        out = self._deltas(pieces)
        self._space = ""  # trailing: parse_tool_calls strips it
        return out

    def _deltas(self, pieces: list[str | ToolCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for piece in pieces:
            out += self._call(piece) if isinstance(piece, ToolCall) else self._text(piece)
        return out

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

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        index = len(self.calls)
        self.calls.append(call)
        return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}]},
                {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0

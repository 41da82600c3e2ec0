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


def tool_choice_constraint(functions: list[dict[str, Any]], tool_choice: Any) -> StructuredOutputs | None:
    """The constraint `tool_choice` puts on the answer: None for "none" / "auto";
    for "required", one or more `<tool_call>` blocks of any of the functions; for
    {"type": "function", "function": {"name": X}}, exactly one block calling X."""
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        return StructuredOutputs(grammar=_calls_grammar(functions, repeat=True))
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
    schema = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}}
                        for f in functions]}
    more = ' ("\\n" call)*' if repeat else ""
    return f'start: call{more}\ncall: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n'


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
    """(content, calls) of an answer: every `<tool_call>` block whose body is a JSON
    object with a string "name" and an object "arguments" (or "parameters") is a
    call; a final block missing its closing tag counts when its JSON is whole.
    Everything else, malformed blocks included, is the content (None if blank)."""
    content, calls, pos = [], [], 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            content.append(text[pos:])
            break
        end = text.find(CLOSE, start)
        body = text[start + len(OPEN):end if end >= 0 else len(text)]
        call = _parse_call(body)
        stop = end + len(CLOSE) if end >= 0 else len(text)
        content.append(text[pos:start] if call is not None else text[pos:stop])
        if call is not None:
            calls.append(call)
        pos = stop
        if end < 0:
            break
    joined = "".join(content).strip()
    return (joined or None), calls


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
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStreamParser:
    """parse_tool_calls for a stream: `feed(delta)` and then `finish()` return
    OpenAI chat-chunk deltas, {"content": text} for text and, per call, a header
    {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}
    then {"tool_calls": [{"index", "function": {"arguments"}}]}.  Text that may
    begin a `<tool_call>` is held back until it is known; a block is sent when
    it closes (or at finish, when its JSON is whole).  The content sent, stripped,
    is parse_tool_calls' content and `calls` its calls."""

    def __init__(self):
        self._pending = ""       # text not sent yet
        self._sent_text = False  # (leading whitespace before any text is dropped, as parse_tool_calls strips)
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self._pending += delta
        out: list[dict[str, Any]] = []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._pending, OPEN)
                out += self._text(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                return out
            end = self._pending.find(CLOSE, start)
            if end < 0:
                out += self._text(self._pending[:start])
                self._pending = self._pending[start:]
                return out
            block, rest = self._pending[start:end + len(CLOSE)], self._pending[end + len(CLOSE):]
            call = _parse_call(block[len(OPEN):-len(CLOSE)])
            out += self._text(self._pending[:start]) + (self._call(call) if call else self._text(block))
            self._pending = rest

    def finish(self) -> list[dict[str, Any]]:
        """Flushes what is held: an unclosed final block is a call when its JSON is whole."""
        pending, self._pending = self._pending, ""
        if pending.startswith(OPEN):
            call = _parse_call(pending[len(OPEN):])
            if call is not None:
                return self._call(call)
        return self._text(pending.rstrip())

    def _text(self, text: str) -> list[dict[str, Any]]:
        if not self._sent_text:
            text = text.lstrip()
        if not text:
            return []
        self._sent_text = True
        return [{"content": text}]

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

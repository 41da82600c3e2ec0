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
- `declared_tools`: how an answer's calls are read for a request (only its
  declared functions are called); `parse_tool_calls` and `ToolCallStreamParser`
  (jpaged.structured.tool_parser): the calls in an answer, whole or streamed
  (OpenAI's `tool_calls` and `delta.tool_calls`).
- `disable_additional_properties` (vLLM's option of that name): objects in the
  parameters schemas that do not say otherwise take no keys beyond theirs.
Host code: no jax.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jpaged.structured.schemas import check_schema, close_objects, map_schemas
from jpaged.structured.spec import StructuredOutputs
from jpaged.structured.tool_parser import (CLOSE, OPEN, DeclaredTools, ToolCall,  # noqa: F401 - re-exported
                                           ToolCallStreamParser, parse_tool_calls)

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def validate_tools(tools: Any, disable_additional_properties: bool = False) -> list[dict[str, Any]]:
    """OpenAI's `tools` ([{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}]) as function dicts {"name", "description",
    "parameters"}; ValueError naming the bad field (`tools[1].function.name ...`,
    a `parameters` that is no JSON schema).  With `disable_additional_properties`,
    the parameters' objects are closed (jpaged.structured.schemas.close_objects)."""
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
        check_schema(parameters, f"{where}.function.parameters")
        if disable_additional_properties:
            parameters = close_objects(parameters)
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


def declared_tools(functions: list[dict[str, Any]], tool_choice: Any) -> DeclaredTools:
    """How the answer to a request with these functions is read for calls: only
    they are called; "required" or a named function forced the call (its grammar
    made the arguments valid), else ("auto") the arguments must validate."""
    return DeclaredTools(functions, forced=tool_choice not in (None, "none", "auto"))


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


def _rebased(schema: Any, base: str) -> Any:
    """`schema` moved to the JSON pointer `base`: its local references ("#" and
    "#/...") made relative to `base`, and its root's "$id" / "$schema" dropped (an
    "$id" would re-root the rewritten references)."""
    def rebase(node: dict) -> dict:
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = base + ref[1:]
        return node
    if not isinstance(schema, dict):
        return schema
    return map_schemas({k: v for k, v in schema.items() if k not in ("$id", "$schema")}, rebase)


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

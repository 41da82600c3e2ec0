"""Tool calls and disable_additional_properties at the protocol level
(jpaged.entrypoints.openai.protocol): which calls a chat answer reports (only
declared functions; forced calls cut short by max_tokens), and how the
disable_additional_properties request field and server option close the
schemas.  Host only, no model."""

from __future__ import annotations

import json

import pytest

from jpaged.core.sequence import SamplingParams
from jpaged.entrypoints.openai.errors import RequestError
from jpaged.entrypoints.openai.protocol import parse_chat, parse_completion
from jpaged.entrypoints.openai.responses import chat_choice

DEFAULT = SamplingParams(max_tokens=16)
MESSAGES = [{"role": "user", "content": "Repeat after me."}]
OPEN_SCHEMA = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": OPEN_SCHEMA}}
DELETE = '<tool_call>\n{"name": "delete_all_files", "arguments": {"path": "/"}}\n</tool_call>'


def chat(**fields):
    return parse_chat({"messages": MESSAGES, **fields}, DEFAULT, "m")


def test_an_undeclared_function_in_the_answer_stays_content():
    gen = chat(tools=[WEATHER], tool_choice="auto")
    choice = chat_choice(0, DELETE, "stop", tools=gen.declared_tools)
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": DELETE}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    choice = chat_choice(0, DELETE + "\n" + call, "stop", tools=gen.declared_tools)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == DELETE
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    # Arguments that do not validate stay content under auto.
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Rome"}}\n</tool_call>'
    assert chat_choice(0, bad, "stop", tools=gen.declared_tools)["message"]["content"] == bad


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_by_max_tokens_is_reported(tool_choice):
    gen = chat(tools=[WEATHER], tool_choice=tool_choice)
    assert gen.declared_tools.forced
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro'
    choice = chat_choice(0, text, "length", tools=gen.declared_tools)
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Ro'}
    # Under auto the same text is text: nothing forced it to be a call.
    auto = chat(tools=[WEATHER]).declared_tools
    assert chat_choice(0, text, "length", tools=auto)["message"] == {"role": "assistant", "content": text}


def grammar_schema(gen) -> dict:
    """The call schema inside a tool_choice grammar."""
    grammar = gen.params.structured.grammar
    return json.loads(grammar[grammar.index("%json ") + 6:grammar.rindex(' "\\n</tool_call>"')])


@pytest.mark.parametrize("fields", [{"disable_additional_properties": True},
                                    {"structured_outputs": {"disable_additional_properties": True}}])
def test_disable_additional_properties_per_request(fields):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": OPEN_SCHEMA}}
    if "structured_outputs" in fields:  # vLLM's place: beside the constraint it shapes
        closed = chat(structured_outputs={"json": OPEN_SCHEMA, "disable_additional_properties": True})
    else:
        closed = chat(response_format=fmt, **fields)
    assert json.loads(closed.params.structured.json) == {**OPEN_SCHEMA, "additionalProperties": False}
    assert json.loads(chat(response_format=fmt).params.structured.json) == OPEN_SCHEMA
    tools = chat(tools=[WEATHER], tool_choice="required", **fields)
    assert grammar_schema(tools)["$defs"]["tool0"]["additionalProperties"] is False
    assert "additionalProperties" not in grammar_schema(chat(tools=[WEATHER], tool_choice="required"))["$defs"]["tool0"]
    # Under auto, the closed schema is what the arguments validate against.
    extra = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "x": 1}}\n</tool_call>'
    assert chat_choice(0, extra, "stop", tools=chat(tools=[WEATHER], **fields).declared_tools)["message"][
        "content"] == extra
    assert chat_choice(0, extra, "stop", tools=chat(tools=[WEATHER]).declared_tools)["finish_reason"] == "tool_calls"
    # /v1/completions takes it too.
    body = {"prompt": "x", "guided_json": OPEN_SCHEMA, **fields}
    if "structured_outputs" in fields:
        body = {"prompt": "x", "structured_outputs": {"json": OPEN_SCHEMA, "disable_additional_properties": True}}
    spec = parse_completion(body, DEFAULT, "m").params.structured
    assert json.loads(spec.json)["additionalProperties"] is False


@pytest.mark.parametrize("fields, param", [
    ({"disable_additional_properties": "yes"}, "disable_additional_properties"),
    ({"structured_outputs": {"json": OPEN_SCHEMA, "disable_additional_properties": 1}}, "structured_outputs"),
    ({"structured_outputs": {"disable_additional_properties": "no"}, "tools": [WEATHER]}, "structured_outputs"),
])
def test_a_bad_disable_additional_properties_is_a_400_naming_it(fields, param):
    with pytest.raises(RequestError) as e:
        chat(**fields)
    assert e.value.status == 400 and e.value.param == param and "disable_additional_properties" in e.value.message


def test_the_server_option_is_each_requests_default(tmp_path):
    """ServerOptions.disable_additional_properties: a request that says nothing is closed; its own false wins."""
    from jpaged.entrypoints.openai.serving import _prepare
    from jpaged.entrypoints.openai.state import ServerOptions
    from types import SimpleNamespace
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": OPEN_SCHEMA}}

    class Stop(Exception):
        pass

    def parse(raw, *args):
        seen.append(raw.get("disable_additional_properties"))
        raise Stop
    for option, body, expected in [(True, {}, True), (True, {"disable_additional_properties": False}, False),
                                   (False, {}, None)]:
        seen: list = []
        state = SimpleNamespace(options=ServerOptions(disable_additional_properties=option), defaults=DEFAULT,
                                model_name="m", adapters={})
        with pytest.raises(Stop):
            _prepare(state, parse, json.dumps({"messages": MESSAGES, "response_format": fmt, **body}).encode())
        assert seen == [expected]
    from jpaged.entrypoints import serve  # `jpaged serve --disable_additional_properties`
    assert serve.server_options(serve.Args(disable_additional_properties=True), {}).disable_additional_properties
    assert not serve.server_options(serve.Args(), {}).disable_additional_properties


def test_batch_lines_take_disable_additional_properties():
    """The batch CLI's request lines read it as the server does (the same body models)."""
    from jpaged.entrypoints.batch_requests import parse_request
    line = {"prompt": "x", "guided_json": OPEN_SCHEMA, "disable_additional_properties": True}
    parsed = parse_request(line, DEFAULT)
    assert parsed.error is None and not parsed.warnings
    assert json.loads(parsed.params.structured.json)["additionalProperties"] is False
    inner = {"prompt": "x", "structured_outputs": {"json": OPEN_SCHEMA, "disable_additional_properties": True}}
    assert json.loads(parse_request(inner, DEFAULT).params.structured.json)["additionalProperties"] is False
    assert "additionalProperties" not in json.loads(parse_request({"prompt": "x", "guided_json": OPEN_SCHEMA},
                                                                  DEFAULT).params.structured.json)
    bad = parse_request({**line, "disable_additional_properties": "yes"}, DEFAULT, index=2)
    assert bad.error.startswith("request 2: disable_additional_properties: Input should be a valid boolean")

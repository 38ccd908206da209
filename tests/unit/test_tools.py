"""Tool-call prompts, grammars and parsers (``tessera.cluster.tools``)."""

from __future__ import annotations

import json

import llguidance
import pytest

from tessera.cluster.tools import call_grammar, call_text, parse, tool_format, tool_prompt

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city"],
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}


def test_hermes_blocks_are_parsed_with_the_text_around_them():
    text = (
        "Let me check.\n"
        + call_text("get_weather", {"city": "Oslo"})
        + "\n"
        + call_text("get_time", {})
        + "\n<tool_call>\n{not json}\n</tool_call>"
    )
    content, calls = parse(text, "hermes", {"get_weather", "get_time"})
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert content == "Let me check.\n\n\n<tool_call>\n{not json}\n</tool_call>"


def test_unknown_functions_and_plain_text_stay_text():
    text = call_text("launch_rockets", {"count": 3})
    assert parse(text, "hermes", {"get_weather"}) == (text, [])
    assert parse("It is sunny.", "hermes", {"get_weather"}) == ("It is sunny.", [])


def test_llama3_json_is_parsed():
    content, calls = parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}',
        "llama3",
        {"get_weather"},
    )
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]


def test_the_format_follows_the_template():
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tool_format("<|python_tag|>{{ x }}") == "llama3"
    assert tool_format(None) == "hermes"


@pytest.mark.parametrize("name", [None, "get_weather"])
@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_call_grammars_compile_and_accept_only_calls(name, fmt):
    grammar = llguidance.grammar_from("grammar", call_grammar([WEATHER, TIME], name, True, fmt))
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    assert not failed, messages


def test_the_tool_prompt_lists_every_tool_as_json():
    prompt = tool_prompt([WEATHER, TIME])
    listed = prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [WEATHER, TIME]

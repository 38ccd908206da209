"""Tool-call prompts, grammars and parsers (``tessera.cluster.tools``)."""

from __future__ import annotations

import json
import time

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


#: What a caller can make a model write (a structured output, a prompt to echo), each
#: 100k characters or more: the regex this parser once was took 9.9 s on an unclosed
#: tag and 2,000 spaces, and grew with the cube of the length.
ADVERSARIAL = {
    "unclosed tag, spaces": "<tool_call>" + " " * 100_000,
    "unclosed tag, newlines": "<tool_call>\n" + "\n \t" * 40_000 + "x",
    "open tags only": "<tool_call> " * 20_000,
    "nested tags": "<tool_call>" * 10_000 + call_text("get_time", {}) + "</tool_call>" * 10_000,
    "close tags only": "</tool_call>" * 20_000,
    "deep JSON": "<tool_call>" + "[" * 100_000 + "</tool_call>",
    "deep arguments": '<tool_call>{"name": "get_time", "arguments": '
    + '{"a": ' * 50_000
    + "1"
    + "}" * 50_001
    + "</tool_call>",
    "many calls": call_text("get_time", {}) * 5_000,
}


@pytest.mark.parametrize("text", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_adversarial_outputs_parse_in_linear_time(text, fmt):
    """Each parse ends within 0.5 s (measured: under 0.1 s; the largest is the 5,000
    calls' JSON) and gives a result, never an exception."""
    start = time.perf_counter()
    content, calls = parse(text, fmt, {"get_time"})
    assert time.perf_counter() - start < 0.5
    assert content is None or isinstance(content, str)
    assert all(call.name == "get_time" for call in calls)


def test_nested_and_unclosed_blocks_read_as_the_first_close_tag_ends_them():
    call = call_text("get_time", {})
    assert parse("<tool_call>" + call, "hermes", {"get_time"}) == ("<tool_call>" + call, [])
    unclosed = call + "\n<tool_call> {"
    content, calls = parse(unclosed, "hermes", {"get_time"})
    assert content == "<tool_call> {" and [c.name for c in calls] == ["get_time"]


def test_a_block_whose_name_is_not_a_string_stays_text():
    for name in (["get_time"], {"a": 1}, 3, None):
        text = "<tool_call>" + json.dumps({"name": name, "arguments": {}}) + "</tool_call>"
        assert parse(text, "hermes", {"get_time"}) == (text, [])

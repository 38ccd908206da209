"""Every field OpenAI documents for chat and completions bodies: implemented
(``reasoning_effort``, the deprecated ``functions`` / ``function_call``), taken with a
meaning that changes no token (``verbosity``, ``prediction``, cache bookkeeping), or
refused in words where it asks for what this server has not (audio, web search,
moderation, fill-in-the-middle). A field no body declares is refused, or dropped and
logged with ``ignore_unknown_fields``. The wire format alone: no Ray, no HTTP."""

from __future__ import annotations

import json
import logging

import pytest

from tessera.cluster.cli import build_parser
from tessera.cluster.config import ServeConfig, config_from_args
from tessera.cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from tessera.cluster.tools import parse

MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def chat(ignore_unknown: bool = False, **body) -> ChatCompletionRequest:
    body.setdefault("messages", MESSAGES)
    return parse_body(json.dumps(body).encode(), ChatCompletionRequest, ignore_unknown)


def refusal(model=ChatCompletionRequest, **body) -> tuple[str | None, str]:
    if model is ChatCompletionRequest:
        body.setdefault("messages", MESSAGES)
    with pytest.raises(APIError) as caught:
        parse_body(json.dumps(body).encode(), model).sampling_for(4)
    error = caught.value
    assert (error.status, error.code, error.type) == (400, "invalid_value", "invalid_request_error")
    return error.param, error.message


@pytest.mark.parametrize(
    ("effort", "thinking"),
    [("none", False), ("minimal", False), ("low", True), ("medium", True), ("high", True),
     ("xhigh", True), ("max", True)],
)  # fmt: skip
def test_reasoning_effort_sets_the_templates_thinking_switch(effort, thinking):
    assert chat(reasoning_effort=effort).template_kwargs() == {
        "enable_thinking": thinking,
        "reasoning_effort": effort,
    }
    explicit = {"enable_thinking": not thinking, "reasoning_effort": "low"}
    assert chat(reasoning_effort=effort, chat_template_kwargs=explicit).template_kwargs() == (
        explicit
    )
    assert chat().template_kwargs() == {}


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"reasoning_effort": "extreme"},
            "reasoning_effort",
            "reasoning_effort: Input should be 'none', 'minimal', 'low', 'medium', 'high', "
            "'xhigh' or 'max', got 'extreme'",
        ),
        (
            {"verbosity": "terse"},
            "verbosity",
            "verbosity: Input should be 'low', 'medium' or 'high', got 'terse'",
        ),
        (
            {"modalities": ["audio"]},
            "modalities",
            "modalities: must be [\"text\"]: this server writes text only, got ['audio']",
        ),
        (
            {"modalities": ["text", "audio"]},
            "modalities",
            "modalities: must be [\"text\"]: this server writes text only, got ['text', 'audio']",
        ),
        (
            {"audio": {"voice": "alloy", "format": "wav"}},
            "audio",
            "audio: must be null: this server writes text only, got {'voice': 'alloy', "
            "'format': 'wav'}",
        ),
        (
            {"web_search_options": {}},
            "web_search_options",
            "web_search_options: must be null: this server does not search the web, got {}",
        ),
        (
            {"moderation": {"model": "omni-moderation-latest"}},
            "moderation",
            "moderation: must be null: this server runs no moderation model, got {'model': "
            "'omni-moderation-latest'}",
        ),
        (
            {"prediction": {"type": "content"}},
            "prediction.content",
            "prediction.content: is required",
        ),
        (
            {"messages": [{"role": "assistant", "content": "Hi", "audio": {"id": "a1"}}]},
            "messages.0.audio",
            "messages.0.audio: must be null: this server writes text only, so no earlier audio "
            "answer exists, got {'id': 'a1'}",
        ),
        (
            {"functions": [WEATHER], "tools": [{"type": "function", "function": WEATHER}]},
            "functions",
            "functions: is not allowed together with tools: give tools and tool_choice, or the "
            "deprecated functions and function_call",
        ),
        (
            {"function_call": "auto", "tool_choice": "auto"},
            "function_call",
            "function_call: is not allowed together with tool_choice: give tools and "
            "tool_choice, or the deprecated functions and function_call",
        ),
        ({"function_call": "auto"}, "function_call", "function_call: needs functions"),
        (
            {"functions": [WEATHER], "function_call": {"name": "get_time"}},
            "function_call.name",
            "function_call.name: 'get_time' is not among the functions (get_weather)",
        ),
        (
            {"functions": [WEATHER, WEATHER]},
            "functions",
            "functions: function names must be unique",
        ),
        (
            {
                "functions": [WEATHER],
                "function_call": {"name": "get_weather"},
                "response_format": {"type": "json_object"},
            },
            "function_call",
            "function_call: is not allowed together with response_format",
        ),
    ],
)
def test_chat_fields_are_refused_in_words(body, param, message):
    assert refusal(**body) == (param, message)


def test_completions_refuse_a_suffix_in_words():
    assert refusal(CompletionRequest, prompt="def f(", suffix="return x") == (
        "suffix",
        "suffix: must be null: this server has no insertion (fill-in-the-middle) "
        "completions, got 'return x'",
    )
    assert parse_body(b'{"prompt": "x", "suffix": null}', CompletionRequest).suffix is None


def test_fields_that_change_no_token_are_taken():
    plain = chat()
    taken = chat(
        verbosity="low",
        prediction={"type": "content", "content": [{"type": "text", "text": "Sunny, 21 C"}]},
        modalities=["text"],
        service_tier="fast",
        prompt_cache_retention="24h",
        prompt_cache_options={"mode": "explicit", "ttl": "30m"},
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
        audio=None,
        web_search_options=None,
        moderation=None,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "What is the weather in Oslo?",
                        "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"},
                    }
                ],
            }
        ],
    )
    assert taken.sampling_for(4) == plain.sampling_for(4)
    assert taken.conversation() == plain.conversation()
    assert taken.template_kwargs() == {}
    assert chat(prediction={"type": "content", "content": "Sunny"}).prediction.content == "Sunny"


@pytest.mark.parametrize(
    ("legacy", "modern"),
    [
        ({}, {}),
        ({"function_call": "auto"}, {"tool_choice": "auto"}),
        ({"function_call": "none"}, {"tool_choice": "none"}),
        (
            {"function_call": {"name": "get_weather"}},
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        ),
    ],
)
def test_functions_are_read_as_tools(legacy, modern):
    old = chat(functions=[WEATHER], **legacy)
    new = chat(tools=[{"type": "function", "function": WEATHER}], parallel_tool_calls=False,
               **modern)  # fmt: skip
    assert old.legacy_calls and not new.legacy_calls
    assert (old.tools, old.tool_choice) == (new.tools, new.tool_choice)
    assert old.offered_tools() == new.offered_tools()
    old_structured, new_structured = old.structured(), new.structured()
    if new_structured is None:
        assert old_structured is None
    else:  # the same grammar (one call: legacy answers hold one), under the legacy name
        assert old_structured == (new_structured[0], "function_call")
    schemas = [(f.replace("tools.0.function", "functions.0"), p) for f, p in new.tool_schemas()]
    assert old.tool_schemas() == schemas == [("functions.0.parameters", schemas[0][1])]


def test_a_legacy_conversation_renders_as_the_tools_one():
    legacy = chat(
        messages=[
            *MESSAGES,
            {"role": "assistant", "content": None,
             "function_call": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"role": "function", "name": "get_weather", "content": '{"temp": 3}'},
            {"role": "assistant", "refusal": "I cannot say more."},
        ],
    )  # fmt: skip
    for takes_tools in (True, False):
        rendered = legacy.conversation(takes_tools)
        assert rendered[-1] == {"role": "assistant", "content": "I cannot say more."}
        if takes_tools:
            assert rendered[1]["tool_calls"] == [
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Oslo"}}}
            ]  # fmt: skip
            assert rendered[2] == {
                "role": "tool",
                "content": '{"temp": 3}',
                "tool_call_id": None,
                "name": "get_weather",
            }
        else:
            assert rendered[1]["content"] == (
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            )
            assert rendered[2] == {
                "role": "user",
                "content": '<tool_response>\n{"temp": 3}\n</tool_response>',
            }


def test_a_legacy_answer_keeps_its_first_call_and_the_rest_as_text():
    first = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    second = '<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>'
    rest, calls = parse(f"{first}\n{second}", "hermes", {"f"}, most=1)
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
    assert rest == second
    assert len(parse(f"{first}\n{second}", "hermes", {"f"})[1]) == 2


def test_unknown_fields_are_refused_or_dropped_and_logged(caplog):
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache": 1}]}],
        "tools": [{"type": "function", "function": {**WEATHER, "examples": []}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}, "why": "x"},
        "chat_template_kwargs": {"free": "variables are not fields"},
        "top_k_sampling": 3,
    }
    assert refusal(**body) == (
        "messages.0.content.0.cache",
        "messages.0.content.0.cache: Unrecognized request argument supplied: "
        "messages.0.content.0.cache",
    )
    with caplog.at_level(logging.WARNING, logger="tessera.cluster.openai_parsing"):
        taken = chat(ignore_unknown=True, **body)
    (record,) = caplog.records
    assert record.getMessage() == (
        "ChatCompletionRequest: ignored fields this server does not know "
        "(ignore_unknown_fields): messages.0.content.0.cache, tools.0.function.examples, "
        "tool_choice.why, top_k_sampling"
    )
    del body["top_k_sampling"], body["tool_choice"]["why"], body["tools"][0]["function"]["examples"]
    body["messages"][0]["content"][0].pop("cache")
    assert taken == chat(**body)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tessera.cluster.openai_parsing"):
        assert chat(ignore_unknown=True).messages == chat().messages  # nothing to say
        wrong = {"prompt": "x", "n": "2", "bogus": 1}
        with pytest.raises(APIError, match="n: Input should be a valid integer, got '2'"):
            parse_body(json.dumps(wrong).encode(), CompletionRequest, ignore_unknown=True)
    assert caplog.records == []  # refused for its own error: nothing was ignored


def test_ignore_unknown_fields_is_a_serve_setting():
    """Off by default; a config file's key, and a flag that overrides the file."""
    assert ServeConfig.create().ignore_unknown_fields is False
    flag = build_parser().parse_args(["serve", "--ignore-unknown-fields"])
    assert config_from_args(flag, ServeConfig).ignore_unknown_fields is True
    file = {"ignore_unknown_fields": True}
    given = config_from_args(build_parser().parse_args(["serve"]), ServeConfig, file)
    assert given.ignore_unknown_fields is True
    off = build_parser().parse_args(["serve", "--no-ignore-unknown-fields"])
    assert config_from_args(off, ServeConfig, file).ignore_unknown_fields is False


def test_an_object_of_another_type_is_refused_for_its_type_not_its_fields():
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    custom = {"type": "custom", "custom": {"name": "shell"}}
    for ignore_unknown in (False, True):
        with pytest.raises(APIError) as caught:
            chat(ignore_unknown, messages=[{"role": "user", "content": [image]}])
        assert caught.value.message.startswith(
            "messages.0.content: must be a string or a list of text parts"
        )
        with pytest.raises(APIError) as caught:
            chat(ignore_unknown, tools=[custom])
        assert caught.value.message == "tools.0.type: Input should be 'function', got 'custom'"


def test_a_null_reads_as_the_default_only_for_a_declared_field(caplog):
    body = json.dumps({"prompt": "x", "suffix": None, "best_of": None, "bogus": None}).encode()
    with pytest.raises(APIError, match="^bogus: Unrecognized request argument supplied: bogus$"):
        parse_body(body, CompletionRequest)
    with caplog.at_level(logging.WARNING, logger="tessera.cluster.openai_parsing"):
        assert parse_body(body, CompletionRequest, ignore_unknown=True).best_of is None
    assert [r.getMessage() for r in caplog.records] == [
        "CompletionRequest: ignored fields this server does not know (ignore_unknown_fields): bogus"
    ]

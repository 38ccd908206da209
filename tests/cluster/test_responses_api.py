"""OpenAI's Responses API (`POST /v1/responses`) on a real `tessera serve`, called with
the official `openai` client: its greedy answers equal the chat endpoint's for the same
conversation (whole and streamed, with instructions, tools and an earlier response), its
events parse as the SDK's types in OpenAI's order, stored responses are fetched and
deleted, and bad fields are named."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import ray
from ray.experimental import internal_kv

from tests.cluster.serve_process import Server, serve_process

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

API_KEY = "responses-key-2b8e"
MODEL = "smol-responses"
NAMESPACE = "responses-test"
QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
#: The same function as the chat endpoint takes it.
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
#: Event types of a streamed message answer, in order (deltas collapsed).
MESSAGE_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory) -> Server:
    settings = (
        f"served_model_name: {MODEL}\n"
        "workers: 1\n"
        "num_kv_blocks: 256\n"
        "device: cpu\n"
        "report_interval_s: 0.1\n"
    )
    root = tmp_path_factory.mktemp("responses")
    with serve_process(root, settings, API_KEY, NAMESPACE) as server:
        yield server


def _chat(server, messages, max_tokens=24, **fields):
    done = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **fields
    )
    return done.choices[0]


def _collapsed(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1] or "delta" not in t]


def test_create_equals_chat_whole_and_streamed_with_instructions(server):
    client = server.client()
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": QUESTION},
    ]
    expected = _chat(server, messages).message.content
    done = client.responses.create(
        model=MODEL,
        input=QUESTION,
        instructions="Answer briefly.",
        max_output_tokens=24,
        temperature=0,
    )
    assert done.id.startswith("resp_") and done.object == "response"
    assert done.status in ("completed", "incomplete")
    (item,) = done.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert done.output_text == expected
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    assert done.usage.output_tokens <= 24 and done.instructions == "Answer briefly."

    stream = client.responses.create(
        model=MODEL,
        input=[
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": QUESTION}],
            }
        ],
        instructions="Answer briefly.",
        max_output_tokens=24,
        temperature=0,
        stream=True,
    )
    events = list(stream)
    types = [e.type for e in events]
    final = events[-1].response
    assert _collapsed(types) == [*MESSAGE_EVENTS, f"response.{final.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == expected == final.output_text
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {
        (final.output[0].id, 0, 0)
    }
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_the_sdk_stream_helper_and_max_output_tokens_incomplete(server):
    client = server.client()
    expected = _chat(server, [{"role": "user", "content": QUESTION}], max_tokens=3)
    assert expected.finish_reason == "length"
    with client.responses.stream(
        model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0
    ) as stream:
        events = list(stream)
    # The SDK's get_final_response() wants response.completed, which an incomplete
    # response (OpenAI's too) does not end with.
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == expected.message.content and final.usage.output_tokens == 3
    done = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"


def test_tools_give_function_calls_as_chat_and_their_outputs_continue(server):
    client = server.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    chat = _chat(
        server,
        messages,
        max_tokens=40,
        tools=[CHAT_WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (expected,) = chat.message.tool_calls
    done = client.responses.create(
        model=MODEL,
        input=messages,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    (call,) = [item for item in done.output if item.type == "function_call"]
    assert (call.name, call.arguments) == (expected.function.name, expected.function.arguments)
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"

    with client.responses.stream(
        model=MODEL,
        input=messages,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.status == "completed" and events[-1].type == "response.completed"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == args_done.arguments
    (streamed,) = [i for i in final.output if i.type == "function_call"]
    assert streamed.arguments == args_done.arguments == call.arguments

    # The output goes back as input (the SDK's own items), with the call's result: the
    # same as chat's assistant and tool messages.
    history = [
        *messages,
        *done.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'},
    ]
    assistant_call = {"name": "get_weather", "arguments": call.arguments}
    chat_history = [
        *messages,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.call_id, "type": "function", "function": assistant_call}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'},
    ]
    answer = client.responses.create(
        model=MODEL, input=history, tools=[WEATHER], max_output_tokens=16, temperature=0
    )
    expected = _chat(server, chat_history, max_tokens=16, tools=[CHAT_WEATHER])
    assert answer.output_text == (expected.message.content or "")


def test_text_format_json_schema_is_chat_response_format(server):
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 12}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    expected = _chat(
        server,
        [{"role": "user", "content": QUESTION}],
        max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    done = server.client().responses.create(
        model=MODEL,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "c", "schema": schema, "strict": True}},
        max_output_tokens=30,
        temperature=0,
    )
    assert done.output_text == expected.message.content
    assert done.text.format.type == "json_schema"


def test_stored_responses_continue_and_are_fetched_and_deleted(server):
    client = server.client()
    first = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0
    )
    follow = "And of Italy?"
    second = client.responses.create(
        model=MODEL,
        input=follow,
        previous_response_id=first.id,
        max_output_tokens=12,
        temperature=0,
    )
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": follow},
    ]
    assert second.output_text == _chat(server, history, max_tokens=12).message.content
    assert second.previous_response_id == first.id

    fetched = client.responses.retrieve(second.id)
    assert fetched.model_dump() == second.model_dump()
    # In the GCS, where every front-end replica finds it.
    key = f"tessera/{NAMESPACE}/tessera-scheduler/responses/{second.id}"
    assert internal_kv._internal_kv_get(key) is not None
    client.responses.delete(second.id)
    assert internal_kv._internal_kv_get(key) is None
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as missing:
            call(second.id)
        assert missing.value.body["param"] == "response_id"
    unstored = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=2, store=False
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input=follow, previous_response_id="resp_nothing")
    assert missing.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": "x", "background": True}, "background"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input.0.message.content.0.type",
        ),
        ({"input": [{"type": "web_search_call"}]}, "input.0"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema"}}},
            "text.format.json_schema.name",
        ),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "max_output_tokens": 10**7}, "max_output_tokens"),
        ({}, "input"),
        ({"input": []}, "input"),
    ],
)
def test_bad_fields_are_named(server, fields, param):
    response = server.post("/v1/responses", {"model": MODEL, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    story = "Write a very long story about a dragon who learns to bake bread."
    body = {"input": story, "max_output_tokens": 4000, "stream": True, "temperature": 0}
    scheduler = ray.get_actor("tessera-scheduler", namespace=NAMESPACE)
    with httpx.stream(
        "POST", f"{server.url}/v1/responses", json=body, headers=server.headers, timeout=60
    ) as response:
        lines = response.iter_lines()
        deltas = 0
        while deltas < 3:
            deltas += "response.output_text.delta" in next(lines)
        deadline = time.monotonic() + 10  # the scheduler sees the worker's polled load
        while ray.get(scheduler.stats.remote()).workers[0].load.engine.running != 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    deadline = time.monotonic() + 15
    while True:  # 4000 tokens would take minutes: it ends at once only when aborted
        load = ray.get(scheduler.stats.remote()).workers[0].load
        if load.requests == 0 and load.engine.running == 0:
            break
        assert time.monotonic() < deadline, load
        time.sleep(0.1)
    assert load.engine.free_blocks == load.engine.total_blocks


def test_the_schema_lists_the_routes(server):
    paths = httpx.get(f"{server.url}/openapi.json", headers=server.headers).json()["paths"]
    assert "post" in paths["/v1/responses"]
    assert {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
    assert json.dumps(paths)  # serializable

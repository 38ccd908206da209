"""A reasoning model served by `tessera serve` (``reasoning_parser: qwen3``, a chat
template file), called with the official `openai` client: the scripted model
(``tests/scripted_model.py``) writes ``<think>abc</think>answer`` after any prompt, so
every expected string is exact. Its reasoning reaches ``reasoning_content`` and its
answer ``content``, whole and streamed; structured outputs and tool calls hold the answer
only; ``chat_template_kwargs`` and ``reasoning_effort`` reach the template; completions
are not split."""

from __future__ import annotations

import json

import pytest

from tests.cluster.serve_process import Server, serve_process
from tests.scripted_model import save_scripted_model, scripted_tokenizer

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

API_KEY = "reasoning-key-51c2"
MODEL = "thinker"
NAMESPACE = "serve-reasoning-test"
#: A chat template as Qwen3's works (``enable_thinking`` false closes the reasoning in the
#: prompt), with a mark that SmolLM2's own template does not write.
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant [thinker]\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory) -> Server:
    root = tmp_path_factory.mktemp("serve-reasoning")
    model = save_scripted_model(root / "thinker")
    (root / "template.jinja").write_text(TEMPLATE)
    settings = (
        f"model: {model}\n"
        f"served_model_name: {MODEL}\n"
        "reasoning_parser: qwen3\n"
        f"chat_template: {root / 'template.jinja'}\n"
        "num_kv_blocks: 64\n"
        "stream_interval: 1\n"  # a delta per token: each chunk is one token's text
        "device: cpu\n"
        "report_interval_s: 0.1\n"
    )
    with serve_process(root, settings, API_KEY, NAMESPACE) as server:
        yield server


def chat(server: Server, **fields):
    fields = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 0, **fields}
    return server.client().chat.completions.create(**fields)


def streamed(server: Server, **fields) -> tuple[list[dict], str | None]:
    """Each chunk's delta (its fields that are set, the role's chunk left out) and the
    finish reason."""
    deltas, finish = [], None
    for chunk in chat(server, stream=True, **fields):
        (choice,) = chunk.choices
        delta = choice.delta.model_dump(exclude_none=True)
        if delta.pop("role", None) is None:
            deltas.append(delta)
        finish = choice.finish_reason or finish
    return deltas, finish


def test_a_chat_answer_keeps_its_reasoning_apart(server):
    done = chat(server)
    (choice,) = done.choices
    assert choice.message.content == "answer"
    assert choice.message.reasoning_content == "abc"
    assert choice.finish_reason == "stop"
    assert done.usage.completion_tokens == 5  # <think> abc </think> answer, the end token


def test_streamed_deltas_carry_reasoning_and_content_apart(server):
    deltas, finish = streamed(server)
    # <think>: held, then consumed; abc; </think>: consumed; answer; the end token
    assert deltas == [{}, {"reasoning_content": "abc"}, {}, {"content": "answer"}, {}]
    assert finish == "stop"


def test_completions_are_not_split(server):
    done = server.client().completions.create(
        model=MODEL, prompt="What is 2 + 2?", max_tokens=16, temperature=0
    )
    assert done.choices[0].text == "<think>abc</think>answer"
    assert done.usage.completion_tokens == 5


def test_a_structured_output_holds_the_answer_only(server):
    tokenizer = scripted_tokenizer()
    (other,) = tokenizer("other", add_special_tokens=False).input_ids
    # 'other' (+30) loses to each scripted token (40), but wins once the grammar
    # refuses 'answer': the reasoning ran free, the answer is the regex's
    done = chat(
        server,
        logit_bias={str(other): 30},
        extra_body={"structured_outputs": {"regex": "other|another"}},
    )
    message = done.choices[0].message
    assert (message.reasoning_content, message.content) == ("abc", "other")


def test_forced_tool_calls_follow_the_reasoning(server):
    tool = {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
    done = chat(server, tools=[tool], tool_choice="required", parallel_tool_calls=False,
                max_tokens=64)  # fmt: skip
    (choice,) = done.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "abc"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {})


def test_with_tools_offered_the_reasoning_streams_and_the_answer_is_parsed_whole(server):
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    done = chat(server, tools=[tool])
    message = done.choices[0].message
    assert (message.reasoning_content, message.content, message.tool_calls) == (
        "abc",
        "answer",
        None,
    )
    deltas, finish = streamed(server, tools=[tool])
    assert deltas == [{"reasoning_content": "abc"}, {"content": "answer"}, {}]
    assert finish == "stop"


def tokenize_chat(server: Server, **fields) -> dict:
    answer = server.post("/tokenize", {"model": MODEL, "messages": MESSAGES, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_chat_template_file_and_its_kwargs_render_the_prompt(server):
    tokenizer = scripted_tokenizer()
    for kwargs in ({}, {"enable_thinking": False}):
        text = tokenizer.apply_chat_template(
            MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False,
            **kwargs,
        )  # fmt: skip
        expected = tokenizer(text, add_special_tokens=False).input_ids
        fields = {"chat_template_kwargs": kwargs} if kwargs else {}
        assert tokenize_chat(server, **fields)["tokens"] == expected
        done = chat(server, extra_body=fields)
        assert done.usage.prompt_tokens == len(expected)
        assert done.choices[0].message.content == "answer"  # the scripted model's
    closed = tokenize_chat(server, chat_template_kwargs={"enable_thinking": False})
    assert tokenizer.decode(closed["tokens"]).endswith("assistant [thinker]<think>\n\n</think>")


def test_reasoning_effort_sets_the_templates_thinking_switch(server):
    """none and minimal render the prompt as enable_thinking false does (the reasoning
    closed in the prompt, so the answer has none), the others as true;
    chat_template_kwargs that set the switch win."""
    thinking = tokenize_chat(server)["count"]
    closed = tokenize_chat(server, chat_template_kwargs={"enable_thinking": False})["count"]
    assert closed > thinking
    for effort, kwargs, expected in (
        ("none", {}, closed),
        ("minimal", {}, closed),
        ("low", {}, thinking),
        ("high", {}, thinking),
        ("none", {"enable_thinking": True}, thinking),
        ("high", {"enable_thinking": False}, closed),
    ):
        extra = {"chat_template_kwargs": kwargs} if kwargs else {}
        done = chat(server, reasoning_effort=effort, extra_body=extra)
        assert done.usage.prompt_tokens == expected, (effort, kwargs)
        message = done.choices[0].message
        reasoning = None if expected == closed else "abc"  # the script goes on after </think>
        assert (message.reasoning_content, message.content) == (reasoning, "answer")


def test_chat_template_kwargs_that_set_the_calls_own_arguments_are_refused(server):
    for path in ("/v1/chat/completions", "/tokenize"):
        refused = server.post(
            path, {"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"tools": []}}
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"] == {
            "message": "chat_template_kwargs: 'tools' is an argument of the chat template "
            "call itself, not a template variable; it cannot be set here",
            "type": "invalid_request_error",
            "param": "chat_template_kwargs",
            "code": "invalid_value",
        }
    assert chat(server).choices[0].message.content == "answer"  # and it serves on


def test_the_responses_api_gives_the_reasoning_its_own_item(server):
    client = server.client()
    fields = {"model": MODEL, "input": MESSAGES, "max_output_tokens": 16, "temperature": 0}
    done = client.responses.create(**fields)
    reasoning, message = done.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [part.text for part in reasoning.content] == ["abc"]
    assert message.type == "message" and done.output_text == "answer"
    events = list(client.responses.create(stream=True, **fields))
    types = [e.type for e in events]
    for kind in ("reasoning_text", "output_text"):
        assert "".join(e.delta for e in events if e.type == f"response.{kind}.delta") == (
            "abc" if kind == "reasoning_text" else "answer"
        )
    order = [t for i, t in enumerate(types) if "delta" not in t or types[i - 1] != t]
    item = ["response.output_item.added", "response.content_part.added"]
    close = ["response.content_part.done", "response.output_item.done"]
    assert order == [
        "response.created",
        "response.in_progress",
        *item,
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        *close,
        *item,
        "response.output_text.delta",
        "response.output_text.done",
        *close,
        "response.completed",
    ]
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "abc" and final.output_text == "answer"

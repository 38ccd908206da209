"""Reasoning parsers: a whole output and a streamed one split alike into reasoning and
content, with the tags split across deltas at every position; the answer grammar leaves
the reasoning free; ``chat_template_kwargs`` is checked before it reaches a template."""

from __future__ import annotations

import functools
import inspect
import itertools
import json

import pytest

from tessera.cluster.cluster_config import ConfigError
from tessera.cluster.openai_chat import TEMPLATE_CALL_ARGUMENTS, ChatCompletionRequest
from tessera.cluster.openai_errors import APIError
from tessera.cluster.openai_parsing import parse_body
from tessera.cluster.reasoning import (
    REASONING_FORMATS,
    ReasoningSplitter,
    answer_grammar,
    split_reasoning,
)
from tessera.cluster.serve_config import ServeConfig
from tessera.workers.api import StructuredParams
from tests.scripted_model import TAGS

R1, QWEN3 = REASONING_FORMATS["deepseek_r1"], REASONING_FORMATS["qwen3"]

#: (output, deepseek_r1's (reasoning, content), qwen3's (reasoning, content))
CASES = [
    ("<think>abc</think>answer", ("abc", "answer"), ("abc", "answer")),
    ("<think>\nabc\n</think>\n\nanswer", ("\nabc\n", "\n\nanswer"), ("\nabc\n", "\n\nanswer")),
    ("abc</think>answer", ("abc", "answer"), (None, "abc</think>answer")),
    ("answer", ("answer", None), (None, "answer")),
    ("<think>abc", ("abc", None), (None, "<think>abc")),
    ("<think>abc</think>", ("abc", None), ("abc", None)),
    ("</think>answer", (None, "answer"), (None, "</think>answer")),
    ("<think></think>answer", (None, "answer"), (None, "answer")),
    ("<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),
    ("x<think>abc</think>answer", ("x<think>abc", "answer"), (None, "x<think>abc</think>answer")),
    ("<thinking>answer", ("<thinking>answer", None), (None, "<thinking>answer")),
    ("<th", ("<th", None), (None, "<th")),
    ("<think>ab</thi", ("ab</thi", None), (None, "<think>ab</thi")),
    ("", (None, None), (None, None)),
]


@pytest.mark.parametrize(("text", "r1", "qwen3"), CASES)
def test_a_whole_output_splits_as_vllms_parsers_read_it(text, r1, qwen3):
    assert split_reasoning(R1, text) == r1
    assert split_reasoning(QWEN3, text) == qwen3


def stream(fmt, pieces: list[str]) -> list[tuple[str, str]]:
    """What a splitter sends for each piece, then at the end."""
    splitter = ReasoningSplitter(fmt)
    return [*(splitter.feed(piece) for piece in pieces), splitter.finish()]


def joined(sent: list[tuple[str, str]]) -> tuple[str | None, str | None]:
    reasoning = "".join(r for r, _ in sent)
    content = "".join(c for _, c in sent)
    return reasoning or None, content or None


def splits(text: str, parts: int):
    """``text`` cut into ``parts`` pieces at every choice of positions."""
    for cuts in itertools.combinations_with_replacement(range(len(text) + 1), parts - 1):
        bounds = (0, *cuts, len(text))
        yield [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("fmt", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
@pytest.mark.parametrize(("text", "r1", "qwen3"), CASES)
def test_a_stream_sends_what_the_whole_output_holds_at_every_split(fmt, text, r1, qwen3):
    expected = r1 if fmt is R1 else qwen3
    # qwen3 output that opened <think> and never closed it: streamed, that was reasoning
    if fmt is QWEN3 and text.startswith("<think>") and "</think>" not in text:
        expected = (text.removeprefix("<think>") or None, None)
    for parts in (1, 2, 3):
        for pieces in splits(text, parts):
            sent = stream(fmt, pieces)
            assert joined(sent) == expected, pieces
            for tag in ("<think>", "</think>"):  # a tag that is consumed never shows
                if tag not in (expected[0] or ""):
                    assert not any(tag in reasoning for reasoning, _ in sent), pieces


def test_a_tag_split_across_deltas_is_held_until_it_is_decided():
    assert stream(QWEN3, ["<thi", "nk>abc</th", "ink>answer"]) == [
        ("", ""),
        ("abc", ""),
        ("", "answer"),
        ("", ""),
    ]
    assert stream(QWEN3, ["<", "th", "is is content"]) == [
        ("", ""),
        ("", ""),
        ("", "<this is content"),
        ("", ""),
    ]
    assert stream(R1, ["abc<", "/", "think", ">", "answer"]) == [
        ("abc", ""),
        ("", ""),
        ("", ""),
        ("", ""),
        ("", "answer"),
        ("", ""),
    ]
    assert stream(R1, ["ab", "c</t"]) == [("ab", ""), ("c", ""), ("</t", "")]  # the end
    assert stream(R1, ["a </", "b"]) == [("a ", ""), ("</b", ""), ("", "")]  # not a tag


@functools.cache
def grammar_tokenizer(tags: tuple[str, ...]):
    """The built-in tokenizer with ``tags`` added as tokens, and llguidance's view of it."""
    import llguidance.hf

    from tests.scripted_model import scripted_tokenizer

    tokenizer = scripted_tokenizer(tags)
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))


def matches(tags: tuple[str, ...], lark: str, text: str) -> bool:
    """Whether ``text`` (tokenized as the model would write it) is a whole output the
    grammar accepts."""
    import llguidance

    tokenizer, wrapped = grammar_tokenizer(tags)
    matcher = llguidance.LLMatcher(wrapped, llguidance.LLMatcher.grammar_from_lark(lark))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return matcher.consume_tokens(ids) and matcher.is_accepting()


OUTPUTS = [
    '{"a": 1}',
    '<think>abc</think>\n\n{"a": 1}',
    'abc</think>{"a": 1}',
    "<think>abc</think>answer",
    '<think>a</think>b</think>{"a": 1}',
]


@pytest.mark.parametrize("tags", [(), TAGS], ids=["text", "tokens"])
def test_the_answer_grammar_holds_the_answer_and_leaves_the_reasoning_free(tags):
    special = frozenset(tags)  # the tags that are tokens of their own
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    accepted = {}
    for name, fmt in REASONING_FORMATS.items():
        grammar = answer_grammar(fmt, StructuredParams("json", schema), special)
        assert grammar.kind == "grammar"
        accepted[name] = [matches(tags, grammar.spec, text) for text in OUTPUTS]
    assert accepted == {
        "deepseek_r1": [False, True, True, False, False],
        "qwen3": [True, True, False, False, False],
    }


@pytest.mark.parametrize(
    ("params", "answer"),
    [
        (StructuredParams("regex", "a/b|answer"), "answer"),
        (StructuredParams("choice", json.dumps(["answer", "other"])), "other"),
        (StructuredParams("grammar", 'start: "ans" "wer"'), "answer"),
        (StructuredParams("grammar", 'root ::= "answer"'), "answer"),  # GBNF
    ],
    ids=["regex", "choice", "lark", "gbnf"],
)
def test_every_kind_of_structured_output_can_hold_the_answer(params, answer):
    grammar = answer_grammar(QWEN3, params, frozenset(TAGS))
    assert matches(TAGS, grammar.spec, f"<think>free text</think>{answer}")
    assert matches(TAGS, grammar.spec, answer)
    assert not matches(TAGS, grammar.spec, "<think>free text</think>wrong")


def chat_body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def test_chat_template_kwargs_are_the_templates_variables():
    body = parse_body(
        json.dumps(chat_body(chat_template_kwargs={"enable_thinking": False})).encode(),
        ChatCompletionRequest,
    )
    assert body.template_kwargs() == {"enable_thinking": False}
    assert (
        parse_body(json.dumps(chat_body()).encode(), ChatCompletionRequest).template_kwargs() == {}
    )


@pytest.mark.parametrize("given", ["yes", [1], 3])
def test_chat_template_kwargs_must_be_an_object(given):
    with pytest.raises(APIError) as refused:
        parse_body(
            json.dumps(chat_body(chat_template_kwargs=given)).encode(), ChatCompletionRequest
        )
    assert refused.value.status == 400
    assert refused.value.body()["error"]["param"] == "chat_template_kwargs"
    assert refused.value.body()["error"]["message"] == (
        "chat_template_kwargs: must be an object of the chat template's extra variables "
        f'with string keys, e.g. {{"enable_thinking": false}}, got {given!r}'
    )


@pytest.mark.parametrize("key", ["messages", "tools", "tokenize", "add_generation_prompt"])
def test_chat_template_kwargs_may_not_set_the_calls_own_arguments(key):
    raw = json.dumps(chat_body(chat_template_kwargs={"enable_thinking": True, key: 1})).encode()
    body = parse_body(raw, ChatCompletionRequest)
    with pytest.raises(APIError) as refused:
        body.template_kwargs()
    assert refused.value.status == 400
    assert refused.value.body()["error"]["message"] == (
        f"chat_template_kwargs: {key!r} is an argument of the chat template call itself, "
        "not a template variable; it cannot be set here"
    )


def test_the_refused_keys_cover_every_argument_of_apply_chat_template():
    from transformers import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    own = {name for name, p in parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD}
    assert own - {"self"} <= set(TEMPLATE_CALL_ARGUMENTS)
    assert "messages" in TEMPLATE_CALL_ARGUMENTS  # the template's name for the conversation


def test_the_reasoning_parser_setting_takes_the_declared_parsers():
    assert ServeConfig.create().reasoning_parser is None
    assert ServeConfig.create(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ConfigError) as refused:
        ServeConfig.create(reasoning_parser="granite")
    assert str(refused.value) == (
        "reasoning_parser: Input should be 'deepseek_r1' or 'qwen3', got 'granite'"
    )

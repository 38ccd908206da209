"""A reasoning model's chat output split into its reasoning and its answer
(``--reasoning-parser``).

Reasoning models (DeepSeek-R1, Qwen3) think before they answer, between ``<think>`` and
``</think>``. With a parser set, a chat choice's reasoning goes to
``message.reasoning_content`` and the rest to ``message.content``; streamed, each delta
carries ``delta.reasoning_content`` and ``delta.content`` (vLLM's names). Completions
are not split. The parsers read the output as vLLM's do:

- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output
  before the first ``</think>`` is reasoning (a ``<think>`` the output starts with is
  dropped); an output without ``</think>`` is all reasoning.
- ``qwen3``: reasoning only when the output starts with ``<think>`` and closes it with
  ``</think>``; any other output (``enable_thinking`` false, or no ``</think>``) is all
  content. Streamed, an output that opened ``<think>`` sends reasoning until
  ``</think>``: one cut off before it has sent its text as reasoning already.

A stream holds back text that may still become a tag (``<th`` at the start, ``</thi``
in the reasoning) until the next delta decides it, so no tag is ever shown in part.
Tool calls are parsed in the answer only, and a structured output (or forced tool calls)
constrains only the answer: ``answer_grammar`` lets the reasoning run free up to
``</think>``.

Nothing heavy is imported here: ``tessera --help`` lists the parsers from this module.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Literal

from tessera.workers.api import StructuredParams
from tessera.workers.decoding import structured


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How one family of models marks its reasoning."""

    start: str
    end: str
    #: The prompt opens the reasoning: the output before the first ``end`` is reasoning
    #: with or without ``start`` (deepseek_r1). Else there is reasoning only when the
    #: output starts with ``start`` and holds ``end`` (qwen3).
    opened_by_prompt: bool


#: The parsers ``--reasoning-parser`` takes, by name: the one declaration of them.
REASONING_FORMATS = {
    "deepseek_r1": ReasoningFormat("<think>", "</think>", opened_by_prompt=True),
    "qwen3": ReasoningFormat("<think>", "</think>", opened_by_prompt=False),
}
ReasoningParser = Literal[tuple(REASONING_FORMATS)]  # type: ignore[valid-type]


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content); each None where empty."""
    opened = text.startswith(fmt.start)
    body = text[len(fmt.start) :] if opened else text
    end = body.find(fmt.end)
    if not fmt.opened_by_prompt and not (opened and end >= 0):
        return None, text or None
    if end < 0:
        return body or None, None
    return body[:end] or None, body[end + len(fmt.end) :] or None


class _Part(enum.Enum):
    START = "start"  # the output may still begin with the start tag
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningSplitter:
    """One streamed output split as it arrives: ``feed`` each delta's text, ``finish``
    after the last; each returns the (reasoning, content) text to send now. What they
    send adds up to ``split_reasoning`` of the whole text (but for a qwen3 output cut
    off inside its reasoning: streamed, that was reasoning)."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.part = _Part.START
        self.held = ""  # text that may be the start of a tag: the next delta decides

    def feed(self, text: str) -> tuple[str, str]:
        fmt = self.fmt
        text, self.held = self.held + text, ""
        reasoning = ""
        if self.part is _Part.START:
            if text.startswith(fmt.start):
                text = text[len(fmt.start) :]
                self.part = _Part.REASONING
            elif fmt.start.startswith(text):  # "", "<", "<th": not decided yet
                self.held = text
                return "", ""
            else:
                self.part = _Part.REASONING if fmt.opened_by_prompt else _Part.CONTENT
        if self.part is _Part.REASONING:
            end = text.find(fmt.end)
            if end < 0:
                keep = _tag_prefix_at_end(text, fmt.end)
                self.held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(fmt.end) :]
            self.part = _Part.CONTENT
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """The text held back, now that no delta follows: reasoning or content as the
        output stood."""
        held, self.held = self.held, ""
        as_content = self.part is _Part.CONTENT or (
            self.part is _Part.START and not self.fmt.opened_by_prompt
        )
        return ("", held) if as_content else (held, "")


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (0 if none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def answer_grammar(
    fmt: ReasoningFormat, params: StructuredParams, special_tags: frozenset[str] = frozenset()
) -> StructuredParams:
    """A grammar that leaves the reasoning free and holds the answer to ``params``: the
    reasoning (any text up to the first end tag), whitespace, then ``params``' grammar;
    for qwen3 also the answer alone. ``special_tags``: the tags that are tokens of their
    own in the tokenizer (a grammar names those as tokens, not as text)."""

    def tag(text: str) -> str:
        return text if text in special_tags else json.dumps(text)

    if fmt.end in special_tags:  # a token: the text before it cannot hold it
        reasoning = f"reasoning: THINK? {tag(fmt.end)}\nTHINK: /(.|\\n)+/"
    else:  # text: the first end tag ends it (a lazy lexeme)
        reasoning = f"reasoning[lazy]: THINK {tag(fmt.end)}\nTHINK: /(.|\\n)*/"
    thought = f"{tag(fmt.start)}? reasoning WS? answer"
    if not fmt.opened_by_prompt:
        thought = f"answer | {tag(fmt.start)} reasoning WS? answer"
    lark = (
        "%llguidance {}\n"
        f"start: {thought}\n"
        f"{reasoning}\n"
        "WS: /[ \\t\\r\\n]+/\n"
        f"answer: {structured.embedded(params)}\n"
    )
    return StructuredParams("grammar", lark)

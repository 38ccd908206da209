"""Tool calls for ``/v1/chat/completions``: prompts, grammars and parsers.

- **Rendering.** A chat template that takes ``tools`` (it mentions them) gets them, and
  the conversation's assistant tool calls and tool results as its messages say. Other
  templates (SmolLM2's) get a system prompt of ours that lists the tools as JSON and
  asks for calls in Hermes' format, and the conversation rewritten into plain turns
  in that format.
- **Formats** (``ToolFormat``, chosen per model family from its template): Hermes /
  Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the
  default), or Llama 3's bare ``{"name": ..., "parameters": {...}}`` object.
- **Enforcement.** ``tool_choice`` ``required`` or a named function constrains decoding
  with a grammar (llguidance Lark with the parameters' JSON schemas embedded), so the
  output is always a call whose arguments validate; ``auto`` decodes freely and
  ``parse`` finds the calls; ``none`` leaves the tools out of the prompt's reach.
- **Parsing is linear.** A caller can steer the output (a structured output, a prompt),
  so ``parse`` scans it with ``str.find`` (each character looked at a bounded number of
  times) and ``json.loads`` on each block: no backtracking regex, whose cost an unclosed
  ``<tool_call>`` and a run of spaces made cubic.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

ToolFormat = Literal["hermes", "llama3"]

#: A Hermes call block's tags.
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def message(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (with ``index`` in a stream's delta)."""
        entry: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return entry if index is None else {"index": index, **entry}


def tool_format(chat_template: str | None) -> ToolFormat:
    """The call format a model family writes, read from its chat template."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"  # what our own tool prompt asks for


def template_takes_tools(chat_template: str | None) -> bool:
    return "tools" in (chat_template or "")


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The system prompt that offers ``tools`` (OpenAI ``function`` objects) to a
    model whose template does not take them."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You can call functions to help with the request. The functions, one JSON "
        f"object each:\n<tools>\n{listed}\n</tools>\n"
        "To call a function, answer with a JSON object holding its name and its "
        "arguments inside <tool_call></tool_call> tags, one block per call:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>'
    )


def call_text(name: str, arguments: Any) -> str:
    """An earlier assistant call, written as the Hermes format asks for it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def call_grammar(
    tools: list[dict[str, Any]], name: str | None, parallel: bool, fmt: ToolFormat
) -> str:
    """A Lark grammar (llguidance's, with ``%json``) whose outputs are calls to
    ``name`` (or to any of ``tools``), one or (``parallel``) more."""
    chosen = [t for t in tools if name is None or t["name"] == name]
    key = "arguments" if fmt == "hermes" else "parameters"
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                key: t.get("parameters") or {"type": "object"},
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if fmt == "llama3":
        return f"start: obj\nobj: %json {json.dumps(schema)}"
    repeat = "+" if parallel else ""
    return (
        f"start: call{repeat}\n"
        'call: "<tool_call>\\n" obj "\\n</tool_call>" "\\n"?\n'
        f"obj: %json {json.dumps(schema)}"
    )


def parse(
    text: str, fmt: ToolFormat, names: set[str], most: int | None = None
) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls, or None; the calls found) in a model's output.
    A block that is not a call to one of ``names`` stays text, and so do the blocks
    after the first ``most`` calls."""
    calls: list[ToolCall] = []
    if fmt == "llama3":
        stripped = text.strip().removeprefix("<|python_tag|>").strip()
        call = _call(stripped, names, "parameters")
        return (None, [call]) if call is not None else (text, [])
    kept, last = [], 0
    for start, end, block in _hermes_blocks(text):
        if len(calls) == most:
            break
        call = _call(block, names, "arguments")
        if call is None:
            continue
        kept.append(text[last:start])
        last = end
        calls.append(call)
    kept.append(text[last:])
    rest = "".join(kept).strip()
    return (rest or None) if calls else text, calls


def _hermes_blocks(text: str) -> Iterator[tuple[int, int, str]]:
    """(start, end, inner text stripped) of each ``<tool_call>...</tool_call>`` block,
    left to right: a block ends at the first close tag after its open tag, and the next
    is looked for after it. An open tag with no close tag after it ends the scan (no
    later one has one either). Linear in ``len(text)``: each ``find`` starts where the
    last one stopped."""
    pos = 0
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        inner = start + len(CALL_OPEN)
        close = text.find(CALL_CLOSE, inner)
        if close < 0:
            return
        pos = close + len(CALL_CLOSE)
        yield start, pos, text[inner:close].strip()


def _call(text: str, names: set[str], key: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if value["name"] not in names:
        return None
    arguments = value.get(key, value.get("arguments", value.get("parameters", {})))
    if not isinstance(arguments, dict):
        return None
    try:
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
    except RecursionError:  # arguments nested as deep as the parser allows
        return None

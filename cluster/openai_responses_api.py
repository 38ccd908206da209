"""OpenAI's Responses API bodies (``POST /v1/responses``) and their mapping onto the chat
endpoint's: a Responses request becomes a ``ChatCompletionRequest`` (its validation,
placement, chat template and streaming are the chat path's), its answer an OpenAI
response object (``tessera.cluster.responses_answers``).

What maps: ``input`` (a string, or message items with text parts, ``function_call`` and
``function_call_output`` items) after ``instructions`` (a system message) and the
conversation of ``previous_response_id``; ``max_output_tokens``, ``temperature``,
``top_p``, ``user``, ``metadata``; function ``tools`` (flat, unlike chat's) and
``tool_choice``; ``text.format`` (``json_object``, ``json_schema``) as chat's
``response_format``. Any other field is refused (400 naming it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from tessera.cluster.openai_chat import MAX_TOOLS, ChatCompletionRequest
from tessera.cluster.openai_errors import invalid
from tessera.cluster.openai_parsing import validate_body
from tessera.cluster.openai_requests import Body


class TextPart(Body):
    """A message's text: ``input_text``, or ``output_text`` of an earlier answer passed
    back as input (its annotations and logprobs are ignored)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: list[TextPart] | str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(Body):
    """A call the model made earlier (an output item passed back as input)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Body):
    """A call's result, which the client ran."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningPart(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Body):
    """Earlier reasoning passed back as input: accepted and not shown to the model
    (chat templates drop earlier turns' reasoning too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(Body):
    """A function the model may call (flat, unlike chat's ``{"function": {...}}``)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Body):
    type: Literal["function"]
    name: str


class JsonSchemaText(Body):
    """``text.format`` json_schema (``schema`` is aliased: pydantic reserves it)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["json_schema"]
    name: str
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class PlainFormat(Body):
    type: Literal["text", "json_object"]


def _format_type(value: Any) -> str:
    return "json_schema" if isinstance(value, dict) and value.get("type") == "json_schema" else "-"


class TextConfig(Body):
    format: (
        Annotated[
            Annotated[JsonSchemaText, Tag("json_schema")] | Annotated[PlainFormat, Tag("-")],
            Discriminator(_format_type),
        ]
        | None
    ) = None


class ResponsesRequest(Body):
    """``POST /v1/responses``."""

    model: str | None = None
    input: list[InputItem] | str
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    # OpenAI's bookkeeping, which changes no token: taken and not used
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["disabled"] | None = None

    def input_items(self) -> list[dict[str, Any]]:
        """This request's input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(exclude_none=True, by_alias=True) for item in self.input]

    def chat_request(self, earlier: list[dict[str, Any]]) -> ResponsesChatRequest:
        """The chat request that generates this response; ``earlier``: the items of the
        conversation ``previous_response_id`` continues."""
        messages = chat_messages([*earlier, *self.input_items()])
        if not messages:
            raise invalid("input", "holds no message or call: the model would have nothing to read")
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        data: dict[str, Any] = {"messages": messages, "parallel_tool_calls": True}
        for name in ("model", "temperature", "top_p", "user", "metadata"):
            if (value := getattr(self, name)) is not None:
                data[name] = value
        if self.max_output_tokens is not None:
            data["max_tokens"] = self.max_output_tokens
        if self.tools:
            data["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            data["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            data["tool_choice"] = choice
        data["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, JsonSchemaText):
            schema = fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
            data["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif isinstance(fmt, PlainFormat):
            data["response_format"] = {"type": fmt.type}
        return validate_body(data, ResponsesChatRequest)


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a Responses request becomes; its errors name the Responses
    API's fields."""

    def wire_name(self, field: str) -> str:
        name = super().wire_name(field)
        return _WIRE_NAMES.get(name, name)


#: The chat request's fields under their Responses API names.
_WIRE_NAMES = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a function call joins the assistant message before
    it (the calls of one turn are one message), its output is a tool message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            if not isinstance(content, str):
                content = "".join(part["text"] for part in content)
            messages.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
    return messages

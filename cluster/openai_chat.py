"""The chat endpoint's bodies: messages, tools, and the conversation a chat template
renders (``POST /v1/chat/completions``, and ``POST /tokenize`` with messages).

Tools offered with ``tool_choice`` ``required`` or a named function make decoding follow
the calls' grammar (``tessera.cluster.tools``); earlier calls and their results reach
the template as it takes them. OpenAI's deprecated ``functions`` and ``function_call``
are read as ``tools`` and ``tool_choice`` (one call at most, answered as
``message.function_call``), its ``function`` messages as tool results.

Every field OpenAI documents for the endpoint's body is here: implemented, taken with a
meaning that changes no token here (``verbosity``, ``prediction``, the bookkeeping), or
(outputs this server does not have: audio, web search, moderation) accepted only absent
or null, which ``openai_parsing`` words. Tools are functions: OpenAI's ``custom`` tools
and its ``allowed_tools`` choice are refused by their ``type``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from tessera.cluster import tools as tool_calls
from tessera.cluster.openai_errors import invalid
from tessera.cluster.openai_requests import Body, SamplingBody
from tessera.workers.api import MAX_TOP_LOGPROBS, SamplingParams, StructuredParams

#: The most functions one request may offer (OpenAI's limit): each one's schema is
#: compiled on the replica's thread pool.
MAX_TOOLS = 128


class CacheBreakpoint(Body):
    """OpenAI's explicit prompt-cache boundary; the prefix cache here needs none."""

    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: CacheBreakpoint | None = None


class RefusalPart(Body):
    """An assistant's earlier refusal, as OpenAI answers one."""

    type: Literal["refusal"]
    refusal: str


class FunctionCall(Body):
    name: str
    arguments: str  # JSON text


class AssistantToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    #: ``function``: a deprecated function's result (``name`` names it), read as a tool's.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    function_call: FunctionCall | None = None  # an assistant's deprecated earlier call
    tool_call_id: str | None = None  # a tool's result: the call it answers
    refusal: str | None = None  # an assistant's earlier refusal: its text when no content
    audio: None = None  # an earlier spoken answer: none exists here

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(
                part.text if isinstance(part, TextPart) else part.refusal for part in self.content
            )
        return self.content or self.refusal or ""

    def calls(self) -> list[FunctionCall]:
        """An assistant's earlier calls: ``tool_calls``, or the deprecated ``function_call``."""
        if self.tool_calls:
            return [call.function for call in self.tool_calls]
        return [self.function_call] if self.function_call is not None else []


class FunctionDef(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Body):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: ToolChoiceFunction


#: The roles a chat template takes for OpenAI's others.
_TEMPLATE_ROLES = {"developer": "system", "function": "tool"}
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
#: ``reasoning_effort`` values that turn a chat template's thinking off.
NO_THINKING = ("none", "minimal")


class Prediction(Body):
    """OpenAI's predicted output: text the answer is expected to repeat, which makes
    OpenAI's answers faster and never different."""

    type: Literal["content"]
    content: str | list[TextPart]


class PromptCacheOptions(Body):
    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m"] = "30m"


#: The chat template call's own arguments (``apply_chat_template``'s, and the template's
#: ``messages``): ``chat_template_kwargs`` may not set them.
TEMPLATE_CALL_ARGUMENTS = (
    "conversation", "messages", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
)  # fmt: skip


class Conversation(Body):
    """A conversation as a chat template renders it."""

    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    #: Extra variables of the chat template (vLLM's extra), e.g. Qwen3's
    #: ``{"enable_thinking": false}``.
    chat_template_kwargs: dict[str, Any] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """``chat_template_kwargs``, refusing a key that is the call's own argument."""
        given = self.chat_template_kwargs or {}
        for key in given:
            if key in TEMPLATE_CALL_ARGUMENTS:
                raise invalid(
                    "chat_template_kwargs",
                    f"{key!r} is an argument of the chat template call itself, not a "
                    "template variable; it cannot be set here",
                )
        return dict(given)

    def conversation(self, template_takes_tools: bool = True) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (developer is system). Earlier
        tool calls and results go to a template that takes tools as its messages
        (arguments parsed); to others as plain turns in the Hermes format."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            role = _TEMPLATE_ROLES.get(m.role, m.role)
            message: dict[str, Any] = {"role": role, "content": m.text()}
            if m.calls():
                calls = [(c.name, _arguments(c.arguments)) for c in m.calls()]
                if template_takes_tools:
                    message["tool_calls"] = [
                        {"type": "function", "function": {"name": n, "arguments": a}}
                        for n, a in calls
                    ]
                else:
                    message["content"] = "\n".join(
                        filter(None, [m.text(), *(tool_calls.call_text(n, a) for n, a in calls)])
                    )
            if role == "tool":
                if template_takes_tools:
                    message["tool_call_id"] = m.tool_call_id
                    if m.role == "function":
                        message["name"] = m.name
                else:
                    message = {
                        "role": "user",
                        "content": f"<tool_response>\n{m.text()}\n</tool_response>",
                    }
            out.append(message)
        return out


class ChatCompletionRequest(SamplingBody, Conversation):
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's deprecated function calling: read as tools and tool_choice
    functions: list[FunctionDef] | None = Field(None, max_length=MAX_TOOLS)
    function_call: Literal["none", "auto"] | ToolChoiceFunction | None = None
    #: The chat template's thinking switch (``template_kwargs``).
    reasoning_effort: ReasoningEffort | None = None
    # What changes no token here: taken and not used (like ``user``). The model's own
    # length (max_tokens bounds it); a prediction (which changes no token at OpenAI
    # either); OpenAI's bookkeeping and cache lifetimes (the prefix cache keeps blocks
    # while the pool has room).
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: Prediction | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = None
    store: Literal[False] = False
    # Outputs this server does not have: text only, no web search, no moderation model
    modalities: list[Literal["text"]] | None = None
    audio: None = None
    web_search_options: None = None
    moderation: None = None
    #: The model family's call format (``tools.tool_format``); the server sets it.
    _tool_format: str = PrivateAttr("hermes")

    @model_validator(mode="after")
    def _read_functions(self) -> ChatCompletionRequest:
        """The deprecated ``functions`` and ``function_call`` as ``tools`` and
        ``tool_choice``, checked under their own names."""
        if self.functions is None and self.function_call is None:
            return self
        given = "functions" if self.functions is not None else "function_call"
        for modern in ("tools", "tool_choice"):
            if getattr(self, modern) is not None:
                raise invalid(
                    given,
                    f"is not allowed together with {modern}: give tools and tool_choice, or "
                    "the deprecated functions and function_call",
                )
        names = [f.name for f in self.functions or ()]
        choice = self.function_call
        if choice not in (None, "none") and not names:
            raise invalid("function_call", "needs functions")
        if len(set(names)) != len(names):
            raise invalid("functions", "function names must be unique")
        if isinstance(choice, ToolChoiceFunction):
            if choice.name not in names:
                raise invalid(
                    "function_call.name",
                    f"{choice.name!r} is not among the functions ({', '.join(names)})",
                )
            choice = NamedToolChoice(type="function", function=choice)
        self.tool_choice = choice
        if self.functions is not None:
            self.tools = [ToolDef(type="function", function=f) for f in self.functions]
        return self

    @property
    def legacy_calls(self) -> bool:
        """Functions offered the deprecated way: their call is answered as
        ``message.function_call``, one at most."""
        return self.functions is not None

    def template_kwargs(self) -> dict[str, Any]:
        """``chat_template_kwargs``, and ``reasoning_effort`` as the template variables
        ``enable_thinking`` (false for none and minimal: Qwen3's switch) and
        ``reasoning_effort`` (gpt-oss's), where the request's kwargs do not set them; a
        template that reads neither renders as without."""
        kwargs = super().template_kwargs()
        if self.reasoning_effort is not None:
            kwargs.setdefault("enable_thinking", self.reasoning_effort not in NO_THINKING)
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs

    def offered_tools(self) -> list[dict[str, Any]]:
        """The functions the model may call (none with ``tool_choice`` none)."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise invalid("tool_choice", "needs tools")
            return []
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise invalid("tools", "function names must be unique")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid(
                "tool_choice.function.name",
                f"{choice.function.name!r} is not among the tools ({', '.join(names)})",
            )
        if choice == "none":
            return []
        return [t.function.model_dump(exclude_none=True) for t in self.tools]

    def tool_schemas(self) -> list[tuple[str, StructuredParams]]:
        """(field, JSON schema) of each function's ``parameters``, for the front end to
        check (bounded in size, compiled off the event loop) before anything uses them."""
        path = "functions.{}.parameters" if self.legacy_calls else "tools.{}.function.parameters"
        return [
            (path.format(i), StructuredParams("json", json.dumps(parameters)))
            for i, tool in enumerate(self.tools or ())
            if (parameters := tool.function.parameters) is not None
        ]

    @property
    def calls_forced(self) -> bool:
        """``required`` or a named function: decoding follows the calls' grammar."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def structured(self) -> tuple[dict[str, str], str] | None:
        given = super().structured()
        if not (self.offered_tools() and self.calls_forced):
            return given
        field = "function_call" if self.legacy_calls else "tool_choice"
        if given is not None:
            raise invalid(field, f"is not allowed together with {given[1]}")
        choice = self.tool_choice
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        parallel = self.parallel_tool_calls and not self.legacy_calls
        grammar = tool_calls.call_grammar(self.offered_tools(), name, parallel, self._tool_format)
        return {"kind": "grammar", "spec": grammar}, field

    def sampling_for(self, max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise invalid("top_logprobs", "requires logprobs to be true")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise invalid(
                    "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
                )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling(max_tokens, logprobs)

    def wire_name(self, field: str) -> str:
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().wire_name(field)

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeChatRequest(Conversation):
    """``POST /tokenize`` with messages: the chat template's prompt (vLLM's shape)."""

    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


def _arguments(text: str) -> Any:
    """An earlier call's arguments for a chat template: parsed when they are JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text

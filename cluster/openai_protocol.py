"""The OpenAI wire format: request bodies in, response objects and errors out.

Pure functions and pydantic models, no Ray and no HTTP, so each mapping is unit
tested alone. Request models are strict and forbid unknown fields (as OpenAI's API
answers "Unrecognized request argument supplied"; with ``ignore_unknown_fields`` they are
dropped and logged instead); every error becomes an ``APIError`` that the HTTP app
renders as ``{"error": {"message", "type", "param", "code"}}``.

Tessera's extras ride in the same body, as vLLM's do: ``best_of``, ``beam_width`` /
``use_beam_search``, ``length_penalty``, ``early_stopping``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``priority``,
``cache_salt``, ``speculative`` (``{"method", "num_tokens", "adaptive"}``) and
``parallel_tokens`` (``{"threshold", "max_width", "mode"}``). A choice of a request that
speculated carries ``speculative`` (its counters); one of a ``parallel_tokens`` request
carries ``parallel_tokens``, its sets in order. The body's sampling fields carry the
engine's names and map to ``SamplingParams`` by ``tessera.workers.decoding.sampling_fields``.

This module is the wire format's public face; each part lives in its own module:
``openai_errors`` (``APIError`` and the mapping of every failure to one),
``openai_requests`` (the bodies both endpoints share, and completions'), ``openai_chat``
(messages, tools, the conversation), ``openai_parsing`` (JSON in, a body or a 400 out),
``openai_responses`` (choices, envelopes and their fields) and ``openai_logprobs``.
"""

from tessera.cluster.openai_chat import (
    AssistantToolCall,
    ChatCompletionRequest,
    FunctionCall,
    FunctionDef,
    Message,
    NamedToolChoice,
    TextPart,
    TokenizeChatRequest,
    ToolChoiceFunction,
    ToolDef,
)
from tessera.cluster.openai_errors import (
    RETRY_AFTER_S,
    APIError,
    api_error,
    internal_error,
    invalid,
)
from tessera.cluster.openai_logprobs import LogprobFormatter
from tessera.cluster.openai_parsing import parse_body, validate_body
from tessera.cluster.openai_requests import (
    HTTP_NAMES,
    MAX_PROMPTS,
    CompletionRequest,
    DetokenizeRequest,
    JsonSchemaFormat,
    ParallelTokensBody,
    ResponseFormat,
    SpeculativeBody,
    StreamOptions,
    StructuredOutputsBody,
    TokenizeCompletionRequest,
    max_prompt_chars,
)
from tessera.cluster.openai_responses import finish_reason, parallel_sets, speculative_stats, usage

__all__ = [
    "HTTP_NAMES",
    "MAX_PROMPTS",
    "RETRY_AFTER_S",
    "APIError",
    "AssistantToolCall",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "FunctionCall",
    "FunctionDef",
    "JsonSchemaFormat",
    "LogprobFormatter",
    "Message",
    "NamedToolChoice",
    "ParallelTokensBody",
    "ResponseFormat",
    "SpeculativeBody",
    "StreamOptions",
    "StructuredOutputsBody",
    "TextPart",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "ToolChoiceFunction",
    "ToolDef",
    "api_error",
    "finish_reason",
    "internal_error",
    "invalid",
    "max_prompt_chars",
    "parallel_sets",
    "parse_body",
    "speculative_stats",
    "usage",
    "validate_body",
]

"""Request bodies from the wire: JSON in, a validated body model out, or an
``APIError`` 400 that names the field in OpenAI's words."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from tessera.cluster.openai_errors import APIError, invalid
from tessera.cluster.openai_requests import Body


def _check_unicode(value: Any, path: list[str]) -> None:
    """Refuse a string holding a lone UTF-16 surrogate (JSON's ``"\\ud800"``): it is
    not Unicode text, and neither the tokenizer nor a UTF-8 response can carry it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise invalid(
                ".".join(path) or None,
                f"has a lone surrogate (U+{ord(value[error.start]):04X}) at character "
                f"{error.start}: not valid Unicode text",
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, path)
            _check_unicode(item, [*path, str(key)])
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_unicode(item, [*path, str(index)])


def parse_body(raw: bytes, model: type[Body]) -> Any:
    """The request body as ``model``; ``APIError`` 400 naming the field otherwise."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise invalid(None, f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise invalid(None, "the body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise invalid(None, f"the body must be a JSON object, got {type(data).__name__}")
    _check_unicode(data, [])
    data = {key: value for key, value in data.items() if value is not None}  # null: default
    return validate_body(data, model)


def validate_body(data: dict[str, Any], model: type[Body]) -> Any:
    """``data`` as ``model`` (a body the gRPC door builds, too); ``APIError`` 400
    naming the field otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise _refusal(error.errors()[0], data) from None


def _refusal(first: Any, data: dict[str, Any]) -> APIError:
    """The 400 for pydantic's first error about ``data``."""
    loc = [str(part) for part in first["loc"]]
    # A union's branch name (e.g. 'str', 'list[int]') is not part of the path.
    param = ".".join(part for part in loc if not _is_type_name(part)) or None
    if first["type"] == "extra_forbidden":
        return invalid(param, f"Unrecognized request argument supplied: {param}")
    if first["type"] == "missing":
        return invalid(param, "is required")
    message, given = first["msg"], first.get("input")
    for pattern, must in _MUST:
        found = pattern.match(param or "")
        if found:  # an error inside the field (an item of it) is the field's
            param, message = found.group(0), must
            given = _value_at(data, param.split("."))
            break
    return invalid(param, f"{message}, got {_short(given)}")


#: What these fields must be, where pydantic's words would not say it: the field's path
#: (a regex, matched at the start of the error's path) and what it must be.
_MUST = [
    (re.compile(rf"{path}(?=\.|$)"), must)
    for path, must in (
        (
            r"prompt",
            "must be a string, a list of strings, a list of token ids or a list of lists of "
            "token ids",
        ),
        (
            r"chat_template_kwargs",
            "must be an object of the chat template's extra variables with string keys, "
            'e.g. {"enable_thinking": false}',
        ),
        (r"store", "must be false: this server keeps no completions to fetch later"),
        (
            r"messages\.\d+\.content",
            "must be a string or a list of text parts ({'type': 'text', 'text': ...}): "
            "the model reads text only",
        ),
        (r"modalities", 'must be ["text"]: this server writes text only'),
        (r"audio", "must be null: this server writes text only"),
        (
            r"messages\.\d+\.audio",
            "must be null: this server writes text only, so no earlier audio answer exists",
        ),
        (r"web_search_options", "must be null: this server does not search the web"),
        (r"moderation", "must be null: this server runs no moderation model"),
        (r"suffix", "must be null: this server has no insertion (fill-in-the-middle) completions"),
    )
]


def _value_at(data: Any, path: list[str]) -> Any:
    """The value at ``path`` (keys, and list indices as text) in ``data``."""
    for part in path:
        data = data[int(part)] if isinstance(data, list) else data.get(part)
    return data


def _is_type_name(part: str) -> bool:
    return (
        part in {"str", "int", "bool", "float", "none"} or "[" in part or part.startswith("literal")
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

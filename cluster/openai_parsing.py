"""Request bodies from the wire: JSON in, a validated body model out, or an
``APIError`` 400 that names the field in OpenAI's words."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from tessera.cluster.openai_errors import invalid
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
    # null: a declared field's default (an undeclared one stays, and is refused)
    fields = model.model_fields
    data = {key: value for key, value in data.items() if value is not None or key not in fields}
    return validate_body(data, model)


def validate_body(data: dict[str, Any], model: type[Body]) -> Any:
    """``data`` as ``model`` (a body the gRPC door builds, too); ``APIError`` 400
    naming the field otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        loc = [str(part) for part in first["loc"]]
        # A union's branch name (e.g. 'str', 'list[int]') is not part of the path.
        param = ".".join(part for part in loc if not _is_type_name(part)) or None
        if first["type"] == "extra_forbidden":
            raise invalid(param, f"Unrecognized request argument supplied: {param}") from None
        if first["type"] == "missing":
            raise invalid(param, "is required") from None
        message = first["msg"]
        if param == "prompt":
            message = (
                "must be a string, a list of strings, a list of token ids or a list of "
                "lists of token ids"
            )
        elif param == "chat_template_kwargs":
            message = (
                "must be an object of the chat template's extra variables with string keys, "
                'e.g. {"enable_thinking": false}'
            )
        elif param == "store":
            message = "must be false: this server keeps no completions to fetch later"
        elif param is not None and _MESSAGE_CONTENT.fullmatch(param):
            message = (
                "must be a string or a list of text parts ({'type': 'text', 'text': ...}): "
                "the model reads text only"
            )
        raise invalid(param, f"{message}, got {_short(first.get('input'))}") from None


#: A chat message's ``content``, whose errors pydantic words as a bad string's.
_MESSAGE_CONTENT = re.compile(r"messages\.\d+\.content")


def _is_type_name(part: str) -> bool:
    return (
        part in {"str", "int", "bool", "float", "none"} or "[" in part or part.startswith("literal")
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

"""Request bodies from the wire: JSON in, a validated body model out, or an
``APIError`` 400 that names the field in OpenAI's words.

A field the body does not declare is refused, as OpenAI refuses it ("Unrecognized
request argument supplied"), unless the server sets ``ignore_unknown_fields``: then the
request goes on without them and the log has one warning naming them (vLLM's way).
"""

from __future__ import annotations

import json
import logging
import re
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from tessera.cluster.openai_errors import APIError, invalid
from tessera.cluster.openai_requests import Body

logger = logging.getLogger(__name__)


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


def parse_body(raw: bytes, model: type[Body], ignore_unknown: bool = False) -> Any:
    """The request body as ``model``; ``APIError`` 400 naming the field otherwise.
    ``ignore_unknown``: fields ``model`` does not declare are dropped and logged."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise invalid(None, f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise invalid(None, "the body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise invalid(None, f"the body must be a JSON object, got {type(data).__name__}")
    _check_unicode(data, [])
    # a declared field's null reads as its default; an unknown one's is still unknown
    declared = {info.alias or name for name, info in model.model_fields.items()}
    data = {key: value for key, value in data.items() if value is not None or key not in declared}
    return validate_body(data, model, ignore_unknown)


def validate_body(data: dict[str, Any], model: type[Body], ignore_unknown: bool = False) -> Any:
    """``data`` as ``model`` (a body the gRPC door builds, too); ``APIError`` 400
    naming the field otherwise. ``ignore_unknown``: fields ``model`` does not declare
    are dropped (from ``data``) and logged."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        errors = error.errors()
    # pydantic also calls a field extra in the members of a union that do not declare it
    unknown: list[str] = []
    if any(e["type"] == "extra_forbidden" for e in errors):
        _unknown_fields(data, [model], (), unknown, drop=ignore_unknown)
    if unknown and not ignore_unknown:
        raise invalid(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}")
    if unknown:
        try:
            body = model.model_validate(data)
        except ValidationError as error:
            errors = error.errors()  # refused for another reason: that one is named
        else:
            logger.warning(
                "%s: ignored fields this server does not know (ignore_unknown_fields): %s",
                model.__name__,
                ", ".join(unknown),
            )
            return body
    raise _refusal(errors[0], data) from None


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


def _unknown_fields(data: Any, kinds: list[Any], path: tuple, found: list[str], drop: bool) -> None:
    """The path of every key in ``data`` that no body model of ``kinds`` (the types
    the value may have: a union's members each) declares, into ``found``; removed from
    ``data`` where ``drop``. An object whose ``type`` no model takes (an image part) is
    not looked into: it is refused for its type."""
    members = _members(kinds)
    if isinstance(data, dict):
        known: dict[str, list[Any]] = {}
        for model in members:
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                continue
            if not _takes_type(model, data.get("type")):
                continue
            for name, info in model.model_fields.items():
                names = {info.alias or name}
                if model.model_config.get("populate_by_name"):
                    names.add(name)
                for key in names:
                    known.setdefault(key, []).append(info.annotation)
        if not known:  # a free object (chat_template_kwargs, metadata)
            return
        for key in list(data):
            if key in known:
                _unknown_fields(data[key], known[key], (*path, key), found, drop)
            else:
                found.append(".".join(map(str, (*path, key))))
                if drop:
                    del data[key]
    elif isinstance(data, list):
        items = [typing.get_args(kind)[0] for kind in members if typing.get_origin(kind) is list]
        for index, item in enumerate(data):
            _unknown_fields(item, items, (*path, index), found, drop)


def _takes_type(model: type[BaseModel], kind: Any) -> bool:
    """Whether ``model`` may be an object whose ``type`` is ``kind``."""
    field = model.model_fields.get("type")
    if kind is None or field is None or typing.get_origin(field.annotation) is not Literal:
        return True
    return kind in typing.get_args(field.annotation)


def _members(kinds: list[Any]) -> list[Any]:
    """``kinds`` with each union replaced by its members."""
    out = []
    for kind in kinds:
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            out.extend(_members(list(typing.get_args(kind))))
        else:
            out.append(kind)
    return out


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

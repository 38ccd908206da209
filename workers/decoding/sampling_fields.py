"""The wire fields of a request's sampling settings, declared once.

Every door into the engine names a sampling field as ``SamplingParams`` does: the
OpenAI body (``cluster/openai_protocol.py``), the gRPC ``SamplingOptions``
(``cluster/grpc_api.py``, ``cluster/grpc_client.py``), the KV-transfer request and the
CLI. ``FIELDS`` says how each travels; the functions below map values both ways, so a
door never lists field names of its own:

    wire values (a mapping by name) --sampling_params--> SamplingParams
    SamplingParams --wire_values--> wire values
    wire values or SamplingParams --options_message--> a SamplingOptions-like message
    a SamplingOptions-like message --message_values--> wire values

A missing or ``None`` value is unset and takes ``SamplingParams``' default (a JSON
null, an unset proto field). Light on purpose: no torch, and protobuf only through the
messages handed in.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from tessera.workers.api import (
    InvalidRequestError,
    ParallelTokensParams,
    SamplingParams,
    SpeculativeParams,
    StructuredParams,
)
from tessera.workers.params import MAX_LOGIT_BIAS

#: The params dataclasses a sampling field may hold (a nested object on the wire).
NESTED = (SpeculativeParams, ParallelTokensParams, StructuredParams)

M = TypeVar("M", bound=Message)


@dataclass(frozen=True, slots=True)
class WireField:
    """One sampling field on the wire; ``name`` is also its ``SamplingParams`` field."""

    name: str
    #: A list on the wire, a tuple in ``SamplingParams``.
    repeated: bool = False
    #: A map on the wire ({token id: bias}), (key, value) pairs in ``SamplingParams``.
    mapping: bool = False
    #: An object / message of its own, whose fields are this dataclass's.
    nested: type[SpeculativeParams] | type[ParallelTokensParams] | type[StructuredParams] | None = (
        None
    )

    def to_param(self, value: Any) -> Any:
        """A wire value (not None) as the ``SamplingParams`` field takes it. A value of
        the wrong shape passes through, for ``SamplingParams`` to refuse by name."""
        if self.mapping and isinstance(value, Mapping):
            if len(value) > MAX_LOGIT_BIAS:  # before converting every key
                raise InvalidRequestError(
                    self.name, f"at most {MAX_LOGIT_BIAS} tokens, got {len(value)}"
                )
            try:
                return tuple(sorted((int(k), v) for k, v in value.items()))
            except (TypeError, ValueError):
                raise InvalidRequestError(
                    self.name, f"keys must be token ids, got {sorted(value)[:3]!r}"
                ) from None
        if self.repeated and isinstance(value, (list, tuple)):
            return tuple(value)
        if self.nested is not None and isinstance(value, Mapping):
            unknown = sorted(set(value) - _field_names(self.nested))
            if unknown:
                raise TypeError(f"unknown {self.name} field(s) {unknown}")
            return self.nested(**{k: v for k, v in value.items() if v is not None})
        return value

    def to_wire(self, value: Any) -> Any:
        """A ``SamplingParams`` value (not None) as wire values: a nested one as a dict."""
        if self.nested is not None:
            return dataclasses.asdict(value)
        if self.mapping:
            return dict(value)
        return value


#: ``SamplingParams`` fields that no wire carries (none today): every other field is on
#: the wire under its own name, and the ``SamplingOptions`` message must carry it (a
#: unit test holds the message to ``FIELDS``).
NOT_ON_THE_WIRE: frozenset[str] = frozenset()


def _wire_field(name: str, annotation: Any) -> WireField:
    """How a ``SamplingParams`` field travels, read from its type: a tuple is a list on
    the wire, a params dataclass a nested object."""
    kinds = typing.get_args(annotation) or (annotation,)
    nested = next((k for k in kinds if k in NESTED), None)
    is_tuple = typing.get_origin(annotation) is tuple
    pairs = is_tuple and typing.get_origin(kinds[0]) is tuple  # tuple[tuple[K, V], ...]
    return WireField(name, repeated=is_tuple and not pairs, mapping=pairs, nested=nested)


#: Every sampling field a request carries, in ``SamplingParams``' order: derived from
#: ``SamplingParams`` itself, the one declaration of them.
FIELDS: tuple[WireField, ...] = tuple(
    _wire_field(name, annotation)
    for name, annotation in typing.get_type_hints(SamplingParams).items()
    if name not in NOT_ON_THE_WIRE
)
BY_NAME: dict[str, WireField] = {field.name: field for field in FIELDS}
#: The wire names, which are the ``SamplingParams`` field names.
WIRE_NAMES: frozenset[str] = frozenset(BY_NAME)


def _field_names(kind: type) -> set[str]:
    return {f.name for f in dataclasses.fields(kind)}


def defaults(kind: type = SamplingParams) -> dict[str, Any]:
    """The defaults of a params dataclass's fields (``SamplingParams``,
    ``SpeculativeParams``, ``ParallelTokensParams``), for a door that states them."""
    return {f.name: f.default for f in dataclasses.fields(kind)}


def sampling_params(values: Mapping[str, Any]) -> SamplingParams:
    """``SamplingParams`` from wire values by name; a missing or None value takes the
    default. Lists become tuples; a nested field takes a mapping of its fields (None
    among them: their default) or its params object.

    Raises ``InvalidRequestError`` naming the field (e.g. ``speculative.num_tokens``)
    for a bad value, ``TypeError`` for a name that is no sampling field."""
    unknown = sorted(set(values) - WIRE_NAMES)
    if unknown:
        raise TypeError(f"unknown sampling field(s) {unknown}")
    # Nested params are built (and checked) before SamplingParams, in FIELDS' order.
    kwargs = {
        field.name: field.to_param(values[field.name])
        for field in FIELDS
        if values.get(field.name) is not None
    }
    return SamplingParams(**kwargs)


def wire_values(params: SamplingParams, names: Collection[str] | None = None) -> dict[str, Any]:
    """``params`` as wire values by name (``names``: only those), leaving out None
    (unset); nested params become dicts of their fields."""
    return {
        field.name: field.to_wire(value)
        for field in FIELDS
        if (names is None or field.name in names)
        and (value := getattr(params, field.name)) is not None
    }


def options_message(
    kind: type[M],
    values: Mapping[str, Any] | SamplingParams,
    names: Collection[str] | None = None,
) -> M:
    """A ``SamplingOptions``-like message (its fields named as the wire names) holding
    ``values`` (``names``: only those). None leaves a field unset; a nested field takes a
    dict of its fields, its params dataclass or its message.

    Raises ``TypeError`` for an option the message lacks or a nested value of another
    kind, and protobuf's ``TypeError`` or ``ValueError`` for a value its field cannot
    hold (a negative ``seed``, text for a number), with the field's name in front."""
    if isinstance(values, SamplingParams):
        values = wire_values(values, names)
    elif names is not None:
        values = {name: value for name, value in values.items() if name in names}
    descriptor = kind.DESCRIPTOR
    unknown = sorted(set(values) - set(descriptor.fields_by_name))
    if unknown:
        raise TypeError(f"unknown sampling option(s) {unknown}; see {descriptor.name}")
    kwargs = {}
    for field in descriptor.fields:  # the message's order: the first bad nested value raises
        if field.name not in values:
            continue
        value = values[field.name]
        if _is_map(field):
            value = dict(value) if not isinstance(value, Mapping) else value
        elif field.message_type is not None:
            value = _nested_message(field.name, GetMessageClass(field.message_type), value)
        kwargs[field.name] = value
    try:
        return kind(**kwargs)
    except (TypeError, ValueError):
        for name, value in kwargs.items():  # protobuf's message names no field: find it
            try:
                kind(**{name: value})
            except (TypeError, ValueError) as error:
                raise type(error)(f"{name}: {error}") from None
        raise


def _nested_message(name: str, kind: type[Message], value: Any) -> Message | None:
    if value is None or isinstance(value, kind):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict of {kind.DESCRIPTOR.name} fields, got {value!r}")
    unknown = sorted(set(value) - set(kind.DESCRIPTOR.fields_by_name))
    if unknown:
        raise TypeError(f"unknown {name} option(s) {unknown}; see {kind.DESCRIPTOR.name}")
    return kind(**{field: given for field, given in value.items() if given is not None})


def message_values(message: Message, names: Collection[str] | None = None) -> dict[str, Any]:
    """The set fields of a ``SamplingOptions``-like message as wire values by name
    (``names``: only those). A field with presence counts when set; one without (a list,
    a plain bool or string) when not empty, as proto3 cannot tell empty from unset. A
    set nested message becomes a dict of its own set fields (possibly empty: all
    defaults)."""
    fields = message.DESCRIPTOR.fields_by_name
    return {
        field.name: value
        for field in FIELDS
        if (names is None or field.name in names)
        and (value := _read(message, fields[field.name])) is not None
    }


def _is_map(field: FieldDescriptor) -> bool:
    entry = field.message_type
    return entry is not None and entry.GetOptions().map_entry


def _read(message: Message, field: FieldDescriptor) -> Any:
    """A field's value, or None when it is unset (see ``message_values``)."""
    value = getattr(message, field.name)
    if _is_map(field):
        return dict(value) if value else None
    if field.message_type is not None:
        if not message.HasField(field.name):
            return None
        return {f.name: v for f in field.message_type.fields if (v := _read(value, f)) is not None}
    if field.has_presence:
        return value if message.HasField(field.name) else None
    if field.is_repeated:
        return tuple(value) if value else None
    return value if value else None

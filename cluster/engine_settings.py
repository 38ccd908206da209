"""The cluster's engine settings, derived from the engine's one declaration.

``EngineConfig``'s fields (``tessera.workers.config``) declare the engine settings: each
carries its help, bounds, choices and command-line default in its metadata. Here they
become pydantic fields (``EngineSettings``), less the ones a cluster does not take
(``ENGINE_ONLY``), with the cluster's own ``device``. ``ClusterConfig`` extends
``EngineSettings``; the command line's flags (``tessera.cluster.flags``) and the Helm
chart's schema are made from the same fields.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from pydantic import ConfigDict, Field, create_model

from tessera.workers.config import EngineConfig

#: EngineConfig fields that are not cluster settings: workers keep the engine's default.
ENGINE_ONLY = ("kv_cache_memory_fraction", "enable_block_sharing")


def scalar_type(annotation):
    """``int | None`` -> int; other annotations as they are."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (inner,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return inner
    return annotation


def setting_type(spec: dataclasses.Field, hint: Any) -> Any:
    """An ``EngineConfig`` field's type, its ``choices`` as a ``Literal`` (``| None`` kept)."""
    choices = spec.metadata.get("choices")
    if choices is None:
        return hint
    kind = Literal[tuple(choices)]
    return kind | None if scalar_type(hint) is not hint else kind


def engine_settings() -> dict[str, tuple[Any, Any]]:
    """Pydantic fields from ``EngineConfig``'s declaration: type, default (its
    ``cli_default`` where it has one), help as the description, bounds as constraints;
    ``ENGINE_ONLY`` left out."""
    hints = typing.get_type_hints(EngineConfig)
    fields = {}
    for spec in dataclasses.fields(EngineConfig):
        if spec.name in ENGINE_ONLY:
            continue
        bounds = {key: spec.metadata[key] for key in ("ge", "gt", "le") if key in spec.metadata}
        description = spec.metadata["help"]
        default = spec.metadata.get("cli_default", spec.default)
        field = Field(default, description=description, **bounds)
        fields[spec.name] = (setting_type(spec, hints[spec.name]), field)
    return fields


#: The cluster's engine settings. ``device`` is the cluster's own: where each worker runs,
#: chosen when it starts (the engine's cpu or cuda[:N] comes from it).
EngineSettings = create_model(
    "EngineSettings",
    __config__=ConfigDict(frozen=True, extra="forbid"),
    **{
        **engine_settings(),
        "device": (
            Literal["auto", "cpu", "cuda"],
            Field(
                "auto",
                description="where workers run: auto takes a GPU per worker when the Ray "
                "cluster has GPUs, else the CPU",
            ),
        ),
    },
)

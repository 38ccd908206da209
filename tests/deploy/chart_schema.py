"""The chart's schema of the engine settings, generated from their one declaration.

``EngineConfig``'s fields declare each engine setting (name, type, default, help, bounds);
``tessera.cluster.config.EngineSettings`` turns them into the cluster's pydantic fields.
Here each of those fields becomes its property under ``tessera`` in
``helm/tessera/values.schema.json`` (with its ``default``), so ``test_chart`` fails when
the chart and the declaration differ in a name, type, default, bound or description, and
``python -m tests.deploy.helm`` rewrites the properties from the declaration.
"""

from __future__ import annotations

import json
import typing
from typing import Any, Literal

from pydantic.fields import FieldInfo

from tests.deploy.helm import CHART

SCHEMA = CHART / "values.schema.json"
#: Settings given as a size such as 2GiB or as a number of bytes (ServeConfig parses them).
SIZES = ("kv_cache_memory", "max_request_bytes")
JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}
BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum"}


def setting_property(name: str, info: FieldInfo) -> dict[str, Any]:
    """The JSON schema of one setting, as the chart's values take it."""
    kind, optional = info.annotation, False
    args = typing.get_args(kind)
    if type(None) in args:
        (kind,) = [arg for arg in args if arg is not type(None)]
        optional = True
    prop: dict[str, Any] = {"description": info.description}
    if typing.get_origin(kind) is Literal:
        choices = list(typing.get_args(kind))
        if optional:
            prop["type"] = ["string", "null"]
            choices.append(None)
        prop["enum"] = choices
    else:
        types = [JSON_TYPES[kind]] + ["string"] * (name in SIZES) + ["null"] * optional
        prop["type"] = types if len(types) > 1 else types[0]
        if name not in SIZES:  # "2GiB" is a string: ServeConfig checks the size it means
            for constraint in info.metadata:
                for key, keyword in BOUNDS.items():
                    if hasattr(constraint, key):
                        prop[keyword] = getattr(constraint, key)
    prop["default"] = info.default
    return prop


def engine_properties() -> dict[str, dict[str, Any]]:
    """Each engine setting's property, from the declaration."""
    from tessera.cluster.config import EngineSettings

    return {
        name: setting_property(name, info) for name, info in EngineSettings.model_fields.items()
    }


def values_schema() -> str:
    """``values.schema.json`` with its engine settings' properties generated."""
    schema = json.loads(SCHEMA.read_text())
    settings = schema["properties"]["tessera"]["properties"]
    for name, prop in engine_properties().items():
        settings[name] = prop  # in place: a key keeps its position
    return json.dumps(schema, indent=2) + "\n"

"""The command line's flags, derived from the settings' one declaration.

One ``--flag`` per field of ``ClusterConfig`` or ``ServeConfig`` (``add_config_arguments``),
its help the field's description, so ``--help`` explains every setting; ``tessera
generate`` gets one per ``EngineConfig`` field (``add_engine_arguments``), spelled, typed
and explained alike. Nothing heavy is imported here (no torch, grpc or ray): ``tessera
--help`` builds its flags from this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Literal

from tessera.cluster.cluster_config import ClusterConfig
from tessera.cluster.engine_settings import scalar_type, setting_type
from tessera.cluster.memory_size import memory_size
from tessera.workers.config import EngineConfig

#: Settings written as sizes: their flags read "2GiB" as well as bytes.
_PARSERS = {
    "kv_cache_memory": memory_size,
    "max_request_bytes": memory_size,
    "max_grammar_bytes": memory_size,
}


def add_config_arguments(
    parser: argparse.ArgumentParser,
    model: type[ClusterConfig] = ClusterConfig,
    skip: tuple[str, ...] = (),
    only_given: bool = False,
) -> None:
    """One ``--flag`` per field of ``model``, its help from the field description.
    ``only_given``: a flag left out is absent from the parsed arguments (so that a
    config file's value is not overridden by a flag's default)."""
    groups = {
        "cluster": parser.add_argument_group("cluster"),
        "server": parser.add_argument_group("server"),
    }
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        group = groups["cluster" if name in ClusterConfig.model_fields else "server"]
        _add_flag(group, name, info.annotation, info.default, info.description, only_given)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``EngineConfig`` field (``tessera generate``), spelled, typed
    and explained as the cluster's flags are; ``engine_config_from_args`` reads them."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for spec in dataclasses.fields(EngineConfig):
        kind = setting_type(spec, hints[spec.name])
        default = spec.metadata.get("cli_default", spec.default)
        _add_flag(group, spec.name, kind, default, spec.metadata["help"])


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """``EngineConfig`` from ``add_engine_arguments``' flags, then ``overrides``."""
    given = {spec.name: getattr(args, spec.name) for spec in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{**given, **overrides})


def _add_flag(
    group: argparse._ArgumentGroup,
    name: str,
    annotation: Any,
    default: Any,
    description: str,
    only_given: bool = False,
) -> None:
    """``--name-with-dashes`` for a setting; its help ends with the default."""
    flag = "--" + name.replace("_", "-")
    help_text = description
    if "default:" not in help_text:
        help_text += f" (default: {default})"
    help_text = help_text.replace("%", "%%")
    kind = scalar_type(annotation)
    if kind is bool:
        # The default goes to the parser, not the action, whose help would repeat it.
        group.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
        )
        if not only_given:
            group.set_defaults(**{name: default})
        return
    default = argparse.SUPPRESS if only_given else default
    if typing.get_origin(kind) is list:  # --flag A B C
        group.add_argument(flag, nargs="+", metavar="VALUE", default=default, help=help_text)
    elif typing.get_origin(kind) is Literal:
        group.add_argument(flag, choices=typing.get_args(kind), default=default, help=help_text)
    else:
        group.add_argument(flag, type=_PARSERS.get(name, kind), default=default, help=help_text)


def config_from_args(
    args: argparse.Namespace,
    model: type[ClusterConfig] = ClusterConfig,
    base: dict[str, typing.Any] | None = None,
    **overrides,
) -> ClusterConfig:
    """``model`` from ``base`` (a config file's settings), then the flags given, then
    ``overrides``; raise ``ConfigError`` naming the field."""
    given = {name: getattr(args, name) for name in model.model_fields if hasattr(args, name)}
    return model.create(**{**(base or {}), **given, **overrides})

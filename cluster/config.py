"""The cluster's configuration: one typed, validated object for the whole cluster.

``ClusterConfig`` is user-facing (pydantic, a description on every field); the
command line is generated from it (``add_config_arguments``), so ``--help`` explains
every field. Its engine settings are not written there: ``EngineSettings`` derives them
from ``EngineConfig``'s fields (the one declaration; see ``tessera.workers.config``),
less the ones a cluster does not take, with the cluster's own ``device``. Its errors
name the field: ``ConfigError("block_size: Input should be greater than or equal to 1,
got 0")``. ``check_environment`` adds what only the machine can tell (does the model
path exist, does the KV memory fit) and runs when the cluster starts.

This module is the configuration's public face; each part lives in its own module:

- ``engine_settings``: ``EngineSettings``, derived from ``EngineConfig``;
- ``cluster_config``: ``ClusterConfig`` and ``ConfigError``;
- ``serve_config``: ``ServeConfig`` (the cluster plus its HTTP front end) and its file;
- ``flags``: the command line's flags, derived from the same fields;
- ``memory_size``: sizes such as ``2GiB``;
- ``environment``: ``check_environment``.

Nothing heavy is imported here (no torch, grpc or ray): ``tessera --help`` builds its
flags from these modules.
"""

from tessera.cluster.cluster_config import DISAGGREGATED_BOUNDS, ClusterConfig, ConfigError
from tessera.cluster.engine_settings import ENGINE_ONLY, EngineSettings, setting_type
from tessera.cluster.environment import check_environment
from tessera.cluster.flags import (
    add_config_arguments,
    add_engine_arguments,
    config_from_args,
    engine_config_from_args,
)
from tessera.cluster.memory_size import memory_size
from tessera.cluster.serve_config import ServeConfig, load_config_file

__all__ = [
    "DISAGGREGATED_BOUNDS",
    "ENGINE_ONLY",
    "ClusterConfig",
    "ConfigError",
    "EngineSettings",
    "ServeConfig",
    "add_config_arguments",
    "add_engine_arguments",
    "check_environment",
    "config_from_args",
    "engine_config_from_args",
    "load_config_file",
    "memory_size",
    "setting_type",
]

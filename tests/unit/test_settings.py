"""Each engine setting is declared once (``EngineConfig``'s fields) and appears with the
same name, default and help in ``ClusterConfig``, the ``tessera generate`` flags, the
``tessera serve`` flags and the Helm chart's schema; the old ``generate`` spellings still
work for one release and say which flag replaces them."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from tessera.cluster import cli
from tessera.cluster.config import (
    ENGINE_ONLY,
    ClusterConfig,
    EngineSettings,
    ServeConfig,
    config_from_args,
)
from tessera.workers.config import EngineConfig

SCHEMA = Path(__file__).resolve().parents[2] / "helm" / "tessera" / "values.schema.json"
#: The cluster's own setting of this name: where workers run (auto|cpu|cuda), not cpu|cuda:N.
CLUSTER_OWN = ("device",)
DECLARED = {spec.name: spec for spec in dataclasses.fields(EngineConfig)}
#: Engine settings that the cluster takes as the engine declares them.
SHARED = [name for name in DECLARED if name not in ENGINE_ONLY + CLUSTER_OWN]
#: A value other than the default for each shared setting (a new setting must add one).
OTHER_VALUES = {
    "model": "/models/llama",
    "revision": "v2",
    "tokenizer": "/models/tokenizer",
    "chat_template": "/models/chat.jinja",
    "dtype": "bfloat16",
    "block_size": 8,
    "kv_cache_memory": 2**20,
    "num_kv_blocks": 100,
    "max_num_batched_tokens": 512,
    "max_num_seqs": 8,
    "max_model_len": 256,
    "stream_interval": 2,
    "enable_prefix_caching": False,
    "packed_weights": False,
    "cuda_graphs": False,
    "native_decode": False,
    "speculative_method": "draft",
    "speculative_num_tokens": 6,
    "speculative_min_tokens": 2,
    "draft_model": "target:2",
    "embedding_pooling": "mean",
    "embedding_normalize": False,
    "enable_lora": True,
    "max_loras": 2,
    "max_lora_rank": 8,
    "tensor_parallel_size": 2,
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def subcommand(name: str) -> argparse.ArgumentParser:
    (commands,) = [
        a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ]
    return commands.choices[name]


def actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def test_the_cluster_takes_every_engine_setting_but_the_named_exceptions():
    assert set(EngineSettings.model_fields) == set(DECLARED) - set(ENGINE_ONLY)
    assert set(OTHER_VALUES) == set(SHARED), "give the new setting a value above"
    assert ClusterConfig.model_fields["device"].default == "auto"
    assert DECLARED["device"].default == "cpu"


@pytest.mark.parametrize("name", SHARED)
def test_same_name_default_and_help_everywhere(name: str):
    spec = DECLARED[name]
    default = spec.metadata.get("cli_default", spec.default)  # the entry points' default
    field = ClusterConfig.model_fields[name]
    assert (field.default, field.description) == (default, spec.metadata["help"])

    generate = actions(subcommand("generate"))[flag(name)]
    serve = actions(subcommand("serve"))[flag(name)]
    assert generate.dest == serve.dest == name
    assert generate.option_strings == serve.option_strings
    assert generate.help == serve.help
    assert generate.choices == serve.choices

    generated = subcommand("generate").parse_args(["--prompt", "hi"])
    assert getattr(generated, name) == default
    served = subcommand("serve").parse_args([])
    assert not hasattr(served, name)  # only the flags given; the default is ServeConfig's
    assert getattr(config_from_args(served, ServeConfig), name) == default

    chart = json.loads(SCHEMA.read_text())["properties"]["tessera"]["properties"]
    assert chart[name]["default"] == default
    assert chart[name]["description"] == spec.metadata["help"]


def test_the_entry_points_default_to_the_fast_mode_and_the_python_api_to_the_exact_one():
    """``tessera serve``/``cluster``/``generate`` and the chart pick ``auto`` (the fast
    mode where it runs); ``EngineConfig()`` stays float32, the exact mode."""
    assert DECLARED["dtype"].default == "float32"
    assert DECLARED["dtype"].metadata["cli_default"] == "auto"
    assert subcommand("generate").parse_args(["--prompt", "hi"]).dtype == "auto"
    assert ClusterConfig.create().dtype == "auto"
    assert ClusterConfig.create(dtype="float32").dtype == "float32"


def test_engine_only_settings_are_generate_flags():
    generate = actions(subcommand("generate"))
    serve = actions(subcommand("serve"))
    for name in ENGINE_ONLY:
        assert flag(name) in generate and flag(name) not in serve


def test_cluster_engine_config_carries_every_shared_setting():
    config = ClusterConfig.create(**OTHER_VALUES).engine_config("cuda:1")
    assert {name: getattr(config, name) for name in SHARED} == OTHER_VALUES
    assert config.device == "cuda:1"
    for name in ENGINE_ONLY:
        assert getattr(config, name) == DECLARED[name].default


def test_generate_flags_build_the_engine_config():
    argv = ["--prompt", "hi", "--device", "cuda:0", "--kv-cache-memory", "1MiB"]
    for name, value in OTHER_VALUES.items():
        if isinstance(value, bool):
            argv.append(("--no-" if not value else "--") + flag(name)[2:])
        elif name != "kv_cache_memory":
            argv += [flag(name), str(value)]
    argv += ["--kv-cache-memory-fraction", "0.5", "--no-enable-block-sharing"]
    args = subcommand("generate").parse_args(argv)
    config = cli._engine_config(args)
    expected = dict(OTHER_VALUES, device="cuda:0")
    expected |= {"kv_cache_memory_fraction": 0.5, "enable_block_sharing": False}
    for name in cli.REQUEST_SETTINGS:  # the request carries them, the engine keeps defaults
        assert getattr(args, name) == expected.pop(name)
        assert getattr(config, name) == DECLARED[name].default
    assert {name: getattr(config, name) for name in expected} == expected


@pytest.mark.parametrize(
    ("old", "new", "name", "value"),
    [
        (["--no-prefix-caching"], "--no-enable-prefix-caching", "enable_prefix_caching", False),
        (["--speculative", "ngram"], "--speculative-method", "speculative_method", "ngram"),
        (
            ["--num-speculative-tokens", "3"],
            "--speculative-num-tokens",
            "speculative_num_tokens",
            3,
        ),
    ],
)
def test_deprecated_generate_spellings_work_and_warn(old, new, name, value, capsys):
    args = subcommand("generate").parse_args(["--prompt", "hi", *old])
    assert getattr(args, name) == value
    err = capsys.readouterr().err
    assert f"warning: {old[0]} is deprecated" in err and f"use {new}" in err


def test_new_spellings_do_not_warn(capsys):
    argv = ["--prompt", "hi", "--no-enable-prefix-caching", "--speculative-method", "ngram"]
    args = subcommand("generate").parse_args([*argv, "--speculative-num-tokens", "3"])
    assert (args.enable_prefix_caching, args.speculative_method) == (False, "ngram")
    assert args.speculative_num_tokens == 3
    assert capsys.readouterr().err == ""


def test_deprecated_spelling_of_a_bad_value_is_refused(capsys):
    with pytest.raises(SystemExit):
        subcommand("generate").parse_args(["--prompt", "hi", "--speculative", "magic"])
    assert "invalid choice: 'magic'" in capsys.readouterr().err

"""The cluster configuration (cluster/config.py): ClusterConfig.create's errors naming the
field, check_environment's model-path and memory checks, memory_size parsing, and the
generated command line (add_config_arguments / config_from_args)."""

from __future__ import annotations

import argparse

import pytest

from tessera.cluster.config import (
    ClusterConfig,
    ConfigError,
    add_config_arguments,
    check_environment,
    config_from_args,
    memory_size,
)

POLICY_NAMES = "['least_loaded', 'prefix_affinity', 'round_robin']"


def create_error(**fields) -> str:
    with pytest.raises(ConfigError) as error:
        ClusterConfig.create(**fields)
    return str(error.value)


def make_parser(skip=()):
    parser = argparse.ArgumentParser(prog="tessera")
    add_config_arguments(parser, skip=skip)
    return parser


# ------------------------------------------------------------------ ClusterConfig.create
def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_defaults_are_valid():
    config = ClusterConfig.create()
    assert config.workers == 1
    assert config.placement == "prefix_affinity"
    assert config.pool_bounds == (1, 1)


def test_the_ready_line_names_the_precision_mode():
    auto = ClusterConfig.create()
    assert auto.precision_text(1, "fast") == (
        "auto -> float32, fast mode: bf16 inputs to the GGUF matmuls, fp16 KV cache, packed "
        "GGUF weights on the CPU; 1 CPU(s) and torch threads per worker"
    )
    assert auto.precision_text(1, "float32") == (
        "auto -> float32, exact mode, packed GGUF weights on the CPU; "
        "1 CPU(s) and torch threads per worker"
    )
    bf16 = ClusterConfig.create(dtype="bfloat16", worker_num_cpus=2, model="/m/model.gguf")
    assert bf16.precision_text(2, "bfloat16") == (
        "bfloat16 activations and KV cache, packed GGUF weights on the CPU; "
        "2 CPU(s) and torch threads per worker"
    )
    dense = ClusterConfig.create(dtype="float32", packed_weights=False, model="/m/hf-dir")
    assert dense.precision_text(1) == "float32, exact mode; 1 CPU(s) and torch threads per worker"
    gpu = ClusterConfig.create()  # device auto, resolved to a GPU: float32, packed there
    assert gpu.precision_text(1, "float32", "cuda") == (
        "auto -> float32, exact mode, packed GGUF weights on the GPU; "
        "1 CPU(s) and torch threads per worker"
    )
    gpu_bf16 = ClusterConfig.create(device="cuda", dtype="bfloat16")
    assert gpu_bf16.precision_text(1, "bfloat16") == (
        "bfloat16 activations and KV cache; 1 CPU(s) and torch threads per worker"
    )
    half = ClusterConfig.create(dtype="float16")
    assert half.precision_text(1) == (
        "float16 activations and KV cache; 1 CPU(s) and torch threads per worker"
    )


def test_workers_zero():
    assert create_error(workers=0) == "workers: the cluster needs at least one worker, got 0"
    assert create_error(workers=-1) == "workers: Input should be greater than or equal to 0, got -1"


def test_disaggregation_settings():
    config = ClusterConfig.create(prefill_workers=1, decode_workers=2)
    assert config.workers == 0 and config.pools == {"prefill": (1, 1, 1), "decode": (2, 2, 2)}
    assert create_error(prefill_workers=1) == (
        "prefill_workers: disaggregation needs prefill and decode workers, got 1 prefill and "
        "0 decode"
    )
    assert create_error(prefill_workers=1, decode_workers=1, workers=1).startswith(
        "workers: mixed workers do not join a disaggregated cluster; got 1"
    )
    assert create_error(prefill_workers=1, decode_workers=1, max_workers=3) == (
        "max_workers: bounds the mixed workers, and a disaggregated cluster has none (set "
        "max_prefill_workers and max_decode_workers), got 3"
    )
    assert create_error(prefill_workers=1, decode_workers=1, min_workers=1) == (
        "min_workers: bounds the mixed workers, and a disaggregated cluster has none (set "
        "min_prefill_workers and min_decode_workers), got 1"
    )
    assert create_error(kv_transfer_tls_cert="c.pem") == (
        "kv_transfer_tls_cert: mutual TLS needs the certificate, key and CA together"
    )


def test_prefill_and_decode_pools_autoscale_within_their_own_bounds():
    config = ClusterConfig.create(
        prefill_workers=1,
        decode_workers=2,
        max_prefill_workers=3,
        min_decode_workers=1,
        max_decode_workers=4,
    )
    assert config.pools == {"prefill": (1, 1, 3), "decode": (2, 1, 4)}
    # a floor alone raises the ceiling to it; a ceiling alone keeps the start as the floor
    config = ClusterConfig.create(prefill_workers=2, decode_workers=2, min_prefill_workers=2)
    assert config.pools == {"prefill": (2, 2, 2), "decode": (2, 2, 2)}
    config = ClusterConfig.create(prefill_workers=2, decode_workers=1, max_decode_workers=2)
    assert config.pools == {"prefill": (2, 2, 2), "decode": (1, 1, 2)}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"min_prefill_workers": 3, "max_prefill_workers": 2},
            "min_prefill_workers: 3 is above max_prefill_workers (2)",
        ),
        (
            {"prefill_workers": 5, "max_prefill_workers": 4},
            "prefill_workers: 5 is above max_prefill_workers (4)",
        ),
        ({"min_prefill_workers": 2}, "prefill_workers: 1 is below min_prefill_workers (2)"),
        (
            {"min_decode_workers": 3, "max_decode_workers": 2},
            "min_decode_workers: 3 is above max_decode_workers (2)",
        ),
        (
            {"decode_workers": 3, "max_decode_workers": 2},
            "decode_workers: 3 is above max_decode_workers (2)",
        ),
        (
            {"min_decode_workers": 2, "max_decode_workers": 4},
            "decode_workers: 1 is below min_decode_workers (2)",
        ),
        (
            {"max_decode_workers": 0},
            "max_decode_workers: Input should be greater than or equal to 1, got 0",
        ),
        (
            {"min_prefill_workers": 0},
            "min_prefill_workers: Input should be greater than or equal to 1, got 0",
        ),
    ],
)
def test_prefill_and_decode_bounds_errors_name_the_field_the_limit_and_the_value(fields, message):
    assert create_error(**{"prefill_workers": 1, "decode_workers": 1, **fields}) == message


@pytest.mark.parametrize(
    "name",
    ["min_prefill_workers", "max_prefill_workers", "min_decode_workers", "max_decode_workers"],
)
def test_prefill_and_decode_bounds_need_prefill_and_decode_workers(name):
    role = name.split("_")[1]
    assert create_error(workers=2, **{name: 2}) == (
        f"{name}: bounds the {role} workers, and the cluster has none (set prefill_workers "
        "and decode_workers), got 2"
    )


def test_prefill_queue_target_defaults_to_two_steps_of_tokens():
    assert ClusterConfig.create(max_num_batched_tokens=512).prefill_queue_target == 1024
    assert ClusterConfig.create(target_prefill_queue_tokens=300).prefill_queue_target == 300
    assert create_error(target_prefill_queue_tokens=0) == (
        "target_prefill_queue_tokens: Input should be greater than or equal to 1, got 0"
    )


def test_block_size_zero():
    message = create_error(block_size=0)
    assert message.startswith("block_size: ")
    assert message == "block_size: Input should be greater than or equal to 1, got 0"


def test_unknown_placement():
    message = create_error(placement="nope")
    assert message == f"placement: must be one of {POLICY_NAMES}, got 'nope'"


def test_min_workers_above_max_workers():
    message = create_error(workers=2, min_workers=3, max_workers=2)
    assert message == "min_workers: 3 is above max_workers (2)"


def test_workers_above_max_workers():
    message = create_error(workers=5, min_workers=2, max_workers=4)
    assert message == "workers: 5 is above max_workers (4)"


def test_workers_below_min_workers():
    message = create_error(workers=1, min_workers=2, max_workers=4)
    assert message == "workers: 1 is below min_workers (2)"


def test_workers_below_min_workers_without_max():
    # max defaults to max(workers, min_workers) = 3
    message = create_error(workers=1, min_workers=3)
    assert message == "workers: 1 is below min_workers (3)"


def test_workers_inside_bounds_are_accepted():
    config = ClusterConfig.create(workers=2, min_workers=1, max_workers=4)
    assert config.pool_bounds == (1, 4)
    assert ClusterConfig.create(workers=3, max_workers=5).pool_bounds == (3, 5)
    assert ClusterConfig.create(workers=2, min_workers=2, max_workers=2).pool_bounds == (2, 2)


def test_unknown_dtype():
    message = create_error(dtype="int4")
    assert message.startswith("dtype: ")
    assert message == (
        "dtype: Input should be 'auto', 'int8', 'float32', 'bfloat16' or 'float16', got 'int4'"
    )


def test_unknown_field():
    message = create_error(wrokers=2)
    assert message.startswith("wrokers: ")
    assert message == "wrokers: Extra inputs are not permitted, got 2"


def test_config_is_frozen():
    config = ClusterConfig.create()
    with pytest.raises(ValueError):
        config.workers = 2


# ------------------------------------------------------------------ check_environment
def test_check_environment_missing_model_path(tmp_path):
    missing = tmp_path / "missing.gguf"
    config = ClusterConfig.create(model=str(missing))
    with pytest.raises(ConfigError) as error:
        check_environment(config)
    message = str(error.value)
    assert message.startswith("model:")
    assert message == f"model: path '{missing}' does not exist"


def test_check_environment_model_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"")
    with pytest.raises(ConfigError) as error:
        check_environment(ClusterConfig.create(model=str(path)))
    assert str(error.value) == f"model: '{path}' is neither a directory nor a .gguf file"


def test_check_environment_model_directory_without_weights(tmp_path):
    with pytest.raises(ConfigError) as error:
        check_environment(ClusterConfig.create(model=str(tmp_path)))
    assert str(error.value) == (
        f"model: directory '{tmp_path}' has no config.json and 0 .gguf files (need exactly one)"
    )


def test_check_environment_kv_memory_larger_than_the_machine():
    config = ClusterConfig.create(kv_cache_memory=10**15)
    with pytest.raises(ConfigError) as error:
        check_environment(config)
    message = str(error.value)
    assert message.startswith(
        "kv_cache_memory: 1000000000000000 bytes per worker is more than this machine's "
    )
    assert message.endswith(" bytes of memory")


def test_check_environment_accepts_builtin_model_and_small_kv_memory():
    check_environment(ClusterConfig.create(kv_cache_memory=2**20))  # no error


# ------------------------------------------------------------------ memory_size
@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512MiB", 512 * 1024 * 1024),
        ("2GiB", 2 * 1024 * 1024 * 1024),
        ("1.5GB", 1_500_000_000),
        ("1000", 1000),
        ("64KiB", 65536),
        ("3k", 3000),
        (" 2gib ", 2147483648),
        ("100B", 100),
    ],
)
def test_memory_size(text, size):
    assert memory_size(text) == size


@pytest.mark.parametrize("text", ["lots", "", "GiB", "1.5.5G"])
def test_memory_size_rejects_nonsense(text):
    with pytest.raises(argparse.ArgumentTypeError):
        memory_size(text)


def test_memory_size_rejects_infinity_with_a_unit():
    with pytest.raises(argparse.ArgumentTypeError):
        memory_size("infGiB")


def test_memory_size_error_message():
    with pytest.raises(argparse.ArgumentTypeError) as error:
        memory_size("lots")
    assert str(error.value) == "not a memory size: 'lots'"


# ------------------------------------------------------------------ command line
def test_command_line_round_trip():
    args = make_parser().parse_args(
        [
            "--workers",
            "3",
            "--max-workers",
            "4",
            "--kv-cache-memory",
            "1GiB",
            "--no-enable-prefix-caching",
            "--placement",
            "round_robin",
            "--dtype",
            "bfloat16",
            "--worker-num-cpus",
            "2.5",
        ]
    )
    config = config_from_args(args)
    assert config.workers == 3
    assert config.max_workers == 4
    assert config.min_workers is None
    assert config.kv_cache_memory == 1073741824
    assert config.enable_prefix_caching is False
    assert config.placement == "round_robin"
    assert config.dtype == "bfloat16"
    assert config.worker_num_cpus == 2.5
    assert config.pool_bounds == (3, 4)


def test_command_line_defaults_are_the_config_defaults():
    config = config_from_args(make_parser().parse_args([]))
    assert config == ClusterConfig()
    assert config.enable_prefix_caching is True
    assert config.kv_cache_memory is None


def test_enable_prefix_caching_flag():
    args = make_parser().parse_args(["--enable-prefix-caching"])
    assert config_from_args(args).enable_prefix_caching is True


def test_config_from_args_overrides_win():
    args = make_parser().parse_args(["--workers", "3", "--max-workers", "4"])
    config = config_from_args(args, workers=2, address="auto")
    assert config.workers == 2
    assert config.address == "auto"
    assert config.max_workers == 4


def test_config_from_args_validates():
    args = make_parser().parse_args(["--workers", "5", "--max-workers", "4"])
    with pytest.raises(ConfigError) as error:
        config_from_args(args)
    assert error.value.args[0].startswith("workers: 5 is above max_workers")


def test_config_from_args_with_fields_skipped():
    parser = make_parser(skip=("address", "namespace"))
    args = parser.parse_args([])
    assert not hasattr(args, "address")
    config = config_from_args(args)
    assert config.address is None
    assert config.namespace == "tessera"


def test_bad_values_are_refused_by_the_parser(capsys):
    for argv in (["--kv-cache-memory", "lots"], ["--dtype", "int4"], ["--workers", "two"]):
        with pytest.raises(SystemExit):
            make_parser().parse_args(argv)
    assert "not a memory size: 'lots'" in capsys.readouterr().err


def test_every_field_has_a_flag_with_help():
    parser = make_parser()
    by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
    for name in ClusterConfig.model_fields:
        flag = "--" + name.replace("_", "-")
        assert flag in by_flag, flag
        action = by_flag[flag]
        assert action.dest == name
        assert action.help and action.help.strip(), flag
    assert "--no-enable-prefix-caching" in by_flag


def test_help_text_comes_from_the_description_and_default():
    parser = make_parser()
    by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
    assert by_flag["--block-size"].help == "tokens per KV block (default: 16)"
    assert by_flag["--dtype"].choices == ("auto", "int8", "float32", "bfloat16", "float16")
    assert by_flag["--device"].choices == ("auto", "cpu", "cuda")


def test_skipped_fields_have_no_flag():
    parser = make_parser(skip=("address",))
    flags = {flag for action in parser._actions for flag in action.option_strings}
    assert "--address" not in flags
    assert "--namespace" in flags


def test_full_help_renders():
    text = make_parser().format_help()  # '%' in descriptions must be escaped
    assert "10% of the worker's free memory" in text
    assert "--kv-cache-memory" in text


@pytest.mark.parametrize(
    ("fields", "device", "cpus", "expected"),
    [
        ({}, "cpu", 2, 2.0),  # one worker takes the machine
        ({"workers": 2}, "cpu", 16, 8.0),
        ({"min_workers": 1, "max_workers": 4}, "cpu", 16, 4.0),  # room for the ceiling
        ({"workers": 3}, "cpu", 2, 1.0),  # at least one
        ({"prefill_workers": 1, "decode_workers": 2}, "cpu", 12, 4.0),
        ({}, "cuda", 16, 1.0),
        ({"worker_num_cpus": 0.5}, "cpu", 16, 0.5),  # as configured
    ],
)
def test_worker_cpus_default_to_the_machine(monkeypatch, fields, device, cpus, expected):
    import ray

    from tessera.cluster.launch import resolve_worker_cpus

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": float(cpus)})
    assert resolve_worker_cpus(ClusterConfig.create(**fields), device) == expected

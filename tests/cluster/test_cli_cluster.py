"""`tessera cluster` as a user runs it: a real process joining the session's Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest
import ray

from tessera.cluster.config import ClusterConfig
from tessera.workers.api import SamplingParams
from tests.helpers import run_engine, text_of

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CLI = [sys.executable, "-m", "tessera.cluster.cli", "cluster"]


def test_help_has_a_flag_for_every_config_field():
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, check=True).stdout
    for name in ClusterConfig.model_fields:
        assert "--" + name.replace("_", "-") in out, name


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "0"], "error: workers: the cluster needs at least one worker, got 0"),
        (["--block-size", "0"], "error: block_size: Input should be greater than or equal to 1"),
        (["--model", "/no/such/dir"], "error: model: path '/no/such/dir' does not exist"),
        (["--kv-cache-memory", "1000TiB"], "error: kv_cache_memory: "),
    ],
)
def test_bad_flags_fail_at_start_naming_the_field(flags, message):
    done = subprocess.run([*CLI, *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr


def test_cluster_runs_prompts_like_the_engine(ray_session, make_engine):
    prompt = "The capital of France is"
    engine = make_engine()
    engine.add_request("ref", prompt, SamplingParams(max_tokens=8, temperature=0))
    expected = text_of(run_engine(engine)["ref"])
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run(
        [
            *CLI,
            "--address",
            address,
            "--namespace",
            "cli-test",
            "--workers",
            "1",
            "--num-kv-blocks",
            "128",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--prompt",
            prompt,
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    assert "mixed-0 healthy: 1 placed" in done.stderr
    assert "float32, exact mode" in done.stderr

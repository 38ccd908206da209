"""The chaos soak (benchmarks/soak.py) for 2 minutes against a real `tessera serve`
with two workers and two front-end replicas: a worker, the scheduler and a replica are
killed in turn under a streaming load, and nothing may be lost, altered or leaked."""

from __future__ import annotations

import asyncio
import os

import pytest

from benchmarks.soak import PROMPTS, Soak, references, soak
from tests.cluster.serve_process import serve_process

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MAX_TOKENS = 24


def test_two_minutes_of_chaos_lose_alter_and_leak_nothing(ray_session, tmp_path, make_engine):
    expected = references(PROMPTS, MAX_TOKENS, engine=make_engine())
    settings = (
        "served_model_name: soak\n"
        "workers: 2\n"
        "dtype: float32\n"
        "num_kv_blocks: 256\n"
        "device: cpu\n"
        "report_interval_s: 0.1\n"
        "min_replicas: 2\n"
        "max_replicas: 2\n"
    )
    with serve_process(tmp_path, settings, "soak-key", "soak-test") as server:
        runner = Soak(
            server.url,
            "soak-key",
            "soak",
            "tessera-scheduler",
            "soak-test",
            expected,
            MAX_TOKENS,
            concurrency=6,
            stall_s=60,
        )
        result = asyncio.run(soak(runner, os.getpid(), warmup_s=20, seconds=100, fault_every_s=25))

    tally = result["tally"]
    report = {**tally.record(), "faults": result["faults"], "leaks": result["leaks"]}
    assert [f["kind"] for f in result["faults"]] == ["worker", "scheduler", "replica"], report
    assert not any("not injected" in f["what"] for f in result["faults"]), report
    assert tally.ok >= 20, report
    assert (tally.altered, tally.lost, tally.unclean) == (0, 0, 0), dict(tally.failures)
    assert result["leaks"]["settled"], report
    roles = {row["role"] for row in result["memory"]}
    assert {"Serve proxy", "Serve controller", "worker", "front-end replica"} <= roles
    for row in result["memory"]:
        assert row["growth"] < 0.05, (row, result["memory"])

"""Two front-end replicas behind Ray Serve (`tessera serve` with min_replicas 2):
both serve, one scrape of /metrics shows both replicas' request series and the
cluster's once, and killing one replica mid-load loses only the streams it held (their
clients get an error at once, never a hang) while the other goes on serving; the
worker frees what the lost streams held."""

from __future__ import annotations

import asyncio
import collections
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from tessera.cluster.front_end import METRICS_PUBLISH_S
from tessera.cluster.serve_app import REPLICA_HEADER
from tessera.workers.api import SamplingParams
from tests.cluster.serve_process import Server, serve_process
from tests.helpers import run_engine, text_of

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

API_KEY = "replicas-key"
NAMESPACE = "replicas-test"
MODEL = "smol-replicas"


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory) -> Server:
    settings = (
        f"served_model_name: {MODEL}\n"
        "num_kv_blocks: 256\n"
        "device: cpu\n"
        "report_interval_s: 0.1\n"
        "max_ongoing_requests: 16\n"
        "min_replicas: 2\n"
        "max_replicas: 2\n"
    )
    root = tmp_path_factory.mktemp("replicas")
    with serve_process(root, settings, API_KEY, NAMESPACE) as server:
        yield server


def engine_text(make_engine, prompt: str, max_tokens: int, ignore_eos: bool = False) -> str:
    engine = make_engine()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    engine.add_request("ref", prompt, params)
    return text_of(run_engine(engine)["ref"])


def replicas_seen(server: Server, tries: int = 60) -> set[str]:
    seen = set()
    for _ in range(tries):
        seen.add(httpx.get(f"{server.url}/health").headers[REPLICA_HEADER])
        if len(seen) == 2:
            break
    return seen


def request_counts(server: Server) -> tuple[dict[str, float], int]:
    """/metrics: completions answered 200 per replica, and how many samples the
    cluster-wide queue gauge has."""
    per_replica, queue_samples = collections.Counter(), 0
    metrics = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == "tessera_requests_total" and s.labels["endpoint"] == "completions":
                per_replica[s.labels["replica"]] += s.value if s.labels["status"] == "200" else 0
            if s.name == "tessera_queued_requests":
                queue_samples += 1
    return per_replica, queue_samples


def test_both_replicas_serve_and_one_scrape_shows_both(server):
    assert len(replicas_seen(server)) == 2
    before, _ = request_counts(server)
    served = collections.Counter()
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    while len(served) < 2 or sum(served.values()) < 8:
        response = httpx.post(
            f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60
        )
        assert response.status_code == 200, response.text
        served[response.headers[REPLICA_HEADER]] += 1
        assert sum(served.values()) < 60, "Serve sent everything to one replica"
    time.sleep(METRICS_PUBLISH_S + 1)  # each replica published its counts
    for _ in range(4):  # whichever replica answers the scrape shows both, and the cluster once
        after, queue_samples = request_counts(server)
        assert {r: after[r] - before.get(r, 0) for r in served} == dict(served)
        assert queue_samples == 1


def test_a_killed_replica_loses_only_its_streams_and_the_other_serves_on(server, make_engine):
    assert len(replicas_seen(server)) == 2
    prompts = [f"Write a long story about a lighthouse keeper named {i}." for i in range(8)]
    max_tokens = 48
    replica_of: dict[int, str] = {}
    texts = [""] * len(prompts)
    outcome: dict[int, str] = {}
    started = asyncio.Event()
    placed = collections.defaultdict(asyncio.Event)  # i: its response headers came
    chunks = collections.Counter()

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": prompts[i],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            async with client.stream(
                "POST", f"{server.url}/v1/completions", json=body, headers=server.headers
            ) as response:
                assert response.status_code == 200
                replica_of[i] = response.headers[REPLICA_HEADER]
                placed[i].set()
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        event = httpx.Response(200, content=line[6:]).json()
                        if "error" in event:
                            outcome[i] = "error event"
                            return
                        texts[i] += event["choices"][0]["text"]
                        chunks[i] += 1
                        if len(chunks) == len(prompts) and min(chunks.values()) >= 2:
                            started.set()
                    elif line == "data: [DONE]":
                        outcome[i] = "done"
            outcome.setdefault(i, "cut")  # the stream ended without [DONE]
        except httpx.HTTPError as error:
            outcome[i] = f"error {type(error).__name__}"

    async def main() -> float:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, read=30)) as client:
            tasks = []
            for i in range(len(prompts)):  # one by one: Serve spreads them like test 1's
                tasks.append(asyncio.create_task(stream(client, i)))
                await asyncio.wait_for(placed[i].wait(), 60)
            await asyncio.wait_for(started.wait(), 120)
            victim = replica_of[0]
            assert set(replica_of.values()) == set(replicas_seen(server)), "both hold streams"
            actor = ray.get_actor(f"SERVE_REPLICA::tessera#tessera#{victim}", namespace="serve")
            ray.kill(actor, no_restart=True)
            killed = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            return victim, time.monotonic() - killed

    victim, ended_after = asyncio.run(main())
    for i, prompt in enumerate(prompts):
        if replica_of[i] == victim:
            # an error the client sees (the proxy cuts the chunked body), never a
            # stream that looks finished or a silent end
            assert outcome[i].startswith("error"), (i, outcome[i])
        else:
            assert outcome[i] == "done", (i, outcome[i])
            assert texts[i] == engine_text(make_engine, prompt, max_tokens, ignore_eos=True), i
    assert ended_after < 30, "the lost streams ended at once, not by a timeout"

    # the other replica serves on
    body = {"model": MODEL, "prompt": prompts[0], "max_tokens": 8, "temperature": 0}
    for _ in range(4):
        response = httpx.post(
            f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60
        )
        assert response.status_code == 200, response.text
        assert response.headers[REPLICA_HEADER] != victim
        assert response.json()["choices"][0]["text"] == engine_text(make_engine, prompts[0], 8)

    # nothing the lost streams held stays: no placement, every KV block free again
    deadline = time.monotonic() + 60
    while True:
        (worker,) = ray.get(server.scheduler().stats.remote()).workers
        engine = worker.load.engine
        if worker.ongoing == 0 and engine.running == 0 and engine.free_blocks == 256:
            break
        assert time.monotonic() < deadline, (worker.ongoing, engine)
        time.sleep(0.5)

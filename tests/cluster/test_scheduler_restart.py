"""A scheduler killed with SIGKILL comes back: `tessera serve` with 16 streams in flight.

The workers are detached actors, so they outlive the scheduler; Ray restarts it; it
takes them back by name, recounts what runs on them from their reports, and resumes
placement. The streams never pass through the scheduler, so every one finishes with
the text the in-process engine gives; a request sent while it is down waits and
completes; `tessera serve` still stops cleanly (``serve_process`` checks).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from tessera.workers.api import SamplingParams
from tests.cluster.serve_process import serve_process
from tests.helpers import run_engine, text_of

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAMESPACE = "restart-test"
MODEL = "smol-restart"
PROMPTS = [f"Write item {i} of a list of facts about lighthouses:" for i in range(16)]
# Long enough to outlast the scheduler's restart (~3.3 s on a 2-core Zen 5 EPYC, where
# 16 streams of 48 tokens had all ended before it, and nothing was left to recount).
MAX_TOKENS = 320


def _stream(client, prompt: str, texts: dict, errors: list) -> None:
    try:
        stream = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        texts[prompt] = "".join(chunk.choices[0].text for chunk in stream)
    except Exception as error:  # the test fails on any
        errors.append(f"{prompt!r}: {type(error).__name__}: {error}")


def _healthy_again(scheduler, timeout_s: float = 60):
    """The restarted scheduler's stats once it has taken its workers back."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stats = ray.get(scheduler.stats.remote(), timeout=5)
            if stats.workers and all(w.status.value == "healthy" for w in stats.workers):
                return stats
        except Exception:  # still down
            pass
        assert time.monotonic() < deadline, "the scheduler did not come back"
        time.sleep(0.1)


def test_scheduler_sigkill_mid_load_loses_nothing(ray_session, tmp_path, make_engine):
    settings = (
        f"served_model_name: {MODEL}\n"
        "num_kv_blocks: 256\n"
        "device: cpu\n"
        "report_interval_s: 0.1\n"
        "max_ongoing_requests: 16\n"
    )
    expected = {}
    engine = make_engine()
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy)
    outputs = run_engine(engine)
    expected = {prompt: text_of(outputs[f"r{i}"]) for i, prompt in enumerate(PROMPTS)}

    with serve_process(tmp_path, settings, "restart-key", NAMESPACE) as server:
        scheduler = server.scheduler()
        before = ray.get(scheduler.stats.remote())
        workers = [(w.worker_id, w.incarnation) for w in before.workers]
        client = server.client()
        texts: dict[str, str] = {}
        errors: list[str] = []
        threads = [
            threading.Thread(target=_stream, args=(client, p, texts, errors)) for p in PROMPTS
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while sum(w.ongoing for w in ray.get(scheduler.stats.remote()).workers) < 16:
            assert time.monotonic() < deadline, "the 16 streams did not start"
            time.sleep(0.05)
        os.kill(ray.get(scheduler.pid.remote()), signal.SIGKILL)
        # Sent while the scheduler is down: it waits for the new one, then completes.
        late: dict[str, str] = {}
        late_thread = threading.Thread(target=_stream, args=(client, PROMPTS[0], late, errors))
        late_thread.start()
        after = _healthy_again(scheduler)
        assert [(w.worker_id, w.incarnation) for w in after.workers] == workers
        assert any("scheduler restarted: took back 1 live workers" in e for e in after.events)
        # the streams placed before the kill (still running) are counted from the worker's report
        assert len(texts) < len(PROMPTS), "every stream ended before the scheduler came back"
        assert 0 < sum(w.ongoing for w in after.workers) <= 17
        for thread in [*threads, late_thread]:
            thread.join(timeout=300)
        assert errors == []
        assert texts == expected
        assert late == {PROMPTS[0]: expected[PROMPTS[0]]}
        deadline = time.monotonic() + 10
        while True:  # every stream ended: nothing in flight, on the live worker only
            stats = ray.get(scheduler.stats.remote())
            if [(w.worker_id, w.ongoing, w.status.value) for w in stats.workers] == [
                (workers[0][0], 0, "healthy")
            ]:
                break
            assert time.monotonic() < deadline, stats.workers
            time.sleep(0.1)

"""Soaks: a streaming load on a real `tessera serve` while its parts are killed, or
(`--hostile`, benchmarks/soak_hostile.py) while hostile traffic runs beside it.

Peer: the same server and load without faults (run first, ``--baseline-s``); the ratio
is the output tokens per second under chaos over that. Every request is a greedy
streaming completion whose text is known from the in-process engine (the reference):

- a request that finishes must have exactly that text (else it is *altered*);
- a failed attempt must be a clean, retriable error: HTTP 408/429/503, an SSE error
  event of type timeout/overloaded/unavailable, a connection the server cut (a killed
  front-end replica), or Serve's proxy's plain HTTP 500 for a request that reached a
  replica as it died (counted apart in ``failures``); the client retries it. Anything
  else (our own 500, a stream that ends without ``[DONE]`` or an error, a stream silent
  for ``--stall-s``) is *unclean*; a request that never finishes in ``--attempts`` tries is *lost*;
- afterwards no KV block may stay in use and no placement may stay open (*leaked*);
- the resident memory of every long-lived process (Serve replicas, proxy and
  controller, the scheduler, the workers, ``tessera serve``) that lived through the
  soak may grow less than 5% after the warm-up.

Faults, in turn every ``--fault-every-s``: SIGKILL of the worker with the most
requests, SIGKILL of the scheduler, ``ray.kill`` of a front-end replica. Ray restarts
workers and the scheduler, Serve replaces the replica.

    python benchmarks/soak.py                   # 10 minutes of chaos, 2 of baseline
    python benchmarks/soak.py --duration-s 120 --baseline-s 0
    python benchmarks/soak.py --hostile         # 60 s without, then 60 s with hostile traffic

The test (tests/cluster/test_soak.py) runs the same ``Soak`` for 2 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil
import ray

from tessera.cluster.serve_app import REPLICA_HEADER

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: `benchmarks` is then importable
    sys.path.insert(0, str(ROOT))

RETRIABLE_STATUS = (408, 429, 503)
RETRIABLE_TYPES = ("timeout_error", "overloaded_error", "unavailable_error")
FAULT_KINDS = ("worker", "scheduler", "replica")
#: Process titles (Ray's ``ray::<class>``) of the long-lived processes, and their role.
ROLES = {
    "ray::ServeReplica": "front-end replica",
    "ray::ProxyActor": "Serve proxy",
    "ray::ServeController": "Serve controller",
    "ray::Scheduler": "scheduler",
    "ray::WorkerActor": "worker",
}
#: Completion prompts of different lengths (the server sees them without a template).
PROMPTS = [
    "The lighthouse keeper climbed the stairs at dusk and",
    "Here is a short list of things to pack for a rainy weekend: an umbrella,",
    "Customs forms ask for the value of every item in a parcel, because",
    "A bicycle stays upright while it moves since",
    "Dear customer, your order number 1042 has shipped and will arrive",
    "In the old harbour town, every morning began with the sound of",
    "To bake bread at home you need flour, water, salt and",
    "The difference between weather and climate is that",
    "Once upon a time, a small robot who loved gardening decided to",
    "The three most important rules of keeping bees are",
    "When the train stopped in the middle of the snowy field, the passengers",
    "Recipe for a quick dinner: heat the olive oil, add the onions and",
]


@dataclass
class Tally:
    ok: int = 0
    altered: int = 0
    lost: int = 0
    retried: int = 0  # clean, retriable failed attempts
    unclean: int = 0
    tokens: int = 0
    failures: collections.Counter = field(default_factory=collections.Counter)
    finished_at: list[float] = field(default_factory=list)  # per ok request, since start
    latencies: list[float] = field(default_factory=list)  # per ok request, retries included
    ttfts: list[float] = field(default_factory=list)  # per ok request, its last attempt's

    def record(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "altered": self.altered,
            "lost": self.lost,
            "retried": self.retried,
            "unclean": self.unclean,
            "output_tokens": self.tokens,
            "failures": dict(self.failures.most_common()),
            "latency_s": {f"p{q}": percentile(self.latencies, q) for q in (50, 99)},
            "ttft_s": {f"p{q}": percentile(self.ttfts, q) for q in (50, 99)},
        }


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``values``; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)], 4)


def references(
    prompts: list[str], max_tokens: int, engine=None, ignore_eos: bool = False
) -> dict[str, tuple[str, list[int]]]:
    """Each prompt's greedy text and token ids from the in-process engine (float32, the
    built-in model unless ``engine`` is given): the reference the outputs must equal."""
    from tessera.workers.api import SamplingParams
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine

    engine = engine or Engine(EngineConfig(num_kv_blocks=512))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    texts: dict[str, str] = collections.defaultdict(str)
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    while engine.has_work():
        for output in engine.step():
            texts[output.request_id] += output.text
            tokens[output.request_id].extend(output.token_ids)
    return {prompt: (texts[str(i)], tokens[str(i)]) for i, prompt in enumerate(prompts)}


def long_lived(root_pid: int) -> dict[int, tuple[str, int]]:
    """pid -> (role, resident bytes) of the long-lived processes under ``root_pid``."""
    out = {}
    try:
        processes = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return out
    for process in processes:
        try:
            title = (process.cmdline() or [""])[0]
            role = next((r for prefix, r in ROLES.items() if title.startswith(prefix)), None)
            if role is None and "tessera.cluster.cli" in " ".join(process.cmdline()):
                role = "tessera serve"
            if role is not None:
                out[process.pid] = (role, process.memory_info().rss)
        except psutil.Error:  # gone meanwhile
            continue
    return out


class Soak:
    """The load, the faults and the accounting against one running server."""

    def __init__(
        self,
        url: str,
        api_key: str,
        model: str,
        scheduler_name: str,
        namespace: str,
        expected: dict[str, tuple[str, list[int]]],
        max_tokens: int,
        concurrency: int = 8,
        stall_s: float = 60.0,
        attempts: int = 8,
        seed: int = 0,
    ) -> None:
        self.url, self.model = url, model
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.scheduler_name, self.namespace = scheduler_name, namespace
        self.expected, self.max_tokens = expected, max_tokens
        self.concurrency, self.stall_s, self.attempts = concurrency, stall_s, attempts
        self.random = random.Random(seed)
        self.replicas: set[str] = set()  # seen in responses
        self.faults: list[dict[str, Any]] = []

    def scheduler(self):
        return ray.get_actor(self.scheduler_name, namespace=self.namespace)

    # ---------------------------------------------------------------- the load
    async def _attempt(
        self, client: httpx.AsyncClient, prompt: str
    ) -> tuple[str, str, float | None]:
        """("done", text, seconds to its first text) or (failure kind, "retriable" |
        "unclean", None)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        timeout = httpx.Timeout(30.0, read=self.stall_s)
        start, first = time.monotonic(), None
        try:
            async with client.stream(
                "POST",
                f"{self.url}/v1/completions",
                json=body,
                headers=self.headers,
                timeout=timeout,
            ) as response:
                if REPLICA_HEADER in response.headers:
                    self.replicas.add(response.headers[REPLICA_HEADER])
                if response.status_code != 200:
                    body = await response.aread()
                    if response.status_code == 500 and not body.startswith(b"{"):
                        # Serve's proxy: the replica died after the request reached it
                        # and before it answered (Ray Serve sends no body of its own for
                        # that, so uvicorn's plain 500 goes out); nothing had started
                        return "HTTP 500 from Serve's proxy (its replica died)", "retriable", None
                    kind = "retriable" if response.status_code in RETRIABLE_STATUS else "unclean"
                    return f"HTTP {response.status_code}", kind, None
                text = ""
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        return "done", text, first
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        kind = event["error"].get("type")
                        return (
                            f"error event {kind}",
                            ("retriable" if kind in RETRIABLE_TYPES else "unclean"),
                            None,
                        )
                    text += event["choices"][0]["text"]
                    if first is None and text:
                        first = time.monotonic() - start
                return "ended without [DONE]", "unclean", None
        except httpx.ReadTimeout:
            return f"silent for {self.stall_s} s", "unclean", None
        except httpx.TransportError as error:  # cut or refused: a replica died
            return f"connection {type(error).__name__}", "retriable", None

    async def _client(self, client: httpx.AsyncClient, tally: Tally, start: float, stop: float):
        while time.monotonic() < stop:
            prompt = self.random.choice(list(self.expected))
            begun = time.monotonic()
            for _ in range(self.attempts):
                outcome, detail, ttft = await self._attempt(client, prompt)
                if outcome == "done":
                    text, tokens = self.expected[prompt]
                    if detail == text:
                        tally.ok += 1
                        tally.tokens += len(tokens)
                        tally.finished_at.append(time.monotonic() - start)
                        tally.latencies.append(time.monotonic() - begun)
                        if ttft is not None:
                            tally.ttfts.append(ttft)
                    else:
                        tally.altered += 1
                        tally.failures[f"altered: {prompt[:30]!r}"] += 1
                    break
                tally.failures[outcome] += 1
                if detail == "unclean":
                    tally.unclean += 1
                else:
                    tally.retried += 1
                await asyncio.sleep(0.5)
            else:
                tally.lost += 1

    async def load(self, seconds: float, faults: bool, fault_every_s: float) -> Tally:
        tally = Tally()
        start = time.monotonic()
        stop = start + seconds
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
            clients = [
                asyncio.create_task(self._client(client, tally, start, stop))
                for _ in range(self.concurrency)
            ]
            chaos = asyncio.create_task(self._chaos(start, stop, fault_every_s)) if faults else None
            await asyncio.gather(*clients)
            if chaos is not None:
                chaos.cancel()
        return tally

    # ---------------------------------------------------------------- the faults
    async def _chaos(self, start: float, stop: float, every_s: float) -> None:
        for n in range(10**6):
            await asyncio.sleep(start + (n + 1) * every_s - time.monotonic())
            if time.monotonic() > stop - every_s / 2:
                return
            kind = FAULT_KINDS[n % len(FAULT_KINDS)]
            try:
                what = await getattr(self, f"_kill_{kind}")()
            except Exception as error:  # a fault that could not be made is recorded
                what = f"not injected: {type(error).__name__}: {error}"
            self.faults.append(
                {"at_s": round(time.monotonic() - start, 1), "kind": kind, "what": what}
            )
            print(f"  fault at {self.faults[-1]['at_s']} s: {kind}: {what}", flush=True)

    async def _kill_worker(self) -> str:
        scheduler = self.scheduler()
        stats = await scheduler.stats.remote()
        worker = max(stats.workers, key=lambda w: (w.ongoing, self.random.random()))
        handle = await scheduler.worker_handle.remote(worker.worker_id)
        pid = (await handle.info.remote()).pid
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL worker {worker.worker_id} (pid {pid}, {worker.ongoing} requests)"

    async def _kill_scheduler(self) -> str:
        pid = await self.scheduler().pid.remote()
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL scheduler (pid {pid})"

    async def _kill_replica(self) -> str:
        for replica in sorted(self.replicas):
            self.replicas.discard(replica)
            try:
                actor = ray.get_actor(
                    f"SERVE_REPLICA::tessera#tessera#{replica}", namespace="serve"
                )
            except ValueError:  # gone already
                continue
            ray.kill(actor, no_restart=True)
            return f"ray.kill front-end replica {replica}"
        return "not injected: no live replica seen"

    # ---------------------------------------------------------------- the checks
    async def leaks(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Once idle: placements still open and KV blocks still in use, per worker."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = await self.scheduler().stats.remote()
            leaked = {
                w.worker_id: {
                    "ongoing": w.ongoing,
                    "blocks_in_use": w.load.engine.total_blocks - w.load.engine.free_blocks,
                    "running": w.load.engine.running,
                }
                for w in stats.workers
                if w.load is not None
            }
            settled = len(leaked) == len(stats.workers) and not any(
                any(v.values()) for v in leaked.values()
            )
            if settled or time.monotonic() > deadline:
                return {"workers": leaked, "settled": settled, "queued": stats.queued}
            await asyncio.sleep(0.5)


def memory_growth(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]):
    """Rows for the processes alive at both samples: role, pid, MB before/after, growth."""
    rows = []
    for pid, (role, rss) in sorted(before.items(), key=lambda kv: kv[1][0]):
        if pid in after and after[pid][0] == role:
            rows.append(
                {
                    "role": role,
                    "pid": pid,
                    "rss_mb_after_warmup": round(rss / 2**20, 1),
                    "rss_mb_end": round(after[pid][1] / 2**20, 1),
                    "growth": round(after[pid][1] / rss - 1, 4),
                }
            )
    return rows


async def soak(
    soak_: Soak, root_pid: int, warmup_s: float, seconds: float, fault_every_s: float
) -> dict[str, Any]:
    """Warm up, sample memory, run the load with faults, check leaks and memory."""
    await soak_.load(warmup_s, faults=False, fault_every_s=fault_every_s)
    before = long_lived(root_pid)
    tally = await soak_.load(seconds, faults=True, fault_every_s=fault_every_s)
    leaks = await soak_.leaks()
    rows = memory_growth(before, long_lived(root_pid))
    return {
        "tally": tally,
        "faults": soak_.faults,
        "leaks": leaks,
        "memory": rows,
        "seconds": seconds,
    }


# ------------------------------------------------------------------ the benchmark
def arguments() -> argparse.ArgumentParser:
    """The command line of both soaks."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600, help="the chaos soak")
    parser.add_argument("--baseline-s", type=float, default=120, help="the same load, no faults")
    parser.add_argument("--warmup-s", type=float, default=30)
    parser.add_argument("--fault-every-s", type=float, default=30)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--stall-s", type=float, default=60)
    parser.add_argument("--attempts", type=int, default=8)
    parser.add_argument(
        "--hostile",
        action="store_true",
        help="the hostile-neighbour soak instead (benchmarks/soak_hostile.py)",
    )
    parser.add_argument("--phase-s", type=float, default=60, help="--hostile: each phase")
    parser.add_argument(
        "--fuzz-examples", type=int, default=25, help="--hostile: fuzzer cases per route and mode"
    )
    parser.add_argument(
        "--hostile-kinds",
        help="--hostile: some kinds of hostile traffic only, comma-separated (default: all "
        "of benchmarks/hostile.py's KINDS)",
    )
    return parser


def main() -> None:
    args = arguments().parse_args()
    if args.hostile:
        from benchmarks.soak_hostile import main as hostile_main

        hostile_main(args)
        return

    from benchmarks.common import machine, report
    from benchmarks.serve_load import start_server, stop_server

    print("references from the in-process engine ...", flush=True)
    expected = references(PROMPTS, args.max_tokens)
    cpus = os.cpu_count() or 2
    ray.init(
        num_cpus=max(cpus, args.workers),
        namespace="soak",
        include_dashboard=False,
        log_to_driver=False,
    )
    settings = (
        f"workers: {args.workers}\nworker_num_cpus: 1\ndevice: cpu\ndtype: float32\n"
        f"num_kv_blocks: 256\nreport_interval_s: 0.25\nmin_replicas: {args.replicas}\n"
        f"max_replicas: {args.replicas}\nnamespace: soak\nserved_model_name: smollm2\n"
    )
    config = Path(tempfile.mkdtemp(prefix="tessera-soak-")) / "serve.yaml"
    config.write_text(settings)
    server_args = SimpleNamespace(
        url=f"http://127.0.0.1:{args.port}",
        serve_args=[
            "--config",
            str(config),
            "--address",
            ray.get_runtime_context().gcs_address,
            "--api-key",
            "soak",
        ],
        start_timeout_s=600,
    )
    process = start_server(server_args)
    try:
        runner = Soak(
            server_args.url,
            "soak",
            "smollm2",
            "tessera-scheduler",
            "soak",
            expected,
            args.max_tokens,
            args.concurrency,
            args.stall_s,
            args.attempts,
        )
        baseline = None
        if args.baseline_s:
            print(f"baseline: {args.baseline_s:.0f} s without faults ...", flush=True)
            baseline = asyncio.run(runner.load(args.baseline_s, False, args.fault_every_s))
        print(
            f"soak: {args.duration_s:.0f} s, a fault every {args.fault_every_s:.0f} s ...",
            flush=True,
        )
        result = asyncio.run(
            soak(runner, os.getpid(), args.warmup_s, args.duration_s, args.fault_every_s)
        )
    finally:
        stop_server(process)
        ray.shutdown()

    tally: Tally = result["tally"]
    rate = tally.tokens / args.duration_s
    base_rate = baseline.tokens / args.baseline_s if baseline else None
    leaked = sum(v["blocks_in_use"] + v["ongoing"] for v in result["leaks"]["workers"].values())
    worst = max((r["growth"] for r in result["memory"]), default=0.0)
    table = [
        ["requests ok", tally.ok],
        ["altered", tally.altered],
        ["lost", tally.lost],
        ["unclean failures", tally.unclean],
        ["clean retriable failures (retried)", tally.retried],
        ["leaked (blocks in use + open placements)", leaked],
        ["faults injected", sum("not injected" not in f["what"] for f in result["faults"])],
        ["worst memory growth after warm-up", f"{worst:.1%}"],
        ["output tok/s under chaos", f"{rate:.1f}"],
        ["output tok/s without faults (peer)", f"{base_rate:.1f}" if base_rate else "-"],
        ["ratio chaos / no faults", f"{rate / base_rate:.2f}x" if base_rate else "-"],
    ]
    record = {
        "args": vars(args),
        "machine": machine(),
        "soak": tally.record(),
        "baseline": baseline.record() if baseline else None,
        "ratio_vs_no_faults": rate / base_rate if base_rate else None,
        "faults": result["faults"],
        "leaks": result["leaks"],
        "memory": result["memory"],
        "pass": tally.altered == tally.lost == tally.unclean == leaked == 0 and worst < 0.05,
    }

    def plot(ax) -> None:
        times = sorted(tally.finished_at)
        ax.plot(times, range(1, len(times) + 1), label="requests finished (exact)")
        for fault in result["faults"]:
            ax.axvline(fault["at_s"], color="red", alpha=0.3)
        ax.set_xlabel("seconds into the soak (red: a fault)")
        ax.set_ylabel("requests")
        ax.legend()

    report("soak", [{"measure": m, "value": v} for m, v in table], record, plot)
    for row in result["memory"]:
        print(
            f"  {row['role']:<18} pid {row['pid']:<8} {row['rss_mb_after_warmup']:>8} MB ->"
            f" {row['rss_mb_end']:>8} MB ({row['growth']:+.1%})"
        )
    print(json.dumps({"pass": record["pass"]}))


if __name__ == "__main__":
    main()

"""Hostile-neighbour soak: a valid streaming load, alone and then beside hostile traffic.

    python benchmarks/soak.py --hostile                 # 60 s per phase
    python benchmarks/soak.py --hostile --phase-s 90 --fuzz-examples 40
    python benchmarks/soak.py --hostile --hostile-kinds redos,grpc   # some kinds only

One `tessera serve` (a prefill and a decode worker, so the KV path is live; the gRPC
door on; the built-in model in float32; the Serve settings of a Ray that `tessera
serve` starts, so gRPC's message limit is ``max_request_bytes``). The valid load is
``benchmarks/soak.py``'s: ``--concurrency`` streaming clients, greedy completions whose
text must equal the in-process engine's. After a warm-up it runs ``--phase-s`` alone
(the baseline), then ``--phase-s`` beside every kind of ``benchmarks/hostile.py``.

Report: valid requests lost or altered (must be 0), their p50/p99 latency and TTFT
under hostile traffic over the baseline's (target: p99 latency at most
``P99_TARGET`` times), every hostile request's outcome, the resident memory of the
server's long-lived processes before and after the hostile phase, and the server's
state afterwards (healthy, no KV block or placement left).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil
import ray
import schemathesis

from benchmarks.hostile import KINDS, Hostile, Outcomes
from benchmarks.openapi_fuzz import BODIES, fuzz_schema, generate
from benchmarks.soak import (
    PROMPTS,
    Soak,
    Tally,
    long_lived,
    memory_growth,
    percentile,
    references,
)
from tessera.cluster.server import _free_ports, local_ray_env

API_KEY = "soak-hostile"
MODEL = "smollm2"
NAMESPACE = "soak-hostile"
#: The most a hostile phase's p99 latency may be over the baseline's.
P99_TARGET = 1.5
#: Seconds between /health probes, and between memory samples.
PROBE_EVERY_S = 0.5
MEMORY_EVERY_S = 10.0


def fuzz_requests(url: str, headers: dict[str, str], examples: int) -> list[tuple[str, str, dict]]:
    """The OpenAPI fuzzer's cases for every POST route, as httpx request arguments,
    interleaved (route by route, positive and negative in turn) so that a phase too
    short for all of them still sends every kind."""
    served = httpx.get(f"{url}/openapi.json", headers=headers, timeout=30).json()
    from tessera.workers.model.loader import load_tokenizer

    vocab_size = len(load_tokenizer(None))
    lists = []
    for mode in ("positive", "negative"):
        schema = schemathesis.openapi.from_dict(
            fuzz_schema(served, MODEL, vocab_size, positive=mode == "positive")
        )
        for path in BODIES:
            requests = []
            for case in generate(schema, "POST", path, mode, examples):
                sent = case.as_transport_kwargs(base_url=url, headers=headers)
                request = {"method": sent["method"], "url": sent["url"]}
                request["headers"] = sent["headers"]
                if "json" in sent:
                    try:
                        request["content"] = json.dumps(sent["json"], allow_nan=False).encode()
                    except ValueError:  # not JSON (NaN): never sent as it is
                        continue
                elif "data" in sent:
                    request["content"] = sent["data"]
                requests.append((mode, f"{mode} POST {path}", request))
            lists.append(requests)
    interleaved = itertools.zip_longest(*lists)
    return [case for cases in interleaved for case in cases if case is not None]


async def workers(scheduler) -> tuple[dict[str, str], dict[int, str]]:
    """(prefill worker id -> the address of its KV-transfer server, pid -> role and id
    of every worker)."""
    stats = await scheduler.stats.remote()
    targets, names = {}, {}
    for worker in stats.workers:
        handle = await scheduler.worker_handle.remote(worker.worker_id)
        info = await handle.info.remote()
        names[info.pid] = f"{worker.role} worker {worker.worker_id}"
        if worker.role == "prefill" and info.kv_address:
            targets[worker.worker_id] = info.kv_address
    return targets, names


def series_mb(samples: list[dict[int, tuple[str, int]]], names: dict[int, str]) -> dict:
    """Each process's resident MB at every sample of a phase (those alive at its end)."""
    return {
        f"{names.get(pid, role)} (pid {pid})": [
            round(sample[pid][1] / 2**20, 1) for sample in samples if pid in sample
        ]
        for pid, (role, _) in (samples[-1] if samples else {}).items()
    }


def named(rows: list[dict[str, Any]], names: dict[int, str]) -> list[dict[str, Any]]:
    """``memory_growth`` rows with each worker's role and id."""
    return [{**row, "role": names.get(row["pid"], row["role"])} for row in rows]


def cpu_seconds(root_pid: int) -> dict[int, float]:
    """pid -> user + system CPU seconds of ``root_pid`` and every process under it."""
    out = {}
    root = psutil.Process(root_pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
            out[process.pid] = times.user + times.system
        except psutil.Error:  # gone meanwhile
            continue
    return out


def cpu_used(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds between two ``cpu_seconds`` samples: this process (the clients) and
    the rest (the server's processes)."""
    used = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    mine = used.pop(os.getpid(), 0.0)
    return {"clients_s": round(mine, 1), "server_s": round(sum(used.values()), 1)}


async def health_probe(url: str, seconds: float) -> list[float]:
    """Seconds each ``GET /health`` took, one every ``PROBE_EVERY_S``: a replica whose
    event loop stalls answers late."""
    took = []
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        while time.monotonic() < stop:
            start = time.monotonic()
            await client.get(f"{url}/health")
            took.append(time.monotonic() - start)
            await asyncio.sleep(PROBE_EVERY_S)
    return took


async def memory_series(seconds: float) -> list[dict[int, tuple[str, int]]]:
    """``long_lived`` samples every ``MEMORY_EVERY_S`` (the last at the end)."""
    samples = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        await asyncio.sleep(min(MEMORY_EVERY_S, max(stop - time.monotonic(), 0)))
        samples.append(long_lived(os.getpid()))
    return samples


async def phase(
    load: Soak, seconds: float, hostile: Hostile | None, kinds: tuple[str, ...] = KINDS
) -> dict[str, Any]:
    """The valid load for ``seconds``, with ``hostile`` beside it if given, and the
    probes: /health's latency, CPU seconds, memory."""
    cpu = cpu_seconds(os.getpid())
    tasks = [
        load.load(seconds, faults=False, fault_every_s=seconds),
        health_probe(load.url, seconds),
        memory_series(seconds),
    ]
    if hostile is not None:
        tasks.append(hostile.run(seconds, kinds))
    tally, health, memory, *outcomes = await asyncio.gather(*tasks)
    return {
        "tally": tally,
        "health_s": health,
        "memory": memory,
        "cpu": cpu_used(cpu, cpu_seconds(os.getpid())),
        "outcomes": outcomes[0] if outcomes else None,
    }


async def phases(
    load: Soak, hostile: Hostile, warmup_s: float, phase_s: float, kinds: tuple[str, ...]
) -> dict[str, Any]:
    """Warm up; the baseline; the hostile phase; leaks and health afterwards."""
    await load.load(warmup_s, faults=False, fault_every_s=phase_s)
    before = long_lived(os.getpid())
    baseline = await phase(load, phase_s, None)
    under = await phase(load, phase_s, hostile, kinds)
    leaks = await load.leaks()
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        health = (await client.get(f"{load.url}/health")).status_code
    middle = under["memory"][len(under["memory"]) // 2 - 1] if under["memory"] else {}
    after = under["memory"][-1] if under["memory"] else {}
    return {
        "baseline": baseline,
        "hostile": under,
        "leaks": leaks,
        "memory": {
            "baseline": memory_growth(before, baseline["memory"][-1]),
            "hostile": memory_growth(baseline["memory"][-1], after),
            "hostile_second_half": memory_growth(middle, after),
        },
        "health": health,
    }


def ratio(under: Tally, baseline: Tally, measure: str, q: str) -> float | None:
    a, b = under.record()[measure][q], baseline.record()[measure][q]
    return round(a / b, 3) if a and b else None


def main(args) -> None:
    from benchmarks.serve_load import start_server, stop_server

    print("references from the in-process engine ...", flush=True)
    expected = references(PROMPTS, args.max_tokens)
    for name, value in local_ray_env().items():  # as in a Ray that tessera serve starts
        os.environ.setdefault(name, value)
    ray.init(
        num_cpus=max(os.cpu_count() or 2, 2),
        namespace=NAMESPACE,
        include_dashboard=False,
        log_to_driver=False,
    )
    settings = (
        "prefill_workers: 1\ndecode_workers: 1\nworkers: 0\nworker_num_cpus: 1\n"
        "device: cpu\ndtype: float32\nnum_kv_blocks: 256\nreport_interval_s: 0.25\n"
        f"namespace: {NAMESPACE}\nserved_model_name: {MODEL}\n"
    )
    config = Path(tempfile.mkdtemp(prefix="tessera-soak-hostile-")) / "serve.yaml"
    config.write_text(settings)
    (grpc_port,) = _free_ports(1)
    server_args = SimpleNamespace(
        url=f"http://127.0.0.1:{args.port}",
        serve_args=[
            *("--config", str(config)),
            *("--address", ray.get_runtime_context().gcs_address),
            *("--api-key", API_KEY),
            *("--grpc-port", str(grpc_port)),
        ],
        start_timeout_s=600,
    )
    process = start_server(server_args)
    try:
        load = Soak(
            server_args.url,
            API_KEY,
            MODEL,
            "tessera-scheduler",
            NAMESPACE,
            expected,
            args.max_tokens,
            args.concurrency,
            args.stall_s,
            args.attempts,
        )
        headers = {"Authorization": f"Bearer {API_KEY}"}
        cases = fuzz_requests(server_args.url, headers, args.fuzz_examples)
        targets, names = asyncio.run(workers(load.scheduler()))
        print(f"{len(cases)} fuzz cases; KV servers at {targets}", flush=True)
        hostile = Hostile(server_args.url, API_KEY, MODEL, f"127.0.0.1:{grpc_port}", targets, cases)
        print(f"warm-up {args.warmup_s:.0f} s, then {args.phase_s:.0f} s per phase ...")
        kinds = tuple(args.hostile_kinds.split(",")) if args.hostile_kinds else KINDS
        result = asyncio.run(phases(load, hostile, args.warmup_s, args.phase_s, kinds))
    finally:
        stop_server(process)
        ray.shutdown()

    result["memory"] = {phase: named(rows, names) for phase, rows in result["memory"].items()}
    result["memory_series"] = series_mb(result["hostile"]["memory"], names)
    write_report(args, result, len(cases), len(targets))


def command(args) -> str:
    """The command line that reproduces this run (the options that shape it)."""
    from benchmarks.soak import arguments

    defaults = arguments()
    parts = ["python benchmarks/soak.py --hostile"]
    for name in _ARGS:
        value = getattr(args, name)
        if value != defaults.get_default(name):
            shown = f"{value:g}" if isinstance(value, float) else value
            parts.append(f"--{name.replace('_', '-')} {shown}")
    return " ".join(parts)


def _worst(rows: list[dict[str, Any]]) -> str:
    worst = max(rows, key=lambda r: r["growth"], default=None)
    return f"{worst['growth']:+.1%} ({worst['role']})" if worst else "-"


def write_report(args, result: dict[str, Any], fuzz_cases: int, kv_servers: int) -> None:
    """The table, the JSON and the plot (``benchmarks.common.report``)."""
    from benchmarks.common import report, side_panels

    baseline: Tally = result["baseline"]["tally"]
    under: Tally = result["hostile"]["tally"]
    outcomes: Outcomes = result["hostile"]["outcomes"]
    leaked = sum(v["blocks_in_use"] + v["ongoing"] for v in result["leaks"]["workers"].values())
    p99_ratio = ratio(under, baseline, "latency_s", "p99")
    unexpected = sum(outcomes.unexpected.values())
    sent = sum(sum(counter.values()) for counter in outcomes.counts.values())
    b, u = baseline.record(), under.record()
    health = {
        name: {f"p{q}": percentile(result[name]["health_s"], q) for q in (50, 99, 100)}
        for name in ("baseline", "hostile")
    }
    cpu = {name: result[name]["cpu"] for name in ("baseline", "hostile")}
    memory = result["memory"]
    table = [
        ["valid requests ok (baseline / hostile)", f"{baseline.ok} / {under.ok}"],
        ["lost", f"{baseline.lost} / {under.lost}"],
        ["altered", f"{baseline.altered} / {under.altered}"],
        ["unclean failures", f"{baseline.unclean} / {under.unclean}"],
    ]
    for measure, label in (("latency_s", "latency"), ("ttft_s", "TTFT")):
        for q in ("p50", "p99"):
            r = ratio(under, baseline, measure, q)
            table.append([f"{label} {q} (s)", f"{b[measure][q]} / {u[measure][q]} ({r}x)"])
    table += [
        [
            "GET /health p50 / max (s)",
            " / ".join(f"{health[n]['p50']} / {health[n]['p100']}" for n in health),
        ],
        [
            "CPU s: clients, server",
            " / ".join(f"{cpu[n]['clients_s']}, {cpu[n]['server_s']}" for n in cpu),
        ],
        [
            "hostile requests (unexpected outcomes)",
            f"{sent} in {args.phase_s:.0f} s ({unexpected})",
        ],
        ["leaked (blocks in use + open placements)", leaked],
        ["health after", result["health"]],
        ["worst memory growth, baseline phase", _worst(memory["baseline"])],
        ["worst memory growth, hostile phase", _worst(memory["hostile"])],
        ["... its second half", _worst(memory["hostile_second_half"])],
    ]
    for name, row in outcomes.record().items():
        counts = ", ".join(f"{k} x{v}" for k, v in row["outcomes"].items())
        table.append([f"  {name}", f"{counts}; slowest {row['slowest_s']:.2f} s"])
    clean = under.lost == under.altered == under.unclean == 0
    clean = clean and baseline.lost == baseline.altered == baseline.unclean == 0
    record = {
        "command": command(args),
        "peer": "the same load without hostile traffic (same run)",
        "hostile": True,
        "args": {k: v for k, v in vars(args).items() if k in _ARGS},
        "baseline": b,
        "under_hostile": u,
        "p99_latency_ratio": p99_ratio,
        "p99_target": P99_TARGET,
        "health_probe_s": health,
        "cpu_s": cpu,
        "hostile_outcomes": outcomes.record(),
        "hostile_requests": sent,
        "fuzz_cases": fuzz_cases,
        "fuzz_problems": outcomes.problems,
        "kv_servers": kv_servers,
        "leaks": result["leaks"],
        "memory": memory,
        "memory_series_mb": result["memory_series"],
        "memory_every_s": MEMORY_EVERY_S,
        "health_after": result["health"],
        "pass": clean
        and unexpected == 0
        and leaked == 0
        and result["health"] == 200
        and p99_ratio is not None
        and p99_ratio <= P99_TARGET,
    }

    def plot(ax) -> None:
        left, right = side_panels(ax, [1.0, 1.3])
        for tally, name in ((baseline, "baseline"), (under, "beside hostile traffic")):
            times = sorted(tally.latencies)
            left.plot(times, [(i + 1) / len(times) for i in range(len(times))], label=name)
        left.set_xlabel("valid request latency (s)")
        left.set_ylabel("fraction of requests")
        left.legend(fontsize=7)
        rows = outcomes.record()
        names = list(rows)
        right.barh(names, [sum(rows[n]["outcomes"].values()) for n in names], label="expected")
        right.barh(names, [rows[n]["unexpected"] for n in names], color="red", label="unexpected")
        right.tick_params(axis="y", labelsize=5)
        right.set_xlabel("hostile requests")
        right.legend(fontsize=7)

    report("soak_hostile", [{"measure": m, "value": v} for m, v in table], record, plot)
    for phase_name, rows in memory.items():
        for row in rows:
            print(
                f"  {phase_name:<20} {row['role']:<18} pid {row['pid']:<8}"
                f" {row['rss_mb_after_warmup']:>8} MB -> {row['rss_mb_end']:>8} MB"
                f" ({row['growth']:+.1%})"
            )
    for problem in outcomes.problems:
        print("  fuzz problem:", problem)
    print(json.dumps({"pass": record["pass"]}))


#: The arguments that shape this soak (the rest are the chaos soak's).
_ARGS = ("phase_s", "warmup_s", "concurrency", "max_tokens", "fuzz_examples", "hostile_kinds")

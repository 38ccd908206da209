"""``tessera bench serve``: load any OpenAI-compatible server and report as vLLM's
``vllm bench serve`` does (its option names where they mean the same), so that one
command compares Tessera with the server in use today.

The requests' arrivals, prompts and lengths come from ``--seed`` alone, so two servers
given the same flags get the same load. The client core (schedules, the streaming
sender, the timing math) is ``tessera.cluster.bench`` and ``bench_schedule``; prompts come from
``bench_datasets``, the summary, JSON and PNG from ``bench_report``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import re
import sys
from pathlib import Path

from tessera.cluster import exit_status
from tessera.cluster.bench import COMPLETIONS, ENDPOINTS, METRICS
from tessera.cluster.bench_datasets import DATASETS

#: Goodput SLOs: the metrics that may carry one (vLLM's names).
SLO_METRICS = ("ttft", "tpot", "e2el")


def goodput_slo(text: str) -> tuple[str, float]:
    """``ttft:500`` -> ("ttft", 0.5): a metric and its SLO in milliseconds."""
    metric, _, value = text.partition(":")
    if metric not in SLO_METRICS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}"
        )
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number of ms") from None
    if not ms >= 0 or math.isinf(ms):
        raise argparse.ArgumentTypeError(f"{text!r}: the SLO must be a finite ms >= 0")
    return metric, ms / 1e3


def metric_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METRICS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a comma-separated list of {', '.join(METRICS)}"
        )
    return names


def percentile_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers") from None
    if not all(0 < q <= 100 for q in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each percentile in (0, 100]")
    return values


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be above 0")
    return value


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("the server")
    server.add_argument(
        "--base-url",
        help="the server's base URL, without /v1, e.g. http://10.0.0.5:8000 "
        "(default: http://--host:--port)",
    )
    server.add_argument("--host", default="127.0.0.1", help="without --base-url (127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="without --base-url (8000)")
    server.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default=COMPLETIONS,
        help="the API to load; every request streams, with usage in the last chunk "
        f"(default: {COMPLETIONS})",
    )
    server.add_argument(
        "--model", help="the model id to send (default: the first from GET /v1/models)"
    )
    server.add_argument(
        "--api-key",
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, if set)",
    )
    server.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=60.0,
        help="how long to wait for GET /v1/models to answer (default: 60)",
    )
    server.add_argument(
        "--request-timeout-sec",
        type=positive_float,
        default=600.0,
        help="most seconds to wait for each read of a stream (default: 600)",
    )

    data = parser.add_argument_group("the prompts")
    data.add_argument(
        "--dataset-name",
        choices=DATASETS,
        default="random",
        help="random: prompts of exactly --random-input-len tokens (token ids on "
        "/v1/completions; random words on the chat endpoint, whose input tokens the "
        'server\'s usage reports); jsonl: one {"prompt": ..., "output_len": N} per '
        "line (output_len or max_tokens optional); sharegpt: a ShareGPT JSON list, the "
        "first human turn as prompt (default: random)",
    )
    data.add_argument("--dataset-path", type=Path, help="the jsonl or sharegpt file")
    data.add_argument(
        "--num-prompts", type=positive_int, default=1000, help="requests to send (default: 1000)"
    )
    data.add_argument(
        "--random-input-len",
        type=positive_int,
        default=1024,
        help="random: prompt tokens (default: 1024)",
    )
    data.add_argument(
        "--random-output-len",
        type=positive_int,
        default=128,
        help="random: max_tokens of each request (default: 128)",
    )
    data.add_argument(
        "--jsonl-output-len",
        type=positive_int,
        default=128,
        help="jsonl: max_tokens of lines that give neither output_len nor max_tokens "
        "(default: 128)",
    )
    data.add_argument(
        "--sharegpt-output-len",
        type=positive_int,
        help="sharegpt: max_tokens of every request (default: the gpt answer's length, "
        "estimated at 4 characters a token)",
    )
    data.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the prompts, their order and the arrival times (default: 0)",
    )

    load = parser.add_argument_group("the load")
    load.add_argument(
        "--request-rate",
        type=positive_float,
        default=math.inf,
        help="requests per second, arriving as a Poisson process (gamma with "
        "--burstiness); inf sends them all at once (default: inf)",
    )
    load.add_argument(
        "--burstiness",
        type=positive_float,
        default=1.0,
        help="the gamma shape of the gaps between arrivals: 1 is Poisson, below 1 "
        "burstier, above 1 more even; the mean rate stays --request-rate (default: 1)",
    )
    load.add_argument(
        "--max-concurrency",
        type=positive_int,
        help="most requests in flight; one due while all are busy waits (default: no cap)",
    )
    load.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="requests sent before the run, not counted (default: 0)",
    )
    load.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (a Tessera and vLLM extra): every request generates exactly "
        "its max_tokens",
    )
    load.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default: 0)"
    )

    report = parser.add_argument_group("the report")
    report.add_argument(
        "--goodput",
        nargs="+",
        type=goodput_slo,
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000: requests per second that "
        "met all of them (metrics: ttft, tpot, e2el; milliseconds)",
    )
    report.add_argument(
        "--percentile-metrics",
        type=metric_list,
        default=list(METRICS),
        help="comma-separated metrics to report: ttft, tpot, itl, e2el (default: all)",
    )
    report.add_argument(
        "--metric-percentiles",
        type=percentile_list,
        default=[99.0],
        help="comma-separated percentiles to report, e.g. 50,90,99 (default: 99)",
    )
    report.add_argument(
        "--save-result",
        action="store_true",
        help="write the result as JSON, and a PNG of the latencies beside it",
    )
    report.add_argument(
        "--save-detailed",
        action="store_true",
        help="with --save-result: also each request's lengths, latencies and error",
    )
    report.add_argument(
        "--result-dir", type=Path, default=Path("."), help="where to write them (default: .)"
    )
    report.add_argument(
        "--result-filename",
        help="the JSON's name (default: bench-serve-<rate>qps-concurrency<n>-<model>-"
        "<time>.json); the PNG takes the same name with .png",
    )
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run_bench_serve(args: argparse.Namespace) -> int:
    from tessera.cluster.bench_datasets import DatasetError

    if args.dataset_name != "random" and args.dataset_path is None:
        return _usage(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.num_warmups < 0:
        return _usage("--num-warmups must be 0 or more")
    try:
        requests = build_requests(args)
    except DatasetError as error:
        return _usage(str(error))
    try:
        return asyncio.run(_run(args, requests))
    except ConnectionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return exit_status.INTERRUPTED


def _usage(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return exit_status.USAGE


def build_requests(args: argparse.Namespace):
    """The run's requests: prompts from the dataset, arrivals from the rate (both from
    --seed)."""
    from tessera.cluster import bench_datasets as datasets
    from tessera.cluster.bench_schedule import Request, arrival_times

    if args.dataset_name == "random":
        prompts = datasets.random_prompts(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.seed,
            args.endpoint,
        )
    else:
        if args.dataset_name == "jsonl":
            loaded = datasets.load_jsonl(args.dataset_path, args.jsonl_output_len)
        else:
            loaded = datasets.load_sharegpt(args.dataset_path, args.sharegpt_output_len)
        prompts = datasets.sample(loaded, args.num_prompts, args.seed)
    times = arrival_times(args.num_prompts, args.request_rate, args.seed, args.burstiness)
    return [Request(t, p.text, p.output_len) for t, p in zip(times, prompts, strict=True)]


async def _run(args: argparse.Namespace, requests) -> int:
    from tessera.cluster import bench, bench_report
    from tessera.cluster.bench_schedule import Request

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    slos = dict(args.goodput or ())
    async with bench.http_client(args.request_timeout_sec) as client:
        target = await bench.resolve(
            client, "server", base_url, base_url, args.model, api_key, args.ready_check_timeout_sec
        )

        async def sender(request: Request) -> bench.Outcome:
            return await bench.send(
                client,
                target,
                request,
                endpoint=args.endpoint,
                temperature=args.temperature,
                ignore_eos=args.ignore_eos,
            )

        if args.num_warmups:
            print(f"warming up with {args.num_warmups} requests", file=sys.stderr)
            warm = [
                Request(0.0, q.prompt, q.output_tokens)
                for q in (requests * args.num_warmups)[: args.num_warmups]
            ]
            outcomes, _, _ = await bench.run_schedule(
                sender,
                warm,
                max_concurrency=args.max_concurrency,
                desc="warm-up",
                disable_tqdm=args.disable_tqdm,
            )
            failed = next((o.error for o in outcomes if not o.ok), None)
            if failed is not None:
                raise ConnectionError(f"a warm-up request to {base_url} failed: {failed}")
        print(
            f"{len(requests)} requests to {base_url}{args.endpoint} (model {target.model}), "
            f"request rate {args.request_rate:g}, max concurrency {args.max_concurrency}",
            file=sys.stderr,
        )
        started = datetime.datetime.now()
        outcomes, duration, _ = await bench.run_schedule(
            sender,
            requests,
            max_concurrency=args.max_concurrency,
            desc="requests",
            disable_tqdm=args.disable_tqdm,
        )
    numbers = bench.summary(
        requests,
        outcomes,
        duration,
        slos,
        args.percentile_metrics,
        args.metric_percentiles,
    )
    result = {
        "date": started.strftime("%Y%m%d-%H%M%S"),
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model_id": target.model,
        "dataset_name": args.dataset_name,
        "dataset_path": None if args.dataset_path is None else str(args.dataset_path),
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "num_warmups": args.num_warmups,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed,
        "goodput_slos_ms": {metric: s * 1e3 for metric, s in slos.items()} or None,
        **numbers,
        "first_errors": sorted({o.error for o in outcomes if o.error})[:5],
    }
    shown = result | {"request_rate": args.request_rate}
    print(bench_report.summary_text(shown, args.percentile_metrics, args.metric_percentiles))
    for error in result["first_errors"]:
        print(f"failed: {error}", file=sys.stderr)
    if args.save_result:
        if args.save_detailed:
            result |= bench_report.detailed(requests, outcomes)
        path = args.result_dir / (args.result_filename or _default_name(args, target.model))
        bench_report.write_json(path, result)
        print(f"result: {path}", file=sys.stderr)
        title = (
            f"{target.model} at {base_url}: {len(requests)} requests, rate "
            f"{args.request_rate:g}/s, max concurrency {args.max_concurrency}"
        )
        picture = path.with_suffix(".png")
        if bench_report.write_png(picture, requests, outcomes, title):
            print(f"plot: {picture}", file=sys.stderr)
    return exit_status.OK if numbers["completed"] else 1  # no request succeeded


def _default_name(args: argparse.Namespace, model: str) -> str:
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", model)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return (
        f"bench-serve-{args.request_rate:g}qps-concurrency{args.max_concurrency}-"
        f"{model}-{stamp}.json"
    )

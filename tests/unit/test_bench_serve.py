"""``tessera bench serve`` without a real server: its datasets (and their error
messages), its schedules, the summary math against hand-computed values, and one run
against a scripted OpenAI-compatible stream (aiohttp's own test server)."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest

from tessera.cluster import bench, bench_schedule
from tessera.cluster.bench import Outcome
from tessera.cluster.bench_datasets import (
    DatasetError,
    Prompt,
    load_jsonl,
    load_sharegpt,
    random_prompts,
    sample,
)
from tessera.cluster.bench_schedule import Request
from tessera.cluster.cli import main


# ------------------------------------------------------------------ datasets
def test_jsonl_prompts_and_their_output_lengths(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "a", "output_len": 5}\n\n{"prompt": "b", "max_tokens": 7}\n{"prompt": "c"}\n'
    )
    assert load_jsonl(path, 9) == [Prompt("a", 5), Prompt("b", 7), Prompt("c", 9)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "a"}\n{"prompt": "b"\n', "{path}:2: not JSON (Expecting ',' delimiter)"),
        ('{"prompt": "a"}\n["b"]\n', "{path}:2: expected an object with a prompt"),
        ('{"text": "a"}\n', "{path}:1: 'prompt' must be a non-empty string"),
        (
            '{"prompt": "a", "output_len": 0}\n',
            "{path}:1: output_len must be a positive integer, not 0",
        ),
        (
            '{"prompt": "a", "max_tokens": "8"}\n',
            "{path}:1: max_tokens must be a positive integer, not '8'",
        ),
        ("\n\n", "{path}: no prompts"),
    ],
    ids=["json", "object", "prompt", "output-len", "max-tokens", "empty"],
)
def test_jsonl_errors_name_the_line(tmp_path, text, message):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(DatasetError) as error:
        load_jsonl(path, 16)
    assert str(error.value) == message.format(path=path)


def conversation(*turns: tuple[str, str]) -> dict:
    return {"conversations": [{"from": who, "value": value} for who, value in turns]}


def test_sharegpt_first_human_turn_and_its_answers_length(tmp_path):
    path = tmp_path / "sharegpt.json"
    entries = [
        conversation(("human", "hi"), ("gpt", "x" * 10), ("human", "more"), ("gpt", "y")),
        conversation(("gpt", "no question first"), ("human", "why?"), ("gpt", "abcd")),
        conversation(("human", "unanswered")),  # skipped, as vLLM's benchmark does
        {"conversations": []},
    ]
    path.write_text(json.dumps(entries))
    assert load_sharegpt(path, None) == [Prompt("hi", 3), Prompt("why?", 1)]  # ceil(10 / 4)
    assert load_sharegpt(path, 32) == [Prompt("hi", 32), Prompt("why?", 32)]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"conversations": []}, "{path}: expected a JSON list of conversations"),
        (
            [conversation(("human", "a"), ("gpt", "b")), ["x"]],
            "{path}: entry 1: expected an object with conversations",
        ),
        (
            [conversation(("human", "a"))],
            "{path}: no conversation with a human turn and a gpt answer",
        ),
    ],
    ids=["not-a-list", "entry", "no-exchange"],
)
def test_sharegpt_errors_name_the_entry(tmp_path, entries, message):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    with pytest.raises(DatasetError) as error:
        load_sharegpt(path, None)
    assert str(error.value) == message.format(path=path)


def test_random_prompts_are_exact_token_ids_or_words():
    ids = random_prompts(3, 12, 4, seed=1, endpoint=bench.COMPLETIONS)
    assert [len(p.text) for p in ids] == [12, 12, 12] and {p.output_len for p in ids} == {4}
    assert all(
        bench_schedule.TOKEN_IDS[0] <= t < bench_schedule.TOKEN_IDS[1] for p in ids for t in p.text
    )
    assert ids == random_prompts(3, 12, 4, seed=1, endpoint=bench.COMPLETIONS)
    words = random_prompts(2, 5, 4, seed=1, endpoint=bench.CHAT)
    assert all(isinstance(p.text, str) and len(p.text.split()) == 5 for p in words)


def test_sample_shuffles_with_the_seed_and_repeats():
    prompts = [Prompt(str(i), 1) for i in range(3)]
    picked = sample(prompts, 7, seed=3)
    assert picked == sample(prompts, 7, seed=3)
    assert sorted(p.text for p in picked[:3]) == ["0", "1", "2"]
    assert picked[3:6] == picked[:3] and picked[6] == picked[0]


# ------------------------------------------------------------------ the command's errors
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dataset-name", "jsonl"], "error: --dataset-name jsonl needs --dataset-path\n"),
        (["--dataset-name", "jsonl", "--dataset-path", "{path}"], "error: {path}:1: not JSON"),
        (
            ["--dataset-name", "sharegpt", "--dataset-path", "{path}.missing"],
            "error: --dataset-path {path}.missing: [Errno 2] No such file or directory",
        ),
    ],
    ids=["no-path", "bad-line", "missing-file"],
)
def test_bad_files_and_options_exit_2_naming_them(tmp_path, capsys, argv, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("not json\n")
    argv = [arg.format(path=path) for arg in argv]
    assert main(["bench", "serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(path=path)) and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--goodput", "ttft:fast"],
            "argument --goodput: 'ttft:fast': 'fast' is not a number of ms",
        ),
        (
            ["--goodput", "itl:5"],
            "argument --goodput: 'itl:5': expected METRIC:MS with METRIC one of ttft, tpot, e2el",
        ),
        (
            ["--percentile-metrics", "ttft,foo"],
            "argument --percentile-metrics: 'ttft,foo': "
            "a comma-separated list of ttft, tpot, itl, e2el",
        ),
        (["--request-rate", "0"], "argument --request-rate: '0': must be above 0"),
        (["--max-concurrency", "0"], "argument --max-concurrency: '0': must be at least 1"),
    ],
    ids=["goodput-value", "goodput-metric", "metrics", "rate", "concurrency"],
)
def test_bad_option_values_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ schedules
def test_poisson_arrivals_are_seeded_and_scale_with_the_rate():
    first = bench_schedule.arrival_times(50, 2.0, seed=7)
    assert first == bench_schedule.arrival_times(50, 2.0, seed=7)
    assert first != bench_schedule.arrival_times(50, 2.0, seed=8)
    assert first[0] == 0.0 and first == sorted(first)
    half = bench_schedule.arrival_times(50, 1.0, seed=7)  # the same unit gaps, twice as long
    assert all(math.isclose(a * 2, b) for a, b in zip(first, half, strict=True))
    assert bench_schedule.arrival_times(4, math.inf, seed=7) == [0.0] * 4
    many = bench_schedule.arrival_times(20_000, 4.0, seed=1, burstiness=0.5)
    assert many[-1] / (len(many) - 1) == pytest.approx(0.25, rel=0.05)  # the mean rate holds


async def test_max_concurrency_caps_requests_in_flight():
    in_flight = peak = 0

    async def sender(request: Request) -> Outcome:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return Outcome(ttft_s=0.01, e2e_s=0.02, completion_tokens=1)

    schedule = [Request(0.0, [1], 1) for _ in range(9)]
    start = time.perf_counter()
    outcomes, wall, _ = await bench.run_schedule(
        sender, schedule, max_concurrency=3, disable_tqdm=True
    )
    assert peak == 3 and len(outcomes) == 9 and all(o.ok for o in outcomes)
    assert wall >= 0.06 and time.perf_counter() - start >= 0.06  # three waves of 20 ms


# ------------------------------------------------------------------ the summary math
def test_summary_against_hand_computed_values():
    requests = [Request(0.0, [1, 2, 3], 4), Request(0.5, "text", 2), Request(1.0, [1], 3)]
    outcomes = [
        # e2e 0.4, TTFT 0.1: TPOT (0.4 - 0.1) / 3 = 0.1; ITLs 0.1 x 3
        Outcome(ttft_s=0.1, e2e_s=0.4, completion_tokens=4, itls_s=[0.1, 0.1, 0.1]),
        # the server said 5 prompt tokens; TPOT (0.6 - 0.2) / 1 = 0.4
        Outcome(ttft_s=0.2, e2e_s=0.6, completion_tokens=2, prompt_tokens=5, itls_s=[0.4]),
        Outcome(error="HTTP 500: boom"),
    ]
    slos = {"ttft": 0.15, "e2el": 1.0}  # only the first meets both
    got = bench.summary(requests, outcomes, 2.0, slos, ("ttft", "tpot", "itl"), (50, 99))
    assert (got["completed"], got["failed"]) == (2, 1)
    assert (got["total_input_tokens"], got["total_output_tokens"]) == (3 + 5, 6)
    assert got["request_throughput"] == 1.0
    assert got["output_throughput"] == 3.0
    assert got["total_token_throughput"] == 7.0
    assert got["request_goodput"] == 0.5
    assert got["mean_ttft_ms"] == pytest.approx(150) and got["median_ttft_ms"] == pytest.approx(150)
    assert got["p99_ttft_ms"] == pytest.approx(100 + 100 * 0.99)
    assert got["p50_tpot_ms"] == pytest.approx(250) and got["std_tpot_ms"] == pytest.approx(150)
    assert got["mean_itl_ms"] == pytest.approx(175)  # 100, 100, 100, 400
    assert got["p50_itl_ms"] == pytest.approx(100)
    assert got["p99_itl_ms"] == pytest.approx(100 + 300 * 0.97)  # rank 2.97 of 0..3
    assert "mean_e2el_ms" not in got
    assert bench.summary(requests, outcomes, 2.0)["request_goodput"] is None


def test_spread_gaps_split_a_chunks_gap_among_its_tokens():
    assert bench.spread_gaps([0.0, 0.1, 0.4], 5) == pytest.approx([0.05, 0.05, 0.15, 0.15])
    assert bench.spread_gaps([0.0, 0.1, 0.3], 2) == pytest.approx([0.3])  # the gap handed on
    assert bench.spread_gaps([0.0], 1) == []


# ------------------------------------------------------------------ one scripted server
async def test_a_run_against_a_scripted_chat_stream(tmp_path, capsys):
    """The chat endpoint's deltas, usage in the last chunk, the summary, JSON and PNG."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    bodies = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "scripted"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text in ("a", "b", "c"):
            delta = {"choices": [{"index": 0, "delta": {"content": text}}]}
            await response.write(f"data: {json.dumps(delta)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    async with TestServer(app) as server:
        argv = [
            *("bench", "serve", "--base-url", str(server.make_url("")).rstrip("/")),
            *("--endpoint", "/v1/chat/completions", "--num-prompts", "4"),
            *("--random-input-len", "6", "--random-output-len", "3", "--num-warmups", "1"),
            *("--goodput", "ttft:60000", "--save-result", "--result-dir", str(tmp_path)),
            *("--result-filename", "run.json", "--disable-tqdm", "--ignore-eos"),
        ]
        assert await asyncio.to_thread(main, argv) == 0
    assert len(bodies) == 5  # one warm-up
    assert bodies[0]["model"] == "scripted" and bodies[0]["ignore_eos"] is True
    assert len(bodies[0]["messages"][0]["content"].split()) == 6
    result = json.loads((tmp_path / "run.json").read_text())
    assert (result["completed"], result["total_output_tokens"]) == (4, 12)
    assert result["total_input_tokens"] == 44 and result["request_goodput"] > 0
    assert (tmp_path / "run.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    assert "Total generated tokens:                  12" in out


async def test_a_server_that_fails_every_request_exits_1_naming_the_error(capsys):
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "no capacity"}}, status=503)

    app = web.Application()
    app.router.add_post("/v1/completions", refuse)
    async with TestServer(app) as server:
        argv = [
            *("bench", "serve", "--base-url", str(server.make_url("")).rstrip("/")),
            *("--model", "m", "--num-prompts", "2", "--random-input-len", "4"),
            "--disable-tqdm",
        ]
        assert await asyncio.to_thread(main, argv) == 1
    captured = capsys.readouterr()
    assert "Successful requests:                     0\n" in captured.out
    assert "Failed requests:                         2\n" in captured.out
    assert 'failed: HTTP 503: {"error": {"message": "no capacity"}}' in captured.err

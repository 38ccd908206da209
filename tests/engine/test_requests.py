"""Request-level behaviour: seeds, stops, finish reasons, logprobs, abort, the async API."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest
import torch

from tessera.workers.api import INTER_TOKEN_LATENCY_BUCKETS, FinishReason, Phase, SamplingParams
from tessera.workers.engine.async_engine import AsyncEngine, EngineClosedError
from tests.helpers import run_engine, text_of, tokens_of

pytestmark = pytest.mark.slow

SEEDED = SamplingParams(
    max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True
)
FILLER = [
    "Tell me a story about a dragon.",
    "def add(a, b):",
    "The weather today is",
    "Lorem ipsum dolor sit amet, " * 8,
    "1, 2, 3, 4,",
    "Why is the sky blue?",
]


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(make_engine):
    engine = make_engine()
    engine.add_request("s", "Write a poem about the sea.", SEEDED)
    alone = tokens_of(run_engine(engine)["s"])

    busy = make_engine(max_num_batched_tokens=32)
    for i, prompt in enumerate(FILLER):  # others first, so "s" lands at a different row
        busy.add_request(f"f{i}", prompt, SamplingParams(max_tokens=30, temperature=1.0))
    busy.step()
    busy.add_request("s", "Write a poem about the sea.", SEEDED)
    outputs = run_engine(busy)
    assert tokens_of(outputs["s"]) == alone
    assert len(set(alone)) > 5  # it really sampled


def test_seeded_sampling_survives_preemption(make_engine):
    engine = make_engine()
    engine.add_request("s", "Write a poem about the sea.", SEEDED)
    alone = tokens_of(run_engine(engine)["s"])
    tight = make_engine(num_kv_blocks=12)
    tight.add_request("s", "Write a poem about the sea.", SEEDED)
    for i, prompt in enumerate(FILLER[:4]):
        tight.add_request(f"f{i}", prompt, SamplingParams(max_tokens=40, temperature=0))
    outputs = run_engine(tight)
    assert tight.stats().preemptions > 0
    assert tokens_of(outputs["s"]) == alone


def test_different_seeds_differ(make_engine):
    engine = make_engine()
    for seed in (1, 2):
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        engine.add_request(f"s{seed}", "Once upon a time", params)
    outputs = run_engine(engine)
    assert tokens_of(outputs["s1"]) != tokens_of(outputs["s2"])


def test_max_tokens_and_eos_finish_reasons(make_engine, smollm2):
    engine = make_engine()
    chat = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=False
    )
    engine.add_request("eos", chat, SamplingParams(max_tokens=200, temperature=0))
    engine.add_request("len", "Count: 1, 2, 3,", SamplingParams(max_tokens=5, temperature=0))
    outputs = run_engine(engine)
    last = outputs["eos"][-1]
    assert last.finish_reason is FinishReason.STOP
    assert tokens_of(outputs["eos"])[-1] in smollm2.config.eos_token_ids
    assert "<|im_end|>" not in text_of(outputs["eos"])
    assert outputs["len"][-1].finish_reason is FinishReason.LENGTH
    assert outputs["len"][-1].completion_tokens == len(tokens_of(outputs["len"])) == 5


def test_stop_string_spanning_tokens_is_cut(make_engine, smollm2):
    engine = make_engine()
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request("free", "Count: 1, 2, 3,", greedy)
    full = text_of(run_engine(engine)["free"])
    # a stop string that starts inside one token and ends in a later one
    index = full.index(" 6")
    stop = full[index + 1 : index + 5]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))
    engine.add_request("stopped", "Count: 1, 2, 3,", params)
    out = run_engine(engine)["stopped"]
    assert text_of(out) == full[: full.index(stop)]
    assert out[-1].finish_reason is FinishReason.STOP and out[-1].stop_reason == stop


def test_stop_token_ids_and_min_tokens(make_engine):
    engine = make_engine()
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request("free", "Count: 1, 2, 3,", greedy)
    free = tokens_of(run_engine(engine)["free"])
    stop_id = free[3]
    engine.add_request(
        "stop",
        "Count: 1, 2, 3,",
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=(stop_id,)),
    )
    out = run_engine(engine)["stop"]
    assert tokens_of(out) == free[: free.index(stop_id) + 1]
    assert out[-1].stop_reason == stop_id
    # min_tokens suppresses the stop token until enough tokens exist
    engine.add_request(
        "min",
        "Count: 1, 2, 3,",
        SamplingParams(
            max_tokens=30, min_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=(stop_id,)
        ),
    )
    got = tokens_of(run_engine(engine)["min"])
    assert stop_id not in got[:10] and len(got) >= 10


def test_logprobs_are_consistent_with_the_tokens(make_engine, smollm2, hf_reference):
    engine = make_engine()
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    prompt = smollm2.tokenizer("The capital of France is").input_ids
    engine.add_request("lp", prompt, params)
    out = run_engine(engine)["lp"]
    tokens = tokens_of(out)
    logprobs = [lp for d in out for lp in d.logprobs]
    assert [lp.token_id for lp in logprobs] == tokens
    with torch.no_grad():  # the first token's logprob, checked against transformers
        logits = hf_reference.model(torch.tensor([prompt])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)
    assert logprobs[0].logprob == pytest.approx(float(expected[tokens[0]]), abs=1e-4)
    for lp in logprobs:
        assert len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy: the chosen token is the most likely
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_abort_frees_blocks_and_reports(make_engine):
    engine = make_engine()
    # "a" must still be running after three steps: no early EOS from an unseeded sample.
    long = SamplingParams(max_tokens=100, seed=0, ignore_eos=True)
    engine.add_request("a", "Tell me a long story.", long)
    engine.add_request("b", "Tell me another.", SamplingParams(max_tokens=5, temperature=0))
    for _ in range(3):
        engine.step()
    held = len(engine.kv.block_ids("a"))
    free_before = engine.kv.num_free_blocks
    assert held
    engine.abort("a")  # no step running: the blocks come back at once
    assert engine.kv.block_ids("a") == []
    assert engine.kv.num_free_blocks == free_before + held
    engine.check_integrity()
    engine.add_request("c", "Never runs.", SamplingParams(max_tokens=5))
    engine.abort("c")  # aborted before any step admitted it
    outputs = run_engine(engine)
    assert [(d.finish_reason, d.token_ids) for d in outputs["c"]] == [(FinishReason.ABORT, ())]
    assert outputs["a"][-1].finish_reason is FinishReason.ABORT
    assert outputs["b"][-1].finish_reason is FinishReason.LENGTH
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_phases_are_observable(make_engine):
    engine = make_engine(max_num_batched_tokens=8)
    engine.add_request("p", "word " * 30, SamplingParams(max_tokens=3, temperature=0))
    assert engine.stats().phases == {}
    engine.step()
    assert engine.groups["p"].seqs[0].phase is Phase.PREFILL
    while engine.groups["p"].seqs[0].num_output_tokens == 0:
        engine.step()
    assert engine.groups["p"].seqs[0].phase is Phase.DECODE
    run_engine(engine)
    stats = engine.stats()
    assert stats.steps > 4 and stats.preemptions == 0 and stats.generated_tokens >= 3


def test_the_host_overhead_is_the_step_less_its_forward(make_engine):
    """``recent_host_time``: what a step spends outside the model's forward; the totals
    ``step_seconds`` and ``host_seconds`` add up every step's."""
    engine = make_engine()
    engine.add_request("h", "word " * 30, SamplingParams(max_tokens=8, temperature=0))
    stats = engine.stats()
    assert stats.recent_host_time == stats.step_seconds == stats.host_seconds == 0.0
    started = time.perf_counter()
    engine.step()  # the first batch: the average is this step's own figure
    elapsed = time.perf_counter() - started
    forward = engine.runner.forward_time
    assert 0.0 < forward < elapsed
    stats = engine.stats()
    assert 0.0 < stats.recent_host_time <= elapsed - forward
    assert stats.host_seconds == stats.recent_host_time
    assert forward < stats.step_seconds == stats.recent_step_time <= elapsed  # this call
    assert stats.step_seconds - stats.host_seconds == pytest.approx(forward)
    host_times, step_times = [stats.host_seconds], [stats.step_seconds]
    while engine.has_work():
        engine.step()
        stats = engine.stats()
        host_times.append(stats.host_seconds)
        step_times.append(stats.step_seconds)
    assert stats.steps == 8  # the prompt's step, then one per further token
    assert stats.decode_steps == 7  # all but the prompt's
    assert stats.decode_seconds == pytest.approx(stats.step_seconds - step_times[0])
    assert all(a < b for a, b in itertools.pairwise(host_times))  # each step adds its own
    assert all(a < b for a, b in itertools.pairwise(step_times))
    assert 0.0 < stats.recent_host_time < stats.recent_step_time
    assert 0.0 < stats.host_seconds < stats.step_seconds <= time.perf_counter() - started


def test_stats_read_while_a_step_runs_count_whole_steps(make_engine):
    """The worker's report thread reads ``stats()`` while steps run: a read after a step
    appended its tokens but before it ended shows the counters of the step before (a
    report once showed a request's 5 tokens with 3 of its 4 decode steps)."""
    engine = make_engine()
    engine.add_request("s", "word " * 30, SamplingParams(max_tokens=3, temperature=0))
    engine.step()  # the prompt's step
    before = engine.stats()
    seen = []
    append = engine.post.append_token

    def append_and_read(*args):
        append(*args)
        seen.append(engine.stats())  # the step's token is appended, the step not ended

    engine.post.append_token = append_and_read
    engine.step()
    after = engine.stats()

    def counts(stats):
        return stats.steps, stats.generated_tokens, stats.decode_steps, stats.step_seconds

    assert len(seen) == 1 and counts(seen[0]) == counts(before)
    assert counts(after)[:3] == (before.steps + 1, before.generated_tokens + 1, 1)
    assert after.step_seconds > before.step_seconds


def test_inter_token_latency_counts_each_sequence_and_step_after_its_first_token(make_engine):
    """vLLM's inter-token latency: one interval for each sequence and step that gave it a
    token after its first (forks each, a chunked prefill none), from the previous step's
    end, into vLLM's buckets."""
    engine = make_engine(max_num_batched_tokens=16)  # the long prompt takes 3 steps
    engine.add_request("a", "word " * 40, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request(
        "b", "Hi", SamplingParams(max_tokens=3, n=2, temperature=1, seed=1, ignore_eos=True)
    )
    ends = []
    while engine.has_work():
        engine.step()
        ends.append(time.perf_counter())
    stats = engine.stats()
    assert len(stats.itl_counts) == len(INTER_TOKEN_LATENCY_BUCKETS) + 1
    assert sum(stats.itl_counts) == (5 - 1) + 2 * (3 - 1)
    # every interval lies within the span from the first token to the last step's end
    assert 0 < stats.itl_seconds < (ends[-1] - ends[0]) * sum(stats.itl_counts)
    time.sleep(0.2)  # idle: the next request's interval is not from the last step's end
    engine.add_request("c", "Hello", SamplingParams(max_tokens=2, ignore_eos=True))
    started = time.perf_counter()
    run_engine(engine)
    after = engine.stats()
    assert sum(after.itl_counts) == sum(stats.itl_counts) + 1
    assert 0 < after.itl_seconds - stats.itl_seconds < time.perf_counter() - started


async def test_async_api_streams_and_abort_on_early_exit(make_engine):
    engine = AsyncEngine(make_engine())
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def collect(rid):
        return [d async for d in await engine.add_request(rid, "Hello there", greedy)]

    first, second = await asyncio.gather(collect("x"), collect("y"))
    assert tokens_of(first) == tokens_of(second) and len(tokens_of(first)) == 12
    assert first[-1].finished

    stream = await engine.add_request("z", "Tell me a story.", SamplingParams(max_tokens=200))
    async for _ in stream:
        break  # the caller goes away
    await stream.aclose()
    for _ in range(50):
        if engine.engine.kv.num_free_blocks == engine.engine.kv.pool.num_blocks:
            break
        await asyncio.sleep(0.02)
    assert engine.engine.kv.num_free_blocks == engine.engine.kv.pool.num_blocks
    assert "z" not in engine.engine.groups
    await engine.close()


async def test_close_ends_the_streams_in_flight_and_frees_their_blocks(make_engine):
    engine = AsyncEngine(make_engine())
    long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    stream = await engine.add_request("open", "Tell me a story.", long)
    first = await anext(stream)
    assert first.token_ids and not first.finished
    await engine.close()
    with pytest.raises(EngineClosedError, match="the engine closed with request 'open' in flight"):
        async for _ in stream:
            pass
    assert "open" not in engine.engine.groups
    assert engine.engine.kv.num_free_blocks == engine.engine.kv.pool.num_blocks
    with pytest.raises(EngineClosedError, match="the engine is closed: request 'late' not started"):
        await engine.add_request("late", "Hello", long)
    assert "late" not in engine.engine.groups
    with pytest.raises(EngineClosedError, match="the engine is closed: it runs no more calls"):
        await engine.run(lambda: None)


async def test_every_step_runs_on_the_thread_that_built_the_engine(make_engine):
    """libgomp slows every parallel region once two threads hold OpenMP pools (see
    async_engine): the engine is built, stepped and handed KV work on one thread."""
    built_on = []

    def build():
        built_on.append(threading.get_ident())
        return make_engine()

    engine = AsyncEngine.build(build)
    stepped_on = set()
    step = engine.engine.step

    def recording_step():
        stepped_on.add(threading.get_ident())
        return step()

    engine.engine.step = recording_step
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    deltas = [d async for d in await engine.add_request("t", "Hello there", greedy)]
    assert len(tokens_of(deltas)) == 6
    assert await engine.run(threading.get_ident) == built_on[0]
    assert stepped_on == {built_on[0]} and built_on[0] != threading.get_ident()
    await engine.close()


async def test_steps_go_on_while_the_event_loop_is_busy(make_engine):
    """The engine thread steps back to back: it does not wait for the event loop to see
    one step's outputs before it starts the next. The tokens are those of the engine
    stepped directly."""
    engine = AsyncEngine(make_engine())
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    stream = await engine.add_request("busy", "Hello there", greedy)
    first = await anext(stream)  # the engine is stepping
    before = engine.engine.num_steps
    deadline = time.monotonic() + 60
    # the event loop holds still (no await, no delivered outputs) until 5 more steps ran
    while engine.engine.num_steps < before + 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.engine.num_steps >= before + 5, engine.engine.num_steps - before
    rest = [d async for d in stream]
    await engine.close()
    direct = make_engine()
    direct.add_request("busy", "Hello there", greedy)
    assert tokens_of([first, *rest]) == tokens_of(run_engine(direct)["busy"])
    assert len(tokens_of(rest)) == 39 and rest[-1].finished


async def test_run_calls_go_between_steps_while_the_engine_steps(make_engine):
    """A call waits for the step running now (if any), never for the request to end."""
    engine = AsyncEngine(make_engine())
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    stream = await engine.add_request("long", "Hello there", greedy)
    first = await anext(stream)
    seen = []
    for _ in range(4):
        seen.append(await asyncio.wait_for(engine.run(lambda: engine.engine.num_steps), 10))
        await asyncio.sleep(0.02)  # a step or two
    rest = [d async for d in stream]
    assert len(tokens_of([first, *rest])) == 40
    assert seen == sorted(seen) and seen[0] < seen[-1] < engine.engine.num_steps, seen
    await engine.close()


async def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(make_engine):
    inner = make_engine()
    engine = AsyncEngine(inner)
    execute = inner.runner.execute
    calls = {"n": 0}

    def fail_once(items, argmax_only=False):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return execute(items, argmax_only)

    inner.runner.execute = fail_once
    stream = await engine.add_request("doomed", "Hello", SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="injected step failure"):
        async for _ in stream:
            pass
    greedy = SamplingParams(max_tokens=3, temperature=0)
    deltas = [d async for d in await engine.add_request("after", "Hello", greedy)]
    assert deltas[-1].finished and len(tokens_of(deltas)) == 3
    assert inner.kv.num_free_blocks == inner.kv.pool.num_blocks
    assert "doomed" not in inner.groups
    await engine.close()

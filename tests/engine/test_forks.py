"""n > 1 and best_of: children fork from one prefilled prompt and share its blocks."""

from __future__ import annotations

import asyncio
import random

import pytest

from tessera.workers.api import FinishReason, SamplingParams
from tessera.workers.engine.async_engine import AsyncEngine
from tessera.workers.kv.manager import blocks_needed
from tests.helpers import run_engine, text_of, tokens_of

PROMPT = "Write one sentence about a lighthouse keeper."
# Spans two full blocks of 16 and part of a third, so forks have full blocks to share.
LONG_PROMPT = (
    "You are a poet who writes short, vivid lines. Here is the subject of today's poem: "
    "a lighthouse keeper alone on a rock in the middle of a winter storm."
)


def _by_index(deltas):
    out = {}
    for d in deltas:
        out.setdefault(d.index, []).append(d)
    return out


def test_children_share_the_prompt_blocks_then_diverge(make_engine):
    engine = make_engine(block_size=16)
    prompt = engine.tokenize("A long prompt so that it spans more than one block. " * 4)
    full, partial = divmod(len(prompt), 16)
    assert full >= 2 and partial > 0
    params = SamplingParams(n=4, seed=11, max_tokens=8, ignore_eos=True, temperature=1.0)
    engine.add_request("r", prompt, params)
    engine.step()  # prefill, fork into 4, sample each child's first token
    group = engine.groups["r"]
    assert [s.index for s in group.seqs] == [0, 1, 2, 3]
    tables = [engine.kv.block_ids(s.seq_id) for s in group.seqs]
    assert all(t == tables[0] for t in tables)
    assert [engine.kv.pool.blocks[i].ref_count for i in tables[0]] == [4] * (full + 1)
    assert engine.kv.pool.num_used == full + 1
    assert engine.stats().shared_blocks == full + 1
    engine.step()  # each child writes its first token: the partial block is copied 3 times
    tables = [engine.kv.block_ids(s.seq_id) for s in group.seqs]
    assert all(t[:full] == tables[0][:full] for t in tables)
    assert len({t[full] for t in tables}) == 4
    assert engine.kv.pool.num_used == full + 4
    assert engine.stats().shared_blocks == full
    engine.check_integrity()
    children = _by_index(run_engine(engine)["r"])
    assert sorted(children) == [0, 1, 2, 3]
    assert all(len(tokens_of(d)) == 8 - 2 for d in children.values())  # 2 came above
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_each_child_equals_a_lone_request_with_its_seed(make_engine):
    engine = make_engine()
    params = SamplingParams(n=5, seed=1234, max_tokens=16, temperature=0.9, top_p=0.95)
    engine.add_request("r", PROMPT, params)
    children = _by_index(run_engine(engine)["r"])
    assert sorted(children) == [0, 1, 2, 3, 4]
    texts = set()
    for index, deltas in children.items():
        assert deltas[-1].finished and deltas[-1].seed == 1234 + index
        lone = make_engine()
        lone.add_request("lone", PROMPT, _replace(params, n=1, seed=1234 + index))
        alone = run_engine(lone)["lone"]
        assert tokens_of(deltas) == tokens_of(alone)
        assert text_of(deltas) == text_of(alone)
        texts.add(text_of(deltas))
    assert len(texts) > 1  # the children really diverge


def _replace(params, **changes):
    fields = {name: getattr(params, name) for name in params.__dataclass_fields__}
    return SamplingParams(**{**fields, **changes})


def test_best_of_returns_the_n_most_likely_samples_whole(make_engine):
    params = SamplingParams(n=2, best_of=5, seed=7, max_tokens=10, temperature=1.0)
    engine = make_engine()
    engine.add_request("r", PROMPT, params)
    outputs = run_engine(engine)["r"]
    assert [o.index for o in outputs] == [0, 1] and all(o.finished for o in outputs)
    lone_logprobs = []
    for index in range(5):
        lone = make_engine()
        lone.add_request(
            "x", PROMPT, _replace(params, n=1, best_of=None, seed=7 + index, logprobs=0)
        )
        deltas = run_engine(lone)["x"]
        lone_logprobs.append(
            (sum(lp.logprob for d in deltas for lp in d.logprobs), tokens_of(deltas))
        )
    lone_logprobs.sort(key=lambda item: -item[0])
    assert [list(o.token_ids) for o in outputs] == [t for _, t in lone_logprobs[:2]]
    for output, (logprob, _) in zip(outputs, lone_logprobs, strict=False):
        assert output.cumulative_logprob == pytest.approx(logprob, abs=1e-4)


def test_greedy_children_all_equal_transformers(make_engine, hf_reference):
    engine = make_engine()
    prompt = engine.tokenize(PROMPT)
    engine.add_request(
        "r", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    children = _by_index(run_engine(engine)["r"])
    reference = hf_reference.greedy(tuple(prompt), 12).token_ids
    assert [tokens_of(children[i]) for i in range(3)] == [list(reference)] * 3


def test_without_sharing_children_copy_blocks_and_give_the_same_tokens(make_engine):
    params = SamplingParams(n=4, seed=3, max_tokens=10, temperature=1.0, ignore_eos=True)
    shared, copied = make_engine(), make_engine(enable_block_sharing=False)
    for engine in (shared, copied):
        engine.add_request("r", LONG_PROMPT, params)
        engine.result = {i: tokens_of(d) for i, d in _by_index(run_engine(engine)["r"]).items()}
    assert shared.result == copied.result
    assert shared.stats().peak_used_blocks < copied.stats().peak_used_blocks


def test_abort_and_preemption_mid_group_leak_nothing(make_engine):
    params = SamplingParams(n=4, seed=5, max_tokens=40, temperature=1.0, ignore_eos=True)
    prompt_len = len(make_engine().tokenize(LONG_PROMPT))
    full = prompt_len // 16
    # one group fits in 20 blocks at its peak (the last token is never computed), two do not
    peak = full + 4 * (blocks_needed(prompt_len + 40 - 1, 16) - full)
    assert peak <= 20 < 2 * peak
    tight = make_engine(num_kv_blocks=20)
    tight.add_request("a", LONG_PROMPT, params)
    tight.add_request("b", LONG_PROMPT, _replace(params, seed=99))
    tight.add_request("c", LONG_PROMPT, params)
    early = []
    for _ in range(6):
        early += tight.step()
        tight.check_integrity()
    tight.abort("c")
    outputs = run_engine(tight)
    for delta in reversed(early):
        outputs[delta.request_id].insert(0, delta)
    assert tight.stats().preemptions > 0
    assert tight.kv.num_free_blocks == tight.kv.pool.num_blocks
    aborted = _by_index(outputs["c"])
    assert all(d[-1].finish_reason is FinishReason.ABORT for d in aborted.values())
    roomy = make_engine()
    roomy.add_request("a", LONG_PROMPT, params)
    roomy.add_request("b", LONG_PROMPT, _replace(params, seed=99))
    expected = run_engine(roomy)
    for rid in ("a", "b"):
        got, want = _by_index(outputs[rid]), _by_index(expected[rid])
        assert {i: tokens_of(d) for i, d in got.items()} == {
            i: tokens_of(d) for i, d in want.items()
        }


def test_abort_before_the_fork_ends_every_output(make_engine):
    engine = make_engine(max_num_batched_tokens=8)  # the prompt takes several steps
    engine.add_request("r", LONG_PROMPT, SamplingParams(n=3, max_tokens=5))
    engine.step()
    assert not engine.groups["r"].forked
    engine.abort("r")
    final = engine.step()
    assert sorted((d.index, d.finished, d.finish_reason) for d in final) == [
        (i, True, FinishReason.ABORT) for i in range(3)
    ]
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_request_ids_cannot_collide_with_fork_ids(make_engine):
    from tessera.workers.api import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="request_id: must not contain '#'"):
        make_engine().add_request("a#1", PROMPT)


async def test_many_tasks_adding_forking_and_aborting_leave_the_pool_whole(make_engine):
    engine = make_engine(num_kv_blocks=48, block_size=8)
    front = AsyncEngine(engine)
    rng = random.Random(0)
    kinds = [
        SamplingParams(max_tokens=12, temperature=1.0, seed=1),
        SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=2),
        SamplingParams(n=2, best_of=3, max_tokens=8, temperature=0.8, seed=3),
        SamplingParams(beam_width=3, n=2, max_tokens=8),
    ]
    finished: dict[str, int] = {}

    async def client(i: int) -> None:
        params = kinds[i % len(kinds)]
        stream = await front.add_request(f"q{i}", f"Request number {i}: tell me a fact.", params)
        leave_after = rng.choice([None, 1, 3])
        count = 0
        async for delta in stream:
            count += 1
            finished[f"q{i}"] = finished.get(f"q{i}", 0) + delta.finished
            if leave_after is not None and count >= leave_after:
                break  # leaving the stream aborts the request
        await asyncio.sleep(0)

    async def aborter() -> None:
        for _ in range(10):
            await asyncio.sleep(0.05)
            front.abort(f"q{rng.randrange(24)}")

    await asyncio.gather(*(client(i) for i in range(24)), aborter())
    while engine.has_work():
        await asyncio.sleep(0.05)
    await front.close()
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert engine.groups == {} and not engine.batcher.has_work()

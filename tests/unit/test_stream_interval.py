"""A worker's channel with ``stream_interval``: which items go out together.

``WorkerActor._forward`` (which items are urgent), ``Outbox`` (when a batch is due)
and ``WorkerActor._batches`` (the batches a channel sends) on a stand-in engine, fed scripted
deltas and step counts (the engine is not what is tested here;
tests/cluster/test_cluster.py checks a channel's batches from a running worker, and
tests/cluster/test_serve.py the text over HTTP with the serve app's interval).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tessera.workers.api import FinishReason, RequestOutput
from tessera.workers.process import channel as channel_module
from tessera.workers.process.actor import WorkerActor
from tessera.workers.process.channel import END, Outbox, StreamFailure


def delta(token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        "r",
        text=f"<{token}>",
        token_ids=(token,),
        finished=finished,
        finish_reason=FinishReason.LENGTH if finished else None,
    )


async def forwarded(deltas: list[RequestOutput], fail: bool = False) -> list[tuple]:
    """``(item, urgent)`` for each item ``_forward`` puts on a channel."""
    channel = Outbox(keepalive_s=60.0)
    puts: list[tuple] = []
    put = channel.put

    def recording_put(request_id, *items, urgent=True):
        puts.extend((item, urgent) for item in items)
        put(request_id, *items, urgent=urgent)

    channel.put = recording_put

    async def stream():
        for d in deltas:
            yield d
        if fail:
            raise RuntimeError("step failed")

    await WorkerActor._forward(stream(), channel, "r")
    assert [item for _, item in channel.take(0)] == [item for item, _ in puts]
    return puts


async def test_the_first_delta_a_finished_one_and_the_end_are_urgent():
    deltas = [delta(i) for i in range(4)] + [delta(4, finished=True)]
    puts = await forwarded(deltas)
    assert puts == [
        (deltas[0], True),
        *[(d, False) for d in deltas[1:4]],
        (deltas[4], True),
        (END, True),
    ]


async def test_a_failure_is_urgent_after_what_came_before_it():
    deltas = [delta(i) for i in range(3)]
    puts = await forwarded(deltas, fail=True)
    assert puts[:3] == [(deltas[0], True), (deltas[1], False), (deltas[2], False)]
    assert puts[3] == (StreamFailure("RuntimeError: step failed"), True)


def test_held_items_go_every_interval_steps_or_with_an_urgent_one():
    channel = Outbox(keepalive_s=60.0, interval=4)
    channel.sent_step = 100
    assert not channel.due(200)  # nothing held
    channel.put("a", delta(1), urgent=False)
    channel.put("b", delta(7), urgent=False)
    assert not channel.due(101) and not channel.due(103)
    assert channel.due(104)  # 4 steps since the last batch
    assert channel.take(104) == [("a", delta(1)), ("b", delta(7))]
    assert not channel.ready.is_set() and not channel.due(110)
    channel.put("a", delta(2), urgent=False)
    assert not channel.due(105)
    channel.put("c", delta(9), urgent=True)  # a first token: it and what is held go
    assert channel.due(105)
    assert channel.take(105) == [("a", delta(2)), ("c", delta(9))]
    channel.put("a", delta(3), urgent=False)
    assert not channel.due(108) and channel.due(109)  # counted from the urgent batch


def test_interval_one_sends_whatever_is_held():
    channel = Outbox(keepalive_s=60.0)
    assert channel.interval == 1
    channel.sent_step = 7
    channel.put("a", delta(1), urgent=False)
    assert channel.due(7)
    channel.take(7)
    channel.put("b", delta(2), urgent=False)  # a late item of the same step
    assert channel.due(7)


async def test_a_channel_sends_held_items_every_interval_steps_and_after_a_stall(monkeypatch):
    monkeypatch.setattr(channel_module, "HOLD_S", 0.3)
    engine = SimpleNamespace(config=SimpleNamespace(stream_interval=3), num_steps=10)
    worker = SimpleNamespace(_channels={}, engine=SimpleNamespace(engine=engine))
    batches = WorkerActor._batches(worker, "c", 60.0)
    assert await anext(batches) == []  # open
    channel = worker._channels["c"]

    got = asyncio.ensure_future(anext(batches))
    channel.put("a", delta(0))  # a first token: at once
    assert await asyncio.wait_for(got, 5) == [("a", delta(0))]

    got = asyncio.ensure_future(anext(batches))
    for step in (11, 12):  # held: fewer than 3 steps since that batch (at step 10)
        engine.num_steps = step
        channel.put("a", delta(step), urgent=False)
        await asyncio.sleep(0.02)
        assert not got.done()
    engine.num_steps = 13
    channel.put("b", delta(13), urgent=False)
    assert await asyncio.wait_for(got, 5) == [("a", delta(11)), ("a", delta(12)), ("b", delta(13))]

    got = asyncio.ensure_future(anext(batches))
    channel.put("a", delta(14), urgent=False)  # and then no step: it goes after HOLD_S
    await asyncio.sleep(0.02)
    assert not got.done()
    assert await asyncio.wait_for(got, 5) == [("a", delta(14))]
    await batches.aclose()
    assert worker._channels == {}

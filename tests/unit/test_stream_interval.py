"""A worker's channel with ``stream_interval``: which deltas go out together.

``WorkerActor._forward`` alone, fed a scripted stream of deltas (the engine is not
what is tested here; tests/cluster/test_serve.py checks the text over HTTP with the
serve app's interval).
"""

from __future__ import annotations

import pytest

from tessera.workers.actor import WorkerActor, _Channel
from tessera.workers.api import FinishReason, RequestOutput
from tessera.workers.protocol import END, StreamFailure


def delta(tokens: int, first: int, finished: bool = False) -> RequestOutput:
    ids = tuple(range(first, first + tokens))
    return RequestOutput(
        "r",
        text="".join(f"<{i}>" for i in ids),
        token_ids=ids,
        finished=finished,
        finish_reason=FinishReason.LENGTH if finished else None,
    )


async def forwarded(deltas: list[RequestOutput], interval: int, fail: bool = False) -> list:
    """The channel's batches as ``_forward`` puts them, one list per ``put``."""
    channel = _Channel(keepalive_s=60.0)
    puts: list[list] = []
    put = channel.put

    def recording_put(request_id, *items):
        puts.append([item for item in items])
        put(request_id, *items)

    channel.put = recording_put

    async def stream():
        for d in deltas:
            yield d
        if fail:
            raise RuntimeError("step failed")

    await WorkerActor._forward(stream(), channel, "r", interval)
    assert [item for _, item in channel.take()] == [item for p in puts for item in p]
    return puts


def token_counts(puts: list[list]) -> list[object]:
    return [
        [
            item if item is END else len(item.token_ids)
            for item in p
            if not isinstance(item, StreamFailure)
        ]
        for p in puts
    ]


async def test_interval_one_puts_every_delta_at_once():
    deltas = [delta(1, i, finished=i == 4) for i in range(5)]
    puts = await forwarded(deltas, 1)
    assert puts == [[d] for d in deltas] + [[END]]


async def test_first_delta_goes_at_once_then_groups_of_interval_tokens():
    deltas = [delta(1, i) for i in range(10)] + [delta(1, 10, finished=True)]
    puts = await forwarded(deltas, 4)
    assert token_counts(puts) == [[1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1], [END]]
    # nothing lost or reordered
    assert [item for p in puts for item in p][:-1] == deltas


async def test_multi_token_deltas_count_their_tokens():
    # speculative decoding and parallel tokens: several tokens in one delta
    deltas = [delta(2, 0), delta(3, 2), delta(1, 5), delta(2, 6), delta(1, 8, finished=True)]
    puts = await forwarded(deltas, 4)
    assert token_counts(puts) == [[2], [3, 1], [2, 1], [END]]


async def test_what_is_held_goes_before_a_failure():
    deltas = [delta(1, i) for i in range(3)]
    puts = await forwarded(deltas, 4, fail=True)
    assert token_counts(puts) == [[1], [1, 1]]
    assert puts[-1][-1] == StreamFailure("RuntimeError: step failed")


@pytest.mark.parametrize("interval", [2, 8])
async def test_a_stream_that_ends_unfinished_flushes_what_it_held(interval):
    # n > 1: the last delta of one output is not the request's end
    deltas = [delta(1, 0), delta(1, 1)]
    puts = await forwarded(deltas, interval)
    assert [item for p in puts for item in p] == [*deltas, END]
    assert puts[-1][-1] is END

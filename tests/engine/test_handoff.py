"""Moving a prompt's KV blocks from one engine to another (``tessera.workers.kv.handoff``):
the receiver's output equals an engine that computed everything itself, the moved
blocks serve as prefix hits, and a released reservation leaves nothing behind."""

from __future__ import annotations

import asyncio

import pytest

from tessera.workers.api import PrefillSource, SamplingParams
from tessera.workers.engine.async_engine import AsyncEngine
from tessera.workers.process.disaggregation import DecodeOrchestrator, PhaseManager
from tessera.workers.process.kv_transfer import KVTransferClient, KVTransferServer, usable_blocks
from tessera.workers.process.protocol import TransferCounters
from tests.helpers import run_engine, tokens_of

PROMPT = (
    "A parcel left the depot on Monday morning and reached the sorting centre by noon. "
    "The customs form was missing, so the parcel waited two days before it moved on. "
)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def test_moved_blocks_give_the_same_tokens_as_computing_them(make_engine):
    sender, receiver, reference = make_engine(), make_engine(), make_engine()
    ids = sender.tokenizer(PROMPT * 2).input_ids
    usable = usable_blocks(len(ids), sender.kv.block_size)
    assert usable >= 3

    sender.add_request("prefill", ids, SamplingParams(max_tokens=1, temperature=0))
    run_engine(sender)
    hashes = sender.handoff.prompt_hashes(ids, None)[:usable]
    blocks = sender.handoff.export(hashes[1:])  # the receiver holds block 0 (say)
    assert blocks is not None and len(blocks) == usable - 1
    assert sender.handoff.export([b"\0" * 32]) is None  # not cached: nothing to send

    reservation = receiver.handoff.reserve(1, hashes[1:])
    receiver.check_integrity()  # reserved blocks are held, by the reservation
    with pytest.raises(ValueError, match="out of order"):
        receiver.handoff.write(reservation, 2, blocks[1])
    for i, kv in enumerate(blocks, start=1):
        receiver.handoff.write(reservation, i, kv)
    receiver.handoff.commit(reservation)
    receiver.check_integrity()
    assert receiver.handoff.cached_prefix(hashes) == 0  # block 0 was never moved
    assert receiver.handoff.cached_prefix(hashes[1:]) == usable - 1

    # Give the receiver block 0 too, the way its own earlier request would have.
    (first,) = sender.handoff.export(hashes[:1])
    head = receiver.handoff.reserve(0, hashes[:1])
    receiver.handoff.write(head, 0, first)
    receiver.handoff.commit(head)
    before = receiver.stats().prefix_cache.hits
    receiver.add_request("decode", ids, GREEDY)
    got = tokens_of(run_engine(receiver)["decode"])
    assert receiver.stats().prefix_cache.hits - before == usable * receiver.kv.block_size

    reference.add_request("ref", ids, GREEDY)
    assert got == tokens_of(run_engine(reference)["ref"])


def test_a_released_reservation_leaves_the_pool_as_it_was(make_engine):
    engine = make_engine()
    free = engine.kv.pool.num_free
    reservation = engine.handoff.reserve(0, [b"a" * 32, b"b" * 32])
    assert engine.kv.pool.num_free == free - 2
    engine.handoff.release(reservation)
    engine.handoff.release(reservation)  # twice is harmless
    assert engine.kv.pool.num_free == free and not engine.kv.pool.cached
    engine.check_integrity()
    assert engine.handoff.reserve(0, [b"x"] * (free + 1)) is None  # no room: refused


async def test_a_pull_cancelled_mid_transfer_gives_its_reserved_blocks_back(make_engine):
    """The caller leaves (or its deadline passes) while the prefill worker is still
    working: the decode side's reservation must not leak."""
    engine = AsyncEngine(make_engine())
    free = engine.engine.kv.pool.num_free
    handling = asyncio.Event()

    async def stalled(request, time_remaining):
        handling.set()
        await asyncio.sleep(60)

    server = KVTransferServer(stalled)
    await server.start()
    client = KVTransferClient()
    counters = TransferCounters()
    decode = DecodeOrchestrator(engine, client, counters, PhaseManager("w"), timeout_s=30)
    ids = engine.engine.tokenizer(PROMPT * 2).input_ids
    try:
        pull = asyncio.ensure_future(
            decode.pull("r", ids, GREEDY, None, PrefillSource("prefill-0", server.address))
        )
        await asyncio.wait_for(handling.wait(), 10)
        assert engine.engine.kv.pool.num_free < free  # reserved for the transfer
        pull.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pull
    finally:
        await client.close()
        await server.stop(None)
        await engine.close()
    assert engine.engine.kv.pool.num_free == free and not engine.engine.handoff.reservations
    engine.engine.check_integrity()
    assert not counters.fallbacks  # not a transfer failure: the request is gone

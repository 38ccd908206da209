"""The global admission queue (scheduler/admission.py): FIFO dispatch, the limit, per-request
deadlines, withdrawal; no Ray."""

from __future__ import annotations

import asyncio

from tessera.scheduler.admission import AdmissionQueue


def start(queue, request_id, timeout_s=5.0, role="mixed"):
    return asyncio.ensure_future(queue.wait(request_id, role, [], (request_id,), timeout_s))


async def test_dispatch_places_oldest_first_until_no_worker_has_room():
    queue = AdmissionQueue(limit=4)
    waits = [start(queue, f"r{i}") for i in range(3)]
    await asyncio.sleep(0)
    assert len(queue) == 3 and not queue.full
    offered = []
    rooms = ["w0", "w1"]  # two free places, then none

    def place(waiter):
        offered.append(waiter.request_id)
        return rooms.pop(0) if rooms else None

    queue.dispatch(place)
    assert offered == ["r0", "r1", "r2"]  # r2 was offered and found no room
    assert await waits[0] == "w0" and await waits[1] == "w1"
    assert not waits[2].done() and len(queue) == 1
    queue.dispatch(lambda waiter: "w9")
    assert await waits[2] == "w9" and len(queue) == 0


async def test_full_at_the_limit_and_counts_per_role():
    queue = AdmissionQueue(limit=2)
    waits = [start(queue, "a"), start(queue, "b", role="prefill")]
    await asyncio.sleep(0)
    assert queue.full
    assert queue.waiting("mixed") == 1 and queue.waiting("prefill") == 1
    queue.cancel_all("closed")
    assert [await w for w in waits] == ["closed", "closed"]
    assert not queue.full and len(queue) == 0


async def test_a_deadline_returns_none_and_leaves_the_queue():
    queue = AdmissionQueue(limit=4)
    late = start(queue, "late", timeout_s=0.05)
    keep = start(queue, "keep")
    assert await late is None
    assert len(queue) == 1
    offered = []
    queue.dispatch(lambda waiter: offered.append(waiter.request_id) or "w0")
    assert offered == ["keep"]  # the expired waiter is skipped, not offered
    assert await keep == "w0"


async def test_cancel_withdraws_one_request_and_is_idempotent():
    queue = AdmissionQueue(limit=4)
    first, second = start(queue, "first"), start(queue, "second")
    await asyncio.sleep(0)
    queue.cancel("first", "gone")
    queue.cancel("first", "again")  # no longer waiting: nothing happens
    queue.cancel("unknown", "x")
    assert await first == "gone"
    assert len(queue) == 1
    queue.dispatch(lambda waiter: waiter.request_id.upper())
    assert await second == "SECOND"

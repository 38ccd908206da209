"""The scheduler's view of which prompt blocks each worker's prefix cache holds.

A worker reports the block hashes its pool stores and evicts (``WorkerLoad.events``);
the index applies them in order. Hashes chain (a block's hash names its whole prefix),
so a worker holds a prompt's first ``k`` blocks exactly when it holds the hash of each
of them, and matching stops at the first miss.

A placement also records the prompt's hashes for its worker at once, marked
*expected*: the worker will cache them within a step or two, and requests sharing the
prefix that arrive before its next report should follow the first one. An expected
hash that no report confirms within ``EXPECTED_TTL`` seconds (the request was
aborted, or its blocks were evicted before the report) is forgotten.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

EXPECTED_TTL = 30.0


class PrefixIndex:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._stored: dict[str, set[bytes]] = {}
        self._expected: dict[str, dict[bytes, float]] = {}  # hash -> when it lapses

    def reset(self, worker_id: str, hashes: Iterable[bytes] = ()) -> None:
        """Forget what ``worker_id`` held (it restarted, or sends a full snapshot)."""
        self._stored[worker_id] = set(hashes)
        self._expected[worker_id] = {}

    def remove(self, worker_id: str) -> None:
        self._stored.pop(worker_id, None)
        self._expected.pop(worker_id, None)

    def apply(self, worker_id: str, events: Iterable[tuple[bool, bytes]]) -> None:
        stored = self._stored.setdefault(worker_id, set())
        expected = self._expected.setdefault(worker_id, {})
        for is_stored, block_hash in events:
            expected.pop(block_hash, None)
            if is_stored:
                stored.add(block_hash)
            else:
                stored.discard(block_hash)
        now = self._clock()
        for block_hash in [h for h, lapse in expected.items() if lapse < now]:
            del expected[block_hash]

    def expect(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        stored = self._stored.setdefault(worker_id, set())
        expected = self._expected.setdefault(worker_id, {})
        lapse = self._clock() + EXPECTED_TTL
        for block_hash in hashes:
            if block_hash not in stored:
                expected[block_hash] = lapse

    def matched(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` the worker holds (or will shortly)."""
        stored = self._stored.get(worker_id, set())
        expected = self._expected.get(worker_id, {})
        now = self._clock()
        count = 0
        for block_hash in hashes:
            if block_hash in stored:
                count += 1
                continue
            lapse = expected.get(block_hash)
            if lapse is None:
                break
            if lapse < now:
                del expected[block_hash]
                break
            count += 1
        return count

    def size(self, worker_id: str) -> int:
        return len(self._stored.get(worker_id, ()))

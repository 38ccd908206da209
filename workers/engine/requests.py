"""An engine's live requests: their groups by id, and which of them speculate.

A request id is taken from ``add_request`` (any thread) until its group ends (the step
thread); ``groups`` and ``speculating`` change on the step thread only.
"""

from __future__ import annotations

import threading

from tessera.workers.api import InvalidRequestError
from tessera.workers.engine.batcher import Batcher
from tessera.workers.engine.loras import LoraManager
from tessera.workers.engine.sequence import SequenceGroup


class LiveRequests:
    def __init__(self, batcher: Batcher, loras: LoraManager | None = None) -> None:
        self.batcher = batcher
        self.loras = loras  # a group's adapter slot is unpinned when it ends
        self.groups: dict[str, SequenceGroup] = {}
        #: Live requests whose sequence speculates: without any, a step skips looking
        #: for sequences to propose drafts for, or drafts to drop.
        self.speculating: set[str] = set()
        self._known_ids: set[str] = set()
        self._lock = threading.Lock()  # guards _known_ids across threads

    def reserve(self, request_id: str) -> None:
        """Take ``request_id``; raises ``InvalidRequestError`` if a live request has it."""
        with self._lock:
            if request_id in self._known_ids:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
            self._known_ids.add(request_id)

    def add(self, group: SequenceGroup) -> None:
        if group.seqs[0].spec is not None:
            self.speculating.add(group.request_id)
        self.groups[group.request_id] = group
        self.batcher.add(group)

    def end(self, group: SequenceGroup) -> None:
        """The group is over: out of the batch (its live sequences' blocks are freed)
        and its id free again."""
        self.batcher.remove(group)
        del self.groups[group.request_id]
        self.speculating.discard(group.request_id)
        if self.loras is not None:
            self.loras.release(group.request_id)
        self.release(group.request_id)

    def release(self, request_id: str) -> None:
        """Free ``request_id`` for another request."""
        with self._lock:
            self._known_ids.discard(request_id)

"""The responses that ``POST /v1/responses`` keeps (``store``, on by default as OpenAI's)
for ``GET`` / ``DELETE /v1/responses/{id}`` and for ``previous_response_id``.

The store lives in its front-end replica's memory: bounded (the oldest go first) and
each entry expiring ``RESPONSE_TTL_S`` after it was written. A response is found only
on the replica that answered it: with several replicas a later request may reach
another one and get 404; a replica that stops takes its responses with it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: The most responses one replica keeps; past it the oldest is dropped.
RESPONSE_STORE_SIZE = 4096
#: Seconds a stored response stays.
RESPONSE_TTL_S = 3600.0


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as answered, and the conversation a follow-up continues: its input
    items (those of the responses before it too) and its output items."""

    response: dict[str, Any]
    items: list[dict[str, Any]]
    expires: float  # time.monotonic()


class ResponseStore:
    """Bounded, expiring responses by id, oldest first."""

    def __init__(self, size: int = RESPONSE_STORE_SIZE, ttl_s: float = RESPONSE_TTL_S) -> None:
        if size < 1 or ttl_s <= 0:
            raise ValueError(f"size must be >= 1 and ttl_s > 0, got {size}, {ttl_s}")
        self.size = size
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        self._expire(now)
        self._entries[response["id"]] = StoredResponse(response, items, now + self.ttl_s)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire(time.monotonic())
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def _expire(self, now: float) -> None:
        """Entries are in write order, so the expired ones are at the front."""
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.expires > now:
                break
            self._entries.popitem(last=False)

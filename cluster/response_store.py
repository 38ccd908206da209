"""The responses that ``POST /v1/responses`` keeps (``store``, on by default as OpenAI's)
for ``GET`` / ``DELETE /v1/responses/{id}`` and for ``previous_response_id``.

They live in Ray's GCS key-value store (as ``ReplicaBoard``'s metrics do), one key per
response, so that every front-end replica finds every replica's responses, and a
replica that stops loses none. Each value is the time it was written and the response
with the conversation a follow-up continues. Bounds (the settings
``response_store_size`` and ``response_store_ttl_s``): a replica keeps at most ``size`` of
the responses it wrote (it deletes its oldest past that), and a response expires
``ttl_s`` after it was written: a reader deletes an expired
one it meets, a writer its own expired ones, and a new replica those of replicas gone
(``sweep``). The calls block on the GCS: run them off the event loop.
"""

from __future__ import annotations

import json
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

#: The most responses one replica keeps of those it wrote; past it the oldest go (the
#: default of the setting ``response_store_size``).
RESPONSE_STORE_SIZE = 4096
#: Seconds a stored response stays (the default of ``response_store_ttl_s``).
RESPONSE_TTL_S = 3600.0
#: A longer id is no id this server gave.
MAX_ID_CHARS = 128
_WRITTEN = struct.Struct("<d")  # time.time() of the write, before the JSON


class KeyValue(Protocol):
    def put(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes | None: ...
    def delete(self, key: str) -> bool: ...
    def keys(self, prefix: str) -> list[str]: ...


class GcsKeyValue:
    """Ray's internal key-value store (the GCS), shared by every process of the
    cluster."""

    def put(self, key: str, value: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(key, value)

    def get(self, key: str) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(key)

    def delete(self, key: str) -> bool:
        from ray.experimental import internal_kv

        return bool(internal_kv._internal_kv_del(key))

    def keys(self, prefix: str) -> list[str]:
        from ray.experimental import internal_kv

        return [key.decode() for key in internal_kv._internal_kv_list(prefix)]


class MemoryKeyValue:
    """A process's own key-value store (tests)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def put(self, key: str, value: bytes) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    def delete(self, key: str) -> bool:
        return self.values.pop(key, None) is not None

    def keys(self, prefix: str) -> list[str]:
        return [key for key in self.values if key.startswith(prefix)]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as answered, and the conversation a follow-up continues: its input
    items (those of the responses before it too) and its output items."""

    response: dict[str, Any]
    items: list[dict[str, Any]]


class ResponseStore:
    """Responses by id under ``prefix`` in ``kv``, bounded and expiring (see the
    module's docstring)."""

    def __init__(
        self,
        kv: KeyValue,
        prefix: str,
        size: int = RESPONSE_STORE_SIZE,
        ttl_s: float = RESPONSE_TTL_S,
    ) -> None:
        if size < 1 or ttl_s <= 0:
            raise ValueError(f"size must be >= 1 and ttl_s > 0, got {size}, {ttl_s}")
        self.kv = kv
        self.prefix = prefix
        self.size = size
        self.ttl_s = ttl_s
        self._mine: OrderedDict[str, float] = OrderedDict()  # id -> written, oldest first

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        now = time.time()
        # the standard library's JSON, not orjson's: a request's items may hold what JSON
        # allows and orjson refuses (an integer past 64 bits, a lone surrogate)
        payload = json.dumps({"response": response, "items": items}).encode()
        self.kv.put(self.prefix + response["id"], _WRITTEN.pack(now) + payload)
        self._mine[response["id"]] = now
        while self._mine:
            oldest, written = next(iter(self._mine.items()))
            if len(self._mine) <= self.size and now - written < self.ttl_s:
                break
            self._mine.popitem(last=False)
            self.kv.delete(self.prefix + oldest)

    def get(self, response_id: str) -> StoredResponse | None:
        if len(response_id) > MAX_ID_CHARS:
            return None
        value = self.kv.get(self.prefix + response_id)
        if value is None:
            return None
        (written,) = _WRITTEN.unpack_from(value)
        if time.time() - written >= self.ttl_s:
            self.delete(response_id)
            return None
        data = json.loads(value[_WRITTEN.size :])
        return StoredResponse(data["response"], data["items"])

    def delete(self, response_id: str) -> bool:
        if len(response_id) > MAX_ID_CHARS:
            return False
        self._mine.pop(response_id, None)
        return self.kv.delete(self.prefix + response_id)

    def sweep(self) -> int:
        """Delete every expired response (those of replicas gone, which no writer
        deletes); how many."""
        now, deleted = time.time(), 0
        for key in self.kv.keys(self.prefix):
            value = self.kv.get(key)
            if value is not None and now - _WRITTEN.unpack_from(value)[0] >= self.ttl_s:
                deleted += self.kv.delete(key)
        return deleted

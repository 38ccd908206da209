"""An engine's LoRA adapters: read and checked on the caller's thread, put in the model's
slots (``model.lora.LoraSlots``) by the step that admits a request using one.

A slot is pinned while a live request uses its adapter; an unpinned slot keeps its
adapter until another needs the room (least recently used first). A request whose
adapter finds every slot pinned waits, in order, until one is unpinned
(``Engine._admit``). Adapters are known by content (``LoraRef.digest``): two names for
the same files share a slot, and an adapter's prefix-cache blocks are its own.
"""

from __future__ import annotations

import collections
import threading

from tessera.workers.api import InvalidRequestError, LoraRef
from tessera.workers.model.config import ModelConfig
from tessera.workers.model.lora import LoraAdapter, LoraBatch, LoraError, LoraSlots, read_adapter

#: Adapters read and checked but not (or no longer) in a slot, kept in memory: a
#: request's adapter is read on the caller's thread, then written by the step.
MAX_READ_ADAPTERS = 32


class LoraManager:
    def __init__(self, slots: LoraSlots) -> None:
        self.slots = slots  # the model's
        self.config: ModelConfig = slots.model_config
        self.max_loras, self.max_rank = slots.max_loras, slots.max_rank
        self.device = slots.device
        self._read: collections.OrderedDict[str, LoraAdapter] = collections.OrderedDict()
        self._lock = threading.Lock()  # guards _read (prepare runs on callers' threads)
        # step thread only:
        self.resident: dict[str, int] = {}  # digest -> slot
        self._digest_of: list[str | None] = [None] * self.max_loras
        self._pins = [0] * self.max_loras
        self._used = [0] * self.max_loras  # when each slot was last acquired
        self._clock = 0
        #: Live requests' slots, by request id (what a step's rows read).
        self.request_slots: dict[str, int] = {}

    def prepare(self, ref: LoraRef) -> None:
        """Read and check ``ref``'s adapter unless it is here already; raises
        ``InvalidRequestError`` on ``model`` saying what is wrong with it."""
        with self._lock:
            if ref.digest in self._read:
                self._read.move_to_end(ref.digest)
                return
        if ref.digest in self.resident:
            return
        adapter = self.read(ref)
        with self._lock:
            self._read[ref.digest] = adapter
            while len(self._read) > MAX_READ_ADAPTERS:
                self._read.popitem(last=False)

    def read(self, ref: LoraRef) -> LoraAdapter:
        try:
            adapter = read_adapter(ref.path, self.config, self.max_rank)
        except LoraError as error:
            raise InvalidRequestError("model", f"LoRA adapter {ref.name!r}: {error}") from None
        if adapter.digest != ref.digest:
            raise InvalidRequestError(
                "model",
                f"LoRA adapter {ref.name!r}: its files in {ref.path!r} changed since it was "
                f"loaded; load it again",
            )
        return adapter

    def acquire(self, request_id: str, ref: LoraRef) -> bool:
        """Pin ``ref``'s slot for request ``request_id`` (writing the adapter into a free
        or least recently used unpinned slot if it is in none); False if every slot is
        pinned. Step thread."""
        self._clock += 1
        slot = self.resident.get(ref.digest)
        if slot is None:
            free = [s for s in range(self.max_loras) if self._pins[s] == 0]
            if not free:
                return False
            slot = min(free, key=lambda s: (self._digest_of[s] is not None, self._used[s]))
            with self._lock:
                adapter = self._read.get(ref.digest)
            if adapter is None:  # dropped from the read ones meanwhile: read again
                adapter = self.read(ref)
            old = self._digest_of[slot]
            if old is not None:
                del self.resident[old]
            self.slots.write(slot, adapter)
            self._digest_of[slot] = ref.digest
            self.resident[ref.digest] = slot
        self._pins[slot] += 1
        self._used[slot] = self._clock
        self.request_slots[request_id] = slot
        return True

    def release(self, request_id: str) -> None:
        """Unpin the slot of ``request_id`` (if it had one). Step thread."""
        slot = self.request_slots.pop(request_id, None)
        if slot is not None:
            self._pins[slot] -= 1

    def batch(self, seq_ids: list[str]) -> LoraBatch | None:
        """The step's adapters for rows of these sequences (``#`` names a fork of its
        request), or None if none of them has one."""
        slots = self.request_slots
        if not slots:
            return None
        rows = [slots.get(seq_id.partition("#")[0], -1) for seq_id in seq_ids]
        return self.slots.batch(rows, self.device)

"""Front-end replicas' request metrics, shared through Ray's GCS key-value store, so
that one scrape of ``/metrics`` (which Serve's proxy hands to any replica) shows every
live replica's request series (``cluster/metrics.py``)."""

from __future__ import annotations

import struct
import time


class ReplicaBoard:
    """Front-end replicas' request metrics, shared through Ray's GCS key-value store:
    one key per replica under ``prefix``, its value the time it was written and the
    replica's ``Metrics.snapshot()``. A snapshot older than ``stale_s`` (its replica is
    gone without withdrawing it) is left out and deleted. The calls block on the GCS:
    run them off the event loop."""

    def __init__(self, prefix: str, replica: str, stale_s: float = 30.0) -> None:
        self.prefix = prefix
        self.key = f"{prefix}{replica}"
        self.stale_s = stale_s

    def publish(self, snapshot: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self.key, struct.pack("<d", time.time()) + snapshot)

    def read(self) -> dict[str, bytes]:
        """Every fresh snapshot but this replica's own: replica -> snapshot."""
        from ray.experimental import internal_kv

        now, out = time.time(), {}
        for key in internal_kv._internal_kv_list(self.prefix):
            name = key.decode()
            if name == self.key:
                continue
            value = internal_kv._internal_kv_get(key)
            if value is None:  # withdrawn meanwhile
                continue
            (written,) = struct.unpack_from("<d", value)
            if now - written > self.stale_s:
                internal_kv._internal_kv_del(key)
                continue
            out[name[len(self.prefix) :]] = value[8:]
        return out

    def withdraw(self) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self.key)

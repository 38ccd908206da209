"""The cluster's LoRA adapters: the scheduler's registry of names, one of its bases.

``load_lora`` asks a healthy worker to read and check an adapter's folder (the worker
keeps what it read, and any worker loads it again from the folder when a request needs
it); the registry maps the name to its ``LoraRef`` (folder and digest). Front ends look
names up per request (``lora``). The registry is kept in Ray's GCS key-value store
under the scheduler's name, so a restarted scheduler (``Scheduler.restarted``) serves
the same adapters; a scheduler started anew begins with none.
"""

from __future__ import annotations

import json
import logging

from tessera.scheduler.api import NoWorkerError, WorkerStatus
from tessera.scheduler.config import SchedulerConfig
from tessera.scheduler.registry import Registry
from tessera.workers.api import InvalidRequestError, LoraRef

logger = logging.getLogger(__name__)

#: Most adapters the registry holds (each a name; workers hold ``max_loras`` at once).
MAX_REGISTERED_LORAS = 1024


class LoraRegistry:
    """The adapter part of ``Scheduler`` (``tessera.scheduler.actor``)."""

    config: SchedulerConfig
    registry: Registry
    restarted: bool

    def _init_loras(self) -> None:
        self.loras: dict[str, LoraRef] = {}
        prefix = self._lora_prefix()
        from ray.experimental import internal_kv

        for key in internal_kv._internal_kv_list(prefix):
            if self.restarted:
                value = json.loads(internal_kv._internal_kv_get(key))
                self.loras[value["name"]] = LoraRef(**value)
            else:  # another cluster's of this name, gone
                internal_kv._internal_kv_del(key)

    def _lora_prefix(self) -> str:
        return f"tessera:loras:{self.config.namespace}:{self.config.scheduler_name}:"

    async def load_lora(self, name: str, path: str) -> LoraRef:
        """Register adapter ``name`` from folder ``path`` (a name already registered is
        replaced); ``InvalidRequestError`` on ``lora_path`` saying what is wrong with it,
        ``NoWorkerError`` if no worker is up to read it."""
        if not self.config.engine.enable_lora:
            raise InvalidRequestError(
                "lora_name",
                "this server serves no LoRA adapters (start it with --enable-lora or "
                "--lora-modules)",
            )
        if name not in self.loras and len(self.loras) >= MAX_REGISTERED_LORAS:
            raise InvalidRequestError(
                "lora_name", f"{MAX_REGISTERED_LORAS} adapters are loaded, the most there may be"
            )
        workers = [w for w in self.registry if w.status is WorkerStatus.HEALTHY]
        if not workers:
            raise NoWorkerError("no worker is up to read the adapter")
        worker = min(workers, key=lambda w: w.in_flight)
        try:
            ref = await worker.handle.read_lora.remote(name, path)
        except InvalidRequestError as error:  # Ray's error is also the worker's
            cause = getattr(error, "cause", error)
            raise InvalidRequestError("lora_path", cause.message) from None
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(
            self._lora_prefix() + name,
            json.dumps({"name": ref.name, "path": ref.path, "digest": ref.digest}).encode(),
        )
        self.loras[name] = ref
        logger.info("LoRA adapter %r loaded from %s", name, ref.path)
        return ref

    def unload_lora(self, name: str) -> bool:
        """Forget adapter ``name`` (requests running with it finish); False if unknown."""
        if self.loras.pop(name, None) is None:
            return False
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self._lora_prefix() + name)
        logger.info("LoRA adapter %r unloaded", name)
        return True

    def lora(self, name: str) -> LoraRef | None:
        return self.loras.get(name)

    def lora_list(self) -> list[LoraRef]:
        return list(self.loras.values())

"""The cluster's configuration: one typed, validated object for the whole cluster.

``ClusterConfig`` is user-facing (pydantic, a description on every field). Its engine
settings are not written here: it extends ``EngineSettings``, which derives them from
``EngineConfig``'s fields (the one declaration). Its errors name the field:
``ConfigError("block_size: Input should be greater than or equal to 1, got 0")``.
"""

from __future__ import annotations

import typing

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from tessera.cluster.engine_settings import EngineSettings
from tessera.cluster.memory_size import memory_value
from tessera.scheduler.placement import POLICIES
from tessera.workers.config import (
    AUTO_DTYPE,
    FAST,
    INT8,
    PACKED_DTYPES,
    PRECISION_TEXT,
    EngineConfig,
)
from tessera.workers.process.protocol import DECODE, MIXED, PREFILL

if typing.TYPE_CHECKING:  # heavy (torch, grpc): imported where used
    from tessera.workers.process.disaggregation import KVTransferConfig
    from tessera.workers.process.kv_auth import ClusterSecret


class ConfigError(ValueError):
    """A bad configuration value; the message starts with the field's name."""


#: The autoscaling bounds of the prefill and decode pools (a disaggregated cluster's).
DISAGGREGATED_BOUNDS = (
    "min_prefill_workers",
    "max_prefill_workers",
    "min_decode_workers",
    "max_decode_workers",
)


class ClusterConfig(EngineSettings):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # -- the model and each worker's engine: EngineSettings

    # -- the worker pools: mixed workers, or prefill + decode workers (disaggregation)
    workers: int = Field(
        1,
        ge=0,
        description="mixed workers (each prefills and decodes its requests) started with the "
        "cluster; default 1, or 0 with --prefill-workers/--decode-workers",
    )
    prefill_workers: int = Field(
        0,
        ge=0,
        description="prefill workers: compute prompts' KV blocks and send them to decode "
        "workers over gRPC (disaggregation; with --decode-workers)",
    )
    decode_workers: int = Field(
        0,
        ge=0,
        description="decode workers: pull each request's prompt blocks from a prefill worker "
        "(only those their own prefix cache lacks), then decode",
    )
    min_workers: int | None = Field(
        None, ge=1, description="autoscaling floor of the mixed workers (default: --workers)"
    )
    max_workers: int | None = Field(
        None,
        ge=1,
        description="autoscaling ceiling of the mixed workers (default: --workers, no autoscaling)",
    )
    min_prefill_workers: int | None = Field(
        None,
        ge=1,
        description="autoscaling floor of the prefill workers (default: --prefill-workers)",
    )
    max_prefill_workers: int | None = Field(
        None,
        ge=1,
        description="autoscaling ceiling of the prefill workers (default: --prefill-workers, "
        "no autoscaling)",
    )
    min_decode_workers: int | None = Field(
        None,
        ge=1,
        description="autoscaling floor of the decode workers (default: --decode-workers)",
    )
    max_decode_workers: int | None = Field(
        None,
        ge=1,
        description="autoscaling ceiling of the decode workers (default: --decode-workers, "
        "no autoscaling)",
    )
    worker_num_cpus: float | None = Field(
        None,
        ge=0,
        description="CPUs Ray reserves per worker, also its torch threads (default: the "
        "Ray cluster's CPUs shared evenly among the most workers the pools may grow to, "
        "at least 1; 1 for a GPU worker)",
    )
    worker_max_restarts: int = Field(
        3, ge=-1, description="times Ray restarts a crashed worker (-1: forever)"
    )
    role_resources: bool = Field(
        False,
        description="each worker asks Ray for one unit of the custom resource "
        "'tessera-<role>' too (on KubeRay, the role's worker group offers it)",
    )
    prefill_tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        description="with prefill workers, the ranks of each prefill worker group (default: "
        "--tensor-parallel-size); groups of different sizes compute K/V in another order, "
        "so their decode workers recompute prompts instead of pulling them",
    )
    tensor_parallel_spread: bool = Field(
        False,
        description="with --tensor-parallel-size > 1, let a worker group's ranks span "
        "nodes (Ray's PACK placement, for CPU groups); off: every rank on one node "
        "(STRICT_PACK)",
    )
    kv_transfer_host: str | None = Field(
        None,
        description="address the prefill workers' KV-transfer gRPC servers listen on; decode "
        "workers must reach it (default: each worker's node IP, as Ray reports it; "
        "0.0.0.0: every interface, advertised as the node IP)",
    )
    kv_transfer_port: int = Field(
        0, ge=0, le=65535, description="their port (0: a free port for each worker)"
    )
    kv_transfer_timeout_s: float = Field(
        30.0,
        gt=0,
        description="deadline of one KV transfer; past it (or on any transfer error) the "
        "decode worker prefills the request itself",
    )
    kv_transfer_tls_cert: str | None = Field(
        None, description="mutual TLS between workers: each worker's certificate (PEM file)"
    )
    kv_transfer_tls_key: str | None = Field(None, description="...its private key (PEM file)")
    kv_transfer_tls_ca: str | None = Field(
        None, description="...and the CA that signed every worker's certificate (PEM file)"
    )
    kv_transfer_tls_server_name: str | None = Field(
        None,
        description="the name (DNS SAN) every worker's certificate carries, which decode "
        "workers check instead of the prefill worker's IP, so one certificate can serve "
        "every worker (default: the IP dialled)",
    )
    kv_transfer_max_concurrent_pulls: int = Field(
        64,
        ge=1,
        description="KV transfers a prefill worker serves at once; it refuses more at once, "
        "and their decode workers prefill themselves",
    )

    # -- LoRA adapters (the engine's enable_lora, max_loras, max_lora_rank)
    lora_modules: list[str] = Field(
        [],
        description="LoRA adapters served from the start, each NAME=PATH (a PEFT folder "
        "with adapter_config.json and adapter_model.safetensors, readable by every "
        "worker); requests choose one by model; turns --enable-lora on",
    )

    # -- placement and admission
    placement: str = Field(
        "prefix_affinity",
        description="placement policy: prefix_affinity follows cached prompt blocks "
        "and balances load; round_robin and least_loaded ignore the cache",
    )
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="requests a worker runs at once before new ones wait in the "
        "global queue (default: --max-num-seqs)",
    )
    max_queued_requests: int = Field(
        256,
        ge=0,
        description="requests that may wait in the global queue; beyond it, new "
        "requests are refused at once with an overload error",
    )
    queue_timeout_s: float = Field(
        60.0,
        gt=0,
        description="default deadline for a request to leave the queue and start "
        "(a request may set its own); past it, it is refused with an overload error",
    )

    # -- health and autoscaling
    # 1 s, not 0.25: each report wakes the scheduler and the worker, and with the
    # worker's threads spinning on every core that cost a one-sequence decode step
    # ~0.5 ms of ~8 (docs/architecture.md); placement tracks ongoing requests itself,
    # so reports only refresh the prefix index, KV usage, health and autoscaling.
    report_interval_s: float = Field(
        1.0, gt=0, description="seconds between the scheduler's load reports from workers"
    )
    health_timeout_s: float = Field(
        5.0, gt=0, description="a worker that does not answer a report in this long is unhealthy"
    )
    upscale_delay_s: float = Field(
        10.0, ge=0, description="seconds queueing or KV pressure must last before a worker is added"
    )
    downscale_delay_s: float = Field(
        60.0, ge=0, description="seconds a worker must be idle before it is drained"
    )
    target_kv_usage: float = Field(
        0.8,
        gt=0,
        le=1,
        description="mean KV usage above which the mixed or decode pool scales up",
    )
    target_ongoing_requests: float | None = Field(
        None,
        gt=0,
        description="mean ongoing requests per worker (decode workers: also running "
        "sequences) above which the mixed or decode pool scales up (default: half of "
        "--max-ongoing-requests)",
    )
    target_prefill_queue_tokens: int | None = Field(
        None,
        ge=1,
        description="mean prompt tokens queued per prefill worker (not computed yet) above "
        "which the prefill pool scales up (default: twice --max-num-batched-tokens)",
    )

    # -- Ray
    address: str | None = Field(
        None, description="Ray cluster to join (e.g. auto or ray://host:10001); default: start one"
    )
    namespace: str = Field("tessera", description="Ray namespace of the named actors")
    scheduler_name: str = Field("tessera-scheduler", description="name of the scheduler actor")

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _memory(cls, value):
        return memory_value(value)

    @model_validator(mode="before")
    @classmethod
    def _no_mixed_by_default_with_roles(cls, data):
        """``workers`` defaults to 0 once prefill/decode workers are asked for."""
        if not isinstance(data, dict):
            return data
        if (data.get("prefill_workers") or data.get("decode_workers")) and "workers" not in data:
            data = {**data, "workers": 0}
        if data.get("lora_modules") and "enable_lora" not in data:
            data = {**data, "enable_lora": True}
        return data

    @property
    def loras(self) -> list[tuple[str, str]]:
        """``lora_modules`` as (name, path) pairs."""
        return [tuple(module.split("=", 1)) for module in self.lora_modules]

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if bool(self.prefill_workers) != bool(self.decode_workers):
            raise ValueError(
                f"prefill_workers: disaggregation needs prefill and decode workers, got "
                f"{self.prefill_workers} prefill and {self.decode_workers} decode"
            )
        if self.disaggregated:
            if self.workers:
                raise ValueError(
                    f"workers: mixed workers do not join a disaggregated cluster; got "
                    f"{self.workers} with prefill/decode workers (set workers: 0)"
                )
            if not self.enable_prefix_caching:
                raise ValueError(
                    "enable_prefix_caching: disaggregation moves blocks through the prefix "
                    "cache; it cannot be off with prefill/decode workers"
                )
            for name in ("min_workers", "max_workers"):
                if getattr(self, name) is not None:
                    bound = name.removesuffix("_workers")
                    raise ValueError(
                        f"{name}: bounds the mixed workers, and a disaggregated cluster has "
                        f"none (set {bound}_prefill_workers and {bound}_decode_workers), got "
                        f"{getattr(self, name)}"
                    )
            self._check_pool("prefill_workers")
            self._check_pool("decode_workers")
            return self._check_common()
        for name in DISAGGREGATED_BOUNDS:
            if getattr(self, name) is not None:
                role = name.split("_")[1]
                raise ValueError(
                    f"{name}: bounds the {role} workers, and the cluster has none (set "
                    f"prefill_workers and decode_workers), got {getattr(self, name)}"
                )
        if not self.workers:
            raise ValueError("workers: the cluster needs at least one worker, got 0")
        self._check_pool("workers")
        return self._check_common()

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_workers)

    def ranks(self, role: str) -> int:
        """The ranks of each worker (group) of ``role``."""
        if role == PREFILL and self.prefill_tensor_parallel_size is not None:
            return self.prefill_tensor_parallel_size
        return self.tensor_parallel_size

    @property
    def workers_text(self) -> str:
        """The worker pools in words, for logs."""
        if self.disaggregated:
            return f"{self.prefill_workers} prefill + {self.decode_workers} decode worker(s)"
        if self.tensor_parallel_size > 1:
            return f"{self.workers} worker group(s) of {self.tensor_parallel_size} ranks"
        return f"{self.workers} worker(s)"

    def precision_text(
        self, worker_num_cpus: float, precision: str | None = None, device: str | None = None
    ) -> str:
        """The precision mode and each worker's CPUs (as resolved) in words, for the
        ready line. ``precision``: what a worker's model computes in
        (``LoadedModel.precision``), which ``dtype="auto"`` resolves on the worker;
        ``device``: the workers' device, which ``device="auto"`` resolves at start."""
        resolved = precision or self.dtype
        on_gpu = (device or self.device).startswith("cuda")
        computes = "float32" if resolved in (FAST, INT8, AUTO_DTYPE) else resolved
        packed = (
            self.packed_weights
            and computes in PACKED_DTYPES["cuda" if on_gpu else "cpu"]
            and (self.model is None or self.model.endswith(".gguf"))
        )
        text = PRECISION_TEXT.get(resolved, resolved)
        if self.dtype == AUTO_DTYPE and precision:
            text = f"auto -> {text}"
        weights = f", packed GGUF weights on the {'GPU' if on_gpu else 'CPU'}" if packed else ""
        each = "rank" if self.tensor_parallel_size > 1 else "worker"
        return f"{text}{weights}; {worker_num_cpus:g} CPU(s) and torch threads per {each}"

    def _check_common(self) -> ClusterConfig:
        names = set()
        for module in self.lora_modules:
            name, equals, path = module.partition("=")
            if not (name and equals and path):
                raise ValueError(f"lora_modules: each must be NAME=PATH, got {module!r}")
            if name in names:
                raise ValueError(f"lora_modules: {name!r} is named twice")
            names.add(name)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("enable_lora: --lora-modules needs it on, got off")
        tls = (self.kv_transfer_tls_cert, self.kv_transfer_tls_key, self.kv_transfer_tls_ca)
        if any(tls) and not all(tls):
            raise ValueError(
                "kv_transfer_tls_cert: mutual TLS needs the certificate, key and CA together"
            )
        if self.placement not in POLICIES:
            raise ValueError(
                f"placement: must be one of {sorted(POLICIES)}, got {self.placement!r}"
            )
        self.engine_config("cpu")  # the engine's own checks (speculative settings)
        return self

    def _check_pool(self, name: str) -> None:
        """A pool's start size (``name``) within its bounds (``min_<name>``, ``max_<name>``)."""
        given_low, given_high = getattr(self, f"min_{name}"), getattr(self, f"max_{name}")
        if given_low is not None and given_high is not None and given_low > given_high:
            raise ValueError(f"min_{name}: {given_low} is above max_{name} ({given_high})")
        start, low, high = self._pool(name)
        if start > high:
            raise ValueError(f"{name}: {start} is above max_{name} ({high})")
        if start < low:
            raise ValueError(f"{name}: {start} is below min_{name} ({low})")

    @classmethod
    def create(cls, **fields) -> typing.Self:
        """Build and validate; raise ``ConfigError`` naming the first bad field."""
        try:
            return cls(**fields)
        except ValidationError as error:
            first = error.errors()[0]
            name = ".".join(str(part) for part in first["loc"])
            message = first["msg"].removeprefix("Value error, ")
            given = first.get("input")
            if name:  # a field's own check
                raise ConfigError(f"{name}: {message}, got {given!r}") from None
            raise ConfigError(message) from None  # the model check names its field

    @property
    def pool_bounds(self) -> tuple[int, int]:
        """The mixed workers' (min, max)."""
        return self._pool("workers")[1:]

    @property
    def pools(self) -> dict[str, tuple[int, int, int]]:
        """Per role: (workers at start, min, max); min <= start <= max."""
        if self.disaggregated:
            return {PREFILL: self._pool("prefill_workers"), DECODE: self._pool("decode_workers")}
        return {MIXED: self._pool("workers")}

    def _pool(self, name: str) -> tuple[int, int, int]:
        """(start, min, max) of the pool sized by ``name``, bounded by ``min_<name>`` and
        ``max_<name>``: each bound defaults to the start size (max at least min)."""
        start, low, high = (getattr(self, f) for f in (name, f"min_{name}", f"max_{name}"))
        low = low if low is not None else start
        return start, low, high if high is not None else max(start, low)

    def kv_transfer_config(self, secret: ClusterSecret | None = None) -> KVTransferConfig:
        """The workers' KV-transfer settings, with the cluster's ``secret`` (its launcher
        makes one per cluster: ``ClusterSecret.generate()``)."""
        from tessera.workers.process.disaggregation import KVTransferConfig
        from tessera.workers.process.kv_transfer import TLSFiles

        tls = None
        if self.kv_transfer_tls_cert:
            tls = TLSFiles(
                self.kv_transfer_tls_cert, self.kv_transfer_tls_key, self.kv_transfer_tls_ca
            )
        return KVTransferConfig(
            host=self.kv_transfer_host,
            port=self.kv_transfer_port,
            timeout_s=self.kv_transfer_timeout_s,
            tls=tls,
            tls_server_name=self.kv_transfer_tls_server_name,
            secret=secret,
            max_concurrent_pulls=self.kv_transfer_max_concurrent_pulls,
        )

    @property
    def capacity(self) -> int:
        return self.max_ongoing_requests or self.max_num_seqs

    @property
    def ongoing_target(self) -> float:
        return self.target_ongoing_requests or self.capacity / 2

    @property
    def prefill_queue_target(self) -> int:
        """Mean prompt tokens queued per prefill worker above which the pool grows: by
        default two engine steps' worth (``max_num_batched_tokens`` each)."""
        return self.target_prefill_queue_tokens or 2 * self.max_num_batched_tokens

    def engine_config(self, device: str) -> EngineConfig:
        """Each worker's engine: the engine settings as given, on ``device``."""
        shared = {name: getattr(self, name) for name in EngineSettings.model_fields}
        return EngineConfig(**{**shared, "device": device})

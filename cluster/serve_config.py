"""Everything ``tessera serve`` runs, as one flat schema: ``ServeConfig``, the cluster's
settings plus its HTTP front end's, and its file form (``--config FILE``, YAML).
"""

from __future__ import annotations

import os
import typing

from pydantic import Field, SecretStr, field_validator, model_validator

from tessera.cluster.cluster_config import ClusterConfig, ConfigError
from tessera.cluster.memory_size import memory_value
from tessera.cluster.reasoning import ReasoningParser
from tessera.cluster.response_store import RESPONSE_STORE_SIZE, RESPONSE_TTL_S
from tessera.cluster.tracing import check_endpoint, exporter_protocol

#: The longest API key ``api_key_file`` may hold.
MAX_KEY_FILE_CHARS = 4096


class ServeConfig(ClusterConfig):
    """Everything ``tessera serve`` runs: the cluster plus the HTTP front end (the Ray
    Serve app). One flat schema for the command line, ``--config FILE`` and Helm."""

    host: str = Field("127.0.0.1", description="address the HTTP server listens on")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    grpc_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="serve the gRPC API (tessera.v1.Generation, grpc.health.v1) on this "
        "port (behind HAProxy on host; Ray Serve's gRPC proxy, and the replica's own gRPC "
        "server behind HAProxy, listen on every interface); off when unset",
    )
    api_key: SecretStr | None = Field(
        None,
        min_length=1,
        description="require 'Authorization: Bearer KEY' on every route but /health (and "
        "/metrics with metrics_open), and on every gRPC method but health; a flag's value "
        "shows in ps: prefer $TESSERA_API_KEY or --api-key-file (default: $TESSERA_API_KEY, "
        "else no key)",
    )
    api_key_file: str | None = Field(
        None,
        min_length=1,
        description="read the API key from this file (its text, surrounding whitespace "
        "dropped), so that it stays out of ps and of config files; not with api_key",
    )
    metrics_open: bool = Field(
        False,
        description="serve /metrics without the API key (for a scrape network that cannot "
        "send it); /docs and /openapi.json always need the key when one is set",
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="the model id clients pass as 'model' (default: the repo id, or the "
        "model file's or directory's name)",
    )
    reasoning_parser: ReasoningParser | None = Field(
        None,
        description="split a reasoning model's chat answers into message.reasoning_content "
        "(its <think> part) and message.content, streamed as delta.reasoning_content and "
        "delta.content: deepseek_r1 reads the output before the first </think> as "
        "reasoning; qwen3 only an output that starts with <think> and closes it; tool "
        "calls and structured outputs apply to the answer only; completions are not "
        "split (default: off)",
    )
    ignore_unknown_fields: bool = Field(
        False,
        description="take request bodies with fields the API does not declare: such a "
        "request goes on without them and logs one warning naming them (vLLM's way); off: "
        "400 'Unrecognized request argument supplied' naming the first (OpenAI's way)",
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        min_length=1,
        description="trace every request with OpenTelemetry: its spans (the front end, the "
        "scheduler's placement, the worker's queue, prefill and decode) go to this OTLP "
        "collector, e.g. http://localhost:4317; a request's W3C traceparent header joins "
        "its trace to the caller's; OTLP/gRPC, or OTLP/HTTP with "
        "$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf; $OTEL_SERVICE_NAME names the "
        "service (default: off)",
    )
    response_store_size: int = Field(
        RESPONSE_STORE_SIZE,
        ge=1,
        description="the most stored Responses API responses each front-end replica keeps of "
        "those it wrote (in Ray's GCS key-value store); past it its oldest go",
    )
    response_store_ttl_s: float = Field(
        RESPONSE_TTL_S,
        gt=0,
        description="seconds a stored Responses API response stays (GET, DELETE and "
        "previous_response_id find it until then)",
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING): a caller with the API key may then make the "
        "workers read any folder they can; off: 403, and --lora-modules loads adapters",
    )
    min_replicas: int = Field(1, ge=1, description="fewest HTTP front-end replicas")
    max_replicas: int = Field(1, ge=1, description="most HTTP front-end replicas (autoscaling)")
    replica_target_ongoing_requests: float = Field(
        32.0,
        gt=0,
        description="ongoing requests per front-end replica that Serve's autoscaler aims at",
    )
    replica_max_ongoing_requests: int = Field(
        1024,
        ge=1,
        description="requests one front-end replica takes at once; the scheduler's "
        "admission (--max-queued-requests) refuses overload before this",
    )
    max_request_bytes: int = Field(
        4 * 2**20,
        ge=1,
        description="largest request body, e.g. 4MiB; larger ones get 413 (HTTP), and "
        "RESOURCE_EXHAUSTED before they are parsed (gRPC, in a Ray that tessera serve starts)",
    )
    max_grammar_bytes: int = Field(
        128 * 2**10,
        ge=1,
        description="largest structured-output grammar (a JSON schema, regex, choice list "
        "or Lark grammar, one tool's parameters or the tools' call grammar), e.g. 128KiB; "
        "larger ones get 400 before they are compiled",
    )
    body_timeout_s: float = Field(
        10.0,
        gt=0,
        description="seconds a client has to send a request's whole body after its "
        "headers; slower ones get 408 and their connection is closed",
    )
    max_pending_bodies: int = Field(
        64,
        ge=1,
        description="requests whose bodies are slow (incomplete 0.5 s after their headers) "
        "one front-end replica reads at once; the next slow one gets 503, so stalled "
        "uploads cannot starve the others",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="deadline of one request from arrival to its last token; past it, "
        "a request gets 408 (or an error event when streaming) and is aborted",
    )
    graceful_shutdown_s: float = Field(
        30.0,
        ge=0,
        description="on Ctrl-C, how long ongoing requests may take to finish before they are cut",
    )

    @field_validator("max_request_bytes", "max_grammar_bytes", mode="before")
    @classmethod
    def _sizes(cls, value):
        return memory_value(value)

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _collector_url(cls, value: str | None) -> str | None:
        return value if value is None else check_endpoint(value)

    @model_validator(mode="before")
    @classmethod
    def _api_key_from_file_or_environment(cls, data):
        """Every way to start (the CLI, ``serve run``, KubeRay) reads the key alike:
        ``api_key``, else ``api_key_file``'s text, else ``$TESSERA_API_KEY``."""
        if not isinstance(data, dict):
            return data
        path = data.get("api_key_file")
        if path is not None and data.get("api_key") is not None:
            raise ValueError("api_key_file: give api_key or api_key_file, not both")
        if path is not None and isinstance(path, str) and path:
            data = {**data, "api_key": read_key_file(path)}
        elif data.get("api_key") is None:
            key = os.environ.get("TESSERA_API_KEY")
            if key:
                data = {**data, "api_key": key}
        return data

    @model_validator(mode="after")
    def _check_tracing(self) -> ServeConfig:
        """The exporter's protocol (an environment variable) is one the replicas speak;
        OTLP/HTTP takes no ``grpc://`` URL."""
        url = self.otlp_traces_endpoint
        if url is not None:
            protocol = exporter_protocol()
            if protocol != "grpc" and url.startswith("grpc:"):
                raise ValueError(
                    f"otlp_traces_endpoint: {url!r} is a gRPC URL, and the protocol is "
                    f"{protocol}; give an http:// or https:// URL"
                )
        return self

    @model_validator(mode="after")
    def _check_replicas(self) -> ServeConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas: {self.min_replicas} is above max_replicas ({self.max_replicas})"
            )
        return self

    def cluster_config(self) -> ClusterConfig:
        """The cluster part (what the scheduler gets)."""
        return ClusterConfig(**{name: getattr(self, name) for name in ClusterConfig.model_fields})

    @property
    def model_name(self) -> str:
        """The id clients pass as ``model``: ``served_model_name``, else a repo id as
        given, else the model file's or directory's name."""
        from tessera.workers.model.loader import resolve_model_path
        from tessera.workers.model.sources import repo_id_of

        if self.served_model_name:
            return self.served_model_name
        if self.model is not None and repo_id_of(self.model) is not None:
            return self.model
        path = resolve_model_path(self.model)
        name = path.name.removesuffix(".gguf")
        return name.split(".")[0] if self.model is None else name  # built-in: drop ".Q4_1"


def read_key_file(path: str) -> str:
    """The API key in file ``path``: its text without surrounding whitespace."""
    try:
        with open(path, encoding="utf-8") as file:
            key = file.read(MAX_KEY_FILE_CHARS + 1).strip()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or "not UTF-8 text"
        raise ValueError(f"api_key_file: cannot read {path!r} ({reason})") from None
    if not key:
        raise ValueError(f"api_key_file: {path!r} is empty")
    if len(key) > MAX_KEY_FILE_CHARS or any(c.isspace() for c in key):
        raise ValueError(
            f"api_key_file: {path!r} must hold one key (no whitespace inside, at most "
            f"{MAX_KEY_FILE_CHARS} characters)"
        )
    return key


def load_config_file(path: str) -> dict[str, typing.Any]:
    """The settings of a YAML config file (``ServeConfig``'s fields, snake_case)."""
    import yaml

    try:
        with open(path) as file:
            data = yaml.safe_load(file)
    except OSError as error:
        raise ConfigError(f"config: cannot read {path!r}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config: {path!r} is not valid YAML: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config: {path!r} must hold a mapping of settings, got {type(data).__name__}"
        )
    unknown = sorted(str(key) for key in data if key not in ServeConfig.model_fields)
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a setting (in config file {path!r})")
    return data

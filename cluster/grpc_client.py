"""Python clients of the gRPC API (``tessera.v1.Generation``), sync and async.

    from tessera.cluster.grpc_client import GenerationClient

    with GenerationClient("127.0.0.1:9000", api_key="...") as client:
        for delta in client.generate("The capital of France is", max_tokens=8,
                                     temperature=0, timeout=30):
            print(delta.text, end="")

``generate`` yields ``GenerateResponse`` messages (one delta of one output each; the
last one has ``usage``; a ``parallel_tokens`` request's deltas carry ``parallel_sets``,
a speculating one's ``speculative``, its counts so far). Sampling options are
``SamplingOptions``' fields as keyword arguments; ``speculative`` and
``parallel_tokens`` take a dict of their fields (``speculative={"method": "ngram",
"num_tokens": 4}``, ``parallel_tokens={"threshold": 0.1, "max_width": 4, "mode":
"visible"}``) or ``tessera.workers.api``'s ``SpeculativeParams`` / ``ParallelTokensParams``.
``timeout`` is the call's gRPC deadline, and is sent as the request's
``timeout_s`` too, so the server stops the request (and its queue wait) at the same
moment the client gives up. Leaving a stream early (or an error ending it) cancels the
call and aborts the request by name. Errors raise ``grpc.RpcError`` with the server's status
code and message.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tessera.cluster.auth import bearer
from tessera.protos.tessera.v1 import generation_pb2 as pb
from tessera.protos.tessera.v1 import generation_pb2_grpc
from tessera.workers.decoding.sampling_fields import options_message

#: Seconds an abort sent by a stream left early may take.
ABORT_TIMEOUT_S = 5.0
#: The version of the API's messages (their ``version`` field; a server reads 0 as 1).
API_VERSION = 1


def generate_request(
    prompt: str | Sequence[int],
    *,
    request_id: str = "",
    model: str = "",
    priority: int = 0,
    cache_salt: str = "",
    timeout: float | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A ``GenerateRequest``; ``sampling`` holds ``SamplingOptions`` fields (None:
    unset; ``speculative`` / ``parallel_tokens``: a dict of their fields, the engine's
    params dataclass or the message)."""
    request = pb.GenerateRequest(
        version=API_VERSION,
        request_id=request_id,
        model=model,
        sampling=options_message(pb.SamplingOptions, sampling),
        priority=priority,
        cache_salt=cache_salt,
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    if timeout is not None:
        request.timeout_s = timeout
    return request


def _with_id(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """Name the request here when the caller did not, so that leaving early can abort
    it by name (the server's cancellation of a dropped call is not relied on alone)."""
    if not request.request_id:
        request.request_id = f"grpc-{uuid.uuid4().hex}"
    return request


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", bearer(api_key)),) if api_key else ()


def _status_name(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


class GenerationClient:
    """A blocking client; ``target`` is ``host:port`` of the gRPC API."""

    def __init__(self, target: str, api_key: str | None = None) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = _metadata(api_key)

    def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **options: Any
    ) -> Iterator[pb.GenerateResponse]:
        """Stream the request's deltas; ``options``: see ``generate_request``. Closing
        the iterator early cancels the call, which aborts the request."""
        request = _with_id(generate_request(prompt, timeout=timeout, **options))
        call = self.stub.Generate(request, timeout=timeout, metadata=self.metadata)
        done = False
        try:
            yield from call
            done = True
        finally:
            if not done:  # left early or failed: make sure the request stops
                call.cancel()
                with contextlib.suppress(grpc.RpcError):
                    self.abort(request.request_id, timeout=ABORT_TIMEOUT_S)

    def abort(self, request_id: str, timeout: float | None = None) -> bool:
        """Abort a running request; False when none has that id."""
        request = pb.AbortRequest(version=API_VERSION, request_id=request_id)
        return self.stub.Abort(request, timeout=timeout, metadata=self.metadata).aborted

    def list_models(self, timeout: float | None = None) -> list[pb.Model]:
        request = pb.ListModelsRequest(version=API_VERSION)
        return list(self.stub.ListModels(request, timeout=timeout, metadata=self.metadata).models)

    def tokenize(
        self, text: str, add_special_tokens: bool = True, timeout: float | None = None
    ) -> list[int]:
        request = pb.TokenizeRequest(
            version=API_VERSION, text=text, add_special_tokens=add_special_tokens
        )
        return list(self.stub.Tokenize(request, timeout=timeout, metadata=self.metadata).token_ids)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """``SERVING`` or ``NOT_SERVING`` (grpc.health.v1; needs no API key)."""
        request = health_pb2.HealthCheckRequest(service=service)
        return _status_name(self.health_stub.Check(request, timeout=timeout))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGenerationClient:
    """The asyncio client: the same methods, awaited (``generate`` is an async
    iterator). Create it inside the event loop that uses it."""

    def __init__(self, target: str, api_key: str | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = _metadata(api_key)

    async def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **options: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        request = _with_id(generate_request(prompt, timeout=timeout, **options))
        call = self.stub.Generate(request, timeout=timeout, metadata=self.metadata)
        done = False
        try:
            async for response in call:
                yield response
            done = True
        finally:
            if not done:  # left early or failed: make sure the request stops
                call.cancel()
                with contextlib.suppress(grpc.RpcError):
                    await self.abort(request.request_id, timeout=ABORT_TIMEOUT_S)

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        request = pb.AbortRequest(version=API_VERSION, request_id=request_id)
        return (await self.stub.Abort(request, timeout=timeout, metadata=self.metadata)).aborted

    async def list_models(self, timeout: float | None = None) -> list[pb.Model]:
        request = pb.ListModelsRequest(version=API_VERSION)
        answer = await self.stub.ListModels(request, timeout=timeout, metadata=self.metadata)
        return list(answer.models)

    async def tokenize(
        self, text: str, add_special_tokens: bool = True, timeout: float | None = None
    ) -> list[int]:
        request = pb.TokenizeRequest(
            version=API_VERSION, text=text, add_special_tokens=add_special_tokens
        )
        answer = await self.stub.Tokenize(request, timeout=timeout, metadata=self.metadata)
        return list(answer.token_ids)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        request = health_pb2.HealthCheckRequest(service=service)
        return _status_name(await self.health_stub.Check(request, timeout=timeout))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

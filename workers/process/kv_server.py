"""The prefill worker's side of KV transfer: the ``tessera.v1.KVTransfer`` gRPC service,
streaming the blocks its handler computed (see ``kv_transfer`` for the protocol).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import grpc
import torch

from tessera.protos.tessera.v1 import kv_transfer_pb2 as pb
from tessera.protos.tessera.v1 import kv_transfer_pb2_grpc as pb_grpc
from tessera.workers.process.kv_wire import API_VERSION, TLSFiles, block_chunks, layers_per_chunk

logger = logging.getLogger(__name__)

#: The default largest chunk payload: well under gRPC's default message limit.
DEFAULT_MAX_CHUNK_BYTES = 1 << 20
#: gRPC's default receive limit; a chunk's payload plus its header must fit.
GRPC_MAX_MESSAGE_BYTES = 4 << 20
#: Room left for a chunk's non-payload fields (indexes, dtype, shape, crc: < 100 bytes).
_CHUNK_HEADER_BYTES = 1 << 10

FaultKind = Literal["corrupt", "cut", "stall"]


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What the handler gives the server to send: the KV of blocks ``skip_blocks,
    skip_blocks + 1, ...`` (each ``[L, 2, block_size, H, D]``, CPU, contiguous, all
    alike) and the first sampled token."""

    blocks: list[torch.Tensor]
    first_token: pb.FirstToken

    def __post_init__(self) -> None:
        for kv in self.blocks:
            if kv.dim() != 5 or kv.device.type != "cpu" or not kv.is_contiguous():
                raise ValueError(f"a block must be a contiguous 5-D CPU tensor, got {kv.shape}")
            if (kv.shape, kv.dtype) != (self.blocks[0].shape, self.blocks[0].dtype):
                raise ValueError("all blocks must share one shape and dtype")


@dataclass(slots=True)
class TransferStats:
    """The server's counters. A transfer that ended with an error status, was cancelled
    or was spoiled by an injected fault counts under ``failures``, not ``transfers``."""

    transfers: int = 0
    bytes_sent: int = 0
    chunks_sent: int = 0
    failures: int = 0


def _num_chunks(blocks: list[torch.Tensor], max_chunk_bytes: int) -> int:
    """How many chunks ``blocks`` make (all alike: the first one says)."""
    if not blocks:
        return 0
    return len(blocks) * math.ceil(
        blocks[0].shape[0] / layers_per_chunk(blocks[0], max_chunk_bytes)
    )


Handler = Callable[[pb.PullBlocksRequest, float | None], Awaitable[PrefillResult]]


class KVTransferServer(pb_grpc.KVTransferServicer):
    """The prefill worker's side: serves ``PullBlocks`` with what ``handler`` returns."""

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: TLSFiles | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    ) -> None:
        if not 0 < max_chunk_bytes <= GRPC_MAX_MESSAGE_BYTES - _CHUNK_HEADER_BYTES:
            raise ValueError(f"max_chunk_bytes {max_chunk_bytes} must fit one gRPC message")
        self._handler = handler
        self._host, self._port, self._tls = host, port, tls
        self.max_chunk_bytes = max_chunk_bytes
        self.stats = TransferStats()
        self.address: str | None = None  # "host:port" once started
        self._server: grpc.aio.Server | None = None
        self._faults: deque[FaultKind] = deque()

    async def start(self) -> None:
        server = grpc.aio.server()
        pb_grpc.add_KVTransferServicer_to_server(self, server)
        bind = f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"
        if self._tls is None:
            port = server.add_insecure_port(bind)
        else:
            cert, key, ca = self._tls.read()
            creds = grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=ca, require_client_auth=True
            )
            port = server.add_secure_port(bind, creds)
        await server.start()
        self._server = server
        self.address = bind.rsplit(":", 1)[0] + f":{port}"

    async def stop(self, grace: float | None = None) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    def inject_fault(self, kind: FaultKind, count: int = 1) -> None:
        """Test hook: spoil the next ``count`` transfers. ``corrupt`` flips a byte of
        the middle chunk after its crc is taken; ``cut`` ends the stream before the
        middle chunk, without a first token; ``stall`` stops sending there until the
        client's deadline passes (gRPC then cancels the call)."""
        if kind not in get_args(FaultKind) or count < 1:
            raise ValueError(f"fault {kind!r} x{count}: kind is one of {get_args(FaultKind)}")
        self._faults.extend([kind] * count)

    async def PullBlocks(  # noqa: N802 (the generated servicer's name)
        self, request: pb.PullBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PullBlocksResponse]:
        finished = False
        try:
            if request.version not in (0, API_VERSION):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"version: this server speaks version {API_VERSION}, got {request.version}",
                )
            limit = min(request.max_chunk_bytes or self.max_chunk_bytes, self.max_chunk_bytes)
            try:
                result = await self._handler(request, context.time_remaining())
                num_chunks = _num_chunks(result.blocks, limit)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except Exception as e:
                logger.exception("KV transfer %s: the handler failed", request.request_id)
                await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
            fault = self._faults.popleft() if self._faults else None
            fault_at = num_chunks // 2  # the middle chunk (the first token if none)
            for i, message in enumerate(_messages(result, request.skip_blocks, limit)):
                if i == fault_at and fault == "cut":
                    return
                if i == fault_at and fault == "stall":
                    await asyncio.Event().wait()  # cancelled at the client's deadline
                if i == fault_at and fault == "corrupt" and message.HasField("chunk"):
                    data = message.chunk.data
                    message.chunk.data = bytes([data[0] ^ 0xFF]) + data[1:]
                yield message
                if message.HasField("chunk"):
                    self.stats.chunks_sent += 1
                    self.stats.bytes_sent += len(message.chunk.data)
            if fault is None:
                finished = True
                self.stats.transfers += 1
        finally:
            if not finished:
                self.stats.failures += 1


def _messages(
    result: PrefillResult, first_block: int, max_chunk_bytes: int
) -> Iterator[pb.PullBlocksResponse]:
    """The stream, one block's chunks in memory at a time."""
    for i, kv in enumerate(result.blocks):
        for chunk in block_chunks(kv, first_block + i, max_chunk_bytes):
            yield pb.PullBlocksResponse(version=API_VERSION, chunk=chunk)
    yield pb.PullBlocksResponse(version=API_VERSION, first_token=result.first_token)

"""The prefill worker's side of KV transfer: the ``tessera.v1.KVTransfer`` gRPC service,
streaming the blocks its handler computed (see ``kv_transfer`` for the protocol).

Who may pull, and how much: a pull's token is checked before anything else (an
interceptor, before the request is even parsed; ``kv_auth``), then the number of pulls
under way (``PullLimits.max_concurrent_pulls``) and the blocks the pull asks for
(``max_blocks_per_pull``); the whole pull, the handler's prefill included, runs under
the server's own deadline (``timeout_s``, or the caller's if sooner), so a reader that
stops reading frees its blocks when it passes. Peers get generic errors; the details go
to this worker's log. A server bound beyond loopback refuses to start without the
cluster secret or mutual TLS.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import grpc
import torch

from tessera.protos.tessera.v1 import kv_transfer_pb2 as pb
from tessera.protos.tessera.v1 import kv_transfer_pb2_grpc as pb_grpc
from tessera.workers.process.kv_auth import AUTH_KEY, PROOF_KEY, PullGate, metadata_value
from tessera.workers.process.kv_wire import (
    API_VERSION,
    TLSFiles,
    block_chunks,
    layers_per_chunk,
    usable_blocks,
)

logger = logging.getLogger(__name__)

#: The default largest chunk payload: well under gRPC's default message limit.
DEFAULT_MAX_CHUNK_BYTES = 1 << 20
#: gRPC's default receive limit; a chunk's payload plus its header must fit.
GRPC_MAX_MESSAGE_BYTES = 4 << 20
#: Room left for a chunk's non-payload fields (indexes, dtype, shape, crc: < 100 bytes).
_CHUNK_HEADER_BYTES = 1 << 10
#: What a server says to peers when its handler refuses or fails (details: its log).
MISMATCH_TEXT = "the pull does not match this prefill worker (see its log)"
FAILED_TEXT = "the prefill failed (see the prefill worker's log)"


class KVServerSecurityError(ValueError):
    """A KV server would listen beyond loopback without the cluster secret or mutual TLS."""


@dataclass(frozen=True, slots=True)
class PullLimits:
    """What one prefill worker serves at most: pulls at once (more are refused at once,
    RESOURCE_EXHAUSTED), blocks one pull may ask for, and seconds one pull may take."""

    max_concurrent_pulls: int = 64
    max_blocks_per_pull: int = 4096
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_concurrent_pulls < 1 or self.max_blocks_per_pull < 1 or self.timeout_s <= 0:
            raise ValueError(f"pull limits must be positive, got {self}")


def is_loopback(host: str) -> bool:
    """Whether ``host`` only takes connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


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
    unauthenticated: int = 0  # pulls refused before their request was read
    busy: int = 0  # refused: max_concurrent_pulls were under way
    deadlines: int = 0  # ended by the server's deadline (also in failures)


def _num_chunks(blocks: list[torch.Tensor], max_chunk_bytes: int) -> int:
    """How many chunks ``blocks`` make (all alike: the first one says)."""
    if not blocks:
        return 0
    return len(blocks) * math.ceil(
        blocks[0].shape[0] / layers_per_chunk(blocks[0], max_chunk_bytes)
    )


Handler = Callable[[pb.PullBlocksRequest, float | None], Awaitable[PrefillResult]]


class KVTransferServer(pb_grpc.KVTransferServicer):
    """The prefill worker's side: serves ``PullBlocks`` with what ``handler`` returns.
    ``gate``: the pull tokens it admits (this worker's id and the cluster secret);
    without it, or ``tls``, it listens on loopback only."""

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: TLSFiles | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        *,
        gate: PullGate | None = None,
        limits: PullLimits = PullLimits(),
    ) -> None:
        if not 0 < max_chunk_bytes <= GRPC_MAX_MESSAGE_BYTES - _CHUNK_HEADER_BYTES:
            raise ValueError(f"max_chunk_bytes {max_chunk_bytes} must fit one gRPC message")
        if gate is None and tls is None and not is_loopback(host):
            raise KVServerSecurityError(
                f"kv_transfer_host: a KV-transfer server on {host} would let anyone who "
                "reaches it run prompts and read their KV blocks; it needs the cluster "
                "secret (workers started by a Tessera cluster get one) or mutual TLS "
                "(set kv_transfer_tls_cert, kv_transfer_tls_key and kv_transfer_tls_ca), "
                "or a loopback kv_transfer_host (127.0.0.1)"
            )
        self._handler = handler
        self._host, self._port, self._tls = host, port, tls
        self._gate = gate
        self.max_chunk_bytes = max_chunk_bytes
        self.limits = limits
        self.stats = TransferStats()
        self.active = 0  # pulls under way
        self.address: str | None = None  # "host:port" once started
        self._server: grpc.aio.Server | None = None
        self._faults: deque[FaultKind] = deque()

    async def start(self) -> None:
        interceptors = [] if self._gate is None else [_TokenCheck(self._gate, self.stats)]
        server = grpc.aio.server(interceptors=interceptors)
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
        middle chunk, without a first token; ``stall`` stops sending there until a
        deadline passes (the client's, or the server's)."""
        if kind not in get_args(FaultKind) or count < 1:
            raise ValueError(f"fault {kind!r} x{count}: kind is one of {get_args(FaultKind)}")
        self._faults.extend([kind] * count)

    async def PullBlocks(  # noqa: N802 (the generated servicer's name)
        self, request: pb.PullBlocksRequest, context: grpc.aio.ServicerContext
    ) -> None:
        if self.active >= self.limits.max_concurrent_pulls:
            self.stats.busy += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy: too many pulls")
        self.active += 1
        finished = False
        try:
            if self._gate is not None:  # answer the token: this worker, this pull
                nonce = metadata_value(context.invocation_metadata(), AUTH_KEY).split(".")[1]
                proof = self._gate.secret.server_proof(self._gate.worker_id, nonce)
                await context.send_initial_metadata(((PROOF_KEY, proof),))
            remaining = context.time_remaining()
            deadline = min(self.limits.timeout_s, remaining or math.inf)
            writing = asyncio.Event()  # set while a write waits on the reader
            try:
                async with asyncio.timeout(deadline):
                    finished = await self._serve(request, context, deadline, writing)
            except TimeoutError:
                self.stats.deadlines += 1
                if writing.is_set():
                    # A status cannot go out behind a write the reader does not take
                    # (abort would wait on it): cancelling resets the stream at once.
                    raise asyncio.CancelledError from None
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the pull's deadline")
        finally:
            self.active -= 1
            if finished:
                self.stats.transfers += 1
            else:
                self.stats.failures += 1

    async def _serve(
        self,
        request: pb.PullBlocksRequest,
        context: grpc.aio.ServicerContext,
        deadline: float,
        writing: asyncio.Event,
    ) -> bool:
        """Check the request, run the handler, stream its blocks; True when the stream
        went out whole (no fault injected)."""
        if request.version not in (0, API_VERSION):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"version: this server speaks version {API_VERSION}, got {request.version}",
            )
        wanted = usable_blocks(len(request.prompt_token_ids), max(request.block_size, 1))
        if wanted - request.skip_blocks > self.limits.max_blocks_per_pull:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt_token_ids: a pull takes at most {self.limits.max_blocks_per_pull} blocks",
            )
        limit = min(request.max_chunk_bytes or self.max_chunk_bytes, self.max_chunk_bytes)
        try:
            result = await self._handler(request, deadline)
        except ValueError:
            logger.warning("KV transfer %s: refused", request.request_id, exc_info=True)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MISMATCH_TEXT)
        except Exception:
            logger.exception("KV transfer %s: the handler failed", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, FAILED_TEXT)
        try:
            num_chunks = _num_chunks(result.blocks, limit)
        except ValueError as e:  # the request's own max_chunk_bytes is below one layer
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"max_chunk_bytes: {e}")
        fault = self._faults.popleft() if self._faults else None
        fault_at = num_chunks // 2  # the middle chunk (the first token if none)
        for i, message in enumerate(_messages(result, request.skip_blocks, limit)):
            if i == fault_at and fault == "cut":
                return False
            if i == fault_at and fault == "stall":
                await asyncio.Event().wait()  # until a deadline passes
            if i == fault_at and fault == "corrupt" and message.HasField("chunk"):
                data = message.chunk.data
                message.chunk.data = bytes([data[0] ^ 0xFF]) + data[1:]
            writing.set()
            await context.write(message)  # waits while the reader's window is full
            writing.clear()
            if message.HasField("chunk"):
                self.stats.chunks_sent += 1
                self.stats.bytes_sent += len(message.chunk.data)
        return fault is None


class _TokenCheck(grpc.aio.ServerInterceptor):
    """The first check of every call: its pull token, before the request is parsed."""

    def __init__(self, gate: PullGate, stats: TransferStats) -> None:
        self._gate = gate
        self._stats = stats

    async def intercept_service(self, continuation, handler_call_details):
        token = metadata_value(handler_call_details.invocation_metadata, AUTH_KEY)
        if self._gate.admit(token) is None:
            self._stats.unauthenticated += 1
            return grpc.unary_stream_rpc_method_handler(_unauthenticated)  # raw bytes, unread
        return await continuation(handler_call_details)


async def _unauthenticated(request: bytes, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated")


def _messages(
    result: PrefillResult, first_block: int, max_chunk_bytes: int
) -> Iterator[pb.PullBlocksResponse]:
    """The stream, one block's chunks in memory at a time."""
    for i, kv in enumerate(result.blocks):
        for chunk in block_chunks(kv, first_block + i, max_chunk_bytes):
            yield pb.PullBlocksResponse(version=API_VERSION, chunk=chunk)
    yield pb.PullBlocksResponse(version=API_VERSION, first_token=result.first_token)

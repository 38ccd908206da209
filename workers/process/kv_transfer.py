"""KV-block transfer between workers: the ``tessera.v1.KVTransfer`` gRPC service
(prefill side) and its client (decode side), over ``grpc.aio``.

Protocol (``PullBlocks``, server streaming)::

    decode worker                          prefill worker
    PullBlocksRequest(skip_blocks=s) --->  handler(request, time_remaining) -> PrefillResult
                                     <---  KVChunk(block s, layers [0, k))
                                     <---  KVChunk(block s, layers [k, L))  -> on_block(s, kv)
                                     <---  KVChunk(block s+1, ...) ...
                                     <---  FirstToken                       (last message)

Invariants the client checks (any breach raises ``TransferError``; the decode worker
then discards what it got and prefills itself):

- every message has ``version`` 0 or ``API_VERSION``;
- every chunk's ``crc32`` is ``zlib.crc32(data)`` and its data length is what its
  dtype and shape say; dtype, ``num_layers`` and per-layer shape are the same in all
  chunks, and the block size is the request's;
- blocks arrive in order from ``skip_blocks``, each block's layers contiguously from 0
  to ``num_layers``; the stream ends with ``first_token`` after exactly
  ``usable_blocks(len(prompt_token_ids), block_size) - skip_blocks`` complete blocks
  (when the request names a block size): the prompt's full blocks that leave its last
  token to compute, which is all a receiver's prefix cache can take.

A chunk carries at most ``min(request.max_chunk_bytes or server's, server's)`` payload
bytes and at least one layer. Tensor bytes travel raw (C order, little endian), so any
dtype in ``_DTYPES`` round-trips exactly, bfloat16 included.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import grpc
import numpy as np
import torch

from tessera.protos.tessera.v1 import kv_transfer_pb2 as pb
from tessera.protos.tessera.v1 import kv_transfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

API_VERSION = 1
#: The default largest chunk payload: well under gRPC's default message limit.
DEFAULT_MAX_CHUNK_BYTES = 1 << 20
#: gRPC's default receive limit; a chunk's payload plus its header must fit.
GRPC_MAX_MESSAGE_BYTES = 4 << 20
#: Room left for a chunk's non-payload fields (indexes, dtype, shape, crc: < 100 bytes).
_CHUNK_HEADER_BYTES = 1 << 10

#: The KV dtypes the wire carries, by torch name ("float32", "bfloat16", ...).
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8,
    )
}  # fmt: skip

FaultKind = Literal["corrupt", "cut", "stall"]
FailureReason = Literal["checksum", "short_stream", "deadline", "unavailable", "protocol", "remote"]
#: gRPC status codes the client sees -> failure reason; any other code is "remote".
_REASONS: dict[grpc.StatusCode, FailureReason] = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.CANCELLED: "unavailable",  # the server went away mid-stream
}


def usable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """The prompt's full blocks that leave its last token to compute (its logits are
    needed): what a transfer carries, and what a prefix-cache hit can cover."""
    return max(num_prompt_tokens - 1, 0) // block_size


class TransferError(Exception):
    """A failed pull; ``reason`` is what the decode worker counts its fallback under."""

    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files for mutual TLS: this side's certificate and key, and the CA that
    signed the other side's certificate."""

    cert: Path | str
    key: Path | str
    ca: Path | str

    def read(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()


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


@dataclass(frozen=True, slots=True)
class TransferResult:
    first_token: pb.FirstToken
    blocks: int  # how many blocks on_block received
    bytes: int  # payload bytes received
    seconds: float


@dataclass(slots=True)
class TransferStats:
    """The server's counters. A transfer that ended with an error status, was cancelled
    or was spoiled by an injected fault counts under ``failures``, not ``transfers``."""

    transfers: int = 0
    bytes_sent: int = 0
    chunks_sent: int = 0
    failures: int = 0


def _layers_per_chunk(kv: torch.Tensor, max_chunk_bytes: int) -> int:
    layer_bytes = kv[0].numel() * kv.element_size()
    if layer_bytes > max_chunk_bytes:
        raise ValueError(
            f"one layer of a block is {layer_bytes} bytes, over the chunk limit of "
            f"{max_chunk_bytes} bytes (max_chunk_bytes)"
        )
    return max_chunk_bytes // layer_bytes


def _num_chunks(blocks: list[torch.Tensor], max_chunk_bytes: int) -> int:
    """How many chunks ``blocks`` make (all alike: the first one says)."""
    if not blocks:
        return 0
    return len(blocks) * math.ceil(
        blocks[0].shape[0] / _layers_per_chunk(blocks[0], max_chunk_bytes)
    )


def block_chunks(kv: torch.Tensor, block_index: int, max_chunk_bytes: int) -> list[pb.KVChunk]:
    """Split one block's KV ``[L, 2, bs, H, D]`` along layers into chunks of at most
    ``max_chunk_bytes`` payload bytes each."""
    if kv.dim() != 5 or kv.numel() == 0:
        raise ValueError(f"a block's KV must be a non-empty 5-D tensor, got {tuple(kv.shape)}")
    name = str(kv.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {name} cannot travel; one of {sorted(_DTYPES)}")
    per_chunk = _layers_per_chunk(kv, max_chunk_bytes)
    num_layers = kv.shape[0]
    chunks = []
    for start in range(0, num_layers, per_chunk):
        part = kv[start : start + per_chunk].contiguous()  # [layers, 2, bs, H, D]
        # Raw bytes through a uint8 view: numpy has no bfloat16.
        data = part.view(torch.uint8).numpy().tobytes()
        chunks.append(
            pb.KVChunk(
                block_index=block_index,
                layer_start=start,
                layer_end=start + part.shape[0],
                num_layers=num_layers,
                dtype=name,
                shape=part.shape,
                data=data,
                crc32=zlib.crc32(data),
            )
        )
    return chunks


class BlockAssembler:
    """The inverse of ``block_chunks`` over a whole stream: writes chunks into
    per-block tensors, checking the stream's invariants, and hands out each block
    as soon as its last layer arrives."""

    def __init__(
        self, first_block: int = 0, *, block_size: int | None = None, num_blocks: int | None = None
    ) -> None:
        self.next_block = first_block
        self.blocks = 0
        self.bytes = 0
        self._block_size = block_size
        self._num_blocks = num_blocks
        # (dtype, num_layers, per-layer shape), fixed by the stream's first chunk.
        self._layout: tuple[torch.dtype, int, tuple[int, ...]] | None = None
        self._partial: torch.Tensor | None = None  # [L, 2, bs, H, D], the block being filled
        self._next_layer = 0

    def add(self, chunk: pb.KVChunk) -> tuple[int, torch.Tensor] | None:
        """Take one chunk; return ``(block_index, kv)`` when it completes a block."""
        where = f"block {chunk.block_index} layers [{chunk.layer_start}, {chunk.layer_end})"
        if zlib.crc32(chunk.data) != chunk.crc32:
            raise TransferError("checksum", f"{where}: crc32 mismatch")
        dtype = _DTYPES.get(chunk.dtype)
        if dtype is None or len(chunk.shape) != 5:
            raise TransferError("protocol", f"{where}: dtype {chunk.dtype!r} shape {chunk.shape}")
        layout = (dtype, chunk.num_layers, tuple(chunk.shape[1:]))
        if self._block_size not in (None, chunk.shape[2]):
            raise TransferError("protocol", f"{where}: block size {chunk.shape[2]}")
        self._layout = self._layout or layout
        if layout != self._layout:
            raise TransferError("protocol", f"{where}: layout {layout}, stream's {self._layout}")
        if (chunk.block_index, chunk.layer_start) != (self.next_block, self._next_layer):
            expected = f"block {self.next_block} from layer {self._next_layer}"
            raise TransferError("protocol", f"{where}: expected {expected}")
        layers = chunk.layer_end - chunk.layer_start
        layer_bytes = math.prod(layout[2]) * dtype.itemsize
        if layers <= 0 or layers != chunk.shape[0] or chunk.layer_end > chunk.num_layers:
            raise TransferError("protocol", f"{where} of {chunk.num_layers}, shape {chunk.shape}")
        if len(chunk.data) != layers * layer_bytes:
            raise TransferError("protocol", f"{where}: {len(chunk.data)} bytes for {chunk.shape}")
        if self._partial is None:
            if self._num_blocks is not None and self.blocks == self._num_blocks:
                raise TransferError("protocol", f"more than the {self._num_blocks} blocks expected")
            self._partial = torch.empty((chunk.num_layers, *layout[2]), dtype=dtype)
        # Write the bytes straight into the block: one copy, whatever the dtype.
        flat = self._partial.view(-1).view(torch.uint8).numpy()
        offset = chunk.layer_start * layer_bytes
        flat[offset : offset + len(chunk.data)] = np.frombuffer(chunk.data, dtype=np.uint8)
        self.bytes += len(chunk.data)
        self._next_layer = chunk.layer_end
        if chunk.layer_end < chunk.num_layers:
            return None
        done = (self.next_block, self._partial)
        self._partial, self._next_layer = None, 0
        self.next_block += 1
        self.blocks += 1
        return done

    def finish(self) -> None:
        """The first token arrived: the stream must be at a block boundary, all blocks in."""
        if self._partial is not None:
            raise TransferError("protocol", f"first token inside block {self.next_block}")
        if self._num_blocks not in (None, self.blocks):
            raise TransferError("protocol", f"first token after {self.blocks}/{self._num_blocks}")


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


class KVTransferClient:
    """The decode worker's side: one channel per prefill worker address, reused."""

    def __init__(self, tls: TLSFiles | None = None) -> None:
        self._tls = tls
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.KVTransferStub]] = {}

    def _stub(self, address: str) -> pb_grpc.KVTransferStub:
        if address not in self._stubs:
            if self._tls is None:
                channel = grpc.aio.insecure_channel(address)
            else:
                cert, key, ca = self._tls.read()
                creds = grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)
                channel = grpc.aio.secure_channel(address, creds)
            self._stubs[address] = (channel, pb_grpc.KVTransferStub(channel))
        return self._stubs[address][1]

    async def pull_blocks(
        self,
        address: str,
        request: pb.PullBlocksRequest,
        *,
        timeout_s: float,
        on_block: Callable[[int, torch.Tensor], None],
    ) -> TransferResult:
        """Pull the blocks ``request`` names from ``address``, calling ``on_block(index,
        kv [L, 2, bs, H, D])`` as each completes; raise ``TransferError`` on any failure
        (the blocks already handed out are then to be discarded)."""
        started = time.perf_counter()
        if request.version == 0:
            request, original = pb.PullBlocksRequest(), request
            request.CopyFrom(original)
            request.version = API_VERSION
        num_blocks = None
        if request.block_size:
            total = usable_blocks(len(request.prompt_token_ids), request.block_size)
            num_blocks = max(total - request.skip_blocks, 0)
        assembler = BlockAssembler(
            request.skip_blocks, block_size=request.block_size or None, num_blocks=num_blocks
        )
        first_token = None
        call = self._stub(address).PullBlocks(request, timeout=timeout_s)
        try:
            async for response in call:
                if response.version not in (0, API_VERSION):
                    raise TransferError("protocol", f"message version {response.version}")
                if first_token is not None:
                    raise TransferError("protocol", "a message after the first token")
                kind = response.WhichOneof("payload")
                if kind == "chunk":
                    done = assembler.add(response.chunk)
                    if done is not None:
                        on_block(*done)
                elif kind == "first_token":
                    assembler.finish()
                    first_token = response.first_token
                else:
                    raise TransferError("protocol", "a message with no payload")
        except grpc.aio.AioRpcError as e:
            reason = _REASONS.get(e.code(), "remote")
            raise TransferError(reason, f"{e.code().name}: {e.details()}") from e
        finally:
            call.cancel()  # a no-op once the stream ended; else stops the sender
        if first_token is None:
            raise TransferError("short_stream", f"no first token after {assembler.blocks} blocks")
        return TransferResult(
            first_token, assembler.blocks, assembler.bytes, time.perf_counter() - started
        )

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


async def pull_blocks(
    address: str,
    request: pb.PullBlocksRequest,
    *,
    timeout_s: float,
    on_block: Callable[[int, torch.Tensor], None],
    tls: TLSFiles | None = None,
) -> TransferResult:
    """One pull on a channel of its own; a worker keeps a ``KVTransferClient`` instead."""
    client = KVTransferClient(tls)
    try:
        return await client.pull_blocks(address, request, timeout_s=timeout_s, on_block=on_block)
    finally:
        await client.close()

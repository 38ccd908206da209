"""The decode worker's side of KV transfer: pulls a prompt's blocks from a prefill worker
over ``grpc.aio``, checking the stream as it arrives (see ``kv_transfer`` for the
protocol and its invariants): with the cluster secret, each pull carries a token for the
worker it is meant for, and no block is taken before that worker's proof (``kv_auth``);
every chunk must fit this worker's own cache layout before it is allocated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from tessera.protos.tessera.v1 import kv_transfer_pb2 as pb
from tessera.protos.tessera.v1 import kv_transfer_pb2_grpc as pb_grpc
from tessera.workers.process.kv_auth import AUTH_KEY, PROOF_KEY, ClusterSecret, metadata_value
from tessera.workers.process.kv_wire import (
    API_VERSION,
    BlockAssembler,
    BlockLayout,
    FailureReason,
    TLSFiles,
    TransferError,
    usable_blocks,
)

#: gRPC status codes the client sees -> failure reason; any other code is "remote".
_REASONS: dict[grpc.StatusCode, FailureReason] = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.CANCELLED: "unavailable",  # the server went away mid-stream
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "busy",
}


@dataclass(frozen=True, slots=True)
class TransferResult:
    first_token: pb.FirstToken
    blocks: int  # how many blocks on_block received
    bytes: int  # payload bytes received
    seconds: float


class KVTransferClient:
    """The decode worker's side: one channel per prefill worker address, reused.
    ``secret``: the cluster's (each pull then names its worker, and takes blocks only
    from it); ``tls_server_name``: the name every worker's certificate carries, checked
    instead of the address dialled, so that one certificate can serve every worker."""

    def __init__(
        self,
        tls: TLSFiles | None = None,
        *,
        secret: ClusterSecret | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        self._tls = tls
        self._secret = secret
        self._server_name = tls_server_name
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.KVTransferStub]] = {}

    def _stub(self, address: str) -> pb_grpc.KVTransferStub:
        if address not in self._stubs:
            if self._tls is None:
                channel = grpc.aio.insecure_channel(address)
            else:
                cert, key, ca = self._tls.read()
                creds = grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)
                options = []
                if self._server_name is not None:
                    options.append(("grpc.ssl_target_name_override", self._server_name))
                channel = grpc.aio.secure_channel(address, creds, options=options)
            self._stubs[address] = (channel, pb_grpc.KVTransferStub(channel))
        return self._stubs[address][1]

    async def pull_blocks(
        self,
        address: str,
        request: pb.PullBlocksRequest,
        *,
        timeout_s: float,
        on_block: Callable[[int, torch.Tensor], None],
        layout: BlockLayout,
        worker_id: str | None = None,
    ) -> TransferResult:
        """Pull the blocks ``request`` names from worker ``worker_id`` at ``address``,
        calling ``on_block(index, kv)`` as each completes, ``kv`` of exactly ``layout``
        (this worker's cache's); raise ``TransferError`` on any failure (the blocks
        already handed out are then to be discarded). With the cluster secret,
        ``worker_id`` is required."""
        started = time.perf_counter()
        metadata, nonce = (), None
        if self._secret is not None:
            if worker_id is None:
                raise ValueError("worker_id: a pull with the cluster secret names its worker")
            token, nonce = self._secret.pull_token(worker_id)
            metadata = ((AUTH_KEY, token),)
        if request.block_size not in (0, layout.block_size):
            raise ValueError(f"block_size: {request.block_size}, the layout's {layout.block_size}")
        if request.version == 0:
            request, original = pb.PullBlocksRequest(), request
            request.CopyFrom(original)
            request.version = API_VERSION
        num_blocks = None
        if request.block_size:
            total = usable_blocks(len(request.prompt_token_ids), request.block_size)
            num_blocks = max(total - request.skip_blocks, 0)
        assembler = BlockAssembler(request.skip_blocks, layout, num_blocks)
        first_token = None
        call = self._stub(address).PullBlocks(request, timeout=timeout_s, metadata=metadata)
        proven = self._secret is None
        try:
            async for response in call:
                if not proven:  # the first message: its worker's proof came before it
                    proof = metadata_value(await call.initial_metadata(), PROOF_KEY)
                    if not self._secret.check_proof(worker_id, nonce, proof):
                        raise TransferError(
                            "unauthenticated", f"{address} did not prove to be {worker_id}"
                        )
                    proven = True
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
    layout: BlockLayout,
    tls: TLSFiles | None = None,
    secret: ClusterSecret | None = None,
    worker_id: str | None = None,
    tls_server_name: str | None = None,
) -> TransferResult:
    """One pull on a channel of its own; a worker keeps a ``KVTransferClient`` instead."""
    client = KVTransferClient(tls, secret=secret, tls_server_name=tls_server_name)
    try:
        return await client.pull_blocks(
            address,
            request,
            timeout_s=timeout_s,
            on_block=on_block,
            layout=layout,
            worker_id=worker_id,
        )
    finally:
        await client.close()

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
dtype the wire carries round-trips exactly, bfloat16 included.

The server is in ``kv_server``, the client in ``kv_client``, and what both share (the
chunks, their reassembly and checks, the errors, the TLS files) in ``kv_wire``.
"""

from tessera.workers.process.kv_client import KVTransferClient, pull_blocks
from tessera.workers.process.kv_server import KVTransferServer, PrefillResult
from tessera.workers.process.kv_wire import (
    API_VERSION,
    BlockAssembler,
    TLSFiles,
    TransferError,
    block_chunks,
    usable_blocks,
)

__all__ = [
    "API_VERSION",
    "BlockAssembler",
    "KVTransferClient",
    "KVTransferServer",
    "PrefillResult",
    "TLSFiles",
    "TransferError",
    "block_chunks",
    "pull_blocks",
    "usable_blocks",
]

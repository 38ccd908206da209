"""KV-block transfer between workers: the ``tessera.v1.KVTransfer`` gRPC service
(prefill side) and its client (decode side), over ``grpc.aio``.

Protocol (``PullBlocks``, server streaming)::

    decode worker                          prefill worker
    PullBlocksRequest(skip_blocks=s) --->  handler(request, time_remaining) -> PrefillResult
                                     <---  KVChunk(block s, layers [0, k))
                                     <---  KVChunk(block s, layers [k, L))  -> on_block(s, kv)
                                     <---  KVChunk(block s+1, ...) ...
                                     <---  FirstToken                       (last message)

Who may pull (``kv_auth``): with the cluster secret, a pull carries a token for the
prefill worker it is meant for, checked before the request is read; the server answers
with its proof, checked before the first block is taken. The server caps pulls at once,
blocks per pull and each pull's time (``PullLimits``), tells peers nothing of its
internals, and refuses to listen beyond loopback with neither the secret nor mutual TLS.

Invariants the client checks (any breach raises ``TransferError``; the decode worker
then discards what it got and prefills itself):

- every message has ``version`` 0 or ``API_VERSION``;
- every chunk's ``crc32`` is ``zlib.crc32(data)`` and its data length is what its
  dtype and shape say; dtype, ``num_layers`` and per-layer shape are those of the
  receiver's own cache (``BlockLayout``), checked before anything is allocated;
- blocks arrive in order from ``skip_blocks``, each block's layers contiguously from 0
  to ``num_layers``; the stream ends with ``first_token`` after exactly
  ``usable_blocks(len(prompt_token_ids), block_size) - skip_blocks`` complete blocks
  (when the request names a block size): the prompt's full blocks that leave its last
  token to compute, which is all a receiver's prefix cache can take.

A chunk carries at most ``min(request.max_chunk_bytes or server's, server's)`` payload
bytes and at least one layer. Tensor bytes travel raw (C order, little endian), so any
dtype the wire carries round-trips exactly, bfloat16 included.

The server is in ``kv_server``, the client in ``kv_client``, what both share (the
chunks, their reassembly and checks, the errors, the TLS files) in ``kv_wire``, and
the secret and its proofs in ``kv_auth``.
"""

from tessera.workers.process.kv_auth import ClusterSecret, PullGate
from tessera.workers.process.kv_client import KVTransferClient, pull_blocks
from tessera.workers.process.kv_server import (
    KVServerSecurityError,
    KVTransferServer,
    PrefillResult,
    PullLimits,
)
from tessera.workers.process.kv_wire import (
    API_VERSION,
    BlockAssembler,
    BlockLayout,
    TLSFiles,
    TransferError,
    block_chunks,
    usable_blocks,
)

__all__ = [
    "API_VERSION",
    "BlockAssembler",
    "BlockLayout",
    "ClusterSecret",
    "KVServerSecurityError",
    "KVTransferClient",
    "KVTransferServer",
    "PrefillResult",
    "PullGate",
    "PullLimits",
    "TLSFiles",
    "TransferError",
    "block_chunks",
    "pull_blocks",
    "usable_blocks",
]

"""KV transfer over gRPC on loopback vs a plain in-memory copy of the same bytes.

A ``KVTransferServer`` on 127.0.0.1 serves prompts of N blocks shaped like SmolLM2's
(30 layers, 2, block of 16 tokens, 3 KV heads of 64, float32: 737 KB a block); a
``KVTransferClient`` pulls them, reassembling and checksumming every chunk (1 MiB at
most), as a decode worker does. The peer is ``torch.Tensor.copy_`` of the same blocks
into a preallocated pool, in the same process: the floor any transport pays. Reported:
GB/s of both, their ratio, and time per transferred block.

    python benchmarks/kv_transfer.py --blocks 8 32 128 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import report  # noqa: E402
from tessera.protos.tessera.v1 import kv_transfer_pb2 as pb  # noqa: E402
from tessera.workers.process.kv_transfer import (  # noqa: E402
    API_VERSION,
    BlockLayout,
    KVTransferClient,
    KVTransferServer,
    PrefillResult,
)

LAYERS, BLOCK, HEADS, DIM = 30, 16, 3, 64  # SmolLM2-135M


def blocks_of(n: int) -> list[torch.Tensor]:
    return [torch.randn(LAYERS, 2, BLOCK, HEADS, DIM) for _ in range(n)]


async def measure(n: int, repeats: int) -> dict:
    blocks = blocks_of(n)
    size = sum(b.numel() * b.element_size() for b in blocks)

    async def handler(request, time_remaining):
        return PrefillResult(blocks=blocks, first_token=pb.FirstToken(token_id=1))

    server = KVTransferServer(handler)
    await server.start()
    client = KVTransferClient()
    pool = torch.empty(LAYERS, 2, n, BLOCK, HEADS, DIM)
    request = pb.PullBlocksRequest(
        version=API_VERSION,
        request_id="bench",
        prompt_token_ids=list(range(n * BLOCK + 1)),
        block_size=BLOCK,
    )
    try:
        grpc_times, copy_times = [], []
        for _ in range(repeats + 1):  # the first pull warms the channel up
            started = time.perf_counter()
            await client.pull_blocks(
                server.address,
                request,
                timeout_s=120,
                on_block=lambda i, kv: pool[:, :, i].copy_(kv),
                layout=BlockLayout.of_cache(pool),  # pool: [L, 2, n, bs, H, D]
            )
            grpc_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            for i, kv in enumerate(blocks):
                pool[:, :, i].copy_(kv)
            copy_times.append(time.perf_counter() - started)
    finally:
        await client.close()
        await server.stop(None)
    grpc_s = statistics.median(grpc_times[1:])
    copy_s = statistics.median(copy_times[1:])
    return {
        "blocks": n,
        "mbytes": size / 1e6,
        "grpc_gb_s": size / grpc_s / 1e9,
        "memcpy_gb_s": size / copy_s / 1e9,
        "grpc_over_memcpy_time": grpc_s / copy_s,
        "ms_per_block": grpc_s / n * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = [asyncio.run(measure(n, args.repeats)) for n in args.blocks]

    def plot(ax) -> None:
        x = [r["blocks"] for r in rows]
        ax.plot(x, [r["grpc_gb_s"] for r in rows], "o-", label="gRPC pull (loopback)")
        ax.plot(x, [r["memcpy_gb_s"] for r in rows], "s--", label="in-memory copy (peer)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("blocks per transfer (737 KB each)")
        ax.set_ylabel("GB/s")
        ax.legend()

    meta = {"peer": "torch copy_ of the same blocks in one process", "repeats": args.repeats}
    report("kv_transfer", rows, meta, plot)


if __name__ == "__main__":
    main()

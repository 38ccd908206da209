"""Decode steps replayed from captured CUDA graphs.

On a GPU a decode step of a small model is bound by kernel launches, not by the
kernels: SmolLM2-135M's ~1,300 launches a step took 22 ms of host time on an H100 for
3 ms of GPU work. A CUDA graph records those launches once and replays them with one.

A graph fixes every shape and address, so a step is replayed from a graph when all of
its attention entries are decodes (one new token each: plain decodes, and the split
rows of a speculative verification or a parallel-token set without a mask), and:

- its rows are padded to a batch bucket (``BATCH_BUCKETS``); a padding row repeats row
  0 (same token, position, slot and context), so it computes and writes exactly row
  0's K/V, and its logits are dropped;
- its block tables are padded to a width bucket (a power of two of blocks), and
  attention reads the whole width as one tile (``static_decode_tile``), masking each
  row's positions past its length. The eager path tiles by 256 tokens: the two differ
  in float rounding only, within the exactness contract (docs/architecture.md).

One graph per (batch bucket, width bucket), captured the first time a step needs it,
from that step's own inputs: warm-up and capture write the same K/V into the same
slots as the replay does, so no cache slot is ever written with anything but its own
token's values. Graphs share one memory pool.

``capture=False`` runs the same static path eagerly (the CPU tests check it against
the dynamic path).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from tessera.workers.attention.metadata import AttentionMetadata, DecodeTile
from tessera.workers.model.llama import LlamaModel

logger = logging.getLogger(__name__)

#: Batch sizes a decode graph is captured for; a step's rows are padded up to the next.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
#: The narrowest block-table width a graph is captured for (then powers of two).
MIN_WIDTH_BLOCKS = 4


def static_decode_tile(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, dtype: torch.dtype
) -> DecodeTile:
    """The whole block table as one decode tile, built with tensor ops only (no host
    values), so it can be captured: positions at or past a row's length read the row's
    first slot (always written, so finite) and get a -inf score."""
    num_rows, width = block_tables.shape
    tokens = width * block_size
    offsets = torch.arange(block_size, device=block_tables.device)
    slots = (block_tables[:, :, None] * block_size + offsets).view(num_rows, tokens)
    positions = torch.arange(tokens, device=block_tables.device)
    past_end = positions[None, :] >= seq_lens[:, None]  # [B, tokens]
    slots = torch.where(past_end, block_tables[:, :1] * block_size, slots)
    bias = torch.zeros(past_end.shape, dtype=dtype, device=block_tables.device)
    bias = bias.masked_fill_(past_end, -math.inf)[:, None, None, :]
    return DecodeTile(slots.reshape(-1), bias, tokens)


class _StaticStep:
    """The input buffers, and on CUDA the graph, of one (batch, width) bucket."""

    def __init__(self, runner: DecodeGraphs, batch: int, width: int) -> None:
        device = runner.kv_cache.device
        self.runner, self.batch, self.width = runner, batch, width
        self.input_ids = torch.zeros(batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(batch, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(batch, width, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(batch, dtype=torch.int64, device=device)
        self.rows = torch.arange(batch, device=device)
        self.query_start_loc = torch.arange(batch + 1, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def fill(self, host: torch.Tensor) -> None:
        """Copy one step's rows in: ``host`` is int64 ``[batch, 4 + width]`` (token,
        position, slot, length, block table), already padded."""
        device_rows = host.to(self.input_ids.device, non_blocking=True)
        self.input_ids.copy_(device_rows[:, 0])
        self.positions.copy_(device_rows[:, 1])
        self.slot_mapping.copy_(device_rows[:, 2])
        self.seq_lens.copy_(device_rows[:, 3])
        self.block_tables.copy_(device_rows[:, 4:])

    def forward(self) -> torch.Tensor:
        runner = self.runner
        tile = static_decode_tile(
            self.block_tables, self.seq_lens, runner.block_size, runner.kv_cache.dtype
        )
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            num_decodes=self.batch,
            query_start_loc_list=list(range(self.batch + 1)),
            # host lengths only bound the table's width here; the tile masks by seq_lens
            seq_lens_list=[self.width * runner.block_size] * self.batch,
            decode_plan=(tile,),
        )
        return runner.model(self.input_ids, self.positions, runner.kv_cache, meta, self.rows)

    def run(self) -> torch.Tensor:
        if not self.runner.capture:
            return self.forward()
        if self.graph is None:
            self._capture()
        assert self.graph is not None and self.logits is not None
        self.graph.replay()
        return self.logits

    def _capture(self) -> None:
        started = time.perf_counter()
        side = torch.cuda.Stream(self.input_ids.device)
        side.wait_stream(torch.cuda.current_stream(self.input_ids.device))
        with torch.cuda.stream(side):  # warm-up: cuBLAS workspaces, allocator
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream(self.input_ids.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.runner.pool):
            self.logits = self.forward()
        self.graph = graph
        logger.info(
            "captured a decode CUDA graph: %d rows, %d blocks of context, in %.0f ms",
            self.batch,
            self.width,
            (time.perf_counter() - started) * 1e3,
        )


class DecodeGraphs:
    """Runs all-decode steps through per-bucket static buffers (and CUDA graphs)."""

    def __init__(
        self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, capture: bool
    ) -> None:
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.max_width = kv_cache.shape[2]  # a table never lists more blocks than exist
        self.steps: dict[tuple[int, int], _StaticStep] = {}

    @staticmethod
    def fits(num_rows: int) -> bool:
        return num_rows <= BATCH_BUCKETS[-1]

    def prepare(
        self,
        input_ids: Seq[int],
        positions: Seq[int],
        cache_indices: Seq[int],
        tables: Seq[list[int]],
        logits_rows: Seq[int],
    ) -> Callable[[], torch.Tensor]:
        """Fill a bucket's buffers with a step of decode rows and return what runs it:
        row ``i`` is token ``input_ids[i]`` at ``positions[i]``, written to cache index
        ``cache_indices[i]`` of the sequence whose block table is ``tables[i]``; the
        callable returns the logits ``[len(logits_rows), vocab]``."""
        num_rows = len(input_ids)
        batch = BATCH_BUCKETS[bisect.bisect_left(BATCH_BUCKETS, num_rows)]
        needed = max(len(table) for table in tables)
        width = min(max(MIN_WIDTH_BLOCKS, 1 << (needed - 1).bit_length()), self.max_width)
        width = max(width, needed)
        step = self.steps.get((batch, width))
        if step is None:
            step = self.steps[batch, width] = _StaticStep(self, batch, width)
        bs = self.block_size
        rows = [
            [token, position, table[index // bs] * bs + index % bs, index + 1, *table]
            + [0] * (width - len(table))
            for token, position, index, table in zip(
                input_ids, positions, cache_indices, tables, strict=True
            )
        ]
        rows += [rows[0]] * (batch - num_rows)  # padding rows repeat row 0
        host = torch.tensor(rows, dtype=torch.int64)
        step.fill(host)
        wanted = torch.tensor(logits_rows, dtype=torch.int64).to(self.kv_cache.device)
        return lambda: step.run().index_select(0, wanted)

"""What both ends of a KV transfer share: the version, a block's chunks on the wire (and
their reassembly, with the checks the receiver makes against its own cache's layout),
the errors, the TLS files.

The protocol and its invariants are in ``kv_transfer``'s docstring. Tensor bytes travel
raw (C order, little endian), so any dtype in ``_DTYPES`` round-trips exactly, bfloat16
included.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from tessera.protos.tessera.v1 import kv_transfer_pb2 as pb

API_VERSION = 1

#: The KV dtypes the wire carries, by torch name ("float32", "bfloat16", ...).
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8,
    )
}  # fmt: skip

FailureReason = Literal[
    "checksum", "short_stream", "deadline", "unavailable", "protocol", "remote",
    "unauthenticated", "busy",
]  # fmt: skip


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
class BlockLayout:
    """What one block of the receiver's KV cache is: its dtype and ``[num_layers, 2,
    block_size, kv_heads, head_dim]``. Incoming chunks must match it exactly before
    anything is allocated or copied: the sender's word sizes nothing."""

    dtype: torch.dtype
    num_layers: int
    layer_shape: tuple[int, int, int, int]  # [2, block_size, kv_heads, head_dim]

    def __post_init__(self) -> None:
        if self.num_layers < 1 or len(self.layer_shape) != 4 or min(self.layer_shape) < 1:
            raise ValueError(f"a block layout, got {self.num_layers} x {self.layer_shape}")

    @classmethod
    def of_cache(cls, kv_cache: torch.Tensor, kv_heads: int | None = None) -> BlockLayout:
        """The layout of one block of ``kv_cache`` ``[layers, 2, num_blocks, block_size,
        kv_heads, head_dim]``; ``kv_heads``: the whole model's where the cache holds a
        tensor-parallel rank's heads only."""
        layers, two, _, block_size, heads, dim = kv_cache.shape
        return cls(kv_cache.dtype, layers, (two, block_size, kv_heads or heads, dim))

    @property
    def block_size(self) -> int:
        return self.layer_shape[1]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, *self.layer_shape)

    @property
    def layer_bytes(self) -> int:
        return math.prod(self.layer_shape) * self.dtype.itemsize


def layers_per_chunk(kv: torch.Tensor, max_chunk_bytes: int) -> int:
    """How many of block ``kv``'s layers one chunk of ``max_chunk_bytes`` carries."""
    layer_bytes = kv[0].numel() * kv.element_size()
    if layer_bytes > max_chunk_bytes:
        raise ValueError(
            f"one layer of a block is {layer_bytes} bytes, over the chunk limit of "
            f"{max_chunk_bytes} bytes (max_chunk_bytes)"
        )
    return max_chunk_bytes // layer_bytes


def block_chunks(kv: torch.Tensor, block_index: int, max_chunk_bytes: int) -> list[pb.KVChunk]:
    """Split one block's KV ``[L, 2, bs, H, D]`` along layers into chunks of at most
    ``max_chunk_bytes`` payload bytes each."""
    if kv.dim() != 5 or kv.numel() == 0:
        raise ValueError(f"a block's KV must be a non-empty 5-D tensor, got {tuple(kv.shape)}")
    name = str(kv.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {name} cannot travel; one of {sorted(_DTYPES)}")
    per_chunk = layers_per_chunk(kv, max_chunk_bytes)
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
    per-block tensors of the receiver's ``layout``, checking the stream's invariants,
    and hands out each block as soon as its last layer arrives."""

    def __init__(
        self, first_block: int, layout: BlockLayout, num_blocks: int | None = None
    ) -> None:
        self.next_block = first_block
        self.blocks = 0
        self.bytes = 0
        self.layout = layout
        self._num_blocks = num_blocks
        self._partial: torch.Tensor | None = None  # [L, 2, bs, H, D], the block being filled
        self._next_layer = 0

    def add(self, chunk: pb.KVChunk) -> tuple[int, torch.Tensor] | None:
        """Take one chunk; return ``(block_index, kv)`` when it completes a block."""
        where = f"block {chunk.block_index} layers [{chunk.layer_start}, {chunk.layer_end})"
        if zlib.crc32(chunk.data) != chunk.crc32:
            raise TransferError("checksum", f"{where}: crc32 mismatch")
        layout = self.layout
        # Everything the chunk says of its block is checked against the local cache
        # before a byte is allocated or copied: a [1, 2, bs, 1, 1] chunk must not
        # broadcast, and a sender's num_layers must not size anything.
        if _DTYPES.get(chunk.dtype) != layout.dtype:
            raise TransferError("protocol", f"{where}: dtype {chunk.dtype!r}, not {layout.dtype}")
        if chunk.num_layers != layout.num_layers or tuple(chunk.shape[1:]) != layout.layer_shape:
            raise TransferError(
                "protocol",
                f"{where}: {chunk.num_layers} layers of {tuple(chunk.shape[1:])}, not "
                f"{layout.num_layers} of {layout.layer_shape}",
            )
        if (chunk.block_index, chunk.layer_start) != (self.next_block, self._next_layer):
            expected = f"block {self.next_block} from layer {self._next_layer}"
            raise TransferError("protocol", f"{where}: expected {expected}")
        layers = chunk.layer_end - chunk.layer_start
        if len(chunk.shape) != 5 or layers <= 0 or layers != chunk.shape[0]:
            raise TransferError("protocol", f"{where}: shape {tuple(chunk.shape)}")
        if chunk.layer_end > layout.num_layers:
            raise TransferError("protocol", f"{where} of {layout.num_layers}")
        if len(chunk.data) != layers * layout.layer_bytes:
            raise TransferError("protocol", f"{where}: {len(chunk.data)} bytes for {chunk.shape}")
        if self._partial is None:
            if self._num_blocks is not None and self.blocks == self._num_blocks:
                raise TransferError("protocol", f"more than the {self._num_blocks} blocks expected")
            self._partial = torch.empty(layout.shape, dtype=layout.dtype)
        # Write the bytes straight into the block: one copy, whatever the dtype.
        flat = self._partial.view(-1).view(torch.uint8).numpy()
        offset = chunk.layer_start * layout.layer_bytes
        flat[offset : offset + len(chunk.data)] = np.frombuffer(chunk.data, dtype=np.uint8)
        self.bytes += len(chunk.data)
        self._next_layer = chunk.layer_end
        if chunk.layer_end < layout.num_layers:
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

"""GGUF block-quantised weight matrices kept packed: Q4_0, Q4_1, Q8_0 and the K-quants
Q4_K, Q5_K, Q6_K.

A weight ``[out_features, in_features]`` (rows are output features) is cut into blocks
of 32 along ``in_features``; each block stores a scale ``d`` (and for Q4_1 a minimum
``m``) as fp16 and 32 small integers ``q``::

    Q4_0  w = d * (q - 8)   q in 0..15, two to a byte
    Q4_1  w = d * q + m     q in 0..15, two to a byte
    Q8_0  w = d * q         q in -128..127

The file interleaves them (``d [m] qs`` per block); here they are split into ``qs``,
``scales`` and ``mins`` tensors with one row per output feature, so every row operation
the model needs (select, permute, concatenate) is a row operation on each tensor.
A Q4 block's 16 bytes hold element ``j`` in the low nibble of byte ``j`` and element
``j + 16`` in the high nibble, as in GGUF.

The K-quants (what a Q4_K_M / Q5_K_M file holds) cut rows into super-blocks of 256
with their own scales inside; their bytes stay verbatim, one row of super-blocks per
output feature: ``qs`` is uint8 ``[out, in / 256 * block_bytes]`` and ``scales`` and
``mins`` are None. ``kquants.py`` documents the three layouts and dequantises them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import torch

from tessera.workers.quant import kquants
from tessera.workers.quant.kquants import SUPER_BLOCK_SIZE

BLOCK_SIZE = 32


class QuantType(IntEnum):
    """The GGML type ids (``gguf.GGMLQuantizationType``) that stay packed."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14

    @property
    def is_k(self) -> bool:
        """A K-quant: super-blocks of 256 kept as the file's bytes."""
        return self.value >= QuantType.Q4_K.value

    @property
    def block_size(self) -> int:
        """Elements of a row a block holds: 32, or a K-quant's super-block of 256."""
        return SUPER_BLOCK_SIZE if self.is_k else BLOCK_SIZE

    @property
    def block_bytes(self) -> int:
        """Bytes a block takes in the file (fp16 scale [+ fp16 min] + quants; a K-quant's
        whole super-block)."""
        return _BLOCK_BYTES[self]

    @property
    def quant_bytes(self) -> int:
        """Bytes of ``qs`` a block of 32 takes (the split types only)."""
        return BLOCK_SIZE if self is QuantType.Q8_0 else BLOCK_SIZE // 2


_BLOCK_BYTES = {
    QuantType.Q4_0: 18,
    QuantType.Q4_1: 20,
    QuantType.Q8_0: 34,
    QuantType.Q4_K: 144,
    QuantType.Q5_K: 176,
    QuantType.Q6_K: 210,
}
#: The types split into ``qs``/``scales``/``mins`` (blocks of 32).
SPLIT_TYPES = (QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0)
#: The K-quants, kept as the file's super-blocks.
K_TYPES = (QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K)


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A GGUF-quantised ``[out_features, in_features]`` matrix, packed as in the file."""

    qtype: QuantType
    qs: torch.Tensor  # Q4_x: uint8 [out, in / 2]; Q8_0: int8 [out, in]; K: uint8 super-blocks
    scales: torch.Tensor | None  # fp16 [out, in / 32]; None for a K-quant
    mins: torch.Tensor | None  # fp16 [out, in / 32] for Q4_1, else None

    def __post_init__(self) -> None:
        qtype = QuantType(self.qtype)
        object.__setattr__(self, "qtype", qtype)
        if qtype.is_k:
            if self.scales is not None or self.mins is not None:
                raise ValueError(f"PackedWeight: {qtype.name} keeps its scales in qs")
            if (
                self.qs.dtype != torch.uint8
                or self.qs.dim() != 2
                or self.qs.shape[1] % qtype.block_bytes
            ):
                raise ValueError(
                    f"PackedWeight: {qtype.name} qs must be uint8 [out, in / 256 * "
                    f"{qtype.block_bytes}], got {self.qs.dtype} {tuple(self.qs.shape)}"
                )
            return
        if self.scales is None:
            raise ValueError(f"PackedWeight: {qtype.name} needs float16 scales")
        out, nb = self.scales.shape
        want_dtype = torch.int8 if qtype is QuantType.Q8_0 else torch.uint8
        if self.qs.dtype != want_dtype or tuple(self.qs.shape) != (out, nb * qtype.quant_bytes):
            raise ValueError(
                f"PackedWeight: {qtype.name} qs must be {want_dtype} "
                f"[{out}, {nb * qtype.quant_bytes}], got {self.qs.dtype} {tuple(self.qs.shape)}"
            )
        if self.scales.dtype != torch.float16:
            raise ValueError(f"PackedWeight: scales must be float16, got {self.scales.dtype}")
        if (self.mins is not None) != (qtype is QuantType.Q4_1):
            raise ValueError(f"PackedWeight: mins go with Q4_1 only (this is {qtype.name})")
        if self.mins is not None and (
            self.mins.dtype != torch.float16 or self.mins.shape != self.scales.shape
        ):
            raise ValueError("PackedWeight: mins must be float16 shaped like scales")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_raw(
        cls, data: np.ndarray | torch.Tensor, qtype: int, shape: tuple[int, int]
    ) -> PackedWeight:
        """From the file's bytes: ``data`` uint8 holding ``shape[0]`` rows of blocks."""
        qtype = QuantType(int(qtype))
        out, in_features = (int(s) for s in shape)
        if in_features % qtype.block_size:
            raise ValueError(
                f"PackedWeight: in_features {in_features} is not a multiple of "
                f"{qtype.block_size} ({qtype.name})"
            )
        nb = in_features // qtype.block_size
        if qtype.is_k:  # the super-blocks verbatim, one row of them per output
            # a copy: the file's tensors are read-only memory maps
            raw = np.array(data, dtype=np.uint8).reshape(out, -1)
            if raw.shape[1] != nb * qtype.block_bytes:
                raise ValueError(
                    f"PackedWeight: {qtype.name} rows of {in_features} take "
                    f"{nb * qtype.block_bytes} bytes, got {raw.shape[1]}"
                )
            return cls(qtype, torch.from_numpy(raw), None, None)
        raw = np.asarray(data, dtype=np.uint8).reshape(out, nb, qtype.block_bytes)
        scales = _fp16(raw[..., 0:2])
        mins = _fp16(raw[..., 2:4]) if qtype is QuantType.Q4_1 else None
        head = 4 if qtype is QuantType.Q4_1 else 2
        qs = torch.from_numpy(np.ascontiguousarray(raw[..., head:]).reshape(out, -1))
        if qtype is QuantType.Q8_0:
            qs = qs.view(torch.int8)
        return cls(qtype, qs, scales, mins)

    @classmethod
    def from_gguf(cls, tensor: Any) -> PackedWeight:
        """From a GGUF tensor (``GGUFTensor``; its ``shape`` is GGUF's ``[in, out]``)."""
        in_features, out = (int(s) for s in tensor.shape)
        return cls.from_raw(tensor.data, int(tensor.tensor_type), (out, in_features))

    @staticmethod
    def supports(qtype: int) -> bool:
        return int(qtype) in QuantType._value2member_map_

    # ------------------------------------------------------------------ shape

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def in_features(self) -> int:
        if self.scales is None:
            return self.qs.shape[1] // self.qtype.block_bytes * SUPER_BLOCK_SIZE
        return self.scales.shape[1] * BLOCK_SIZE

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        tensors = (self.qs, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def to(self, device: torch.device | str) -> PackedWeight:
        """The same packed weight on ``device`` (itself where ``device`` names its tensors'
        device exactly)."""
        device = torch.device(device)
        if self.qs.device == device:
            return self
        return PackedWeight(
            self.qtype, self.qs.to(device), *(_to(t, device) for t in (self.scales, self.mins))
        )

    # ------------------------------------------------------------------ row operations

    def select_rows(self, index: torch.Tensor | slice | Sequence[int]) -> PackedWeight:
        """Rows ``index`` (a slice, or indices: a permutation or a subset) as a new weight."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        return PackedWeight(
            self.qtype,
            *(None if t is None else t[index].contiguous() for t in self._row_tensors()),
        )

    def select_columns(self, start: int, stop: int) -> PackedWeight:
        """Input columns ``start:stop`` as a new weight: whole blocks, never unpacked
        (a row-parallel shard). Both ends must fall on a block boundary."""
        size = self.qtype.block_size
        if start % size or stop % size or not 0 <= start < stop <= self.in_features:
            raise ValueError(
                f"PackedWeight: columns {start}:{stop} of {self.in_features} do not fall on "
                f"{self.qtype.name} blocks of {size}"
            )
        first, last = start // size, stop // size
        if self.scales is None:  # K-quant super-blocks, verbatim
            width = self.qtype.block_bytes
            return PackedWeight(
                self.qtype, self.qs[:, first * width : last * width].contiguous(), None, None
            )
        width = self.qtype.quant_bytes
        return PackedWeight(
            self.qtype,
            self.qs[:, first * width : last * width].contiguous(),
            self.scales[:, first:last].contiguous(),
            None if self.mins is None else self.mins[:, first:last].contiguous(),
        )

    @staticmethod
    def cat(weights: Sequence[PackedWeight]) -> PackedWeight:
        """Stack row groups (fused q/k/v, gate/up): same type and ``in_features``."""
        first = weights[0]
        for w in weights[1:]:
            if w.qtype is not first.qtype or w.in_features != first.in_features:
                raise ValueError(
                    f"PackedWeight.cat: {w.qtype.name} [*, {w.in_features}] does not stack "
                    f"with {first.qtype.name} [*, {first.in_features}]"
                )
        parts = zip(*(w._row_tensors() for w in weights), strict=True)
        return PackedWeight(
            first.qtype, *(None if p[0] is None else torch.cat(list(p)) for p in parts)
        )

    def _row_tensors(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return self.qs, self.scales, self.mins

    # ------------------------------------------------------------------ dense views

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[out, in]``, bit for bit what ``gguf.dequantize`` gives."""
        return self._dequantize_rows(*self._row_tensors())

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """fp32 rows ``start:stop`` (a chunk, without dequantising the rest)."""
        return self._dequantize_rows(
            *(None if t is None else t[start:stop] for t in self._row_tensors())
        )

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``ids`` (any shape) -> ``[*ids.shape, in]``: the embedding lookup."""
        flat = ids.reshape(-1).long()
        rows = self._dequantize_rows(*(None if t is None else t[flat] for t in self._row_tensors()))
        return rows.view(*ids.shape, self.in_features)

    def _dequantize_rows(
        self, qs: torch.Tensor, scales: torch.Tensor | None, mins: torch.Tensor | None
    ) -> torch.Tensor:
        if scales is None:
            return kquants.dequantize(qs, int(self.qtype))
        rows, nb = scales.shape
        d = scales.float().unsqueeze(-1)  # [rows, nb, 1]; fp16 -> fp32 is exact
        if self.qtype is QuantType.Q8_0:
            q = qs.view(rows, nb, BLOCK_SIZE).float()
            return (d * q).view(rows, nb * BLOCK_SIZE)
        packed = qs.view(rows, nb, BLOCK_SIZE // 2)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # [rows, nb, 32]
        if self.qtype is QuantType.Q4_0:
            w = d * (q.float() - 8.0)
        else:
            # two roundings (product, then sum) as gguf does: eager torch does not fuse
            w = d * q.float() + mins.float().unsqueeze(-1)
        return w.view(rows, nb * BLOCK_SIZE)


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def _fp16(two_bytes: np.ndarray) -> torch.Tensor:
    """``[..., 2]`` uint8 (little-endian fp16 bits) -> fp16 tensor ``[...]``."""
    halves = np.ascontiguousarray(two_bytes).view(np.float16)[..., 0]
    return torch.from_numpy(np.ascontiguousarray(halves))

"""GGUF block-quantised weight matrices kept packed: Q4_0, Q4_1 and Q8_0.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import torch

BLOCK_SIZE = 32


class QuantType(IntEnum):
    """The GGML type ids (``gguf.GGMLQuantizationType``) that stay packed."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8

    @property
    def block_bytes(self) -> int:
        """Bytes a block of 32 takes in the file (fp16 scale [+ fp16 min] + quants)."""
        return {QuantType.Q4_0: 18, QuantType.Q4_1: 20, QuantType.Q8_0: 34}[self]

    @property
    def quant_bytes(self) -> int:
        return BLOCK_SIZE if self is QuantType.Q8_0 else BLOCK_SIZE // 2


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A GGUF-quantised ``[out_features, in_features]`` matrix, packed as in the file."""

    qtype: QuantType
    qs: torch.Tensor  # Q4_x: uint8 [out, in / 2]; Q8_0: int8 [out, in]
    scales: torch.Tensor  # fp16 [out, in / 32]
    mins: torch.Tensor | None  # fp16 [out, in / 32] for Q4_1, else None

    def __post_init__(self) -> None:
        qtype = QuantType(self.qtype)
        object.__setattr__(self, "qtype", qtype)
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
        if in_features % BLOCK_SIZE:
            raise ValueError(f"PackedWeight: in_features {in_features} is not a multiple of 32")
        nb = in_features // BLOCK_SIZE
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
        return self.scales.shape[0]

    @property
    def in_features(self) -> int:
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
        mins = None if self.mins is None else self.mins.to(device)
        return PackedWeight(self.qtype, self.qs.to(device), self.scales.to(device), mins)

    # ------------------------------------------------------------------ row operations

    def select_rows(self, index: torch.Tensor | slice | Sequence[int]) -> PackedWeight:
        """Rows ``index`` (a slice, or indices: a permutation or a subset) as a new weight."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        return PackedWeight(
            self.qtype,
            self.qs[index].contiguous(),
            self.scales[index].contiguous(),
            None if self.mins is None else self.mins[index].contiguous(),
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
        return PackedWeight(
            first.qtype,
            torch.cat([w.qs for w in weights]),
            torch.cat([w.scales for w in weights]),
            None if first.mins is None else torch.cat([w.mins for w in weights]),
        )

    # ------------------------------------------------------------------ dense views

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[out, in]``, bit for bit what ``gguf.dequantize`` gives."""
        return self._dequantize_rows(self.qs, self.scales, self.mins)

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """fp32 rows ``start:stop`` (a chunk, without dequantising the rest)."""
        mins = None if self.mins is None else self.mins[start:stop]
        return self._dequantize_rows(self.qs[start:stop], self.scales[start:stop], mins)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``ids`` (any shape) -> ``[*ids.shape, in]``: the embedding lookup."""
        flat = ids.reshape(-1).long()
        mins = None if self.mins is None else self.mins[flat]
        rows = self._dequantize_rows(self.qs[flat], self.scales[flat], mins)
        return rows.view(*ids.shape, self.in_features)

    def _dequantize_rows(
        self, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
    ) -> torch.Tensor:
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


def _fp16(two_bytes: np.ndarray) -> torch.Tensor:
    """``[..., 2]`` uint8 (little-endian fp16 bits) -> fp16 tensor ``[...]``."""
    halves = np.ascontiguousarray(two_bytes).view(np.float16)[..., 0]
    return torch.from_numpy(np.ascontiguousarray(halves))

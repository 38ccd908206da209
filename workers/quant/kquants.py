"""The GGUF K-quants Q4_K, Q5_K and Q6_K: their super-block layouts, and their
dequantisation in torch, bit for bit ``gguf.quants.dequantize``.

A row is cut into super-blocks of 256 elements, each split into sub-blocks with a
scale of their own (6-bit for Q4_K/Q5_K, int8 for Q6_K) times the super-block's fp16
``d``. A super-block as the file stores it (``PackedWeight`` keeps these bytes)::

    Q4_K  144 B  d fp16 | dmin fp16 | scales 12 B | qs 128 B
    Q5_K  176 B  d fp16 | dmin fp16 | scales 12 B | qh 32 B | qs 128 B
    Q6_K  210 B  ql 128 B | qh 64 B | scales 16 x int8 | d fp16

Q4_K and Q5_K: 8 sub-blocks of 32, ``w = (d * sc[j]) * q - dmin * m[j]`` with ``sc``
and ``m`` 6 bits each, packed in the 12 bytes (``scale_min``: bytes 0-3 and 4-7 hold
``sc[0:4]`` and ``m[0:4]`` in their low 6 bits, their top 2 bits are the top bits of
``sc[4:8]`` and ``m[4:8]``, whose low 4 bits are the nibbles of bytes 8-11). Sub-block
``2g`` is the low nibbles of ``qs[32g : 32g + 32]``, sub-block ``2g + 1`` their high
nibbles; Q5_K's fifth bit of element ``i`` of sub-block ``j`` is bit ``j`` of ``qh[i]``.

Q6_K: 16 sub-blocks of 16, ``w = (d * sc[s]) * (q - 32)`` with 6-bit ``q``. Element
``32r + i`` of half ``h`` (``r`` in 0..3, ``i`` in 0..31) has its low 4 bits in nibble
``r >> 1`` of ``ql[64h + 32 (r & 1) + i]`` and its top 2 in bits ``2r, 2r + 1`` of
``qh[32h + i]``.

Each product and difference is rounded to float32 on its own, in gguf's order (eager
torch fuses nothing).
"""

from __future__ import annotations

import torch

SUPER_BLOCK_SIZE = 256
# GGML type ids (gguf.GGMLQuantizationType)
Q4_K, Q5_K, Q6_K = 12, 13, 14


def dequantize(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 ``[rows, super-blocks * block bytes]`` of type ``qtype`` -> fp32
    ``[rows, super-blocks * 256]``."""
    if qtype == Q6_K:
        return _q6_k(raw)
    if qtype in (Q4_K, Q5_K):
        return _q45_k(raw, qtype)
    raise ValueError(f"kquants: GGML type {qtype} is not a K-quant")


def scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes ``[..., 12]`` -> (sc, m), uint8 ``[..., 8]`` each."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _fp16(two: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 2]`` (little-endian fp16 bits) -> fp32 ``[..., 1]``: exact."""
    return two.contiguous().view(torch.float16).float()


def _shifted(qs: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """``[..., n, w]`` bytes -> ``[..., n, len(shifts), w]``: each shifted and masked."""
    by = torch.tensor(shifts, dtype=torch.uint8, device=qs.device).view(-1, 1)
    return (qs.unsqueeze(-2) >> by) & mask


def _q45_k(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    rows = raw.shape[0]
    blocks = raw.view(rows, -1, 176 if qtype == Q5_K else 144)  # [rows, S, bytes]
    nsb = blocks.shape[1]
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])  # [rows, S, 1]
    sc, mn = scale_min(blocks[..., 4:16])
    ds = (d * sc.float()).unsqueeze(-1)  # [rows, S, 8, 1]
    dm = (dmin * mn.float()).unsqueeze(-1)
    qs = blocks[..., -128:].reshape(rows, nsb, 4, 32)
    q = _shifted(qs, (0, 4), 0x0F).reshape(rows, nsb, 8, 32)  # sub-block 2g + s
    if qtype == Q5_K:
        qh = blocks[..., 16:48].reshape(rows, nsb, 1, 32)
        q = q | (_shifted(qh, tuple(range(8)), 0x01).reshape(rows, nsb, 8, 32) << 4)
    return (ds * q.float() - dm).view(rows, nsb * SUPER_BLOCK_SIZE)


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    rows = raw.shape[0]
    blocks = raw.view(rows, -1, 210)
    nsb = blocks.shape[1]
    ql = _shifted(blocks[..., 0:128].reshape(rows, nsb, 2, 64), (0, 4), 0x0F)
    qh = _shifted(blocks[..., 128:192].reshape(rows, nsb, 2, 32), (0, 2, 4, 6), 0x03)
    q = ql.reshape(rows, nsb, 8, 32) | (qh.reshape(rows, nsb, 8, 32) << 4)
    q = (q.view(torch.int8) - 32).float().view(rows, nsb, 16, 16)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [rows, S, 16]
    ds = (_fp16(blocks[..., 208:210]) * sc).unsqueeze(-1)  # [rows, S, 16, 1]
    return (ds * q).view(rows, nsb * SUPER_BLOCK_SIZE)

"""Packed GGUF K-quant weights (Q4_K / Q5_K / Q6_K) and the matmul that reads them,
against gguf's own dequantisation of the same bytes and ``x @ dequantised.T``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from tessera.workers.quant import PackedWeight, QuantType, kernels, quant_matmul
from tessera.workers.quant.blocks import K_TYPES

ROWS = (1, 7, 16, 64)
#: [out, in]: outputs that are no multiple of 2, 4, 8 or 16; in a few super-blocks
SHAPES = ((97, 256 * 3), (33, 256), (130, 256 * 2))


def random_k_blocks(qtype: QuantType, out: int, in_features: int, seed: int = 0) -> np.ndarray:
    """uint8 ``[out, in / 256 * block_bytes]``: valid super-blocks of random bytes whose
    fp16 ``d`` (and ``dmin``) are finite and modest (random bytes there would be NaNs,
    infinities and 1e4 scales)."""
    rng = np.random.default_rng(seed)
    nsb = in_features // 256
    raw = rng.integers(0, 256, size=(out, nsb, qtype.block_bytes), dtype=np.uint8)

    def halves(low: float, high: float) -> np.ndarray:
        values = rng.uniform(low, high, size=(out, nsb)).astype(np.float16)
        return values.view(np.uint8).reshape(out, nsb, 2)

    if qtype is QuantType.Q6_K:  # ... scales (int8) | d
        raw[..., 208:210] = halves(-0.01, 0.01)
    else:  # d | dmin | ...
        raw[..., 0:2] = halves(-0.02, 0.02)
        raw[..., 2:4] = halves(0.0, 0.01)
    return raw.reshape(out, -1)


def random_k(qtype: QuantType, shape: tuple[int, int], seed: int = 0):
    """(packed weight, gguf's dequantisation of the same bytes)."""
    raw = random_k_blocks(qtype, *shape, seed=seed)
    return PackedWeight.from_raw(raw, qtype, shape), torch.from_numpy(dequantize(raw, qtype))


@pytest.fixture(scope="module")
def native():
    if kernels.native_kernels() is None:
        pytest.skip("the native kernels cannot be built here (the torch path is tested)")
    return kernels.native_kernels()


def assert_product(y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """Equal to fp32 rounding: only the order of the sums differs."""
    ref = x @ dense.T
    scale = math.sqrt(dense.shape[1]) * max(1.0, dense.abs().max().item())
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_equals_gguf_bit_for_bit(qtype, shape):
    packed, ref = random_k(qtype, shape, seed=shape[0])
    assert packed.shape == shape
    assert packed.qs.dtype == torch.uint8 and packed.scales is None and packed.mins is None
    assert packed.nbytes == shape[0] * shape[1] // 256 * qtype.block_bytes  # the file's bytes
    assert torch.equal(packed.dequantize(), ref)
    assert torch.equal(packed.dequantize_rows(10, 31), ref[10:31])


@pytest.mark.parametrize("qtype", K_TYPES)
def test_extreme_scales_bit_for_bit(qtype):
    """Every 6-bit scale and min at its largest, negative and zero d: the same values."""
    raw = random_k_blocks(qtype, 8, 512, seed=5).reshape(8, 2, qtype.block_bytes)
    if qtype is QuantType.Q6_K:
        raw[0, :, 192:208] = np.array([-128, 127] * 8, dtype=np.int8).view(np.uint8)
        raw[1, :, 208:210] = np.array([0.0], np.float16).view(np.uint8)
    else:
        raw[0, :, 4:16] = 0xFF
        raw[1, :, 0:4] = np.array([-0.0, 65504.0], np.float16).view(np.uint8)
    raw = raw.reshape(8, -1)
    packed = PackedWeight.from_raw(raw, qtype, (8, 512))
    assert torch.equal(packed.dequantize(), torch.from_numpy(dequantize(raw, qtype)))


@pytest.mark.parametrize("qtype", K_TYPES)
def test_row_select_and_cat_on_packed_equal_dense(qtype):
    a, dense_a = random_k(qtype, SHAPES[0], seed=1)
    b, dense_b = random_k(qtype, (40, SHAPES[0][1]), seed=2)
    perm = torch.randperm(a.out_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.select_rows(perm).dequantize(), dense_a[perm])
    assert torch.equal(a.select_rows(slice(5, 60)).dequantize(), dense_a[5:60])
    fused = PackedWeight.cat([a, b])
    assert fused.shape == (a.out_features + 40, a.in_features)
    assert torch.equal(fused.dequantize(), torch.cat([dense_a, dense_b]))
    ids = torch.tensor([[96, 0], [5, 5]])
    assert torch.equal(a.embedding(ids), dense_a[ids])
    assert a.to("cpu") is a
    moved = a.to("meta")
    assert moved.device.type == "meta" and moved.shape == a.shape and moved.scales is None


def test_cat_refuses_mixed_k_types():
    a, _ = random_k(QuantType.Q4_K, SHAPES[0])
    b, _ = random_k(QuantType.Q5_K, SHAPES[0])
    with pytest.raises(ValueError, match="does not stack"):
        PackedWeight.cat([a, b])


def test_validation_names_the_problem():
    packed, _ = random_k(QuantType.Q4_K, SHAPES[1])
    with pytest.raises(ValueError, match="Q4_K keeps its scales in qs"):
        PackedWeight(QuantType.Q4_K, packed.qs, torch.zeros(33, 8, dtype=torch.float16), None)
    with pytest.raises(ValueError, match=r"Q6_K qs must be uint8 \[out, in / 256 \* 210\]"):
        PackedWeight(QuantType.Q6_K, packed.qs, None, None)  # 144 bytes a block, not 210
    with pytest.raises(ValueError, match="multiple of 256"):
        PackedWeight.from_raw(np.zeros((1, 144), np.uint8), QuantType.Q4_K, (1, 128))
    with pytest.raises(ValueError, match="take 144 bytes, got 176"):
        PackedWeight.from_raw(np.zeros((1, 176), np.uint8), QuantType.Q4_K, (1, 256))


@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_torch_fallback_matmul(qtype, rows, monkeypatch):
    monkeypatch.setattr(kernels, "FALLBACK_CHUNK_ROWS", 40)  # several chunks and a tail
    packed, dense = random_k(qtype, SHAPES[0], seed=rows)
    x = torch.randn(rows, packed.in_features, generator=torch.Generator().manual_seed(rows))
    assert_product(quant_matmul(x, packed, backend="torch"), x, dense)


@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_native_matmul_odd_shapes(native, qtype, rows, shape):
    packed, dense = random_k(qtype, shape, seed=rows + shape[0])
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    assert_product(quant_matmul(x, packed, backend="native"), x, dense)
    assert_product(quant_matmul(x[None], packed)[0], x, dense)  # leading dims kept


@pytest.mark.parametrize("qtype", K_TYPES)
def test_many_rows_take_the_dense_chunks_gemm_on_ggufs_values(native, qtype, monkeypatch):
    """From ``K_DENSE_ROWS`` rows (a prompt's step) the weight is dequantised a chunk of
    rows at a time into torch's GEMM: the same product within float32 sum order."""
    monkeypatch.setattr(kernels, "K_DENSE_CHUNK_ROWS", 40)  # several chunks and a tail
    packed, dense = random_k(qtype, SHAPES[0], seed=3)
    x = torch.randn(kernels.K_DENSE_ROWS + 3, packed.in_features)
    chunks = []
    real = native.kquant_rows
    monkeypatch.setattr(
        native, "kquant_rows", lambda ids, *a: chunks.append(len(ids)) or real(ids, *a)
    )
    assert_product(quant_matmul(x, packed, backend="native"), x, dense)
    assert chunks == [40] * (packed.out_features // 40) + [packed.out_features % 40] * bool(
        packed.out_features % 40
    )


@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("rows", (1, 3, 5, 8, 9, 12, 16))
def test_native_buffered_loop_at_register_row_counts(native, qtype, rows):
    """Both loops at the row counts where either may run (above 8 rows, the register
    loop's groups of 8 over each output row): the same products."""
    packed, dense = random_k(qtype, SHAPES[0], seed=rows)
    x = torch.randn(rows, packed.in_features)
    for register_rows in (0, rows):
        assert_product(native.kquant_mm(x, packed.qs, int(qtype), register_rows), x, dense)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_native_embedding_rows_are_ggufs_dequantisation(native, qtype, monkeypatch):
    packed, dense = random_k(qtype, SHAPES[0])
    ids = torch.tensor([96, 0, 5, 5, 41])
    assert torch.equal(native.kquant_rows(ids, packed.qs, int(qtype)), dense[ids])
    assert torch.equal(kernels.embedding(packed, ids.view(1, 5)), dense[ids].view(1, 5, -1))
    many = torch.arange(packed.out_features).repeat(4)  # enough rows to split between threads
    assert torch.equal(kernels.embedding(packed, many), dense[many])
    with pytest.raises(RuntimeError, match=r"kquant_rows: id 97 at 1 is outside the matrix's 97"):
        native.kquant_rows(torch.tensor([0, 97]), packed.qs, int(qtype))
    monkeypatch.setattr(kernels, "native_kernels", lambda: None)  # the torch path: the same
    assert torch.equal(kernels.embedding(packed, ids.view(1, 5)), dense[ids].view(1, 5, -1))


def test_native_refuses_what_it_cannot_read(native):
    packed, _ = random_k(QuantType.Q4_K, SHAPES[1])
    x = torch.randn(2, packed.in_features)
    with pytest.raises(RuntimeError, match="unsupported GGML type 2"):
        native.kquant_mm(x, packed.qs, 2)
    with pytest.raises(RuntimeError, match=r"contiguous uint8 \[out, in / 256 \* 210\]"):
        native.kquant_mm(x, packed.qs, int(QuantType.Q6_K))
    with pytest.raises(RuntimeError, match="x has 256 features, W takes 512"):
        native.kquant_mm(x, torch.cat([packed.qs, packed.qs], dim=1), int(QuantType.Q4_K))

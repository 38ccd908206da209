"""The fast mode's K-quant product (``quant_matmul(..., int8=True)``,
``csrc/kquant_q8.cpp``): Q4_K / Q5_K / Q6_K weights times activations quantised to int8.

The reference quantises x here, independently of the kernel, as the kernel documents it:
per row and super-block of 256, in float32, ``amax = max |x|``, ``q = rint(x * (127 /
amax))`` (round half to even) and ``d = amax / 127``; it multiplies ``d * q`` with gguf's
own dequantisation of the weights in float64. The kernel sums exact integers and scales
them once per super-block, so it must equal that reference to float32 rounding; against
the exact ``x @ W`` it is off by the int8 rounding of x (about 0.4% of a row's scale)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tessera.workers.quant import QuantType, kernels, quant_matmul
from tessera.workers.quant.blocks import K_TYPES
from tests.unit.test_kquant_kernels import random_k

ROWS = (1, 7, 16, 64)
#: [out, in]: outputs that are no multiple of 2, 4, 8 or 16; in a few super-blocks
SHAPES = ((97, 256 * 3), (33, 256), (130, 256 * 2))


def quantized_x(x: torch.Tensor) -> np.ndarray:
    """``d * q`` (float64) for each row's super-blocks of 256: the kernel's int8 rounding."""
    rows, n = x.shape
    blocks = x.numpy().astype(np.float32).reshape(rows, n // 256, 256)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse)  # float32 product, ties to even
    assert np.abs(q).max() <= 127
    d = (amax / np.float32(127)).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(rows, n)


@pytest.fixture(scope="module")
def native():
    if kernels.native_kernels() is None:
        pytest.skip("the native kernels cannot be built here")
    return kernels.native_kernels()


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_int8_product_matches_the_quantised_reference(native, qtype, shape, rows):
    packed, dense = random_k(qtype, shape, seed=rows)
    torch.manual_seed(rows)
    x = torch.randn(rows, shape[1]) * torch.rand(rows, 1) * 4
    x[0, 5] = 40.0  # an outlier: its block's other values get coarser steps
    y = quant_matmul(x, packed, int8=True)
    assert y.dtype == torch.float32 and y.shape == (rows, shape[0])
    w = dense.double().numpy()
    reference = quantized_x(x) @ w.T
    # exact integers, float32 scales and sums: a few float32 ulps of the row's scale
    scale = math.sqrt(shape[1]) * np.abs(w).max() * x.abs().max().item()
    np.testing.assert_allclose(y.numpy(), reference, rtol=1e-5, atol=2e-7 * scale)
    # and loosely the exact product: x's int8 rounding, at most half a step per element
    exact = x.double().numpy() @ w.T
    step = x.abs().max().item() / 127 / 2
    assert np.abs(y.numpy() - exact).max() <= step * np.abs(w).sum(axis=1).max()
    assert not np.allclose(y.numpy(), exact, rtol=1e-6, atol=0)  # it did round x


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_int8_product_of_zero_and_tiny_blocks(native, qtype):
    """A super-block of zeros has d = 0 (no division by zero); a tiny one keeps its
    relative precision (d scales with it)."""
    packed, dense = random_k(qtype, (33, 512))
    x = torch.zeros(3, 512)
    x[1, 256:] = torch.randn(256) * 1e-30
    x[2] = torch.randn(512)
    x[2, :256] = 0.0
    y = quant_matmul(x, packed, int8=True)
    reference = quantized_x(x) @ dense.double().numpy().T
    assert torch.equal(y[0], torch.zeros(33))
    for row in (1, 2):
        atol = 1e-6 * np.abs(reference[row]).max()
        np.testing.assert_allclose(y[row].numpy(), reference[row], rtol=1e-4, atol=atol)


def test_int8_is_only_for_k_quants_and_batches_are_row_independent(native):
    """Each row is quantised on its own: a row's result does not depend on the batch."""
    packed, _ = random_k(QuantType.Q4_K, (97, 768))
    x = torch.randn(16, 768)
    together = quant_matmul(x, packed, int8=True)
    for t in (0, 7, 15):
        assert torch.equal(quant_matmul(x[t : t + 1], packed, int8=True)[0], together[t])
    with pytest.raises(RuntimeError, match="kquant_q8_mm: unsupported GGML type 2"):
        native.kquant_q8_mm(x, packed.qs, 2)
    with pytest.raises(RuntimeError, match="x has 768 features, W takes 256"):
        native.kquant_q8_mm(x, packed.qs[:, :144].contiguous(), int(QuantType.Q4_K))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_every_row_count_gives_a_row_the_same_bits(native, qtype):
    """Full groups of 16 rows take the kernel's lanes loop, the others its rows loop (8, then
    1 or 2 at a time): both sum a super-block as exact integers and scale it in the same
    float steps, so a row's result never depends on its batch or its place in it."""
    packed, dense = random_k(qtype, (97, 256 * 5), seed=3)
    torch.manual_seed(3)
    x = torch.randn(40, 256 * 5) * torch.rand(40, 1) * 4
    together = quant_matmul(x, packed, int8=True)  # two groups of 16, then 8 rows
    for t in range(40):
        assert torch.equal(quant_matmul(x[t : t + 1], packed, int8=True)[0], together[t]), t
    for first, rows in ((3, 17), (5, 2), (9, 33)):
        part = quant_matmul(x[first : first + rows], packed, int8=True)
        assert torch.equal(part, together[first : first + rows]), (first, rows)
    reference = quantized_x(x) @ dense.double().numpy().T
    scale = math.sqrt(x.shape[1]) * np.abs(dense.numpy()).max() * x.abs().max().item()
    np.testing.assert_allclose(together.numpy(), reference, rtol=1e-5, atol=2e-7 * scale)

"""Packed GGUF weights on CUDA: dequantised there bit for bit as gguf does on the CPU,
and ``quant_matmul`` on CUDA (the fused Triton kernels, and the torch path) the product
with those rows. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tessera.workers.quant import QuantType, quant_matmul, triton_mm
from tessera.workers.quant.blocks import SPLIT_TYPES
from tests.unit.test_quant_kernels import ODD, ROWS, random_packed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("qtype", SPLIT_TYPES)
def test_dequantize_on_cuda_equals_gguf_bit_for_bit(qtype):
    packed, reference = random_packed(qtype, ODD)
    on_gpu = packed.to("cuda")
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.dequantize().cpu(), reference)
    ids = torch.tensor([[3, 0], [96, 3]], device="cuda")
    assert torch.equal(on_gpu.embedding(ids).cpu(), reference[ids.cpu()])


def test_cuda_builds_of_torch_bring_the_fused_kernel():
    assert triton_mm.available()  # else quant_matmul dequantises in torch (slower)


@pytest.mark.parametrize("backend", ["auto", "torch"])  # auto: the Triton kernels
@pytest.mark.parametrize("qtype", SPLIT_TYPES)
@pytest.mark.parametrize("rows", (*ROWS, 100))
def test_quant_matmul_on_cuda_is_the_product_with_the_dequantised_rows(backend, qtype, rows):
    packed, reference = random_packed(qtype, ODD, seed=rows)
    x = torch.randn(rows, ODD[1], generator=torch.Generator().manual_seed(rows)).cuda()
    y = quant_matmul(x, packed.to("cuda"), backend=backend)
    assert y.device.type == "cuda" and y.shape == (rows, ODD[0])
    # float32 sums in another order than cuBLAS's (auto); the same product (torch)
    torch.testing.assert_close(y, x @ reference.cuda().t(), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"^quant_matmul: x is on cpu, the weight on cuda:0$"):
        quant_matmul(x.cpu(), packed.to("cuda"))


@pytest.mark.parametrize("qtype", [QuantType.Q4_1, QuantType.Q8_0])
@pytest.mark.parametrize("rows", [1, 64])  # gemv, tl.dot
def test_a_product_of_too_many_programs_to_split_is_the_product_too(qtype, rows):
    """Past ``SPLIT_PROGRAMS`` output tiles (SmolLM2's tied head, at every step) a product
    is not split: one program sums each output's blocks, the last tile part empty."""
    shape = (16 * triton_mm.SPLIT_PROGRAMS + 27, 96)
    packed, reference = random_packed(qtype, shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).cuda()
    y = quant_matmul(x, packed.to("cuda"))
    torch.testing.assert_close(y, x @ reference.cuda().t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("qtype", SPLIT_TYPES)
def test_one_hot_rows_give_ggufs_dequantised_weights_bit_for_bit(backend, qtype):
    """A row of the identity picks one weight per output, so every sum is exact (the
    split-K partial sums too): the product is gguf's dequantisation bit for bit, which
    pins the nibble order and Q4_1's two roundings (no fused multiply-add)."""
    packed, reference = random_packed(qtype, ODD)
    weight, eye = packed.to("cuda"), torch.eye(ODD[1], device="cuda")
    for at_once in (1, 3, 32):  # the one-row kernel (up to triton_mm.GEMV_ROWS), tl.dot's
        for start in range(0, ODD[1], at_once):
            got = quant_matmul(eye[start : start + at_once], weight, backend=backend)
            assert torch.equal(got.cpu(), reference.t()[start : start + at_once])
    assert quant_matmul(eye[:0], weight, backend=backend).shape == (0, ODD[0])

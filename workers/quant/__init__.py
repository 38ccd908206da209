"""GGUF-quantised weights kept packed, and the matmul that reads them directly.

``PackedWeight.from_gguf(tensor)`` keeps a Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K matrix
as the file stores it; ``quant_matmul(x, weight)`` computes ``x @ dequant(weight).T`` in
fp32 with a C++ kernel compiled on first use (or, where it cannot be built, in plain torch).
"""

from tessera.workers.quant.blocks import BLOCK_SIZE, PackedWeight, QuantType
from tessera.workers.quant.kernels import native_available, quant_matmul

__all__ = ["BLOCK_SIZE", "PackedWeight", "QuantType", "native_available", "quant_matmul"]

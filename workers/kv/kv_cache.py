"""The worker's KV pool tensor, sized from a memory budget.

One tensor holds every layer's keys and values:
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``. It is allocated
once at start; nothing on the hot path allocates KV memory.
"""

from __future__ import annotations

import torch

from tessera.workers.hugepages import huge_zeros
from tessera.workers.model.config import ModelConfig

DEFAULT_MEMORY_FRACTION = 0.1


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * element


def available_memory(device: torch.device) -> int:
    """Bytes the device can still give: free GPU memory, or MemAvailable on the host."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def num_blocks_for_budget(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    memory_bytes: int | None,
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
) -> int:
    """How many blocks fit: ``memory_bytes`` if given, else a fraction of free memory."""
    available = available_memory(device)
    if memory_bytes is None:
        memory_bytes = int(available * memory_fraction)
    elif memory_bytes > available:
        raise ValueError(
            f"kv_cache_memory: {memory_bytes} bytes asked, only {available} available on {device}"
        )
    per_block = bytes_per_block(config, block_size, dtype)
    num_blocks = memory_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory: {memory_bytes} bytes hold no block (one block of "
            f"{block_size} tokens needs {per_block} bytes)"
        )
    return num_blocks


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    if device.type == "cpu":  # read by every decode step: on 2 MiB pages where Linux allows
        return huge_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)

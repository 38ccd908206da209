"""The sampler's noise, keyed by (seed, token_index) alone, and the exponential race that
draws a token with it.

With ``E_i ~ Exp(1)`` independent, ``argmax_i p_i / E_i`` is token ``j`` with probability
``p_j`` (the exponential race; Gumbel-max in another guise), up to float32 rounding of
``p`` and of the uniform draws behind ``E``. Because a row's generator depends on its key
only, a request samples the same tokens whatever batch it shares and whichever row it
sits in. Generators are device-specific: CPU and CUDA streams differ for one key.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tessera.workers.decoding.sampling_row import SamplingRow
from tessera.workers.quant.kernels import argmax_rows

_MASK64 = (1 << 64) - 1
# splitmix64 constants (Steele, Lea and Flood, "Fast splittable pseudorandom number
# generators", 2014): a bijective 64-bit mix whose outputs pass BigCrush.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX_MUL_1 = 0xBF58476D1CE4E5B9
_MIX_MUL_2 = 0x94D049BB133111EB


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN_GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX_MUL_1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX_MUL_2) & _MASK64
    return x ^ (x >> 31)


def random_generator(
    seed: int, token_index: int, *, device: torch.device | str = "cpu"
) -> torch.Generator:
    """A generator keyed by (seed, token_index) only, on ``device``.

    Each mixing step is a bijection, so for one seed distinct token indices get
    distinct 64-bit keys. torch's CPU generator (mt19937) keeps only the low 32 bits of
    its seed, so on CPU two keys collide with probability 2**-32 (they would share noise).
    """
    key = _splitmix64(_splitmix64(seed) ^ token_index)
    generator = torch.Generator(device=device)
    generator.manual_seed(key)
    return generator


def race(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The exponential race over ``probs`` [R, V] (consumed), one keyed stream per row:
    ``argmax p / E`` with ``E ~ Exp(1)``; returns [R] token ids."""
    noise = torch.empty_like(probs)
    for j, row in enumerate(rows):
        gen = random_generator(row.seed, row.token_index, device=probs.device)
        noise[j].uniform_(generator=gen)
    # E = -log(U) with U in [0, 1) is Exp(1) and never 0, so p / E is never 0/0
    # (a NaN argmax would pick); torch's own exponential_ is 4x slower on CPU.
    noise.log_().neg_()
    return argmax_rows(probs.div_(noise))


def keyed_uniform(seed: int, token_index: int) -> float:
    """One uniform draw in [0, 1) keyed by (seed, token_index), like the sampler's noise."""
    gen = random_generator(seed, token_index)
    return float(torch.rand((), generator=gen))

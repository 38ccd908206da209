"""Rotary position embeddings with explicit per-token positions.

The cos/sin tables are computed exactly as Hugging Face does (``position * inv_freq``
in float32, elementwise), so a table lookup gives bit-identical values to
transformers' on-the-fly computation.
"""

from __future__ import annotations

import math

import torch

from tessera.workers.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig, long: bool = False) -> torch.Tensor:
    """``inv_freq`` [rotary_dims // 2], float32, with linear, llama3, YaRN, LongRoPE
    (``long``: its long factors) or per-frequency scaling."""
    dim = config.rotary_dims
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * config.rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if scaling["rope_type"] == "yarn":
        return _yarn_inverse_frequencies(config, inv_freq)
    # llama3: leave high frequencies alone, divide low ones by `factor`, interpolate between.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_factor(config: ModelConfig) -> float:
    scaling = config.rope_scaling
    original = _yarn_original_context(config)
    return scaling.get("factor") or config.max_position_embeddings / original


def _yarn_original_context(config: ModelConfig) -> int:
    scaling = config.rope_scaling
    return scaling.get("original_max_position_embeddings") or config.max_position_embeddings


def _yarn_inverse_frequencies(config: ModelConfig, extrapolated: torch.Tensor) -> torch.Tensor:
    """YaRN (arXiv 2309.00071), as transformers computes it: frequencies that turn fewer
    than ``beta_slow`` times over the original context are interpolated (divided by
    ``factor``), those that turn more than ``beta_fast`` times are kept, with a linear
    ramp over the dimensions between."""
    scaling = config.rope_scaling
    dim, base = config.rotary_dims, config.rope_theta
    interpolated = extrapolated / _yarn_factor(config)
    context = _yarn_original_context(config)

    def dimension(rotations: float) -> float:  # the dimension that turns this many times
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = dimension(scaling.get("beta_fast") or 32)
    high = dimension(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each dimension that extrapolates
    return interpolated * (1 - kept) + extrapolated * kept


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's and LongRoPE's ``attention_factor``
    (where not given: from ``mscale`` for YaRN, from the context's growth for LongRoPE),
    else 1."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling["rope_type"] == "longrope":
        original = _yarn_original_context(config)
        factor = scaling.get("factor") or config.max_position_embeddings / original
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factor = _yarn_factor(config)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


class RotaryEmbedding:
    """Precomputed cos/sin for every position up to the model's context length.

    LongRoPE: positions inside the original context take the short factors, those past
    it the long ones (a position's K/V never depends on how long its sequence grows, so
    prefix caching and recomputation stay exact). transformers instead switches a whole
    forward to the long factors once its longest position passes the original context:
    the two agree on every position before it while no sequence passes it, and on every
    position past it."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float)
        freqs = positions[:, None] * inverse_frequencies(config)[None, :]  # [max_pos, dim // 2]
        scaling = config.rope_scaling
        if scaling is not None and scaling["rope_type"] == "longrope":
            original = _yarn_original_context(config)
            long = positions[original:, None] * inverse_frequencies(config, long=True)[None, :]
            freqs[original:] = long
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, rotary_dims]
        cos, sin = emb.cos(), emb.sin()
        if (scale := attention_factor(config)) != 1.0:
            cos, sin = cos * scale, sin * scale
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin = sin.to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] for the batch's positions [T]; once per step, not per layer."""
        return (
            self.cos.index_select(0, positions).unsqueeze(1),
            self.sin.index_select(0, positions).unsqueeze(1),
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by its token's angle (Hugging Face's rotate-half layout);
    with tables narrower than D (partial rotary), the first dimensions only."""
    dim = cos.shape[-1]
    if dim != x.shape[-1]:
        rotated = x[..., :dim]
        return torch.cat((rotated * cos + _rotate_half(rotated) * sin, x[..., dim:]), dim=-1)
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

"""Rotary position embeddings with explicit per-token positions.

The cos/sin tables are computed exactly as Hugging Face does (``position * inv_freq``
in float32, elementwise), so a table lookup gives bit-identical values to
transformers' on-the-fly computation.

Two scalings depend on the length of the sequence as well as the position: LongRoPE
(short factors up to the original context, long ones past it) and dynamic NTK (the base
stretched for a sequence past the original context). transformers picks them from the
length its forward sees, ``max(position) + 1``: a prompt's whole length at its prefill,
``position + 1`` at each decode step. A token's **context** here is that length,
``max(prompt length, position + 1)``, whatever the chunking (a prompt computed in
chunks, recomputed after preemption or on another worker takes its prompt's length): the
numbers transformers' ``generate`` gives. K/V of a prompt longer than the original
context then depend on its length, which ``context_key`` adds to its blocks' hashes.
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
    if scaling is None or scaling["rope_type"] == "dynamic":  # (dynamic: its unstretched base)
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
    """Precomputed cos/sin for every position up to the model's context length; for
    LongRoPE a second table (its long factors), for dynamic NTK the stretched angles
    computed per token (see the module docstring)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        scaling = config.rope_scaling or {}
        self.kind = scaling.get("rope_type", "default")
        self.original = scaling.get("original_max_position_embeddings") or 0
        self.dtype, self.device = dtype, device
        self.scale = attention_factor(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float)
        self.cos, self.sin = self._table(positions, inverse_frequencies(config))
        if self.kind == "longrope":
            long = inverse_frequencies(config, long=True)
            self.long_cos, self.long_sin = self._table(positions, long)
        if self.kind == "dynamic":
            self.base, self.factor = config.rope_theta, float(scaling["factor"])
            dim = config.rotary_dims
            self.exponents = (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim).to(
                device
            )
            self.stretch = dim / (dim - 2)

    def _table(
        self, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None] * inv_freq[None, :]  # [positions, dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [positions, rotary_dims]
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(device=self.device, dtype=self.dtype), sin.to(
            device=self.device, dtype=self.dtype
        )

    @property
    def context_dependent(self) -> bool:
        """Whether a token's angles depend on its context, not its position alone."""
        return self.kind in ("longrope", "dynamic")

    def context_key(self, prompt_len: int) -> str:
        """What a prompt of ``prompt_len`` tokens adds to its blocks' hash keys: its
        length where that changes its K/V (past the original context), else nothing."""
        if self.context_dependent and prompt_len > self.original:
            return f"rope-context:{prompt_len}"
        return ""

    def lookup(
        self, positions: torch.Tensor, contexts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] for the batch's positions [T] (and each token's context
        [T], ``max(prompt length, position + 1)``; None: ``position + 1``, as every token
        of a decode step has); once per step, not per layer."""
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        if self.context_dependent:
            if contexts is None:
                contexts = positions + 1
            past = (contexts > self.original)[:, None]  # past the original context
            if self.kind == "longrope":
                cos = torch.where(past, self.long_cos.index_select(0, positions), cos)
                sin = torch.where(past, self.long_sin.index_select(0, positions), sin)
            else:
                stretched_cos, stretched_sin = self._stretched(positions, contexts)
                cos, sin = (
                    torch.where(past, stretched_cos, cos),
                    torch.where(past, stretched_sin, sin),
                )
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _stretched(
        self, positions: torch.Tensor, contexts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic NTK's angles for each token's context, as transformers computes its
        base for a forward of that length (float32, the same operations in order)."""
        seq_len = contexts[:, None]  # [T, 1] int64
        base = self.base * ((self.factor * seq_len / self.original) - (self.factor - 1)) ** (
            self.stretch
        )
        inv_freq = 1.0 / (base**self.exponents)  # [T, dim // 2]
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)


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

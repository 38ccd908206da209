"""The architecture of a Llama-family decoder, independent of where it was loaded from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Architectures the decoder implements; they differ only in the flags below.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")
#: ``freq_factors``: each rotary frequency divided by its own factor, as a GGUF file's
#: ``rope_freqs`` tensor gives them (llama.cpp's converter writes Llama 3's scaling so)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": one of ROPE_TYPES, ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias)
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture: {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in ROPE_TYPES:
                raise ValueError(
                    f"rope_scaling: type {rope_type!r} is not supported ({ROPE_TYPES})"
                )
            factors = self.rope_scaling.get("factors")
            if rope_type == "freq_factors" and len(factors) != self.head_dim // 2:
                raise ValueError(
                    f"rope_scaling: {len(factors)} frequency factors for heads of "
                    f"{self.head_dim} (needs {self.head_dim // 2})"
                )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        model_type = hf.get("model_type", "llama")
        num_heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}
        rope_theta = hf.get("rope_theta") or rope.get("rope_theta") or 10000.0
        scaling = hf.get("rope_scaling") or (
            rope if rope.get("rope_type") not in (None, "default") else None
        )
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type"))
            if scaling["rope_type"] == "default":
                scaling = None
        max_pos = hf.get("max_position_embeddings", 2048)
        if model_type == "mistral" and hf.get("sliding_window"):
            # Sliding-window attention is not implemented: stay within the window, where
            # full attention is the same computation.
            max_pos = min(max_pos, hf["sliding_window"])
        partial = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(
                f"partial_rotary_factor: {partial} is not supported (RoPE over whole heads)"
            )
        if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            raise ValueError(
                "use_sliding_window: sliding-window attention is not supported "
                f"({model_type} with use_sliding_window true)"
            )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

"""The architecture of a decoder, independent of where it was loaded from.

One decoder (``llama.py``) serves every family; the families differ only in the
fields below, each a switch or a number that ``from_hf`` (and the GGUF reader) read
from the checkpoint's configuration:

=============  ================================================================
family         what differs from Llama
=============  ================================================================
mistral        a sliding window over every layer
qwen2          q/k/v biases; sliding windows on the layers ``layer_types`` names
qwen3          RMSNorm over each q and k head before RoPE (``qk_norm``)
gemma2         RMSNorm scaled by 1 + w (folded into the weights at load), the
               embedding scaled by sqrt(hidden), GELU(tanh) gates, norms after
               attention and around the MLP (``sandwich_norms``), attention and
               final logit soft-capping, ``query_pre_attn_scalar``, alternating
               sliding-window and global layers
gemma3_text    Gemma 2 without soft-capping, with q/k norms; local layers with
               their own RoPE base (``local_rope_theta``), global ones scaled
phi3           fused q/k/v and gate/up in the checkpoint, ``longrope`` scaling,
               partial rotary (``rotary_dim``), a sliding window
mixtral        a sparse mixture of experts (``moe``) in place of every MLP:
               softmax router, top-k renormalised, SwiGLU experts
qwen2_moe      Qwen2's q/k/v biases; experts on the layers ``decoder_sparse_step``
               and ``mlp_only_layers`` leave sparse (the others dense), top-k
               renormalised if ``norm_topk_prob``, a shared expert gated by
               sigmoid(``shared_expert_gate``)
qwen3_moe      Qwen3's q/k norms; experts as qwen2_moe's, no shared expert
=============  ================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: Architectures the decoder implements; they differ only in the flags below.
SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
)
#: The families whose fast mode (``dtype="auto"`` on a CPU with the AVX512_BF16 kernels)
#: met its quality contract against the exact mode (``benchmarks/fast_mode_families.py``,
#: ``tests/engine/test_fast_mode_families.py``); ``auto`` is exact for the others.
FAST_MODE_FAMILIES = tuple(a for a in SUPPORTED_ARCHITECTURES if a != "gemma3_text")
#: (Gemma 3's fast mode missed it: mean KL 2.4e-4 nats over the 2e-4 bar, every other
#: family's at most 1.1e-4.)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic", "freq_factors")
#: ``freq_factors``: each rotary frequency divided by its own factor, as a GGUF file's
#: ``rope_freqs`` tensor gives them (llama.cpp's converter writes Llama 3's scaling so)
#: Gate activations of the MLP (``act(gate) * up``), by their transformers names.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
#: Layer kinds of ``layer_types`` (transformers' names).
LAYER_TYPES = ("full_attention", "sliding_attention")
#: Families whose ``partial_rotary_factor`` rotates only the first part of each head.
_PARTIAL_ROTARY = ("phi3",)
#: Families whose RMSNorm multiplies by 1 + w: Hugging Face checkpoints store w (GGUF
#: files store 1 + w, llama.cpp's converter adds the 1).
NORM_PLUS_ONE = ("gemma2", "gemma3_text")
#: Families whose MLPs are (on some layers) a sparse mixture of experts.
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
#: Router settings of other MoE families' configs, each with the one value the router
#: implements (softmax scores, plain top-k, weights unscaled); another is refused, not
#: ignored.
ROUTER_SETTINGS = {
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
}


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP (``moe.py``): a router picks each token's
    ``top_k`` of ``num_experts`` SwiGLU experts by softmax probability; their outputs,
    weighted by those probabilities (renormalised to sum to 1 if ``norm_topk_prob``),
    are summed, plus a shared expert's gated by ``sigmoid(shared_expert_gate(x))``
    where ``shared_expert_intermediate_size`` is not 0. The layers ``sparse_layers``
    names have it; the others a dense MLP of ``ModelConfig.intermediate_size`` (a model
    of a checkpoint's first layers, a self-speculative draft, keeps the whole tuple)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    sparse_layers: tuple[int, ...]
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # 0: no shared expert

    def __post_init__(self) -> None:
        for name, hf_name in (
            ("num_experts", "num_experts"),
            ("expert_intermediate_size", "moe_intermediate_size"),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{hf_name}: must be a positive integer, got {value!r}")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: must be between 1 and num_experts "
                f"({self.num_experts}), got {self.top_k!r}"
            )
        shared = self.shared_expert_intermediate_size
        if not isinstance(shared, int) or shared < 0:
            raise ValueError(
                f"shared_expert_intermediate_size: must be 0 (none) or a positive "
                f"integer, got {shared!r}"
            )
        layers = self.sparse_layers
        if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0:
            raise ValueError(
                f"sparse layers: must be distinct layer indices in ascending order, "
                f"got {self.sparse_layers!r}"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts."""
        return layer in self.sparse_layers


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
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    #: The gate's activation (one of ACTIVATIONS).
    hidden_activation: str = "silu"
    #: Gemma: the attention output and the MLP's input and output each RMS-normed
    #: (four norms a layer instead of two).
    sandwich_norms: bool = False
    #: Gemma: the token embedding multiplied by this (sqrt(hidden)); None: not scaled.
    embedding_scale: float | None = None
    #: Gemma 2: attention scores become ``cap * tanh(score / cap)``; None: no cap.
    attn_softcap: float | None = None
    #: Gemma 2: logits become ``cap * tanh(logit / cap)``; None: no cap.
    final_softcap: float | None = None
    #: Attention scores are ``q . k * attention_scale``; None: ``head_dim ** -0.5``.
    attention_scale: float | None = None
    #: Each layer's sliding window (it attends to the last ``window`` positions, its own
    #: included), 0 for a global layer; empty: every layer global.
    layer_windows: tuple[int, ...] = ()
    #: Gemma 3: the RoPE base of the sliding-window layers (unscaled); None: every layer
    #: takes ``rope_theta`` and ``rope_scaling``.
    local_rope_theta: float | None = None
    #: The leading dimensions of each head that RoPE rotates; None: all of them.
    rotary_dim: int | None = None
    #: The mixture of experts on its sparse layers; None: every MLP dense.
    moe: MoEConfig | None = None

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
        if self.hidden_activation not in ACTIVATIONS:
            raise ValueError(
                f"hidden_activation: {self.hidden_activation!r} is not supported "
                f"({', '.join(ACTIVATIONS)})"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_types: {len(self.layer_windows)} entries for {self.num_layers} layers"
            )
        if any(w < 0 for w in self.layer_windows):
            raise ValueError(f"sliding_window: must be positive, got {min(self.layer_windows)}")
        for name in ("attn_softcap", "final_softcap", "attention_scale"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a positive number, got {value!r}")
        if self.rotary_dim is not None and (
            self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim
        ):
            raise ValueError(
                f"partial_rotary_factor: rotates {self.rotary_dim} of {self.head_dim} "
                "dimensions (needs an even number, at most the head's)"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in ROPE_TYPES:
                raise ValueError(
                    f"rope_scaling: type {rope_type!r} is not supported ({ROPE_TYPES})"
                )
            half = self.rotary_dims // 2
            factors = self.rope_scaling.get("factors")
            if rope_type == "freq_factors" and len(factors) != half:
                raise ValueError(
                    f"rope_scaling: {len(factors)} frequency factors for heads of "
                    f"{self.rotary_dims} rotary dimensions (needs {half})"
                )
            for name in ("short_factor", "long_factor") if rope_type == "longrope" else ():
                given = self.rope_scaling.get(name)
                if given is None or len(given) != half:
                    raise ValueError(
                        f"rope_scaling.{name}: needs {half} factors, got "
                        f"{None if given is None else len(given)}"
                    )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dims(self) -> int:
        """The dimensions of each head that RoPE rotates."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def scale(self) -> float:
        """What attention multiplies ``q . k`` by."""
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window, 0 if it attends to the whole context."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def max_window(self) -> int:
        """The widest window, 0 where some layer is global (it needs the whole context)."""
        if not self.layer_windows or 0 in self.layer_windows:
            return 0
        return max(self.layer_windows)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:  # before any family's fields are read
            raise ValueError(
                f"architecture: {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope = hf.get("rope_parameters") or {}
        local_rope_theta = None
        if model_type == "gemma3_text":
            # one RoPE per layer kind: local layers their own base, global ones scaled
            local = rope.get("sliding_attention") or {}
            local_rope_theta = float(
                local.get("rope_theta") or hf.get("rope_local_base_freq") or 10000.0
            )
            if local.get("rope_type", "default") != "default":
                raise ValueError(
                    f"rope_parameters.sliding_attention: type {local['rope_type']!r} is not "
                    "supported for the local layers (default)"
                )
            rope = rope.get("full_attention") or {
                "rope_theta": hf.get("rope_theta", 1_000_000.0),
                **(hf.get("rope_scaling") or {}),
            }
            hf = {**hf, "rope_scaling": None}
        rope_theta = hf.get("rope_theta") or rope.get("rope_theta") or 10000.0
        scaling = hf.get("rope_scaling") or (
            rope if rope.get("rope_type", rope.get("type")) not in (None, "default") else None
        )
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type"))
            if scaling["rope_type"] == "su":  # Phi-3's first name for longrope
                scaling["rope_type"] = "longrope"
            if scaling["rope_type"] == "default":
                scaling = None
        original = hf.get("original_max_position_embeddings")
        if scaling is not None and scaling["rope_type"] == "longrope" and original:
            scaling["original_max_position_embeddings"] = original  # Phi-3's takes precedence
        if scaling is not None and scaling["rope_type"] == "yarn":
            scaling.setdefault("original_max_position_embeddings", original)
        max_positions = hf.get("max_position_embeddings", 2048)
        if scaling is not None and scaling["rope_type"] == "dynamic":
            # dynamic NTK scaling stretches the base past the configured context (its
            # original length here), up to ``factor`` times it
            factor = scaling.get("factor")
            if not isinstance(factor, (int, float)) or factor < 1:
                raise ValueError(f"rope_scaling.factor: must be a number >= 1, got {factor!r}")
            scaling["original_max_position_embeddings"] = max_positions
            max_positions = int(max_positions * factor)
        partial = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        rotary_dim = None
        if partial != 1.0:
            if model_type not in _PARTIAL_ROTARY:
                raise ValueError(
                    f"partial_rotary_factor: {partial} is not supported for {model_type} "
                    "(RoPE over whole heads)"
                )
            rotary_dim = int(head_dim * partial)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attention_bias = bool(hf.get("attention_bias", False))
        # Qwen2's biases on q, k and v only (Qwen2-MoE's config names them ``qkv_bias``)
        qkv_only_bias = model_type == "qwen2" or (
            model_type == "qwen2_moe" and hf.get("qkv_bias", True)
        )
        gemma = model_type in ("gemma2", "gemma3_text")
        softcap = hf.get("attn_logit_softcapping") if gemma else None
        final_softcap = hf.get("final_logit_softcapping") if gemma else None
        scalar = hf.get("query_pre_attn_scalar") if gemma else None
        activation = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        if gemma and hf.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention: only causal attention is supported")
        return cls(
            architecture=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            qkv_bias=qkv_only_bias or attention_bias,
            o_bias=attention_bias and model_type not in ("qwen2", "qwen2_moe"),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_activation=activation,
            sandwich_norms=gemma,
            embedding_scale=hf["hidden_size"] ** 0.5 if gemma else None,
            attn_softcap=float(softcap) if softcap else None,
            final_softcap=float(final_softcap) if final_softcap else None,
            attention_scale=float(scalar) ** -0.5 if scalar else None,
            layer_windows=_layer_windows(model_type, hf),
            local_rope_theta=local_rope_theta,
            rotary_dim=rotary_dim,
            moe=_moe(model_type, hf),
        )


def _layer_windows(model_type: str, hf: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's window from ``layer_types`` and ``sliding_window`` (each family's
    default pattern where the config predates ``layer_types``); empty where every layer
    is global."""
    window = hf.get("sliding_window")
    num_layers = hf["num_hidden_layers"]
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not hf.get(
        "use_sliding_window"
    ):
        return ()
    if not window:
        return ()
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window: must be a positive integer, got {window!r}")
    types = hf.get("layer_types")
    if types is None:
        if model_type == "gemma2":  # even layers local, odd ones global
            types = [LAYER_TYPES[(i + 1) % 2] for i in range(num_layers)]
        elif model_type == "gemma3_text":  # five local layers, then a global one
            pattern = hf.get("sliding_window_pattern") or 6
            types = [LAYER_TYPES[bool((i + 1) % pattern)] for i in range(num_layers)]
        elif model_type in ("qwen2", "qwen3"):
            first = hf.get("max_window_layers", num_layers)
            types = [LAYER_TYPES[i >= first] for i in range(num_layers)]
        elif model_type == "qwen2_moe":  # even layers below max_window_layers
            below = hf.get("max_window_layers", num_layers)
            types = [LAYER_TYPES[i % 2 == 0 and i < below] for i in range(num_layers)]
        else:  # mistral, phi3, mixtral, qwen3_moe: every layer
            types = [LAYER_TYPES[1]] * num_layers
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types: {unknown[0]!r} is not supported ({', '.join(LAYER_TYPES)})")
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in types)
    return windows if any(windows) else ()


def _moe(model_type: str, hf: dict[str, Any]) -> MoEConfig | None:
    """The mixture of experts of an MoE family's config (None for the others, and for a
    Qwen2-MoE whose layers are all dense)."""
    if model_type not in MOE_ARCHITECTURES:
        return None
    for name, implemented in ROUTER_SETTINGS.items():
        value = hf.get(name)
        if value is not None and value != implemented:
            raise ValueError(
                f"{name}: {value!r} is not supported (the router implements {implemented!r})"
            )
    num_layers = hf["num_hidden_layers"]
    # (transformers 5 saves Qwen3-MoE's count as num_local_experts, the Hub's as num_experts)
    num_experts = hf.get("num_local_experts", hf.get("num_experts"))
    if model_type == "mixtral":  # every layer sparse, experts as wide as intermediate_size
        return MoEConfig(
            num_experts=num_experts,
            top_k=hf.get("num_experts_per_tok"),
            expert_intermediate_size=hf["intermediate_size"],
            sparse_layers=tuple(range(num_layers)),
        )
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step: must be a positive integer, got {step!r}")
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    if num_experts == 0 or not sparse:
        return None
    shared = hf.get("shared_expert_intermediate_size") if model_type == "qwen2_moe" else 0
    return MoEConfig(
        num_experts=num_experts,
        top_k=hf.get("num_experts_per_tok"),
        expert_intermediate_size=hf.get("moe_intermediate_size"),
        sparse_layers=sparse,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared or 0,
    )

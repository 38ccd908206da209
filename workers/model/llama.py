"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache.

The forward pass takes a flattened batch: every new token of every sequence in one
``[num_tokens]`` row, its explicit position, and the attention metadata that says
which cache slots it writes and which blocks each sequence reads. Numerics follow
Hugging Face's implementation op for op (RMSNorm in float32, the same RoPE tables),
so float32 outputs match transformers to rounding.

Checkpoint tensors reach the layers through ``hf_weights``; ``native_stack`` hands the
same layers to the native decode stack.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.workers.attention.metadata import AttentionMetadata
from tessera.workers.attention.paged import paged_attention, write_kv
from tessera.workers.config import FAST, INT8
from tessera.workers.model.config import ModelConfig
from tessera.workers.model.hf_weights import Weight, copy_checked, dequantized, load_hf_state_dict
from tessera.workers.model.lora import LoraBatch
from tessera.workers.model.moe import SparseMoE
from tessera.workers.model.native_stack import build_native_layers
from tessera.workers.model.rope import RotaryEmbedding, apply_rotary
from tessera.workers.model.tensor_parallel import Shard
from tessera.workers.quant import PackedWeight, quant_matmul
from tessera.workers.quant.int4 import (
    ALL_ROWS,
    Int4Weight,
    Q4Weight,
    Q8Weight,
    bf16_q4_weight,
    exact_row_limit,
    int4_row_limit,
)
from tessera.workers.quant.kernels import argmax_rows, embedding, kquant_int8_available


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In float32, then in the weight's dtype (the model's): a float32 residual
        stream (see ``LlamaModel.forward``) enters the next matmul in the model's dtype."""
        dtype = self.weight.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Linear(nn.Module):
    """``x @ weight + bias``, the weight either dense or packed.

    Dense, ``weight`` is stored pre-transposed, ``[in, out]``: MKL's sgemm runs the
    skinny batches of decoding (1-64 rows) up to 4x faster in this layout than
    ``F.linear`` with Hugging Face's ``[out, in]`` (2 cores: 16 x 576 -> 3072 took
    0.56 ms vs 2.3 ms).

    Packed (``load_weight`` given ``PackedWeight`` parts: GGUF Q4_0/Q4_1/Q8_0 rows, or
    Q4_K/Q5_K/Q6_K super-blocks, as the file stores them):

    - a float32 model (the exact mode) keeps them packed, ``weight`` is empty, and
      ``quant_matmul`` dequantises inside the kernel, in float32: a step reads ~96 MB of
      SmolLM2's weights instead of 538 MB. On a CPU with AVX-512 or AVX2 its Q4 matrices are
      an exact ``Q4Weight`` instead: the same numbers and arithmetic in a layout with
      one output per vector lane (``csrc/tiled_f32.cpp``: 1.3-2x ``gguf_mm`` at 1-16 rows on
      AVX-512; 3-7x at 1-64 rows on AVX2, where ``gguf_mm`` has only its portable loop),
      for batches of at most ``int4_rows`` rows; a larger one (a long prompt step) takes
      the same weights dequantised for that product into a float32 GEMM (MKL's or
      oneDNN's, ``onednn_gemm``) where it measured faster (``exact_row_limit``: on the
      AVX2 EPYC from 128 rows, a 2,048-row step ~15% faster), so no dense copy is kept;
    - K-quants, in a float32 model, stay packed for ``quant_matmul``'s exact kernel
      (``csrc/kquant_mm.cpp``), or in the int8 mode (``rounding == INT8``, where the CPU
      has AVX512-VNNI: ``int8``) its kernel of int8-quantised inputs (``csrc/kquant_q8.cpp``);
      a bfloat16 model expands them to a dense bf16 ``weight`` at load. Fused parts of
      different types (a Q4_K_M file's Q4_K q and k with a Q6_K v) stay apart in
      ``packed_parts``, multiplied one by one;
    - a float32 model in the fast mode (``rounding == FAST``) keeps Q4 weights as the
      native ``Q4Weight`` where the CPU has AVX512_BF16: its inputs rounded to bf16, the
      file's weights, float32 sums and outputs (every batch size); Q8_0 stays as above;
    - a bfloat16 model (the bfloat16 mode) keeps Q4 weights at 4 bits: where the CPU has
      AVX512_BF16, only as the native ``Q4Weight`` (the file's numbers, every batch
      size; ~15% slower than a dense bf16 GEMM for long prompts, twice torch's int4 at
      16-64 rows); else as torch's ``Int4Weight`` for batches of at most ``int4_rows``
      rows and a dense bf16 ``weight`` for larger ones, where a GEMM wins
      (``int4_row_limit`` measures where, once per process; where it never wins, as on
      a CPU without native bf16, no dense copy is kept).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None
        # row groups of different GGUF types, multiplied one by one (a K-quant mix's fused
        # q/k/v: Q4_K q and k, Q6_K v): float32 only, else they are expanded
        self.packed_parts: tuple[PackedWeight, ...] = ()
        self.int4: Q4Weight | Int4Weight | None = None
        self.int4_rows = 0
        # its K-quant weights multiply inputs quantised to int8 (the fast mode)
        self.int8 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.packed is not None:
            y = quant_matmul(x, self.packed, int8=self.int8)
            return y if self.bias is None else y.add_(self.bias)
        if self.packed_parts:
            parts = [quant_matmul(x, part, int8=self.int8) for part in self.packed_parts]
            y = torch.cat(parts, dim=-1)
            return y if self.bias is None else y.add_(self.bias)
        if self.int4 is not None and x.shape[0] <= self.int4_rows:
            y = self.int4.matmul(x)
            return y if self.bias is None else y.add_(self.bias)
        if isinstance(self.int4, Q4Weight) and self.int4.exact:  # no dense copy is kept
            return self.int4.dense_matmul(x, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)

    def load_weight(self, parts: list[Weight], name: str, rounding: str | None = None) -> None:
        """Set the weight from Hugging Face-layout ``[out, in]`` parts stacked by rows
        (q/k/v, gate/up). All packed: kept packed as the class docstring says
        (``rounding``: a float32 model's fast or int8 mode, ``FAST`` or ``INT8``); otherwise
        dense."""
        packed_parts = all(isinstance(part, PackedWeight) for part in parts)
        if packed_parts and len({part.qtype for part in parts}) > 1:
            shape = (sum(part.out_features for part in parts), parts[0].in_features)
            if self.weight.dtype == torch.float32 and shape == (
                self.out_features,
                self.in_features,
            ):
                runs = itertools.groupby(parts, key=lambda part: part.qtype)  # q and k fused
                self.packed_parts = tuple(PackedWeight.cat(list(run)) for _, run in runs)
                self.int8 = rounding == INT8 and all(p.qtype.is_k for p in self.packed_parts)
                self.int8 = self.int8 and kquant_int8_available()
                self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
                return
            packed_parts = False  # expanded below (a bfloat16 model; a wrong shape says so)
        if packed_parts:
            packed = PackedWeight.cat(parts) if len(parts) > 1 else parts[0]
            if packed.shape != (self.out_features, self.in_features):
                raise ValueError(
                    f"tensor {name!r}: shape {packed.shape}, expected "
                    f"{(self.out_features, self.in_features)}"
                )
            fast = rounding == FAST
            if self.weight.dtype == torch.float32 and fast and Q4Weight.supports(packed):
                self.int4, self.int4_rows = Q4Weight.from_packed(packed), ALL_ROWS
                self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
                return
            if self.weight.dtype == torch.float32 and Q4Weight.supports(packed, exact=True):
                self.int4 = Q4Weight.from_packed(packed, exact=True)
                self.int4_rows = exact_row_limit(self.out_features, self.in_features)
                self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
                return
            if self.weight.dtype == torch.float32:
                self.packed = packed
                self.int8 = rounding == INT8 and packed.qtype.is_k and kquant_int8_available()
                self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
                return
            if self.weight.dtype == torch.bfloat16:
                self.int4 = bf16_q4_weight(packed)
                if isinstance(self.int4, Q4Weight):
                    # every row count, no dense copy: a row's numbers never depend on
                    # how many rows share its step (seeded sampling stays batch-invariant)
                    self.int4_rows = ALL_ROWS
                    self.weight = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), False)
                    return
                if self.int4 is not None:
                    self.int4_rows = int4_row_limit(self.out_features, self.in_features)
                    if self.int4_rows == ALL_ROWS:  # no dense copy: it would never run
                        self.weight = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), False)
                        return
            parts = [packed]
        dense = torch.cat([dequantized(part) for part in parts]).t()
        copy_checked(self.weight, dense, name)

    @property
    def rounded_inputs(self) -> str | None:
        """How it rounds its inputs: ``"bf16"`` (a ``Q4Weight`` that is not exact: the
        fast and bfloat16 modes), ``"int8"`` (K-quants in the fast mode), or None."""
        if isinstance(self.int4, Q4Weight) and not self.int4.exact:
            return "bf16"
        return "int8" if self.int8 else None

    def dense_weight(self) -> torch.Tensor:
        """The weight as a dense ``[in, out]`` tensor (dequantised if packed)."""
        if isinstance(self.int4, Q4Weight):
            return self.int4.dequantize().t()
        if self.packed_parts:
            return torch.cat([part.dequantize() for part in self.packed_parts]).t()
        return self.weight if self.packed is None else self.packed.dequantize().t()


class DecoderLayer(nn.Module):
    """Attention then a gated MLP, each behind a pre-norm and a residual (and, with
    ``sandwich_norms``, each output normed before its residual: Gemma's four norms).
    On a sparse layer of an MoE family the MLP is ``moe`` (``moe.py``), and
    ``gate_up_proj`` and ``down_proj`` are None.

    q/k/v are one fused projection and gate/up another: two matmuls instead of five.
    Norms are named as in the family's checkpoints: Llama's ``post_attention_layernorm``
    is the MLP's input norm, Gemma's (whose MLP's is ``pre_feedforward_layernorm``)
    norms the attention's output.
    """

    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.scale
        self.window = config.window(index)  # 0: global
        self.softcap = config.attn_softcap
        self.gelu = config.hidden_activation == "gelu_pytorch_tanh"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:  # Qwen3, Gemma 3: each q and k head RMS-normalised before RoPE
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sandwich_norms = config.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sparse = config.moe is not None and config.moe.is_sparse(index)
        self.moe = SparseMoE(config, Linear) if sparse else None
        self.gate_up_proj = self.down_proj = None
        if not sparse:
            self.gate_up_proj = Linear(
                config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
            )
            self.down_proj = Linear(
                config.intermediate_size, config.hidden_size, bias=config.mlp_bias
            )
        self.intermediate_size = config.intermediate_size
        # one rank of a tensor-parallel group (``tensor_parallel.py``): o_proj's and the
        # MLP's partial outputs are summed over the ranks
        self.tp: Shard | None = None

    def norms(self) -> tuple[str, ...]:
        """The names of its hidden-size norms, as in the family's checkpoints."""
        names = ("input_layernorm", "post_attention_layernorm")
        if self.sandwich_norms:
            names += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        return names

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, rotary_dims]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,  # [S]: the rows that go on past the attention
        lora: LoraBatch | None = None,  # each row's adapter (``lora.py``)
    ) -> torch.Tensor:
        """``[T, hidden]``; with ``rows`` (the last layer: the rows whose logits are
        wanted), every row's K/V is written and only ``rows`` go on: ``[S, hidden]``."""
        num_tokens = hidden.shape[0]
        x = self.input_layernorm(hidden)
        qkv = self.qkv_proj(x)
        if lora is not None:
            qkv = lora.add(self.qkv_proj, x, qkv)
        # q and k heads side by side, rotated together: [T, H + H_kv, D]
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if self.qk_norm:
            heads = self.num_heads
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        attn = paged_attention(
            q, k_cache, v_cache, meta, self.scale, window=self.window, softcap=self.softcap
        ).reshape(num_tokens, -1)
        if rows is not None:
            hidden, attn = hidden.index_select(0, rows), attn.index_select(0, rows)
            lora = None if lora is None else lora.select(rows)
        attn_out = self.o_proj(attn)
        if lora is not None:
            attn_out = lora.add(self.o_proj, attn, attn_out)
        if self.tp is not None:
            self.tp.all_reduce(attn_out)
        if self.sandwich_norms:
            hidden = hidden + self.post_attention_layernorm(attn_out)
            x = self.pre_feedforward_layernorm(hidden)
        else:
            hidden = hidden + attn_out
            x = self.post_attention_layernorm(hidden)
        if self.moe is not None:
            out = self.moe(x)
        else:
            gate_up = self.gate_up_proj(x)
            if lora is not None:
                gate_up = lora.add(self.gate_up_proj, x, gate_up)
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            act = gate * up
            out = self.down_proj(act)
            if lora is not None:
                out = lora.add(self.down_proj, act, out)
        if self.tp is not None:
            self.tp.all_reduce(out)
        if self.sandwich_norms:
            out = self.post_feedforward_layernorm(out)
        return hidden + out


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        # (uninitialised, as every weight here: loading fills it, or drops it for a packed
        # table; nn.Embedding's own random init wrote 400 MB of a 1B model's peak memory)
        table = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.requires_grad_(False)
        self.to(device=device, dtype=dtype)
        self.rope = RotaryEmbedding(config, dtype, device)
        # Gemma 3: the sliding-window layers' own RoPE (their base, unscaled)
        self.local_rope = None
        if config.local_rope_theta is not None:
            local = dataclasses.replace(
                config, rope_theta=config.local_rope_theta, rope_scaling=None
            )
            self.local_rope = RotaryEmbedding(local, dtype, device)
        # The embedding table kept packed (then embed_tokens.weight is empty); tied, it is
        # also the LM head, multiplied through a Q8_0 kernel of the tiled layout where the
        # CPU has it (``head_q8``, a second copy of the table): the fast and bfloat16
        # modes' bf16 kernel, the exact mode's float32 one.
        self.packed_embedding: PackedWeight | None = None
        self.head_q8: Q8Weight | None = None
        # a tied K-quant head in the fast mode: multiplied with int8-quantised inputs
        self.head_int8 = False
        self._native_layers: Any = _UNBUILT
        # one rank of a tensor-parallel group: its config is the shard's
        # (``tensor_parallel.shard_config``), its weights the shard's
        self.tp: Shard | None = None

    def set_shard(self, shard: Shard) -> None:
        """Make this model (built from ``shard_config``) one rank of a group: every
        layer's partial outputs and the embedding are summed over the ranks, the head's
        logits gathered. The native stack is not used."""
        self.tp = shard
        for layer in self.layers:
            layer.tp = shard
        self._native_layers = None

    def first_layers(self, num_layers: int) -> LlamaModel:
        """A model of this one's first ``num_layers`` layers, sharing its weights (a
        self-speculative draft: the same embedding, final norm and head)."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise ValueError(f"num_layers: must be in [1, {self.config.num_layers}]")
        if self.tp is not None:  # its forward would run collectives the other ranks never join
            raise ValueError("draft_model: a tensor-parallel model's own layers cannot draft")
        model = LlamaModel.__new__(LlamaModel)
        nn.Module.__init__(model)
        model.config = dataclasses.replace(self.config, num_layers=num_layers)
        model.embed_tokens = self.embed_tokens
        model.layers = nn.ModuleList(self.layers[:num_layers])
        model.norm = self.norm
        model.lm_head = self.lm_head
        model.rope = self.rope
        model.local_rope = self.local_rope
        model.packed_embedding = self.packed_embedding
        model.head_q8 = self.head_q8
        model.head_int8 = self.head_int8
        model._native_layers = _UNBUILT
        model.tp = None
        return model

    @property
    def capturable(self) -> bool:
        """Whether its decode steps can be captured as CUDA graphs: not with a mixture of
        experts, whose steps read each expert's row count on the host (``moe.py``)."""
        return self.config.moe is None

    def forget_native_layers(self) -> None:
        """Build the native stack again on next use (its layers gained LoRA slots)."""
        self._native_layers = _UNBUILT

    def native_layers(self) -> Any | None:
        """Every layer as one native call for steps without masked chunks
        (``csrc/decode_layers.cpp``: decode rows, then whole causal chunks), sharing the
        layers' weights; built on first use (after the weights are loaded). None where it
        cannot run: not on the CPU, no native extension, or a dtype it has no kernels for."""
        if self._native_layers is _UNBUILT:
            self._native_layers = None  # a failed build is not retried
            self._native_layers = build_native_layers(self)
        return self._native_layers

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, H_kv, D]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S]: rows of the batch whose next-token logits we need
        native: bool = False,
        argmax_only: bool = False,
        rope_contexts: torch.Tensor | None = None,  # [T]: RotaryEmbedding.lookup's contexts
        logits_for: torch.Tensor | None = None,  # [K]: with argmax_only, rows of the S
        hidden_only: bool = False,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the batch, writing its K/V into the cache; return float32 logits [S, vocab],
        or with ``argmax_only`` each of those rows' argmax (int64 [S], ``argmax_rows``'
        answer; a Q8_0 head on the native kernels takes it without writing the logits).
        With ``argmax_only`` and ``logits_for`` (ascending indices into the S rows: rows a
        grammar masks), the pair (the other rows' argmax in order, ``logits_for``'s
        logits): one constrained row does not cost the others their argmax-only head.
        With ``hidden_only``, the S rows' final-normed hidden states (float32
        ``[S, hidden]``) and no LM head: what an embedding pools.

        ``native``: a batch without masks (decodes, then causal chunks) runs its layers
        through ``native_layers()`` where that exists, not op by op; the chunks' attention
        there is the same torch kernel as op by op. ``lora``: each row's LoRA adapter
        (``lora.py``; the native stack adds it as op by op does)."""
        # The residual stream stays float32 whatever the model's dtype: bf16 matmuls and
        # KV, float32 sums between them (a bf16 residual loses what 30 layers add to it).
        if self.tp is not None:
            hidden = self.tp.embed(input_ids, self._embed)
        else:
            hidden = self._embed(input_ids)
        if self.config.embedding_scale is not None:  # (a float32 scalar, as transformers')
            hidden = hidden * torch.tensor(self.config.embedding_scale, dtype=torch.float32)
        cos, sin = self.rope.lookup(positions, rope_contexts)
        stack = self.native_layers() if native and meta.attn_masks is None else None
        if stack is not None:
            decodes, starts = meta.num_decodes, meta.query_start_loc_list
            prompts = prompt_tables = None
            if decodes < meta.num_seqs:  # (first row, rows, seq_len) of each causal chunk
                prompts = torch.tensor(
                    [
                        (starts[i], starts[i + 1] - starts[i], meta.seq_lens_list[i])
                        for i in range(decodes, meta.num_seqs)
                    ]
                )
                prompt_tables = meta.block_tables[decodes:]
            hidden = stack.forward(
                hidden.contiguous(),
                cos.squeeze(1),
                sin.squeeze(1),
                meta.slot_mapping,
                meta.seq_lens[:decodes],
                meta.block_tables[:decodes],
                kv_cache,
                self.norm.weight,  # and the final norm, of the rows whose logits are wanted
                logits_indices,
                prompts,
                prompt_tables,
                None if lora is None else lora.coef.squeeze(-1),
            )
        else:
            # the last layer goes on past its attention with the rows whose logits are
            # wanted only (a prompt's other rows need only their K/V), as the native stack
            last = len(self.layers) - 1
            local = None if self.local_rope is None else self.local_rope.lookup(positions)
            for index, layer in enumerate(self.layers):
                rows = logits_indices if index == last else None
                c, s = (cos, sin) if local is None or not layer.window else local
                k, v = kv_cache[index, 0], kv_cache[index, 1]
                hidden = layer(hidden, c, s, k, v, meta, rows, lora)
            hidden = self.norm(hidden)
        if hidden_only:
            return hidden.float()
        if argmax_only and logits_for is not None:
            others = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
            others[logits_for] = False
            return self._argmax(hidden[others]), self._logits(hidden.index_select(0, logits_for))
        if argmax_only:
            return self._argmax(hidden)
        return self._logits(hidden)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[T, hidden]`` rows of the embedding table (this rank's, in a group)."""
        if self.packed_embedding is not None:
            return embedding(self.packed_embedding, input_ids)
        return self.embed_tokens(input_ids).float()

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each final-normed row's argmax of its logits (int64 [S])."""
        capped = self.config.final_softcap is not None  # ties as the capped logits have them
        if self.lm_head is None and self.head_q8 is not None and not capped and self.tp is None:
            return self.head_q8.argmax(hidden.float())
        return argmax_rows(self._logits(hidden))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [S, vocab] of the final-normed rows ``hidden`` [S, hidden]
        (soft-capped where the family caps them)."""
        logits = self._head(hidden)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        if (cap := self.config.final_softcap) is not None:
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.head_q8 is not None:  # float32 sums and logits (inputs bf16-rounded unless exact)
            return self.head_q8.matmul(hidden.float())
        if self.packed_embedding is not None:  # float32 in and out, whatever the model's dtype
            return quant_matmul(hidden.float(), self.packed_embedding, int8=self.head_int8)
        # Tied: embedding [vocab, hidden] times hidden^T, no transposed copy of the table.
        return torch.mm(self.embed_tokens.weight, hidden.t()).t().float().contiguous()

    def uses_bf16_kernels(self) -> bool:
        """Whether a projection or the head multiplies through the native bf16 kernels
        (a ``Q4Weight`` or ``head_q8`` that is not ``exact``: the fast and bfloat16 modes)."""
        return "bf16" in self.rounded_inputs()

    def rounded_inputs(self) -> set[str]:
        """How its projections and head round their inputs: ``"bf16"`` (a ``Q4Weight``
        or ``head_q8`` that is not ``exact``), ``"int8"`` (K-quants, ``Linear.int8`` and
        ``head_int8``); empty for the exact mode."""
        linears = (module for module in self.modules() if isinstance(module, Linear))
        found = {x.rounded_inputs for x in linears} - {None}
        if any(layer.moe is not None and layer.moe.int8 for layer in self.layers):
            found.add("int8")
        if self.head_q8 is not None and not self.head_q8.exact:
            found.add("bf16")
        if self.head_int8:
            found.add("int8")
        return found

    def load_hf_state_dict(self, state: dict[str, Weight], rounding: str | None = None) -> None:
        """Copy weights named as in Hugging Face checkpoints (``[out, in]``), fusing q/k/v
        and gate/up and transposing for ``Linear``. GGUF-quantised matrices
        (``PackedWeight``) stay packed: the linear layers and the embedding take them as
        they are (the loader decides). ``rounding``: a float32 model's fast or int8 mode
        (``FAST``, ``INT8``: see ``Linear``)."""
        load_hf_state_dict(self, state, rounding)


_UNBUILT = object()

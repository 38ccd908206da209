"""Run a step's chunks through the model over the paged KV cache.

``ModelRunner`` splits the chunks into attention entries (decodes first), flattens them
into the batch layout of ``flat_batch`` and runs the forward: on the dynamic path, or
through ``DecodeGraphs`` for a step of decodes only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from tessera.workers.attention.metadata import PAD_BLOCK_ID, AttentionMetadata
from tessera.workers.attention.paged import plan_decode
from tessera.workers.engine.cuda_graphs import DecodeGraphs
from tessera.workers.engine.flat_batch import Chunk, HostInts, int64_tensors
from tessera.workers.engine.loras import LoraManager
from tessera.workers.engine.tensor_parallel import (
    ARGMAX_ONLY,
    CONTEXTS,
    DECODES,
    FLAGS,
    HEADER,
    HIDDEN_ONLY,
    LOGITS,
    LOGITS_FOR,
    MASKS,
    ROWS,
    SEQS,
    WIDTH,
    TensorParallelGroup,
)
from tessera.workers.kv.manager import KVCacheManager
from tessera.workers.model.llama import LlamaModel
from tessera.workers.model.lora import LoraBatch
from tessera.workers.quant.kernels import argmax_rows

#: A forward's answer: logits or argmax, or ``execute_decodes``' (argmax, logits) pair.
Out = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

#: Causal chunks of at most this many tokens run as one decode entry per token: the
#: batched decode kernel then takes a verification step's rows along with the plain
#: decodes (a per-sequence prefill call would run for each). Each entry reads its own
#: context, so long chunks stay whole.
DECODE_SPLIT_TOKENS = 8
#: With the native stack and a bf16 (or other reduced-precision) model, a plain causal
#: chunk whose context ends within this many tokens is split into decode entries too
#: (each token's attention reads its context from the cache: cheap for short contexts,
#: quadratic for long ones). Other causal chunks, and every one over a float32 cache (the
#: exact mode), stay whole and the native stack runs their attention through torch's
#: flash kernel, as op by op: there torch's prompt attention measured faster than split
#: rows (mixed steps at 16 concurrent requests, against op by op: bf16 253 ms split
#: against 354; float32 438 split against 422). The fast mode's float16 cache splits: 16
#: prompts of 128 tokens took 1695 ms split against 1949 ms op by op. Only a step with a
#: masked chunk (parallel tokens, a tree of drafts) runs op by op.
NATIVE_SPLIT_CONTEXT = 1024


class ModelRunner:
    """Runs a step's chunks through the model.

    ``static_decode``: steps whose attention entries are all decodes run through
    ``DecodeGraphs`` (bucketed static buffers; on CUDA replayed from captured graphs);
    ``"off"`` runs every step on the dynamic path; ``"eager"`` takes the static path
    without capturing (so the CPU tests can check it).

    ``native_decode``: on the dynamic path, steps without masked chunks run every layer in
    one native call (``LlamaModel.native_layers``) where the model has one; in a reduced
    precision, short prompt chunks go there as decode rows (``NATIVE_SPLIT_CONTEXT``).
    """

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCacheManager,
        kv_cache: torch.Tensor,
        static_decode: str = "off",
        native_decode: bool = False,
        loras: LoraManager | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        if static_decode not in ("off", "eager", "graphs"):
            raise ValueError(f"static_decode: 'off', 'eager' or 'graphs', got {static_decode!r}")
        self.model = model
        self.kv = kv
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.block_size = kv.block_size
        self.decode_graphs = (
            None
            if static_decode == "off"
            else DecodeGraphs(
                model,
                kv_cache,
                kv.block_size,
                capture=static_decode == "graphs" and model.capturable,  # else eager
            )
        )
        # rank 0 of a tensor-parallel group: every forward and block copy runs on each rank
        self.group = group
        self.native_decode = native_decode and model.native_layers() is not None
        self.native_prompts = self.native_decode and kv_cache.dtype != torch.float32
        self.loras = loras  # each live request's LoRA adapter slot (``engine.loras``)
        #: Seconds the last ``execute`` spent in the model's forward (on CUDA, up to the
        #: end of its kernels).
        self.forward_time = 0.0
        self._host_ints = HostInts()  # the CPU's step inputs

    def execute(
        self, chunks: Seq[Chunk], argmax_only: bool = False, hidden_only: bool = False
    ) -> torch.Tensor:
        """Compute every chunk's tokens (writing their K/V); return the logits of each
        chunk's ``logits_rows``, chunk after chunk, as float32 ``[sum of rows, vocab]``, or
        with ``argmax_only`` each of those rows' argmax (int64, ``argmax_rows``' answer).

        With ``hidden_only``, those rows' final-normed hidden states instead (float32
        ``[sum of rows, hidden]``, no LM head: ``embedding.EmbeddingJob``).

        Pending copy-on-write block copies are applied first, in the order recorded.
        """
        self._apply_copies()
        # Attention entries: a short causal chunk (a decode, or a target verifying a few
        # drafts) becomes one decode entry per token, each seeing the cache up to itself
        # (every K/V of the step is written before attention reads it); other chunks
        # are one entry each. Decode entries go first: the backend batches them.
        entries: list[tuple[int, int, int]] = []  # (chunk, first token, tokens)
        split_all: bool | None = None  # every chunk splits: asked at a chunk of several tokens
        whole = False  # whether some chunk is one entry of several tokens
        for i, chunk in enumerate(chunks):
            n = len(chunk.token_ids)
            if chunk.mask is None and n == 1:
                entries.append((i, 0, 1))
                continue
            if split_all is None:
                split_all = self.native_prompts and all(
                    c.mask is None
                    and (len(c.token_ids) <= DECODE_SPLIT_TOKENS or c.end <= NATIVE_SPLIT_CONTEXT)
                    for c in chunks
                )
            if chunk.mask is None and (n <= DECODE_SPLIT_TOKENS or split_all):
                entries += [(i, row, 1) for row in range(n)]
            else:
                entries.append((i, 0, n))
                whole = True
        if whole:
            entries.sort(key=lambda entry: entry[2] != 1)
        lora = None
        if self.loras is not None and self.loras.request_slots:
            lora = self.loras.batch([chunks[i].seq_id for i, _, n in entries for _ in range(n)])
        graphs = self.decode_graphs
        if (
            graphs is not None
            and not whole
            and not hidden_only
            and lora is None
            and graphs.fits(len(entries))
        ):
            logits = self._static_decode(chunks, entries)
            return argmax_rows(logits) if argmax_only else logits
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []  # slot_mapping
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        masks: list[torch.Tensor | None] = []
        # each chunk's rows are consecutive (its entries stay in order when sorted): the
        # batch row of its token r is first_row[i] + r
        first_row = [0] * len(chunks)
        table_of: dict[int, list[int]] = {}  # a split chunk's entries share its table
        num_decodes = 0
        for i, first, n in entries:
            chunk = chunks[i]
            base = query_start[-1]
            start = chunk.start + first
            table = table_of.get(i)
            if table is None:
                table = table_of[i] = self.kv.block_ids(chunk.seq_id)
            if n == 1:  # a decode entry (most of them): no slices or ranges
                input_ids.append(chunk.token_ids[first])
                positions.append(start if chunk.positions is None else chunk.positions[first])
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(chunk.token_ids[first : first + n])
                if chunk.positions is None:
                    positions.extend(range(start, start + n))
                else:
                    positions.extend(chunk.positions[first : first + n])
                # each token's cache row: block_id * block_size + offset, its index's block
                slots.extend(table[k // bs] * bs + k % bs for k in range(start, start + n))
            query_start.append(base + n)
            seq_lens.append(start + n)
            tables.append(table)
            if n == 1 and chunk.mask is None:
                num_decodes += 1
            else:
                masks.append(chunk.mask)
            first_row[i] = base - first
        logits_rows = [
            first_row[i] + r for i, chunk in enumerate(chunks) for r in chunk.logits_rows
        ]
        contexts = None
        if self.model.rope.context_dependent:  # each row's max(prompt length, position + 1)
            prompt_lens = [chunks[i].prompt_len for i, _, n in entries for _ in range(n)]
            contexts = [max(p, q + 1) for p, q in zip(prompt_lens, positions, strict=True)]
        return self._forward(
            input_ids,
            positions,
            slots,
            query_start,
            seq_lens,
            logits_rows,
            tables,
            masks,
            num_decodes,
            argmax_only,
            contexts,
            hidden_only=hidden_only,
            lora=lora,
        )

    def execute_decodes(
        self,
        seq_ids: Seq[str],
        token_ids: list[int],
        starts: list[int],
        argmax_only: bool = False,
        logits_for: Seq[int] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``execute`` of one plain decode per sequence, without building its chunks:
        ``Chunk(seq_ids[i], [token_ids[i]], starts[i], logits_rows=(0,))`` for each ``i``
        (its token at cache index and position ``starts[i]``, causal), the logits in this
        order, or with ``argmax_only`` each row's argmax (int64, ``argmax_rows``' answer).
        With ``argmax_only`` and ``logits_for`` (ascending rows), the pair (the other rows'
        argmax, in order; ``logits_for``'s logits), as ``LlamaModel.forward`` gives it.
        The steady state of serving: 64 decodes' chunks and entries took ~0.25 ms.
        """
        self._apply_copies()
        block_ids = self.kv.block_ids
        tables = [block_ids(seq_id) for seq_id in seq_ids]
        num = len(seq_ids)
        rows = list(range(num))
        lora = None
        if self.loras is not None and self.loras.request_slots:
            lora = self.loras.batch(list(seq_ids))
        graphs = self.decode_graphs
        if graphs is not None and lora is None and graphs.fits(num):
            logits = self._timed(graphs.prepare(token_ids, starts, starts, tables, rows))
            if argmax_only and logits_for:
                others = [row for row in rows if row not in set(logits_for)]
                return argmax_rows(logits[others]), logits[list(logits_for)]
            return argmax_rows(logits) if argmax_only else logits
        bs = self.block_size
        slots = [t[start // bs] * bs + start % bs for t, start in zip(tables, starts, strict=True)]
        seq_lens = [start + 1 for start in starts]
        return self._forward(
            token_ids,
            starts,
            slots,
            list(range(num + 1)),
            seq_lens,
            rows,
            tables,
            [],
            num,
            argmax_only,
            logits_for=logits_for,
            lora=lora,
        )

    def _apply_copies(self) -> None:
        """Pending copy-on-write block copies, in the order recorded."""
        if self.group is not None:
            pairs = [block for pair in self.kv.take_copies() for block in pair]
            if pairs:
                self.group.copy(self.kv_cache, pairs)
            return
        for src, dst in self.kv.take_copies():
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])

    def _forward(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        query_start: list[int],
        seq_lens: list[int],
        logits_rows: list[int],
        tables: list[list[int]],
        masks: list[torch.Tensor | None],
        num_decodes: int,
        argmax_only: bool = False,
        contexts: list[int] | None = None,
        logits_for: Seq[int] = (),
        hidden_only: bool = False,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The forward over a flattened batch (the layout in ``flat_batch``'s docstring):
        its first ``num_decodes`` sequences are decodes of one row each, causal; ``masks``
        holds one entry (a mask or None) for each of the others; ``contexts``, each
        row's RoPE context (None: its position + 1). The logits, or with ``argmax_only``
        their rows' argmax (and ``logits_for``: ``execute_decodes``' pair)."""
        # Every integer input in one host list, then one buffer (``HostInts``,
        # ``int64_tensors``): seven tensors built from lists took ~0.15 ms a step.
        width = max(len(t) for t in tables)
        flat = input_ids + positions + slots + query_start + seq_lens + logits_rows
        for t in tables:
            flat += t
            flat += [PAD_BLOCK_ID] * (width - len(t))
        num_rows, num_seqs = len(input_ids), len(seq_lens)
        if self.group is not None:
            return self._timed(
                lambda: self._group_forward(
                    flat,
                    num_rows,
                    num_seqs,
                    len(logits_rows),
                    width,
                    num_decodes,
                    masks,
                    argmax_only,
                    contexts,
                    logits_for,
                    hidden_only,
                )
            )
        dev = self.device
        sizes = (num_rows, num_rows, num_rows, num_seqs + 1, num_seqs, len(logits_rows))
        if dev.type == "cpu":
            pieces = self._host_ints.tensors(flat, (*sizes, (num_seqs, width)))
        else:
            pieces = int64_tensors(flat, (*sizes, num_seqs * width), dev)
            pieces[-1] = pieces[-1].view(num_seqs, width)
        ids_t, positions_t, slot_mapping, query_start_t, seq_lens_t, rows_t, block_tables = pieces
        masks_given = any(m is not None for m in masks)
        native = self.native_decode and not masks_given
        decode_plan = None
        if num_decodes and not native:
            decode_plan = plan_decode(
                block_tables[:num_decodes],
                seq_lens_t[:num_decodes],
                seq_lens[:num_decodes],
                self.block_size,
                self.model.norm.weight.dtype,  # the queries' (the bias joins their scores)
            )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_t,
            seq_lens=seq_lens_t,
            block_tables=block_tables,
            num_decodes=num_decodes,
            query_start_loc_list=query_start,
            seq_lens_list=seq_lens,
            attn_masks=None
            if not masks_given
            else tuple(None if m is None else m.to(dev) for m in masks),
            decode_plan=decode_plan,
        )
        inputs = (ids_t, positions_t, self.kv_cache, meta, rows_t)
        rope_contexts = None if contexts is None else torch.tensor(contexts, device=dev)
        full = torch.tensor(logits_for, device=dev) if argmax_only and logits_for else None
        return self._timed(
            lambda: self.model(
                *inputs,
                native=native,
                argmax_only=argmax_only,
                rope_contexts=rope_contexts,
                logits_for=full,
                hidden_only=hidden_only,
                lora=lora,
            )
        )

    def _group_forward(
        self,
        flat: list[int],
        num_rows: int,
        num_seqs: int,
        num_logits: int,
        width: int,
        num_decodes: int,
        masks: list[torch.Tensor | None],
        argmax_only: bool,
        contexts: list[int] | None,
        logits_for: Seq[int],
        hidden_only: bool,
    ) -> Out:
        """``_forward`` on every rank of the group (``tensor_parallel.run_step``'s layout)."""
        assert self.group is not None
        header = [0] * HEADER
        header[ROWS], header[SEQS], header[LOGITS], header[WIDTH] = (
            num_rows,
            num_seqs,
            num_logits,
            width,
        )
        header[DECODES] = num_decodes
        header[FLAGS] = (ARGMAX_ONLY if argmax_only else 0) | (HIDDEN_ONLY if hidden_only else 0)
        if contexts is not None:
            header[CONTEXTS] = len(contexts)
            flat = flat + contexts
        if argmax_only and logits_for:
            header[LOGITS_FOR] = len(logits_for)
            flat = flat + list(logits_for)
        if any(m is not None for m in masks):
            header[MASKS] = len(masks)
            for m in masks:
                flat = flat + ([-1, -1] if m is None else list(m.shape))
        return self.group.forward(self.model, self.kv_cache, self.block_size, header, flat, masks)

    def _static_decode(
        self, chunks: Seq[Chunk], entries: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """A step of decode entries only (each ``(chunk, token, 1)``), in entry order."""
        assert self.decode_graphs is not None
        row_of = {(i, row): index for index, (i, row, _) in enumerate(entries)}
        input_ids, positions, indices, tables = [], [], [], []
        for i, row, _ in entries:
            chunk = chunks[i]
            input_ids.append(chunk.token_ids[row])
            index = chunk.start + row
            positions.append(index if chunk.positions is None else chunk.positions[row])
            indices.append(index)
            tables.append(self.kv.block_ids(chunk.seq_id))
        logits_rows = [row_of[i, r] for i, chunk in enumerate(chunks) for r in chunk.logits_rows]
        run = self.decode_graphs.prepare(input_ids, positions, indices, tables, logits_rows)
        return self._timed(run)

    def _timed(self, forward: Callable[[], Out]) -> Out:
        started = time.perf_counter()
        logits = forward()
        device = (logits[1] if isinstance(logits, tuple) else logits).device
        if device.type == "cuda":  # sampling waits for it anyway; the time is the forward's
            torch.cuda.synchronize(device)
        self.forward_time = time.perf_counter() - started
        return logits

"""Turn a step's chunks into flat tensors and run the model over the paged KV cache.

A ``Chunk`` is what one sequence computes in one forward pass: some new tokens, the
cache indices they are written to, their RoPE positions and which earlier tokens each
may see. Every way a sequence adds tokens is a chunk: a prefill or a piece of one, a
decode step, the draft tokens a target verifies (speculative decoding), and a set of
parallel tokens that share one position and see each other (or not) by a mask.

The batch layout (one row per new token, several rows per sequence allowed)::

    input_ids       [T]    token of each row
    positions       [T]    its RoPE position, explicit (not derived from the slot)
    slot_mapping    [T]    block_id * block_size + offset where its K/V is written
    query_start_loc [B+1]  rows of sequence i are query_start_loc[i]:query_start_loc[i+1]
    seq_lens        [B]    cached + new tokens of sequence i after this step
    block_tables    [B, max_blocks]
"""

from __future__ import annotations

import array
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from tessera.workers.attention.metadata import PAD_BLOCK_ID, AttentionMetadata
from tessera.workers.attention.paged import plan_decode
from tessera.workers.engine.cuda_graphs import DecodeGraphs
from tessera.workers.kv.manager import KVCacheManager
from tessera.workers.model.llama import LlamaModel
from tessera.workers.quant.kernels import argmax_rows


@dataclass(slots=True)  # not frozen: a step builds one per sequence, in half the time
class Chunk:
    """New tokens of one sequence for one forward pass (read-only once built).

    The tokens go to cache indices ``start .. start + len(token_ids) - 1`` of the
    sequence's block table (which must already hold them); attention then covers
    cache indices ``0 .. start + len(token_ids) - 1``.

    ``positions``: the RoPE position of each new token; None means its cache index.
    ``mask``: bool ``[len(token_ids), start + len(token_ids)]``, True where a new token
    may attend; None means causal by cache index.
    ``logits_rows``: the new tokens (indices into ``token_ids``) whose next-token
    logits the caller wants, in this order.
    """

    seq_id: str
    token_ids: Seq[int]
    start: int
    positions: Seq[int] | None = None
    mask: torch.Tensor | None = None
    logits_rows: Seq[int] = ()

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError(f"chunk of {self.seq_id!r} has no tokens")
        if self.positions is not None and len(self.positions) != n:
            raise ValueError(f"{len(self.positions)} positions for {n} tokens")
        if self.mask is not None and tuple(self.mask.shape) != (n, self.start + n):
            raise ValueError(f"mask {tuple(self.mask.shape)}, expected ({n}, {self.start + n})")
        if self.logits_rows and any(not 0 <= row < n for row in self.logits_rows):
            raise ValueError(f"logits_rows {list(self.logits_rows)} not in [0, {n})")

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


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


def int64_tensors(values: list[int], sizes: Seq[int], device: torch.device) -> list[torch.Tensor]:
    """``values`` cut into int64 tensors of ``sizes`` on ``device`` (not the CPU's:
    ``HostInts``), through one host array (64 decodes' ~2,000 integers: ~25 us, against
    ~200 for ``torch.tensor``), one copy to the device, and views of it."""
    data = array.array("q", values)
    return list(torch.frombuffer(data, dtype=torch.int64).to(device).split(list(sizes)))


#: The shape of each of a step's integer tensors: a length, or (rows, columns).
Shape = int | tuple[int, int]


class HostInts:
    """A CPU step's integer inputs, written into one buffer kept across steps and read
    through tensors kept per layout (the shapes of the pieces).

    Right after a forward pass the code of each kind of torch op is cold (the forward
    streamed the weights through the caches): a step's seven ``frombuffer`` calls and a
    ``view`` cost ~100 us at 64 decodes, writing the values into the buffer a copy. A
    steady decode batch keeps its layout from step to step (it changes when a sequence
    joins or ends, or the widest block table grows), so most steps make no tensor.

    The tensors of the last call are valid until the next call, which overwrites them:
    the runner's forward is done with them by then. Only the newest ``MAX_LAYOUTS``
    layouts are kept."""

    MAX_LAYOUTS = 32

    def __init__(self) -> None:
        self._data = bytearray()
        self._base = torch.empty(0, dtype=torch.int64)
        # layout -> (its tensors, how many values fill them)
        self._layouts: dict[tuple[Shape, ...], tuple[tuple[torch.Tensor, ...], int]] = {}

    def tensors(self, values: list[int], shapes: tuple[Shape, ...]) -> tuple[torch.Tensor, ...]:
        """``values`` cut into int64 tensors of ``shapes``, in order (they fill it)."""
        count = len(values)
        if 8 * count > len(self._data):
            # a new buffer (the old one stays alive for tensors still holding it)
            self._data = bytearray(8 * max(2 * count, 4096))
            self._base = torch.frombuffer(self._data, dtype=torch.int64)
            self._layouts.clear()
        layout = self._layouts.get(shapes)
        if layout is None:
            if len(self._layouts) >= self.MAX_LAYOUTS:
                del self._layouts[next(iter(self._layouts))]
            made, offset = [], 0
            for shape in shapes:
                size = shape if isinstance(shape, int) else shape[0] * shape[1]
                piece = self._base[offset : offset + size]
                made.append(piece if isinstance(shape, int) else piece.view(shape))
                offset += size
            layout = self._layouts[shapes] = (tuple(made), offset)
        pieces, total = layout
        if total != count:
            raise ValueError(f"{count} values for shapes {shapes} of {total}")
        memoryview(self._data).cast("q")[:count] = array.array("q", values)
        return pieces


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
            else DecodeGraphs(model, kv_cache, kv.block_size, capture=static_decode == "graphs")
        )
        self.native_decode = native_decode and model.native_layers() is not None
        self.native_prompts = self.native_decode and kv_cache.dtype != torch.float32
        #: Seconds the last ``execute`` spent in the model's forward (on CUDA, up to the
        #: end of its kernels).
        self.forward_time = 0.0
        self._host_ints = HostInts()  # the CPU's step inputs

    def execute(self, chunks: Seq[Chunk], argmax_only: bool = False) -> torch.Tensor:
        """Compute every chunk's tokens (writing their K/V); return the logits of each
        chunk's ``logits_rows``, chunk after chunk, as float32 ``[sum of rows, vocab]``, or
        with ``argmax_only`` each of those rows' argmax (int64, ``argmax_rows``' answer).

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
        graphs = self.decode_graphs
        if graphs is not None and not whole and graphs.fits(len(entries)):
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
        )

    def execute_decodes(
        self,
        seq_ids: Seq[str],
        token_ids: list[int],
        starts: list[int],
        argmax_only: bool = False,
    ) -> torch.Tensor:
        """``execute`` of one plain decode per sequence, without building its chunks:
        ``Chunk(seq_ids[i], [token_ids[i]], starts[i], logits_rows=(0,))`` for each ``i``
        (its token at cache index and position ``starts[i]``, causal), the logits in this
        order, or with ``argmax_only`` each row's argmax (int64, ``argmax_rows``' answer).
        The steady state of serving: 64 decodes' chunks and entries took ~0.25 ms.
        """
        self._apply_copies()
        block_ids = self.kv.block_ids
        tables = [block_ids(seq_id) for seq_id in seq_ids]
        num = len(seq_ids)
        rows = list(range(num))
        graphs = self.decode_graphs
        if graphs is not None and graphs.fits(num):
            logits = self._timed(graphs.prepare(token_ids, starts, starts, tables, rows))
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
        )

    def _apply_copies(self) -> None:
        """Pending copy-on-write block copies, in the order recorded."""
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
    ) -> torch.Tensor:
        """The forward over a flattened batch (the layout in this module's docstring):
        its first ``num_decodes`` sequences are decodes of one row each, causal; ``masks``
        holds one entry (a mask or None) for each of the others. The logits, or with
        ``argmax_only`` their rows' argmax."""
        # Every integer input in one host list, then one buffer (``HostInts``,
        # ``int64_tensors``): seven tensors built from lists took ~0.15 ms a step.
        width = max(len(t) for t in tables)
        flat = input_ids + positions + slots + query_start + seq_lens + logits_rows
        for t in tables:
            flat += t
            flat += [PAD_BLOCK_ID] * (width - len(t))
        num_rows, num_seqs = len(input_ids), len(seq_lens)
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
        return self._timed(lambda: self.model(*inputs, native=native, argmax_only=argmax_only))

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

    def _timed(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        started = time.perf_counter()
        logits = forward()
        if logits.is_cuda:  # sampling waits for it anyway; the time then means the forward
            torch.cuda.synchronize(logits.device)
        self.forward_time = time.perf_counter() - started
        return logits

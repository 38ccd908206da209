"""What a step computes, as the model takes it: one ``Chunk`` per sequence, flattened
into int64 tensors with one row per new token (several rows per sequence allowed)::

    input_ids       [T]    token of each row
    positions       [T]    its RoPE position, explicit (not derived from the slot)
    slot_mapping    [T]    block_id * block_size + offset where its K/V is written
    query_start_loc [B+1]  rows of sequence i are query_start_loc[i]:query_start_loc[i+1]
    seq_lens        [B]    cached + new tokens of sequence i after this step
    block_tables    [B, max_blocks]

A ``Chunk`` is what one sequence computes in one forward pass: some new tokens, the
cache indices they are written to, their RoPE positions and which earlier tokens each
may see. Every way a sequence adds tokens is a chunk: a prefill or a piece of one, a
decode step, the draft tokens a target verifies (speculative decoding), and a set of
parallel tokens that share one position and see each other (or not) by a mask.

The integer tensors come from one host list per step, through ``HostInts`` on the CPU
and ``int64_tensors`` elsewhere.
"""

from __future__ import annotations

import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch


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
    ``prompt_len``: its sequence's prompt length, a token's RoPE context being
    ``max(prompt_len, position + 1)`` (``rope.RotaryEmbedding``); 0: ``position + 1``.
    """

    seq_id: str
    token_ids: Seq[int]
    start: int
    positions: Seq[int] | None = None
    mask: torch.Tensor | None = None
    logits_rows: Seq[int] = ()
    prompt_len: int = 0

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

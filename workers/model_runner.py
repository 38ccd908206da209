"""Turn a scheduled batch into flat tensors and run the model over the paged KV cache.

The batch layout (one row per new token, several rows per sequence allowed)::

    input_ids       [T]    token of each row
    positions       [T]    its RoPE position, explicit (not derived from the slot)
    slot_mapping    [T]    block_id * block_size + offset where its K/V is written
    query_start_loc [B+1]  rows of sequence i are query_start_loc[i]:query_start_loc[i+1]
    seq_lens        [B]    cached + new tokens of sequence i after this step
    block_tables    [B, max_blocks]
"""

from __future__ import annotations

import itertools

import torch

from workers.attention.metadata import PAD_BLOCK_ID, AttentionMetadata
from workers.attention.paged import plan_decode
from workers.kv.manager import KVCacheManager
from workers.model.llama import LlamaModel
from workers.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCacheManager, kv_cache: torch.Tensor) -> None:
        self.model = model
        self.kv = kv
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.block_size = kv.block_size

    def execute(self, items: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Compute ``n`` new tokens of each (sequence, n); return logits of the sequences
        that reached their last token ([S, vocab], float32) and those sequences.

        Single-token sequences must come first (the batcher orders them so).
        Pending copy-on-write block copies are applied first, in the order recorded.
        """
        for src, dst in self.kv.take_copies():
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        num_decodes = 0
        for seq, n in items:
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            tables.append(self.kv.block_ids(seq.seq_id))
            if n == 1 and num_decodes == len(seq_lens) - 1:
                num_decodes += 1
            if end == seq.num_tokens:
                logits_rows.append(query_start[-1] - 1)
                sampled.append(seq)
        width = max(len(t) for t in tables)
        dev = self.device
        block_tables = torch.tensor(
            [t + [PAD_BLOCK_ID] * (width - len(t)) for t in tables], device=dev
        )
        query_lens = torch.tensor([b - a for a, b in itertools.pairwise(query_start)], device=dev)
        positions_t = torch.tensor(positions, device=dev)
        seq_index = torch.repeat_interleave(torch.arange(len(items), device=dev), query_lens)
        slot_mapping = block_tables[seq_index, positions_t // bs] * bs + positions_t % bs
        seq_lens_t = torch.tensor(seq_lens, device=dev)
        decode_plan = None
        if num_decodes:
            decode_plan = plan_decode(
                block_tables[:num_decodes],
                seq_lens_t[:num_decodes],
                seq_lens[:num_decodes],
                bs,
                self.kv_cache.dtype,
            )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=torch.tensor(query_start, device=dev),
            seq_lens=seq_lens_t,
            block_tables=block_tables,
            num_decodes=num_decodes,
            query_start_loc_list=query_start,
            seq_lens_list=seq_lens,
            decode_plan=decode_plan,
        )
        logits = self.model(
            torch.tensor(input_ids, device=dev),
            positions_t,
            self.kv_cache,
            meta,
            torch.tensor(logits_rows, dtype=torch.int64, device=dev),
        )
        return logits, sampled

"""The static decode path (what CUDA graphs replay), run eagerly on the CPU: bucketed
batches with padding rows, block tables padded to a width bucket, and the whole
context as one attention tile.

On CUDA the same path is captured and replayed (tests/gpu); here it is checked against
transformers and against the dynamic path, with every kind of decode row: plain
decodes, n > 1 forks, the split rows of speculative verification and parallel tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from tessera.workers.api import SamplingParams
from tessera.workers.attention.metadata import AttentionMetadata
from tessera.workers.attention.paged import paged_attention, reference_attention
from tessera.workers.engine.cuda_graphs import BATCH_BUCKETS, DecodeGraphs, static_decode_tile
from tests.helpers import (
    assert_greedy_matches,
    multi_row_requests,
    run_engine,
    run_multi_row,
    tokens_of,
)

pytestmark = pytest.mark.slow


def static_engine(make_engine, **kwargs):
    engine = make_engine(**kwargs)
    runner = engine.runner
    runner.decode_graphs = DecodeGraphs(
        runner.model, runner.kv_cache, runner.block_size, capture=False
    )
    return engine


def test_static_tile_attention_matches_the_reference():
    """One tile over a padded table: rows of different lengths (one a single token),
    pad entries and stale slots full of NaN never reach the output."""
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim, heads = 12, 4, 2, 8, 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    k_cache[7:], v_cache[7:] = math.nan, math.nan  # never-written blocks
    tables = torch.tensor([[3, 1, 0, 0], [5, 0, 0, 0], [2, 4, 6, 0]])
    seq_lens = torch.tensor([7, 1, 11])
    q = torch.randn(3, heads, head_dim)
    tile = static_decode_tile(tables, seq_lens, block_size, torch.float32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(3, dtype=torch.int64),
        query_start_loc=torch.arange(4),
        seq_lens=seq_lens,
        block_tables=tables,
        num_decodes=3,
        query_start_loc_list=[0, 1, 2, 3],
        seq_lens_list=seq_lens.tolist(),
        decode_plan=(tile,),
    )
    ours = paged_attention(q, k_cache, v_cache, meta, 0.3)
    expected = reference_attention(q, k_cache, v_cache, meta, 0.3)
    assert tile.tokens == 16
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_static_decode_matches_transformers(make_engine, hf_reference):
    """Greedy decodes of three lengths in one batch (3 rows: bucket 4, one padding
    row), one crossing 256 tokens (where the dynamic path tiles)."""
    engine = static_engine(make_engine)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, " * 60]
    ids = [tuple(engine.tokenizer(p).input_ids) for p in prompts]
    assert len(ids[2]) > 256
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(ids):
        engine.add_request(f"r{i}", list(prompt), greedy)
    outputs = run_engine(engine)
    assert len(engine.runner.decode_graphs.steps) >= 1
    assert {batch for batch, _ in engine.runner.decode_graphs.steps} <= set(BATCH_BUCKETS)
    for i, prompt in enumerate(ids):
        assert_greedy_matches(tokens_of(outputs[f"r{i}"]), hf_reference.greedy(prompt, 24))


def test_static_decode_gives_the_dynamic_paths_tokens(make_engine):
    """n > 1 forks, speculative verification (ngram and a self-speculative draft) and
    parallel tokens: the same tokens and parallel sets on both paths."""
    requests = multi_row_requests()
    results = [
        run_multi_row(engine, requests)
        for engine in (
            make_engine(draft_model="target:8"),
            static_engine(make_engine, draft_model="target:8"),
        )
    ]
    assert results[0] == results[1]

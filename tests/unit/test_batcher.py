"""The batcher's decisions, exactly: budget, chunking, admission order, preemption victims."""

from __future__ import annotations

from tessera.workers.api import Phase, Request
from tessera.workers.engine.batcher import Batcher
from tessera.workers.engine.sequence import Sequence, SequenceGroup
from tessera.workers.kv.manager import KVCacheManager


def _seq(name: str, num_tokens: int, priority: int = 0, order: int = 0) -> SequenceGroup:
    """A one-sequence group (a plain request)."""
    prompt = tuple(range(1, num_tokens + 1))
    request = Request(name, prompt, priority=priority)
    seq = Sequence(request, seed=0, token_ids=list(prompt), detokenizer=None, stop_matcher=None)
    return SequenceGroup(request, [seq], width=1, order=order)


def _finish_step(batch) -> None:
    """What the engine does after a step: count computed tokens, append a sampled token."""
    for seq, n in batch.items:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


def test_budget_chunks_prefills_and_decodes_go_first():
    batcher = Batcher(
        KVCacheManager(num_blocks=16, block_size=4), max_num_batched_tokens=8, max_num_seqs=4
    )
    a, b = _seq("a", 3, order=0), _seq("b", 10, order=1)
    batcher.add(a)
    batcher.add(b)
    batch = batcher.schedule()
    assert [(s.seq_id, n) for s, n in batch.items] == [("a", 3), ("b", 5)]
    assert (a.seqs[0].phase, b.seqs[0].phase) == (Phase.PREFILL, Phase.PREFILL)
    _finish_step(batch)
    batch = batcher.schedule()  # a decodes (1 token, first), b gets its last 5
    assert [(s.seq_id, n) for s, n in batch.items] == [("a", 1), ("b", 5)]
    assert a.seqs[0].phase is Phase.DECODE
    assert batcher.kv.block_ids("a") == [0] and batcher.kv.block_ids("b") == [1, 2, 3]
    batcher.kv.check_integrity()


def test_admission_follows_priority_then_arrival():
    batcher = Batcher(
        KVCacheManager(num_blocks=16, block_size=4), max_num_batched_tokens=64, max_num_seqs=2
    )
    for name, priority, order in (("late", 0, 2), ("low", 5, 0), ("first", 0, 1)):
        batcher.add(_seq(name, 4, priority, order))
    batch = batcher.schedule()
    assert [s.seq_id for s, _ in batch.items] == ["first", "late"]  # max_num_seqs = 2
    assert [g.request_id for g in batcher.waiting] == ["low"]


def test_preemption_takes_lowest_priority_newest_first_and_frees_its_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    batcher = Batcher(kv, max_num_batched_tokens=64, max_num_seqs=8)
    seqs = [
        _seq("keep", 4, 0, 0),
        _seq("old", 4, 1, 1),
        _seq("new", 4, 1, 2),
        _seq("vip", 4, -1, 3),
    ]
    for seq in seqs:
        batcher.add(seq)
    _finish_step(batcher.schedule())  # all four prefilled, one block each, pool full
    assert kv.num_free_blocks == 0
    batch = batcher.schedule()  # each now needs a second block
    # "vip" (priority -1) and "keep" go first; "new" is the lowest-priority newest: evicted
    # first, then "old"; that frees one block each for "vip" and "keep".
    assert [g.request_id for g in batch.preempted] == ["new", "old"]
    assert [(s.seq_id, n) for s, n in batch.items] == [("vip", 1), ("keep", 1)]
    # admitted vip, keep, old, new -> blocks 0..3; new's block 3 goes to vip, old's 2 to keep
    assert kv.block_ids("vip") == [0, 3] and kv.block_ids("keep") == [1, 2]
    assert [g.request_id for g in batcher.waiting] == ["old", "new"]
    assert all(
        g.seqs[0].num_computed_tokens == 0 and g.seqs[0].num_tokens == 5 for g in batcher.waiting
    )
    assert batcher.num_preemptions == 2
    kv.check_integrity()


def test_a_sequence_preempts_itself_when_it_is_the_lowest():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    batcher = Batcher(kv, max_num_batched_tokens=64, max_num_seqs=8)
    first, second = _seq("first", 4, 0, 0), _seq("second", 4, 0, 1)
    batcher.add(first)
    batcher.add(second)
    _finish_step(batcher.schedule())
    batch = batcher.schedule()
    assert [g.request_id for g in batch.preempted] == ["second"]
    assert [(s.seq_id, n) for s, n in batch.items] == [("first", 1)]
    assert kv.block_ids("first") == [0, 1]


def test_a_preempted_group_recomputes_its_shared_prompt_once():
    from tessera.workers.kv.prefix_cache import extend_block_hashes

    kv = KVCacheManager(num_blocks=16, block_size=4)
    batcher = Batcher(kv, max_num_batched_tokens=64, max_num_seqs=4)
    prompt = tuple(range(1, 11))  # 10 tokens: 2 full blocks
    request = Request("g", prompt)
    seqs = []
    for index, tail in enumerate(([50, 51, 52], [60, 61, 62])):
        seq = Sequence(request, 0, list(prompt) + tail, None, None, index=index)
        extend_block_hashes(seq.block_hashes, seq.token_ids, 4, ("m", "float32", ""))
        seqs.append(seq)
    group = SequenceGroup(request, seqs, width=2, order=0)
    batcher.add(group)  # as after a preemption: tokens kept, nothing computed
    batch = batcher.schedule()
    # the lead computes up to (not including) its last token; the other waits for it
    assert [(s.seq_id, n) for s, n in batch.items] == [("g", 12)]
    for seq, n in batch.items:
        seq.num_computed_tokens += n
        kv.cache_blocks(seq.seq_id, seq.block_hashes, 0, seq.num_computed_tokens // 4)
    batch = batcher.schedule()
    # the second takes the two prompt blocks from the cache: 8 tokens skipped
    assert sorted((s.seq_id, s.num_computed_tokens, n) for s, n in batch.items) == [
        ("g", 12, 1),
        ("g#1", 8, 5),
    ]
    assert kv.block_ids("g")[:2] == kv.block_ids("g#1")[:2]
    kv.check_integrity()

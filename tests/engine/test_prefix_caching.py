"""Automatic prefix caching in the engine: computed tokens, exact outputs, salts."""

from __future__ import annotations

from tessera.workers.api import SamplingParams
from tests.helpers import assert_greedy_matches, run_engine, tokens_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _long_prefix(engine, n: int = 200) -> list[int]:
    text = (
        "You are a helpful assistant. Answer briefly and precisely, cite your sources, "
        "and say so when you do not know. "
    ) * 12
    ids = engine.tokenize(text)
    assert len(ids) >= n
    return ids[:n]


def test_second_request_with_the_same_200_token_prefix_computes_only_the_rest(make_engine):
    engine = make_engine()
    prefix = _long_prefix(engine)
    first = prefix + engine.tokenize(" What is the capital of France?")
    second = prefix + engine.tokenize(" Name three primary colours.")
    engine.add_request("first", first, GREEDY)
    run_engine(engine)
    before = engine.stats()
    engine.add_request("second", second, GREEDY)
    outputs = run_engine(engine)
    after = engine.stats()
    cached = (200 // 16) * 16  # 12 full blocks = 192 tokens
    assert after.prefix_cache.hits - before.prefix_cache.hits == cached
    assert after.prefix_cache.queries - before.prefix_cache.queries == len(second)
    assert after.prompt_tokens - before.prompt_tokens == len(second) - cached
    assert tokens_of(outputs["second"]) == tokens_of(
        run_engine_alone(make_engine(enable_prefix_caching=False), second)
    )


def run_engine_alone(engine, prompt):
    engine.add_request("alone", prompt, GREEDY)
    return run_engine(engine)["alone"]


def test_caching_on_and_off_give_identical_tokens_even_after_evictions(make_engine, hf_reference):
    # a pool of 24 blocks of 16: the unrelated 300-token request evicts the shared prefix
    on = make_engine(num_kv_blocks=24)
    off = make_engine(num_kv_blocks=24, enable_prefix_caching=False)
    prefix = _long_prefix(on, 120)
    prompts = [
        prefix + on.tokenize(" Question one: why is the sky blue?"),
        prefix + on.tokenize(" Question two: what is a prime number?"),
        on.tokenize("An unrelated prompt about cooking pasta, " * 30)[:300],
        prefix + on.tokenize(" Question three: who wrote Hamlet?"),
        prefix[:100] + on.tokenize(" A prefix that diverges in the middle of a block."),
    ]
    for engine in (on, off):
        results = []
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, GREEDY)
            results.append(tokens_of(run_engine(engine)[f"r{i}"]))
        engine.results = results
    assert on.results == off.results
    stats = on.stats().prefix_cache
    assert stats.hits > 0 and stats.evictions > 0
    assert off.stats().prefix_cache.hits == 0
    for prompt, tokens in zip(prompts, on.results, strict=True):
        assert_greedy_matches(tokens, hf_reference.greedy(tuple(prompt), 12))


def test_requests_running_together_share_cached_blocks(make_engine):
    engine = make_engine()
    prefix = _long_prefix(engine, 64)
    engine.add_request("a", prefix + [100, 200], GREEDY)
    first = engine.step()  # a's prompt is computed; its 4 full blocks are now cached
    engine.add_request("b", prefix + [300], GREEDY)
    second = engine.step()
    a, b = engine.kv.block_ids("a"), engine.kv.block_ids("b")
    assert a[:4] == b[:4] and a[4] != b[4]
    assert [engine.kv.pool.blocks[i].ref_count for i in a[:4]] == [2, 2, 2, 2]
    later = run_engine(engine)
    b_tokens = tokens_of([d for d in first + second if d.request_id == "b"] + later["b"])
    alone = make_engine(enable_prefix_caching=False)
    assert b_tokens == tokens_of(run_engine_alone(alone, prefix + [300]))


def test_cache_salt_stops_sharing(make_engine):
    engine = make_engine()
    prefix = _long_prefix(engine, 96)
    engine.add_request("a", prefix + [10], GREEDY, cache_salt="tenant-a")
    run_engine(engine)
    hits = engine.stats().prefix_cache.hits
    engine.add_request("b", prefix + [11], GREEDY, cache_salt="tenant-b")
    engine.add_request("c", prefix + [12], GREEDY)  # no salt: not tenant-a's either
    run_engine(engine)
    assert engine.stats().prefix_cache.hits == hits
    engine.add_request("d", prefix + [13], GREEDY, cache_salt="tenant-a")
    run_engine(engine)
    assert engine.stats().prefix_cache.hits == hits + 96


def test_preempted_requests_find_their_own_blocks_again(make_engine):
    engine = make_engine(num_kv_blocks=12, block_size=16)
    prompts = [_long_prefix(engine, 60)[i * 3 :] + [i] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs = run_engine(engine)
    assert engine.stats().preemptions > 0
    assert engine.stats().prefix_cache.hits > 0
    alone = make_engine(enable_prefix_caching=False)
    for i, prompt in enumerate(prompts):
        alone.add_request(f"r{i}", prompt, params)
    expected = run_engine(alone)
    for i in range(4):
        assert tokens_of(outputs[f"r{i}"]) == tokens_of(expected[f"r{i}"])

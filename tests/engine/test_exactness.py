"""Greedy float32 output of the engine equals transformers' on SmolLM2 (the exactness
contract, docs/architecture.md).

Each scenario drives the engine step by step and checks the pool's integrity after
every step.
"""

from __future__ import annotations

import pytest

from tessera.workers.api import SamplingParams
from tests.helpers import assert_greedy_matches, run_engine, tokens_of

pytestmark = pytest.mark.slow

MAX_NEW = 64
_PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based inks and a wooden press adapted from "
    "those used to make wine. Within fifty years presses operated in more than two hundred "
    "and fifty cities across Europe, and the price of books fell sharply. "
)
PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours of the rainbow:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    _PARAGRAPH + "Summarise this paragraph in one sentence:",
    _PARAGRAPH * 2 + "What fell sharply?",
    _PARAGRAPH * 3 + "Question: in which century does the history begin? Answer:",
]


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    ids = [tuple(smollm2.tokenizer(p).input_ids) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids), "prompts must differ in length"
    return ids


@pytest.fixture(scope="module")
def references(prompt_ids, hf_reference):
    return [hf_reference.greedy(ids, MAX_NEW) for ids in prompt_ids]


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _check(outputs, references):
    for i, ref in enumerate(references):
        deltas = outputs[f"r{i}"]
        assert deltas[-1].finished and deltas[-1].finish_reason.value == "length"
        assert_greedy_matches(tokens_of(deltas), ref)


@pytest.mark.parametrize("native_decode", [True, False], ids=["native", "op-by-op"])
def test_batched_prompts_match_transformers(make_engine, prompt_ids, references, native_decode):
    """Both decode paths: every layer in one native call (the default), and op by op."""
    engine = make_engine(native_decode=native_decode)
    assert engine.runner.native_decode is native_decode
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", list(ids), GREEDY)
    _check(run_engine(engine), references)
    assert engine.stats().preemptions == 0
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_chunked_prefill_matches_transformers(make_engine, prompt_ids, references):
    engine = make_engine(max_num_batched_tokens=16)
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", list(ids), GREEDY)
    outputs = run_engine(engine)
    _check(outputs, references)
    # every step stayed within the budget, so the long prompts were prefilled in chunks
    assert engine.stats().mean_tokens_per_step <= 16
    assert max(len(ids) for ids in prompt_ids) > 16


def test_preemption_keeps_outputs(make_engine, prompt_ids, references):
    longest = max(len(ids) for ids in prompt_ids) + MAX_NEW
    # Room for the longest sequence and a little more: the batch cannot all fit.
    engine = make_engine(num_kv_blocks=-(-longest // 16) + 4)
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", list(ids), GREEDY)
    outputs = run_engine(engine)
    assert engine.stats().preemptions > 0
    _check(outputs, references)
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_requests_arriving_while_others_decode(make_engine, prompt_ids, references):
    engine = make_engine()
    outputs: dict[str, list] = {}
    pending = list(enumerate(prompt_ids))
    step = 0
    while pending or engine.has_work():
        if pending and step % 7 == 0:  # a new request every 7 steps, mid-decode of others
            i, ids = pending.pop(0)
            engine.add_request(f"r{i}", list(ids), GREEDY)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        engine.check_integrity()
        step += 1
    assert engine.stats().mean_batch_size > 1
    _check(outputs, references)

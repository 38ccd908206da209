"""The engine's lean path for steps of plain decodes (``BatchRunner.run_decodes``): the same
tokens as transformers, the blocks generated tokens fill cached for a follow-up prompt,
and a forward that fails leaving the sequences as they were."""

from __future__ import annotations

import pytest

from tessera.workers.api import SamplingParams
from tests.helpers import assert_greedy_matches, run_engine, tokens_of

PROMPTS = [
    "The lighthouse keeper climbed the stairs every evening, and",
    "List three facts about the planet Mars:",
    "def fibonacci(n):",
]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def lean_steps(engine, argmax_only: list | None = None) -> list[int]:
    """The number of sequences of each lean step the engine runs from now on (and into
    ``argmax_only``, whether the step asked the forward for its rows' argmax, and the
    rows whose logits it asked for beside them)."""
    calls: list[int] = []
    execute = engine.runner.execute_decodes

    def counted(seq_ids, token_ids, starts, only=False, logits_for=()):
        calls.append(len(seq_ids))
        if argmax_only is not None:
            argmax_only.append(only if not logits_for else (only, list(logits_for)))
        return execute(seq_ids, token_ids, starts, only, logits_for)

    engine.runner.execute_decodes = counted
    return calls


def test_plain_decodes_take_the_lean_path_and_match_transformers(make_engine, hf_reference):
    engine = make_engine()
    argmax_only: list = []
    calls = lean_steps(engine, argmax_only)
    prompts = [tuple(engine.tokenize(text)) for text in PROMPTS]
    for i, prompt in enumerate(prompts):
        # the last one asks for logprobs: plain, but sampled by the sampler, not the argmax
        engine.add_request(f"r{i}", prompt, greedy(40, logprobs=1 if i == 2 else None))
    # two samples of one prompt are no plain request: while they run, every step takes
    # the general path
    engine.add_request("forked", prompts[0], greedy(10, n=2))
    outputs = run_engine(engine)
    assert calls and set(calls) == {3}  # only once the forked request has ended
    assert len(calls) == 40 - 10  # its last step ran the others' 10th token with it
    # r2's logprobs need its logits; the other two rows take their argmax alone
    assert argmax_only == [(True, [2])] * len(calls)
    for i, prompt in enumerate(prompts):
        assert_greedy_matches(tokens_of(outputs[f"r{i}"]), hf_reference.greedy(prompt, 40))
    assert all(len(d.logprobs) == len(d.token_ids) for d in outputs["r2"])
    for index in (0, 1):
        forked = [d for d in outputs["forked"] if d.index == index]
        assert_greedy_matches(tokens_of(forked), hf_reference.greedy(prompts[0], 10))


def test_blocks_filled_by_generated_tokens_are_cached_for_a_follow_up(make_engine, hf_reference):
    engine = make_engine()
    argmax_only: list[bool] = []
    calls = lean_steps(engine, argmax_only)
    prompt = engine.tokenize(" ".join(PROMPTS) * 3)[:40]
    engine.add_request("first", prompt, greedy(70))
    first = tokens_of(run_engine(engine)["first"])
    assert len(calls) == 69  # every decode after the prompt's step
    assert all(argmax_only)  # greedy: the forward gives its argmax, not its logits
    before = engine.stats().prefix_cache
    follow_up = tuple(prompt + first)
    engine.add_request("second", follow_up, greedy(8))
    second = tokens_of(run_engine(engine)["second"])
    after = engine.stats().prefix_cache
    # the first request computed the K/V of its prompt and of all its tokens but the
    # last: (40 + 69) // 16 = 6 full blocks, 4 of them filled by generated tokens
    assert after.hits - before.hits == 6 * 16
    assert after.queries - before.queries == len(follow_up) == 110
    assert_greedy_matches(second, hf_reference.greedy(follow_up, 8))


def test_a_forward_that_fails_leaves_the_sequences_as_they_were(make_engine, hf_reference):
    engine = make_engine()
    prompt = tuple(engine.tokenize(PROMPTS[0]))
    engine.add_request("r", prompt, greedy(20))
    outputs = engine.step()  # the prompt, and the first token
    before = engine.stats()
    execute = engine.runner.execute_decodes

    def fail_once(*args):
        engine.runner.execute_decodes = execute
        raise RuntimeError("the forward failed")

    engine.runner.execute_decodes = fail_once
    with pytest.raises(RuntimeError, match="the forward failed"):
        engine.step()
    engine.check_integrity()
    after = engine.stats()
    assert (after.steps, after.prompt_tokens, after.generated_tokens) == (
        before.steps,
        before.prompt_tokens,
        before.generated_tokens,
    )
    outputs += run_engine(engine)["r"]
    assert_greedy_matches(tokens_of(outputs), hf_reference.greedy(prompt, 20))
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks  # all freed at the end

"""Prompt logprobs, computed in the prefill pass, against transformers' log-softmax of
the same prompt: whole, chunked, and again after the prompt is in the prefix cache."""

from __future__ import annotations

import pytest
import torch

from tessera.workers.api import SamplingParams
from tests.helpers import run_engine

pytestmark = pytest.mark.slow

PROMPT = "The lighthouse keeper climbed the stairs at dusk and lit the great lamp. " * 3


def reference(hf_model, prompt_ids: list[int], k: int):
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    raw = torch.log_softmax(logits[:-1], dim=-1)
    chosen = raw.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0]
    return chosen, raw.topk(k, dim=1)


@pytest.mark.parametrize("batched_tokens", [2048, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(make_engine, hf_reference, batched_tokens):
    engine = make_engine(max_num_batched_tokens=batched_tokens)
    prompt_ids = engine.tokenizer(PROMPT).input_ids
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    outputs = []
    for rid in ("first", "again"):  # "again": its prompt is in the prefix cache by then
        engine.add_request(rid, prompt_ids, params)
        deltas = run_engine(engine)[rid]
        assert [d.prompt_logprobs is not None for d in deltas][0]
        assert all(d.prompt_logprobs is None for d in deltas[1:])
        outputs.append(deltas[0].prompt_logprobs)
    chosen, (top_values, top_ids) = reference(hf_reference.model, prompt_ids, 3)
    for ours in outputs:
        assert len(ours) == len(prompt_ids) and ours[0] is None
        assert [e.token_id for e in ours[1:]] == prompt_ids[1:]
        got = torch.tensor([e.logprob for e in ours[1:]])
        torch.testing.assert_close(got, chosen, atol=2e-4, rtol=0)
        for i, entry in enumerate(ours[1:]):
            ids = [t for t, _ in entry.top]
            values = torch.tensor([v for _, v in entry.top])
            torch.testing.assert_close(values, top_values[i], atol=2e-4, rtol=0)
            if ids != top_ids[i].tolist():  # only where two of the top were near-equal
                assert (top_values[i][:-1] - top_values[i][1:]).min() < 1e-4


def test_every_output_of_a_forked_request_carries_the_prompts_logprobs(make_engine):
    """n = 2 of best_of = 3 (sent whole at the end, maybe without the parent): each
    output's first delta has the prompt logprobs of the same prompt run alone."""
    engine = make_engine()
    alone = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    engine.add_request("alone", PROMPT, alone)
    expected = run_engine(engine)["alone"][0].prompt_logprobs
    forked = SamplingParams(max_tokens=4, n=2, best_of=3, seed=3, prompt_logprobs=1)
    engine.add_request("forked", PROMPT, forked)
    deltas = run_engine(engine)["forked"]
    firsts = {}
    for delta in deltas:
        firsts.setdefault(delta.index, delta)
    assert sorted(firsts) == [0, 1]
    for delta in firsts.values():
        assert [e and e.token_id for e in delta.prompt_logprobs] == [
            e and e.token_id for e in expected
        ]
        got = torch.tensor([e.logprob for e in delta.prompt_logprobs[1:]])
        torch.testing.assert_close(got, torch.tensor([e.logprob for e in expected[1:]]))


def test_prompt_logprobs_are_refused_with_beams():
    from tessera.workers.api import InvalidRequestError

    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(beam_width=2, prompt_logprobs=1)
    assert caught.value.field == "prompt_logprobs"

"""Engine beam search against transformers' beam search, and the blocks it shares.

transformers' ``generate(num_beams=W, num_return_sequences=n, length_penalty=...,
early_stopping=...)`` is the reference: the same float32 weights, one prompt at a time,
the same end tokens. Returned beams must be token-identical and their scores equal to
1e-4 (float32 summation order). The pool's integrity is checked after every step.
"""

from __future__ import annotations

import pytest
import torch

from tessera.workers.api import FinishReason, SamplingParams
from tessera.workers.kv.manager import blocks_needed
from tests.helpers import run_engine

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
]
# (beam width, n returned, length_penalty, early_stopping, max_tokens)
CASES = [
    (2, 2, 1.0, False, 12),
    (4, 2, 1.0, True, 12),
    (4, 4, 0.0, "never", 10),
    (8, 3, 2.0, False, 8),
    (8, 8, -0.5, "never", 8),
]


def hf_beam_search(model, prompt_ids, eos, width, n, length_penalty, early_stopping, max_tokens):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            num_beams=width,
            num_return_sequences=n,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=list(eos),
            pad_token_id=eos[0],
            output_scores=True,
            return_dict_in_generate=True,
        )
    beams = []
    for row in range(n):
        length = int((out.beam_indices[row] != -1).sum())  # generated tokens in this beam
        tokens = out.sequences[row, len(prompt_ids) : len(prompt_ids) + length].tolist()
        beams.append((tokens, float(out.sequences_scores[row])))
    return beams


def engine_beam_search(engine, request_id, prompt_ids, **params):
    engine.add_request(request_id, prompt_ids, SamplingParams(**params))
    outputs = run_engine(engine)[request_id]
    assert all(o.finished for o in outputs)
    return sorted(outputs, key=lambda o: o.index)


def assert_same_beams(ours, reference):
    assert [list(o.token_ids) for o in ours] == [tokens for tokens, _ in reference]
    for output, (_, score) in zip(ours, reference, strict=True):
        # A beam's score sums its tokens' logprobs; packed GGUF weights sum each matmul in
        # another float32 order than transformers' dense one (1e-5 relative on a -10 score)
        assert output.score == pytest.approx(score, abs=1e-4, rel=2e-5)


@pytest.mark.parametrize("width,n,length_penalty,early_stopping,max_tokens", CASES)
def test_smollm2_beams_match_transformers(
    make_engine, hf_reference, width, n, length_penalty, early_stopping, max_tokens
):
    engine = make_engine()
    eos = engine.model_config.eos_token_ids
    for i, prompt in enumerate(PROMPTS):
        prompt_ids = engine.tokenize(prompt)
        reference = hf_beam_search(
            hf_reference.model,
            prompt_ids,
            eos,
            width,
            n,
            length_penalty,
            early_stopping,
            max_tokens,
        )
        ours = engine_beam_search(
            engine,
            f"beam-{i}",
            prompt_ids,
            beam_width=width,
            n=n,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            max_tokens=max_tokens,
        )
        assert_same_beams(ours, reference)
        for output in ours:
            ended = output.token_ids[-1] in eos
            assert output.finish_reason is (FinishReason.STOP if ended else FinishReason.LENGTH)
            assert output.text == engine.tokenizer.decode(
                list(output.token_ids), skip_special_tokens=True
            )
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


@pytest.mark.parametrize("width", [2, 4, 8])
def test_tiny_llama_beams_match_transformers(tiny_llama, width):
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine

    path, hf_model = tiny_llama
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=128, block_size=4))
    eos = engine.model_config.eos_token_ids
    generator = torch.Generator().manual_seed(width)
    for i in range(3):
        prompt_ids = torch.randint(3, 500, (5 + 7 * i,), generator=generator).tolist()
        for length_penalty, early_stopping in ((1.0, False), (0.5, True), (1.5, "never")):
            reference = hf_beam_search(
                hf_model, prompt_ids, eos, width, width, length_penalty, early_stopping, 9
            )
            ours = engine_beam_search(
                engine,
                f"b{i}-{early_stopping}",
                prompt_ids,
                beam_width=width,
                n=width,
                length_penalty=length_penalty,
                early_stopping=early_stopping,
                max_tokens=9,
            )
            assert_same_beams(ours, reference)


def _expected_blocks_in_use(beams, block_size: int) -> int:
    """Distinct blocks the beams hold if they share exactly up to where they differ:
    block i is one block for all beams that agree on every computed token up to its end."""
    total = 0
    computed = beams[0].num_computed_tokens
    for i in range(blocks_needed(computed, block_size)):
        end = min((i + 1) * block_size, computed)
        total += len({tuple(b.token_ids[:end]) for b in beams})
    return total


def test_beams_share_blocks_up_to_their_divergence(make_engine):
    engine = make_engine(block_size=4)
    prompt_ids = engine.tokenize("Here is a list of the planets of the solar system:")
    params = SamplingParams(beam_width=4, n=4, max_tokens=16, early_stopping="never")
    engine.add_request("r", prompt_ids, params)
    saved = []
    while engine.has_work():
        engine.step()
        engine.check_integrity()
        group = engine.groups.get("r")
        if group is None or len(group.seqs) < 4:
            continue
        beams = group.seqs
        in_use = engine.kv.pool.num_used
        assert in_use == _expected_blocks_in_use(beams, 4)
        unshared = sum(len(engine.kv.block_ids(b.seq_id)) for b in beams)
        assert unshared == 4 * blocks_needed(beams[0].num_computed_tokens, 4)
        saved.append(unshared - in_use)
    # the prompt's blocks are shared all along: at least 3 copies of them saved per step
    assert min(saved) >= 3 * (len(prompt_ids) // 4)
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_beam_search_without_sharing_gives_the_same_beams_with_more_blocks(make_engine):
    prompt_ids = make_engine().tokenize("The three primary colours are")
    params = SamplingParams(beam_width=4, n=4, max_tokens=12)
    shared = make_engine(block_size=4)
    copied = make_engine(block_size=4, enable_block_sharing=False, enable_prefix_caching=False)
    ours = engine_beam_search(shared, "r", prompt_ids, **_fields(params))
    theirs = engine_beam_search(copied, "r", prompt_ids, **_fields(params))
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert [o.score for o in ours] == pytest.approx([o.score for o in theirs], abs=1e-5)
    assert shared.stats().peak_used_blocks < copied.stats().peak_used_blocks


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_beam_groups_batch_with_other_requests_and_survive_preemption(make_engine):
    prompts = [make_engine().tokenize(p) for p in PROMPTS]
    params = SamplingParams(beam_width=4, n=2, max_tokens=10)
    alone = make_engine()
    expected = [
        engine_beam_search(alone, f"r{i}", p, **_fields(params)) for i, p in enumerate(prompts)
    ]
    # a pool too small for all three groups at once: groups are preempted whole and redone
    tight = make_engine(num_kv_blocks=14, block_size=4)
    for i, p in enumerate(prompts):
        tight.add_request(f"r{i}", p, params)
    tight.add_request("plain", prompts[0], SamplingParams(max_tokens=8, temperature=0.0))
    outputs = run_engine(tight)
    assert tight.stats().preemptions > 0
    for i in range(3):
        got = sorted(outputs[f"r{i}"], key=lambda o: o.index)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected[i]]
        assert [o.score for o in got] == pytest.approx([o.score for o in expected[i]], abs=1e-4)
    assert tight.kv.num_free_blocks == tight.kv.pool.num_blocks


def test_abort_in_the_middle_of_a_beam_group_leaks_nothing(make_engine):
    engine = make_engine(block_size=4)
    engine.add_request(
        "r", engine.tokenize("Tell me a story."), SamplingParams(beam_width=8, n=3, max_tokens=40)
    )
    for _ in range(5):
        engine.step()
    assert len(engine.groups["r"].seqs) == 8 and engine.kv.pool.num_used > 0
    engine.abort("r")  # no step running: applied at once
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    final = engine.step()
    assert [(o.index, o.finished, o.finish_reason) for o in final] == [
        (i, True, FinishReason.ABORT) for i in range(3)
    ]
    assert not engine.has_work()


def test_beam_search_refuses_what_it_does_not_support(make_engine):
    from tessera.workers.api import InvalidRequestError

    engine = make_engine(max_num_seqs=4)
    with pytest.raises(
        InvalidRequestError, match="beam_width: 8 sequences exceed the engine's max_num_seqs"
    ):
        engine.add_request("r", "hi", SamplingParams(beam_width=8))
    for kwargs, field in (
        (dict(beam_width=2, n=3), "n"),
        (dict(beam_width=2, stop=("x",)), "stop"),
        (dict(beam_width=2, logprobs=1), "logprobs"),
        (dict(beam_width=2, early_stopping="sometimes"), "early_stopping"),
        (dict(beam_width=0), "beam_width"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs)
        assert info.value.field == field

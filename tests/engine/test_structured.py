"""Structured outputs in the engine: greedy decoding under a grammar equals
transformers' greedy decoding with the same grammar's mask applied step by step (the
reference is built here from llguidance's own matcher and transformers' logits);
sampled outputs validate; forks, failover (resume) and refusals behave."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch

from tessera.workers.api import (
    InvalidRequestError,
    Resume,
    SamplingParams,
    SpeculativeParams,
    StructuredParams,
)
from tessera.workers.decoding.structured import grammar_text
from tests.helpers import NEAR_TIE_GAP, run_engine, text_of, tokens_of

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPT = "Describe a person as JSON:"


def masked_greedy(hf_model, tokenizer, prompt_ids, params: StructuredParams, max_tokens: int):
    """transformers' greedy loop with llguidance's mask: (tokens, gaps between the best
    two allowed logits)."""
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=hf_model.config.vocab_size)
    matcher = llguidance.LLMatcher(lltok, grammar_text(params))
    vocab = hf_model.config.vocab_size
    tokens, gaps = [], []
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_tokens):
            allowed = torch.zeros(vocab, dtype=torch.bool)
            allowed[[i for i, byte in enumerate(matcher.compute_logit_bias()[:vocab]) if byte]] = (
                True
            )
            logits = out.logits[0, -1].float().masked_fill(~allowed, -torch.inf)
            top2 = logits.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            token = int(logits.argmax())
            tokens.append(token)
            if token == tokenizer.eos_token_id:
                break
            assert matcher.consume_token(token)
            out = hf_model(torch.tensor([[token]]), past_key_values=out.past_key_values)
    return tokens, gaps


@pytest.mark.parametrize(
    "params",
    [
        StructuredParams("json", json.dumps(PERSON)),
        StructuredParams("regex", r"(19|20)\d\d-[01]\d-[0-3]\d"),
        StructuredParams("choice", json.dumps(["lighthouse", "harbour", "ship"])),
        StructuredParams("grammar", 'start: "yes" | "no" | "maybe"'),
    ],
    ids=["json", "regex", "choice", "grammar"],
)
def test_greedy_under_a_grammar_equals_transformers_masked(make_engine, hf_reference, params):
    engine = make_engine()
    prompt_ids = engine.tokenizer(PROMPT).input_ids
    engine.add_request(
        "r", prompt_ids, SamplingParams(max_tokens=60, temperature=0, structured=params)
    )
    out = run_engine(engine)["r"]
    ours = tokens_of(out)
    ref, gaps = masked_greedy(hf_reference.model, engine.tokenizer, prompt_ids, params, 60)
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            assert gaps[i] < NEAR_TIE_GAP, (i, a, b, gaps[i])
            return
    assert ours == ref
    assert out[-1].finish_reason.value == "stop"


def test_sampled_outputs_validate_and_forks_sample_as_alone(make_engine):
    """n = 3 seeded forks, each its own matcher: every output is valid JSON for the
    schema, and fork i gives what a lone request with seed + i gives."""
    params = StructuredParams("json", json.dumps(PERSON))
    engine = make_engine()
    sampled = {"temperature": 1.0, "max_tokens": 80, "structured": params}
    engine.add_request("forks", PROMPT, SamplingParams(n=3, seed=11, **sampled))
    for i in range(3):
        engine.add_request(f"alone{i}", PROMPT, SamplingParams(seed=11 + i, **sampled))
    out = run_engine(engine)
    forks: dict[int, str] = {}
    for delta in out["forks"]:
        forks[delta.index] = forks.get(delta.index, "") + delta.text
    for i in range(3):
        jsonschema.validate(json.loads(forks[i]), PERSON)
        assert forks[i] == text_of(out[f"alone{i}"])


def test_a_resumed_request_replays_its_tokens_into_the_grammar(make_engine):
    """Failover: a request resumed after k tokens ends as the undisturbed one does."""
    params = SamplingParams(
        max_tokens=60,
        temperature=1.0,
        seed=5,
        structured=StructuredParams("json", json.dumps(PERSON)),
    )
    engine = make_engine()
    engine.add_request("whole", PROMPT, params)
    whole = tokens_of(run_engine(engine)["whole"])
    engine.add_request("resumed", PROMPT, params, resume=Resume(tuple(whole[:7]), 0.0))
    assert whole[:7] + tokens_of(run_engine(engine)["resumed"]) == whole


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"beam_width": 2}, "beam_width"),
        ({"ignore_eos": True}, "ignore_eos"),
    ],
)
def test_what_a_grammar_does_not_combine_with_is_refused_by_name(extra, field):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(structured=StructuredParams("regex", "a+"), **extra)
    assert caught.value.field == field


def test_a_bad_spec_is_refused_naming_it(make_engine):
    engine = make_engine()
    for spec in ("{not json", '{"type": "nonsense"}'):
        with pytest.raises(InvalidRequestError) as caught:
            engine.add_request(
                "bad", PROMPT, SamplingParams(structured=StructuredParams("json", spec))
            )
        assert caught.value.field == "structured.spec"


def test_grammar_with_speculation_preemption_and_a_busy_batch_equals_grammar_alone(make_engine):
    """Speculative (ngram) asked for: the structured request decodes one token a step
    and gives the grammar-alone text; the same under preemption (a tiny pool); and 16
    plain requests beside grammar ones give exactly what they give alone."""
    params = StructuredParams("json", json.dumps(PERSON))
    greedy = {"max_tokens": 60, "temperature": 0, "structured": params}
    alone = make_engine()
    alone.add_request("g", PROMPT, SamplingParams(**greedy))
    expected = tokens_of(run_engine(alone)["g"])
    speculating = make_engine()
    spec = SpeculativeParams("ngram", 4)
    speculating.add_request("g", PROMPT, SamplingParams(speculative=spec, **greedy))
    assert tokens_of(run_engine(speculating)["g"]) == expected
    plain = [f"Item {i}: the lighthouse" for i in range(16)]
    references = {}
    for i, prompt in enumerate(plain):
        engine = make_engine()
        engine.add_request("p", prompt, SamplingParams(max_tokens=24, temperature=0))
        references[f"p{i}"] = tokens_of(run_engine(engine)["p"])
    crowded = make_engine(num_kv_blocks=24)  # 16 + 3 requests on 24 blocks: preemptions
    for i, prompt in enumerate(plain):
        crowded.add_request(f"p{i}", prompt, SamplingParams(max_tokens=24, temperature=0))
    for i in range(3):
        crowded.add_request(f"g{i}", PROMPT, SamplingParams(**greedy))
    out = run_engine(crowded)
    assert crowded.stats().preemptions > 0
    assert {rid: tokens_of(out[rid]) for rid in references} == references
    for i in range(3):
        assert tokens_of(out[f"g{i}"]) == expected


def test_a_grammar_row_takes_logits_and_the_other_rows_their_argmax_alone(make_engine, monkeypatch):
    """A decode step of plain greedy rows and one constrained row asks the forward for
    the argmax of the plain rows and the logits of the constrained one only (the head's
    argmax screen stays on for the others); every output is what it is alone."""
    params = StructuredParams("json", json.dumps(PERSON))
    prompts = [f"Item {i}: the lighthouse" for i in range(3)]
    references = {}
    for i, prompt in enumerate(prompts):
        engine = make_engine()
        engine.add_request("p", prompt, SamplingParams(max_tokens=12, temperature=0))
        references[f"p{i}"] = tokens_of(run_engine(engine)["p"])
    alone = make_engine()
    alone.add_request("g", PROMPT, SamplingParams(max_tokens=12, temperature=0, structured=params))
    references["g"] = tokens_of(run_engine(alone)["g"])
    engine = make_engine()
    calls = []
    forward = type(engine.runner.model).forward

    def spy(model, *args, **kwargs):
        calls.append((kwargs.get("argmax_only"), kwargs.get("logits_for")))
        return forward(model, *args, **kwargs)

    monkeypatch.setattr(type(engine.runner.model), "forward", spy)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=12, temperature=0))
    engine.add_request("g", PROMPT, SamplingParams(max_tokens=12, temperature=0, structured=params))
    out = run_engine(engine)
    assert {rid: tokens_of(outs) for rid, outs in out.items()} == references
    split = [rows.tolist() for argmax_only, rows in calls if argmax_only and rows is not None]
    assert split and all(rows == [3] for rows in split), calls
    assert not any(argmax_only is False for argmax_only, _ in calls[1:]), calls


async def test_the_async_engine_builds_a_grammars_matcher_beside_the_step_loop(make_engine):
    """The matcher of a structured request is built off the engine thread (a large
    grammar's takes tens of milliseconds that every stream would wait), and the request
    runs as the engine alone runs it."""
    import threading

    from tessera.workers.engine.async_engine import AsyncEngine

    sampling = SamplingParams(
        max_tokens=10, temperature=0, structured=StructuredParams("json", json.dumps(PERSON))
    )
    alone = make_engine()
    alone.add_request("g", PROMPT, sampling)
    expected = tokens_of(run_engine(alone)["g"])
    engine = make_engine()
    threads = []
    build = engine.grammars.matcher

    def spy(*args):
        threads.append(threading.current_thread().name)
        return build(*args)

    engine.grammars.matcher = spy
    front = AsyncEngine(engine)
    try:
        outputs = [out async for out in await front.add_request("g", PROMPT, sampling)]
    finally:
        await front.close()
    assert tokens_of(outputs) == expected
    assert len(threads) == 1 and not threads[0].startswith("tessera-engine"), threads


def test_prepare_wraps_the_tokenizer_once_and_logs_one_llguidance_cannot_take(
    make_engine, monkeypatch, caplog
):
    """A serving worker wraps its tokenizer at start (``prepare``: ~0.3 s, most of it
    holding the GIL, that the steps beside a first structured request would otherwise
    wait): the wrapped tokenizer is kept; one llguidance cannot read, or cannot wrap (a
    model's vocabulary smaller than its tokenizer's), is logged at start, never fails the
    worker, and is refused per request with the same message, decided once."""
    import llguidance.hf

    grammars = make_engine().grammars
    grammars.prepare()
    wrapped = grammars.tokenizer
    grammars.prepare()
    assert grammars.tokenizer is wrapped

    class Unreadable:
        def decode_bytes(self, ids):
            return b"?"

    def too_small(*args, **kwargs):
        calls.append(args)
        raise ValueError("vocab size too small; 512 vs 49152")

    unavailable = "structured outputs are unavailable on this server: llguidance "
    for wrap, message in [
        (
            lambda *args, **kwargs: Unreadable(),
            f"{unavailable}cannot read its tokenizer's bytes "
            "(transformers >= 5.24 converts it right)",
        ),
        (too_small, f"{unavailable}cannot wrap its tokenizer: vocab size too small; 512 vs 49152"),
    ]:
        calls: list = []
        monkeypatch.setattr(llguidance.hf, "from_tokenizer", wrap)
        unreadable = make_engine().grammars
        caplog.clear()
        with caplog.at_level("WARNING", logger="tessera.workers.decoding.structured"):
            unreadable.prepare()
        assert [record.getMessage() for record in caplog.records] == [message]
        for _ in range(2):
            with pytest.raises(InvalidRequestError) as refused:
                unreadable.tokenizer  # noqa: B018
            assert (refused.value.field, refused.value.message) == ("structured", message)
    assert len(calls) == 1  # the refusal is kept, not found again per request

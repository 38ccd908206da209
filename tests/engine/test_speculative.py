"""Speculative decoding: greedy output equals plain decoding (and transformers), sampled
output has the target's distribution, rejected drafts leave no blocks behind."""

from __future__ import annotations

import pytest
import torch

from tessera.workers.api import InvalidRequestError, SamplingParams, SpeculativeParams
from tessera.workers.decoding.speculative import ngram_proposal
from tessera.workers.kv.manager import blocks_needed
from tests.helpers import assert_greedy_matches, run_engine, tokens_of

PASSAGE = (
    "The old lighthouse keeper climbed the stairs every evening at dusk. He lit the lamp, "
    "wound the clock, and watched the ships pass by the rocky shore."
)
PROMPTS = [
    f"Repeat this passage exactly, word for word:\n{PASSAGE}\nRepeated passage:\n",
    "Write a short poem about autumn leaves.",
    "List the first ten prime numbers:",
    "Explain in one sentence why the sky is blue.",
]
MAX_TOKENS = 32


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **kwargs)


def run_batch(engine, sampling: SamplingParams, check=None) -> dict[str, list]:
    """All prompts in one batch; the pool's integrity (and ``check``) after every step."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, sampling)
    outputs: dict[str, list] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        engine.check_integrity()
        if check is not None:
            check(engine)
    return outputs


def no_blocks_past_computed(engine) -> None:
    """After a step, a speculating sequence holds exactly the blocks of its computed
    tokens, in the target's pool and in the draft's: rejected drafts gave theirs back."""
    bs = engine.kv.block_size
    draft = engine.speculator.draft
    for group in engine.batcher.running:
        for seq in group.seqs:
            if seq.spec is None or seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            assert len(engine.kv.tables[seq.seq_id]) == blocks_needed(seq.num_computed_tokens, bs)
            if draft is not None and seq.seq_id in draft.kv.tables:
                held = len(draft.kv.tables[seq.seq_id])
                assert held == blocks_needed(seq.spec.draft_computed, bs)


@pytest.fixture(scope="module")
def plain(smollm2) -> dict[str, list[int]]:
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine

    engine = Engine(EngineConfig(num_kv_blocks=256), loaded=smollm2)
    return {k: tokens_of(v) for k, v in run_batch(engine, greedy()).items()}


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory, smollm2):
    """A tiny random Llama with SmolLM2's vocabulary: a draft that is mostly wrong."""
    import transformers

    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=smollm2.config.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny-draft")
    model.save_pretrained(path)
    smollm2.tokenizer.save_pretrained(path)
    return path


def test_prompt_lookup_proposes_the_latest_continuation():
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]
    assert ngram_proposal([4, 1, 8, 1], 2) == [8, 1]  # falls back to the last token alone
    assert ngram_proposal([1, 2, 3], 4) == []
    assert ngram_proposal([5, 6, 5], 4) == [6, 5]  # shorter than asked near the end


def test_prompt_lookup_greedy_equals_plain_decoding_and_accepts_drafts(make_engine, plain):
    engine = make_engine()
    outputs = run_batch(
        engine, greedy(speculative=SpeculativeParams("ngram", 4)), no_blocks_past_computed
    )
    for request_id, deltas in outputs.items():
        assert tokens_of(deltas) == plain[request_id], request_id
    copy = outputs["r0"][-1].speculative
    assert copy.accepted > 0 and copy.steps > 0
    # it copies the passage: most steps give more than one token
    assert copy.tokens > copy.steps
    stats = engine.stats()
    assert stats.spec_accepted == sum(d[-1].speculative.accepted for d in outputs.values())
    assert stats.spec_proposed == sum(d[-1].speculative.proposed for d in outputs.values())
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_the_target_as_its_own_draft_accepts_every_draft(make_engine, plain):
    engine = make_engine(draft_model="target")
    outputs = run_batch(
        engine, greedy(speculative=SpeculativeParams("draft", 3)), no_blocks_past_computed
    )
    for request_id, deltas in outputs.items():
        assert tokens_of(deltas) == plain[request_id], request_id
        stats = deltas[-1].speculative
        assert stats.accepted == stats.proposed > 0
        assert stats.tokens == stats.accepted + stats.steps
    assert engine.speculator.draft.kv.num_free_blocks == engine.speculator.draft.kv.pool.num_blocks


def test_a_random_draft_is_rejected_and_the_output_stays_exact(
    make_engine, plain, tiny_draft_dir, hf_reference, smollm2
):
    engine = make_engine(draft_model=str(tiny_draft_dir))
    outputs = run_batch(
        engine, greedy(speculative=SpeculativeParams("draft", 4)), no_blocks_past_computed
    )
    for request_id, deltas in outputs.items():
        assert tokens_of(deltas) == plain[request_id], request_id
    total = engine.stats()
    assert total.spec_proposed > 0
    assert total.spec_acceptance_rate < 0.5
    # adaptive: a draft that keeps failing proposes fewer than the 4 it may
    assert total.spec_proposed < 4 * total.spec_steps
    prompt = tuple(smollm2.tokenizer(PROMPTS[1]).input_ids)
    assert_greedy_matches(tokens_of(outputs["r1"]), hf_reference.greedy(prompt, MAX_TOKENS))


def test_speculation_survives_preemption(make_engine, plain):
    # 13 blocks of 16 tokens cannot hold four ~40-token sequences plus their drafts
    engine = make_engine(num_kv_blocks=13, draft_model="target:10")
    outputs = run_batch(engine, greedy(speculative=SpeculativeParams("draft", 4)))
    assert engine.stats().preemptions > 0
    for request_id, deltas in outputs.items():
        assert tokens_of(deltas) == plain[request_id], request_id


def test_the_worker_default_applies_and_a_request_may_opt_out(make_engine, plain):
    engine = make_engine(speculative_method="ngram", speculative_num_tokens=3)
    engine.add_request("default", PROMPTS[0], greedy())
    engine.add_request("off", PROMPTS[0], greedy(speculative=SpeculativeParams(num_tokens=0)))
    engine.add_request("n2", PROMPTS[0], greedy(n=2))
    outputs = run_engine(engine)
    assert tokens_of(outputs["default"]) == plain["r0"]
    assert outputs["default"][-1].speculative.proposed > 0
    assert outputs["off"][-1].speculative is None
    assert all(d.speculative is None for d in outputs["n2"])


def test_seeded_speculative_sampling_is_reproducible(make_engine):
    sampling = SamplingParams(
        max_tokens=16, temperature=0.8, seed=11, speculative=SpeculativeParams("draft", 3)
    )
    runs = []
    for _ in range(2):
        engine = make_engine(draft_model="target:8")
        engine.add_request("s", PROMPTS[1], sampling)
        runs.append(tokens_of(run_engine(engine)["s"]))
    assert runs[0] == runs[1] and len(runs[0]) == 16


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"method": "lookahead"}, "speculative.method", "must be one of ngram, draft"),
        ({"num_tokens": 17}, "speculative.num_tokens", "must be in [0, 16], got 17"),
        ({"num_tokens": 2.5}, "speculative.num_tokens", "must be an integer"),
        ({"adaptive": "yes"}, "speculative.adaptive", "must be true or false"),
    ],
)
def test_bad_speculative_settings_name_the_field(kwargs, field, message):
    with pytest.raises(InvalidRequestError) as error:
        SpeculativeParams(**kwargs)
    assert error.value.field == field and message in str(error.value)


def test_speculation_is_refused_where_it_does_not_apply(make_engine):
    spec = SpeculativeParams("ngram", 2)
    for kwargs, other in [({"n": 2}, "n"), ({"beam_width": 2}, "beam_width")]:
        with pytest.raises(InvalidRequestError, match=f"speculative: .*{other} > 1"):
            SamplingParams(speculative=spec, **kwargs)
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="'draft' needs a worker started with a draft"):
        engine.add_request("d", "Hi", SamplingParams(speculative=SpeculativeParams("draft")))


def test_a_draft_with_another_vocabulary_is_refused(make_engine, tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="draft_model: its vocabulary has 512 tokens"):
        make_engine(draft_model=str(path))


def test_logprobs_stop_strings_and_max_tokens_are_kept(make_engine):
    """Accepted drafts go through the same bookkeeping as sampled tokens: their logprobs
    are the target's, a stop string inside an accepted run ends the output there, and
    max_tokens is never passed."""
    prompt = PROMPTS[0]
    requests = {
        "logprobs": {"max_tokens": 24, "logprobs": 2},
        "stop": {"max_tokens": 40, "stop": ("stairs",)},
        "short": {"max_tokens": 3},
    }
    results = []
    for spec in (None, SpeculativeParams("ngram", 4)):
        engine = make_engine()
        for rid, kwargs in requests.items():
            engine.add_request(rid, prompt, greedy_with(speculative=spec, **kwargs))
        results.append(run_engine(engine))
    plain, fast = results
    assert fast["stop"][-1].speculative.accepted > 0
    assert plain["stop"][-1].stop_reason == "stairs"  # the copied passage reaches it
    for rid in requests:
        assert tokens_of(fast[rid]) == tokens_of(plain[rid]), rid
        assert "".join(d.text for d in fast[rid]) == "".join(d.text for d in plain[rid])
        assert fast[rid][-1].finish_reason == plain[rid][-1].finish_reason
    assert len(tokens_of(fast["short"])) == 3
    want = [lp for d in plain["logprobs"] for lp in d.logprobs]
    got = [lp for d in fast["logprobs"] for lp in d.logprobs]
    assert [g.token_id for g in got] == [w.token_id for w in want]
    assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert [[t for t, _ in g.top] for g in got] == [[t for t, _ in w.top] for w in want]


def greedy_with(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **kwargs)

"""Every family through the engine's paths: a tiny random model of each, saved as a
Hugging Face directory, run by the engine in float32 and compared token for token with
transformers' greedy decoding of the same weights — batched with chunked prefill, with a
prefix-cache hit, preempted for lack of blocks, as n = 2 forks, speculating (prompt
lookup), and as a beam search against transformers' own.

Prompts run several sliding windows long, so the families with windows (Mistral,
Gemma's local layers, Phi-3) attend past them on every path."""

from __future__ import annotations

import pytest
import torch
import transformers

from tessera.workers.api import InvalidRequestError, Resume, SamplingParams, SpeculativeParams
from tessera.workers.config import EngineConfig
from tessera.workers.engine.cuda_graphs import DecodeGraphs
from tessera.workers.engine.engine import Engine
from tests.engine.test_beam_search import assert_same_beams, engine_beam_search, hf_beam_search
from tests.helpers import (
    TINY_FIELDS,
    TransformersReference,
    assert_greedy_matches,
    run_engine,
    tokens_of,
)

VOCAB = 512
MAX_TOKENS = 24
WINDOW = 8
COMMON = {**TINY_FIELDS, "vocab_size": VOCAB, "pad_token_id": 0}
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=False)),
    "mistral-window": (transformers.MistralConfig, dict(sliding_window=WINDOW)),
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=15.0,
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    # LongRoPE from a 32-token original context: the long prompt and every decode past
    # it take the long factors
    "phi3-longrope": (
        transformers.Phi3Config,
        dict(
            sliding_window=WINDOW,
            original_max_position_embeddings=32,
            rope_parameters={
                "rope_type": "longrope",
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.5, 2.0, 2.5],
                "long_factor": [2.0, 4.0, 8.0, 16.0],
            },
        ),
    ),
    # dynamic NTK from a 32-token context: the long prompt and every decode past it
    "llama-dynamic": (
        transformers.LlamaConfig,
        dict(
            max_position_embeddings=32,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
        ),
    ),
    # experts on the outer layers (a shared one too), a dense middle layer
    "qwen2-moe": (
        transformers.Qwen2MoeConfig,
        dict(
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        ),
    ),
}


def build(name: str, path, tokenizer) -> transformers.PreTrainedModel:
    """Family ``name``'s tiny model, saved with ``tokenizer`` at ``path``; weights scaled
    up so that the logits are peaked (a random model's are nearly flat, and near-ties
    would hide mistakes)."""
    config_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = config_cls(**{**COMMON, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(0.5, 0.5)
            elif param_name.endswith("mlp.gate.weight"):  # MoE routers: no near-tie choices
                param.normal_(0.0, 1.0)
            else:
                param.mul_(4.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, smollm2):
    """The directory and transformers' model."""
    path = tmp_path_factory.mktemp(request.param)
    return path, build(request.param, path, smollm2.tokenizer)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **kwargs)


def test_engine_paths_match_transformers(family):
    path, model = family
    reference = TransformersReference(model)
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(3, VOCAB, (20,), generator=generator).tolist()
    prompts = {
        "long": torch.randint(3, VOCAB, (37,), generator=generator).tolist(),
        "short": torch.randint(3, VOCAB, (5,), generator=generator).tolist(),
        "prefix-a": shared + [7, 8, 9],
        "prefix-b": shared + [10, 11],
    }
    # a 16-token step budget chunks the long prompt; 48 blocks of 4 tokens are too few
    # for all of them at full length, so the youngest is preempted and recomputed (where
    # every layer has a window, blocks behind it are given back: 20 are too few then)
    windowed = bool(getattr(model.config, "sliding_window", None)) and all(
        kind == "sliding_attention" for kind in getattr(model.config, "layer_types", None) or ()
    )
    engine = Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            block_size=4,
            num_kv_blocks=20 if windowed else 48,
            max_num_batched_tokens=16,
        )
    )
    assert engine.window == (WINDOW if windowed else 0)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy())
    engine.add_request("forked", prompts["short"], greedy(n=2))
    # prompt lookup: a prompt that repeats itself, so drafts are proposed and accepted
    looped = prompts["short"] * 4
    engine.add_request("speculative", looped, greedy(speculative=SpeculativeParams("ngram", 3)))
    outputs = run_engine(engine)
    stats = engine.stats()
    assert stats.preemptions > 0
    assert (stats.released_blocks > 0) == windowed
    assert stats.prefix_cache.hits > 0
    for request_id, prompt in prompts.items():
        assert_greedy_matches(
            tokens_of(outputs[request_id]), reference.greedy(tuple(prompt), MAX_TOKENS)
        )
    for index in (0, 1):
        forked = [d for d in outputs["forked"] if d.index == index]
        assert_greedy_matches(
            tokens_of(forked), reference.greedy(tuple(prompts["short"]), MAX_TOKENS)
        )
    assert_greedy_matches(
        tokens_of(outputs["speculative"]), reference.greedy(tuple(looped), MAX_TOKENS)
    )


def test_beam_search_matches_transformers(family):
    path, model = family
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=128, block_size=4))
    eos = engine.model_config.eos_token_ids
    prompt = torch.randint(3, VOCAB, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    reference = hf_beam_search(model, prompt, eos, 4, 2, 1.0, False, 10)
    ours = engine_beam_search(
        engine, "beams", prompt, beam_width=4, n=2, length_penalty=1.0, max_tokens=10
    )
    assert_same_beams(ours, reference)


@pytest.mark.parametrize("static_decode", ["dynamic", "eager"])
def test_blocks_behind_every_window_are_given_back(static_decode, tmp_path, smollm2):
    """A model whose every layer has a window gives back each block once no query to
    come attends to it: the sequence's next query, at index ``i``, attends to indices
    past ``i - window``. One request, its 37-token prompt and 24 tokens: the last step
    computes index 59, so blocks 0..12 (indices 0..51) are given back before it, and the
    tokens stay transformers' (on the dynamic path, and on the static one that CUDA
    graphs capture, run eagerly here)."""
    torch.manual_seed(0)
    config_cls, extra = FAMILIES["mistral-window"]
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**COMMON, **extra}))
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0)
    model.eval().save_pretrained(tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)
    engine = Engine(
        EngineConfig(model=str(tmp_path), dtype="float32", block_size=4, num_kv_blocks=64)
    )
    if static_decode == "eager":  # the static path, without capturing graphs
        runner = engine.runner
        runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_cache, 4, capture=False)
    prompt = torch.randint(3, VOCAB, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.add_request("windowed", prompt, greedy())
    outputs = run_engine(engine)
    assert static_decode == "dynamic" or engine.runner.decode_graphs.steps
    stats = engine.stats()
    assert stats.released_blocks == (37 + MAX_TOKENS - 2 - WINDOW + 1) // 4 == 13
    assert stats.free_blocks == stats.total_blocks
    assert_greedy_matches(
        tokens_of(outputs["windowed"]), TransformersReference(model).greedy(tuple(prompt), 24)
    )


def test_long_prompts_share_blocks_only_with_prompts_of_their_length(tmp_path, smollm2):
    """Dynamic NTK: a prompt past the original context computes its K/V with the base its
    whole length stretches (as transformers' forward over it), so two such prompts with a
    common prefix share no block, while the same prompt again takes every full block from
    the prefix cache; each answer is transformers'."""
    model = build("llama-dynamic", tmp_path, smollm2.tokenizer)
    reference = TransformersReference(model)
    engine = Engine(
        EngineConfig(model=str(tmp_path), dtype="float32", block_size=4, num_kv_blocks=96)
    )
    shared = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    prompts = {
        "a": shared + [7, 8, 9],
        "b": shared + [10, 11, 12, 13],
        "a-again": shared + [7, 8, 9],
    }
    hits = []
    for request_id, prompt in prompts.items():
        before = engine.stats().prefix_cache.hits
        engine.add_request(request_id, prompt, greedy())
        outputs = run_engine(engine)
        hits.append(engine.stats().prefix_cache.hits - before)
        assert_greedy_matches(
            tokens_of(outputs[request_id]), reference.greedy(tuple(prompt), MAX_TOKENS)
        )
    assert hits == [0, 0, (43 - 1) // 4 * 4]


def test_a_text_prompt_past_the_models_vocabulary_is_refused(tmp_path, smollm2):
    """A tokenizer larger than the model's vocabulary (here SmolLM2's beside a 512-token
    model) gives a clear error naming the field and the limit, never an index error."""
    build("qwen3", tmp_path, smollm2.tokenizer)
    engine = Engine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=16))
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request("text", "Hello there", greedy())
    assert str(refused.value) == (
        "prompt: the tokenizer gave token id 19556, out of the model's vocabulary "
        "[0, 512) (is --tokenizer the model's?)"
    )


@pytest.mark.parametrize("name", ["llama-dynamic", "mistral-window", "gemma2"])
def test_blocks_moved_between_engines_give_transformers_tokens(name, tmp_path, smollm2):
    """Prefill on one engine, decode on another (the KV handoff of prefill/decode
    disaggregation): a prompt past dynamic NTK's original context (its blocks hashed with
    its length on both sides), past a window that gave its blocks back on the sender (they
    stay in its prefix cache, where the handoff finds them), or past Gemma's local layers'
    window; the receiver takes every moved block as a prefix hit and answers as
    transformers does."""
    model = build(name, tmp_path, smollm2.tokenizer)

    def engine() -> Engine:
        config = EngineConfig(model=str(tmp_path), dtype="float32", block_size=4, num_kv_blocks=64)
        return Engine(config)

    sender, receiver = engine(), engine()
    ids = torch.randint(3, VOCAB, (41,), generator=torch.Generator().manual_seed(6)).tolist()
    sender.add_request("prefill", ids, SamplingParams(max_tokens=1, temperature=0))
    run_engine(sender)
    usable = (len(ids) - 1) // 4
    hashes = sender.handoff.prompt_hashes(ids, None)[:usable]
    blocks = sender.handoff.export(hashes)
    assert blocks is not None and len(blocks) == usable
    reservation = receiver.handoff.reserve(0, hashes)
    for i, kv in enumerate(blocks):
        receiver.handoff.write(reservation, i, kv)
    receiver.handoff.commit(reservation)
    receiver.add_request("decode", ids, greedy())
    outputs = run_engine(receiver)
    assert receiver.stats().prefix_cache.hits == usable * 4
    assert_greedy_matches(
        tokens_of(outputs["decode"]), TransformersReference(model).greedy(tuple(ids), MAX_TOKENS)
    )


@pytest.mark.parametrize("name", ["llama-dynamic", "phi3-longrope", "gemma3"])
def test_a_resumed_request_continues_as_transformers(name, tmp_path, smollm2):
    """Failover: a fresh engine resumes a request whose first tokens another worker sent
    (recomputing them after the prompt, as the prompt's own length keeps the RoPE
    contexts of dynamic NTK and LongRoPE as they were), and goes on with transformers'
    tokens."""
    model = build(name, tmp_path, smollm2.tokenizer)
    ids = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    expected = TransformersReference(model).greedy(tuple(ids), MAX_TOKENS)
    sent = list(expected.token_ids[:15])  # past the 32-token original context on resume
    engine = Engine(
        EngineConfig(model=str(tmp_path), dtype="float32", block_size=4, num_kv_blocks=64)
    )
    engine.add_request("again", ids, greedy(), resume=Resume(tuple(sent)))
    rest = tokens_of(run_engine(engine)["again"])
    assert_greedy_matches(sent + rest, expected)

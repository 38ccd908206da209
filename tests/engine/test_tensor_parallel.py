"""Tensor-parallel groups in process: an engine whose model is split over 2 or 3 ranks
(rank 0 here, the others Ray actors over gloo) against transformers on the same
weights — Llama with GQA, Qwen2 with q/k/v biases, a Qwen2-MoE with a shared expert,
packed GGUF files (the built-in SmolLM2's Q4_1 over 3 ranks, a K-quant mix over 2) —
and the engine's features on a group against the same engine unsplit.

Row-parallel sums change the order of float32 additions, so greedy tokens follow the
exactness contract's near-tie clause (``assert_greedy_matches``)."""

from __future__ import annotations

import time

import pytest
import ray
import torch
import transformers

from tessera.workers.api import (
    ParallelTokensParams,
    SamplingParams,
    SpeculativeParams,
)
from tessera.workers.config import EngineConfig
from tessera.workers.engine.engine import Engine
from tessera.workers.engine.tensor_parallel import GroupFailedError
from tests.engine.test_gguf_types import _tiny_llama, _write_gguf, tokenizer_fields  # noqa: F401
from tests.helpers import (
    REPEATING_PROMPT,
    TransformersReference,
    assert_greedy_matches,
    run_engine,
    save_random_model,
    tokens_of,
)

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]

#: Each other rank's logical share of the tests' 2-CPU Ray cluster.
RESOURCES = {"CPU": 0.5}
PROMPTS = [list(range(3, 40)), list(range(60, 75)), [5, 6, 7]]
MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def group_engine(path, size: int, **config) -> Engine:
    config.setdefault("num_kv_blocks", 128)
    return Engine(
        EngineConfig(model=str(path), tensor_parallel_size=size, **config),
        rank_resources=RESOURCES,
    )


def greedy_tokens(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    out = run_engine(engine)
    return [tokens_of(out[f"r{i}"]) for i in range(len(prompts))]


#: (transformers' config class, fields over ``TINY_FIELDS``) of each family split here.
FAMILIES = {
    "llama-gqa": ("LlamaConfig", {}),
    # fewer KV heads than ranks: the one KV head replicated on both
    "llama-mqa": ("LlamaConfig", {"num_key_value_heads": 1}),
    "qwen2-bias": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        {
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_over_two_ranks_match_transformers(family, tmp_path, smollm2):
    config_class, fields = FAMILIES[family]
    hf = save_random_model(tmp_path, smollm2.tokenizer, config_class, **fields)
    reference = TransformersReference(hf)
    # chunked prefill: the 37-token prompt runs in chunks next to the others' decodes
    engine = group_engine(tmp_path, 2, max_num_batched_tokens=24)
    try:
        assert engine.loaded.model.config.num_heads == 2  # rank 0 holds half the heads
        for prompt, ours in zip(PROMPTS, greedy_tokens(engine, PROMPTS), strict=True):
            assert_greedy_matches(ours, reference.greedy(tuple(prompt), MAX_NEW))
    finally:
        engine.close()


def test_smollm2_q4_1_over_three_ranks(smollm2_path, hf_reference, make_engine, smollm2):
    """The built-in GGUF (9 heads, 3 KV heads, its Q4_1 matrices split without unpacking)
    on 3 ranks: greedy against transformers; prefix caching, n > 1 forks, beam search,
    prompt lookup and parallel tokens against the unsplit engine."""
    engine = group_engine(smollm2_path, 3, num_kv_blocks=256)
    prompts = [smollm2.tokenizer.encode(p) for p in ("The capital of France is", "Hi")]
    try:
        # no dense copy: the split matrices stay the file's Q4_1 rows and blocks
        qkv = engine.loaded.model.layers[0].qkv_proj
        assert qkv.int4 is not None or qkv.packed is not None
        for prompt, ours in zip(prompts, greedy_tokens(engine, prompts), strict=True):
            assert_greedy_matches(ours, hf_reference.greedy(tuple(prompt), MAX_NEW))
        # a prompt run twice: the second time its full blocks come from the prefix cache
        long = [smollm2.tokenizer.encode(REPEATING_PROMPT * 3)]
        first = greedy_tokens(engine, long)
        hits = engine.stats().prefix_cache.hits
        assert greedy_tokens(engine, long) == first == greedy_tokens(make_engine(), long)
        assert engine.stats().prefix_cache.hits - hits >= 32
        features = {
            "ngram": SamplingParams(
                speculative=SpeculativeParams("ngram", 4),
                max_tokens=16,
                temperature=0,
                ignore_eos=True,
            ),
            "parallel": SamplingParams(
                parallel_tokens=ParallelTokensParams(0.05, 3),
                max_tokens=16,
                temperature=0,
                ignore_eos=True,
            ),
            "forks": SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=16),
            "beams": SamplingParams(n=2, beam_width=3, max_tokens=8, temperature=0),
        }
        assert _feature_outputs(engine, features) == _feature_outputs(make_engine(), features)
    finally:
        engine.close()


def _feature_outputs(engine: Engine, requests: dict[str, SamplingParams]) -> dict:
    for request_id, params in requests.items():
        engine.add_request(request_id, REPEATING_PROMPT, params)
    out = run_engine(engine)
    found = {}
    for request_id, deltas in out.items():
        found[request_id] = sorted((d.index, tuple(d.token_ids)) for d in deltas if d.token_ids)
        sets = (s.token_ids for d in deltas for s in d.parallel_sets or ())
        found[request_id + "/sets"] = list(sets)
    return found


def test_k_quant_file_over_two_ranks(tmp_path, smollm2, tokenizer_fields):  # noqa: F811
    """A Q4_K file (its super-blocks of 256 split whole: 512 columns over 2 ranks)
    against transformers reading the same file."""
    from gguf import GGMLQuantizationType

    torch.manual_seed(0)
    model = _tiny_llama(hidden_size=512, intermediate_size=512, tie_word_embeddings=True)
    path = tmp_path / "tiny-q4k.gguf"
    _write_gguf(path, model, GGMLQuantizationType.Q4_K, tokenizer_fields)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    engine = group_engine(path, 2)
    try:
        assert engine.loaded.model.layers[0].o_proj.packed is not None  # still Q4_K
        refs = TransformersReference(reference)
        for prompt, ours in zip(PROMPTS, greedy_tokens(engine, PROMPTS), strict=True):
            assert_greedy_matches(ours, refs.greedy(tuple(prompt), MAX_NEW))
    finally:
        engine.close()


def _placement_groups() -> int:
    return sum(
        1 for group in ray.util.placement_group_table().values() if group["state"] != "REMOVED"
    )


def test_sizes_that_do_not_split_are_refused_before_any_rank_starts(
    smollm2_path,
    tmp_path,
    tokenizer_fields,  # noqa: F811
):
    from gguf import GGMLQuantizationType

    before = _placement_groups()
    with pytest.raises(ValueError) as error:
        group_engine(smollm2_path, 2)
    assert str(error.value) == (
        "tensor_parallel_size: 2 does not divide the model's 9 attention heads"
    )
    # K-quant super-blocks are never cut: 256 columns over 2 ranks would be
    torch.manual_seed(0)
    model = _tiny_llama(hidden_size=256, intermediate_size=512)
    path = tmp_path / "tiny-q4k.gguf"
    _write_gguf(path, model, GGMLQuantizationType.Q4_K, tokenizer_fields)
    with pytest.raises(ValueError) as error:
        group_engine(path, 2)
    assert str(error.value) == (
        "tensor_parallel_size: tensor 'model.layers.0.self_attn.o_proj.weight' (Q4_K, "
        "[256, 256]) cannot be split over 2 ranks: its 256 columns give 128 each, not a "
        "multiple of the Q4_K block of 256"
    )
    assert _placement_groups() == before


def test_more_ranks_than_the_cluster_has_cpus_is_refused(tiny_llama):
    path, _ = tiny_llama
    before = _placement_groups()
    with pytest.raises(ValueError) as error:
        Engine(
            EngineConfig(model=str(path), tensor_parallel_size=4, num_kv_blocks=32),
            rank_resources={"CPU": 1.0},
        )
    message = str(error.value)
    assert message.startswith(
        "tensor_parallel_size: 4 ranks need 3 more bundles of {'CPU': 1.0}; the Ray "
        "cluster has {'CPU': "
    ), message
    assert _placement_groups() == before


def test_settings_a_group_cannot_serve_are_refused(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match=r"^enable_lora: LoRA adapters are not served"):
        Engine(EngineConfig(model=str(path), tensor_parallel_size=2, enable_lora=True))
    with pytest.raises(ValueError, match=r"^draft_model: 'target:1' drafts with the split"):
        Engine(EngineConfig(model=str(path), tensor_parallel_size=2, draft_model="target:1"))
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)


def test_a_killed_rank_fails_the_step_instead_of_hanging(tiny_llama):
    path, _ = tiny_llama
    engine = group_engine(path, 2)
    try:
        engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        ray.kill(engine.group.ranks[0])
        started = time.monotonic()
        with pytest.raises(GroupFailedError, match="the tensor-parallel group failed"):
            for _ in range(200):
                engine.step()
                time.sleep(0.05)
        assert time.monotonic() - started < 30
    finally:
        engine.close()

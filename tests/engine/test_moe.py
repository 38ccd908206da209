"""The mixture-of-experts MLP (``workers/model/moe.py``) beyond the logits test and the
engine paths of ``test_model_families.py``: the checkpoint layouts its experts load
from, the step's grouping by expert against a per-token reference, the static decode
path (what a CUDA graph replays, run eagerly: an MoE step is never captured) and a draft
of its first layer, and the configs it refuses, naming the field."""

from __future__ import annotations

import pytest
import torch
import transformers

from tessera.workers.api import SamplingParams, SpeculativeParams
from tessera.workers.config import EngineConfig
from tessera.workers.engine.cuda_graphs import DecodeGraphs
from tessera.workers.engine.engine import Engine
from tessera.workers.model.config import ModelConfig, MoEConfig
from tessera.workers.model.llama import LlamaModel
from tessera.workers.model.loader import load_model
from tests.helpers import TransformersReference, assert_greedy_matches, run_engine, tokens_of

QWEN2_MOE = dict(
    model_type="qwen2_moe",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    norm_topk_prob=False,
)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, smollm2):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=5,
        num_experts_per_tok=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # peaked logits and clear routing (test_model_families.py)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.5, 0.5)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
            else:
                param.mul_(4.0)
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path)
    smollm2.tokenizer.save_pretrained(path)
    return path, model


def test_save_pretrained_writes_mixtral_experts_one_matrix_each(mixtral):
    """What the loader reads: the Hub's names (``block_sparse_moe.experts.{e}.w1``)."""
    from safetensors.torch import load_file

    names = set(load_file(mixtral[0] / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.4.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names


def test_fused_expert_stacks_load_as_the_per_expert_matrices(mixtral):
    """transformers' in-memory layout (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
    ``mlp.gate``) gives the same model as the saved per-expert one."""
    path, model = mixtral
    saved = load_model(path, "float32").model
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()
    fused = LlamaModel(saved.config, torch.float32, torch.device("cpu"))
    fused.load_hf_state_dict(dict(model.state_dict()))
    for (name, ours), theirs in zip(
        saved.state_dict().items(), fused.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs), name


def test_static_decode_and_a_first_layer_draft_give_transformers_tokens(mixtral):
    path, model = mixtral
    reference = TransformersReference(model)
    config = EngineConfig(
        model=str(path), dtype="float32", block_size=4, num_kv_blocks=96, draft_model="target:1"
    )
    engine = Engine(config)
    runner = engine.runner
    assert not runner.model.capturable
    runner.decode_graphs = DecodeGraphs(
        runner.model, runner.kv_cache, runner.block_size, capture=False
    )
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (3, 11, 17)]
    greedy = dict(max_tokens=16, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"static-{i}", prompt, SamplingParams(**greedy))
    draft = SpeculativeParams("draft", 3)
    engine.add_request("draft", prompts[1], SamplingParams(speculative=draft, **greedy))
    outputs = run_engine(engine)
    assert runner.decode_graphs.steps and engine.stats().spec_proposed > 0
    for i, prompt in enumerate(prompts):
        expected = reference.greedy(tuple(prompt), 16)
        assert_greedy_matches(tokens_of(outputs[f"static-{i}"]), expected)
    assert_greedy_matches(tokens_of(outputs["draft"]), reference.greedy(tuple(prompts[1]), 16))


def test_a_leftover_expert_is_an_error(mixtral):
    path, model = mixtral
    state = dict(model.state_dict())
    state["model.layers.1.mlp.experts.5.w1.weight"] = torch.zeros(24, 32)
    ours = LlamaModel(load_model(path, "float32").config, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="does not use.*experts.5.w1"):
        ours.load_hf_state_dict(state)


def test_grouped_experts_equal_each_token_alone():
    """The step's rows grouped by expert (one matmul pair per expert) give what each
    token's own experts give it, a batch with unused experts and an empty one included."""
    torch.manual_seed(3)
    config = ModelConfig.from_hf(QWEN2_MOE)
    layer = LlamaModel(config, torch.float32, torch.device("cpu")).layers[0]
    moe = layer.moe
    for param in moe.parameters():
        param.normal_(0.0, 0.5)
    x = torch.randn(9, 32)
    weights, experts = moe.route(x)
    expected = torch.zeros_like(x)
    for t in range(9):
        for weight, e in zip(weights[t], experts[t].tolist(), strict=True):
            gate, up = (x[t] @ moe.gate_up[e]).chunk(2)
            expected[t] += weight * (torch.nn.functional.silu(gate) * up) @ moe.down[e]
    torch.testing.assert_close(moe.experts(x, experts, weights), expected)
    assert moe(x[:0]).shape == (0, 32)
    assert len(set(experts[:2].flatten().tolist())) < config.moe.num_experts
    torch.testing.assert_close(moe.experts(x[:2], experts[:2], weights[:2]), expected[:2])


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    config = ModelConfig.from_hf({**QWEN2_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert config.moe == MoEConfig(
        num_experts=6,
        top_k=2,
        expert_intermediate_size=16,
        sparse_layers=(1,),
        norm_topk_prob=False,
        shared_expert_intermediate_size=24,
    )
    assert config.qkv_bias and not config.o_bias
    model = LlamaModel(config, torch.float32, torch.device("cpu"))
    assert [layer.moe is not None for layer in model.layers] == [False, True, False, False]
    assert model.layers[1].gate_up_proj is None
    assert model.native_layers().num_layers == 4  # sparse and dense layers in one stack
    everything_dense = {**QWEN2_MOE, "mlp_only_layers": [0, 1, 2, 3]}
    assert ModelConfig.from_hf(everything_dense).moe is None


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_experts_per_tok": 7}, "num_experts_per_tok: must be between 1 and num_experts (6)"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok: must be between 1 and num_experts"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size: must be a positive integer"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step: must be a positive integer"),
        ({"scoring_func": "sigmoid"}, "scoring_func: 'sigmoid' is not supported"),
        ({"routed_scaling_factor": 2.5}, "routed_scaling_factor: 2.5 is not supported"),
        ({"topk_method": "group_limited_greedy"}, "topk_method: 'group_limited_greedy' is not"),
    ],
)
def test_moe_settings_it_does_not_implement_are_refused(change, message):
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_hf({**QWEN2_MOE, **change})
    assert str(refused.value).startswith(message)

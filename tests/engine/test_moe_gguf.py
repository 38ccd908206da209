"""Mixture-of-experts GGUF files as llama.cpp's converter writes them: Mixtral under
``llama`` (q/k permuted, ``expert_count`` set), ``qwen2moe`` with its shared expert and a
dense layer, ``qwen3moe``. Each is written with gguf's writer from a tiny transformers
model's weights under llama.cpp's names (experts stacked per projection, ``[E, I, H]``),
read by our loader, and its logits compared with transformers running that model
(float32, atol = rtol = 1e-4). Expert layouts and router keys the loader does not
implement are refused, naming the tensor or key.

Quantised experts (Q4_0, Q8_0, and llama.cpp's Q4_K_M mix: Q4_K gate and up, Q6_K down)
stay packed in a float32 model, one ``PackedWeight`` per expert multiplied by
``quant_matmul``: the model's logits and greedy tokens against transformers running the
file's experts as ``gguf`` dequantises them (float32), the model's memory against the
file's bytes, and each MoE layer alone against transformers' MoE block."""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from tessera.workers.api import SamplingParams
from tessera.workers.config import EngineConfig
from tessera.workers.engine.engine import Engine
from tessera.workers.model.config import ModelConfig
from tessera.workers.model.gguf_file import GGUFFile
from tessera.workers.model.llama import Linear
from tessera.workers.model.loader import int8_mode_available, load_model
from tessera.workers.model.moe import SparseMoE
from tessera.workers.quant import PackedWeight
from tests.engine.test_gguf_types import (  # noqa: F401
    _K_QUANTS,
    VOCAB,
    _permute_rotary,
    tokenizer_fields,
)
from tests.engine.test_int8_mode import MAX_MEAN_KL
from tests.helpers import (
    TransformersReference,
    assert_greedy_matches,
    prefill_logits,
    run_engine,
    tokens_of,
)

HIDDEN, HEADS, KV_HEADS = 64, 4, 2
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# (config class, its fields, the GGUF architecture); the top-k renormalisation each
# family has in llama.cpp (Mixtral and Qwen3-MoE renormalise, Qwen2-MoE not)
FAMILIES = {
    "mixtral": (
        transformers.MixtralConfig,
        dict(num_local_experts=4, num_experts_per_tok=2),
        "llama",
    ),
    "qwen2moe-shared-expert-dense-layer": (
        transformers.Qwen2MoeConfig,
        dict(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
        "qwen2moe",
    ),
    "qwen3moe": (
        transformers.Qwen3MoeConfig,
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            head_dim=32,
            norm_topk_prob=True,
        ),
        "qwen3moe",
    ),
}
#: transformers' (in-memory) layer tensor names -> llama.cpp's.
_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _tiny(name: str, **sizes) -> transformers.PreTrainedModel:
    """The family's tiny model (``sizes`` override its config), its logits peaked and its
    routing clear (as in ``test_model_families.py``)."""
    config_cls, extra, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**{**COMMON, **extra, **sizes}), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(0.5, 0.5)
            elif param_name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
            else:
                param.mul_(4.0)
    return model


def _gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors as llama.cpp's converter writes them."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        data = tensor.float().numpy().copy()
        if name in _GLOBAL:
            tensors[_GLOBAL[name]] = data
            continue
        _, _, layer, *rest = name.split(".")
        if rest[-1] == "gate_up_proj":  # [E, 2I, H]: the converter splits gate and up
            gate, up = np.split(data, 2, axis=1)
            tensors[f"blk.{layer}.ffn_gate_exps.weight"] = gate
            tensors[f"blk.{layer}.ffn_up_exps.weight"] = up
            continue
        if rest[-2:] == ["experts", "down_proj"]:  # a parameter, not a module's weight
            rest.append("weight")
        base, kind = ".".join(rest[:-1]), rest[-1]
        if arch == "llama" and base in ("self_attn.q_proj", "self_attn.k_proj"):
            data = _permute_rotary(data, HEADS if base == "self_attn.q_proj" else KV_HEADS)
        tensors[f"blk.{layer}.{_NAMES[base]}.{kind}"] = data
    return tensors


#: Each expert tensor's type by its GGUF name (``blk.0.ffn_gate_exps.weight``).
ExpertTypes = Callable[[str], GGMLQuantizationType]
F32, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K = (
    GGMLQuantizationType[n] for n in ("F32", "Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
)
#: The packed expert types tested: one type, or llama.cpp's Q4_K_M mix (ffn_down_exps at
#: Q6_K); "Q4_K/Q5_K/Q6_K" gives gate and up different types (no file does; it works).
EXPERT_TYPES: dict[str, ExpertTypes] = {
    "Q4_0": lambda name: Q4_0,
    "Q8_0": lambda name: Q8_0,
    "Q4_K_M": lambda name: Q6_K if "ffn_down_exps" in name else Q4_K,
    "Q4_K/Q5_K/Q6_K": lambda name: {"gate": Q4_K, "up": Q5_K}.get(name.split("_")[1], Q6_K),
}
#: Rows of 256 for the K-quants' super-blocks: hidden and expert sizes of each family.
K_SIZES = {
    "mixtral": dict(hidden_size=256, intermediate_size=256),
    "qwen2moe-shared-expert-dense-layer": dict(hidden_size=256, moe_intermediate_size=256),
    "qwen3moe": dict(hidden_size=256, moe_intermediate_size=256),
}


def _sized(family: str, types: str) -> dict[str, int]:
    return K_SIZES[family] if types.startswith("Q4_K") else {}


def _quantize(data: np.ndarray, kind: GGMLQuantizationType, name: str) -> np.ndarray:
    """``data`` ``[E, out, in]`` as the file's bytes ``[E, out, row bytes]``: gguf's
    quantisation, or random valid K-quant blocks (gguf cannot write those), drawn per
    tensor ``name``."""
    if kind not in _K_QUANTS:
        return quants.quantize(data, kind)
    experts, out, in_features = data.shape
    blocks = _K_QUANTS[kind]((experts * out, in_features), seed=zlib.crc32(name.encode()))
    return blocks.reshape(experts, out, -1)


def _write(
    path,
    model,
    arch: str,
    tokenizer: dict[str, list],
    experts_type: GGMLQuantizationType | ExpertTypes = F32,
    extra: Callable[[GGUFWriter], None] | None = None,
) -> None:
    """``model`` as llama.cpp's converter writes it, its expert tensors of
    ``experts_type`` (one, or each tensor's by its name); the rest float32."""
    config = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // HEADS
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["token_type"])
    writer.add_token_merges(tokenizer["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch != "llama":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    for name, data in _gguf_tensors(model, arch).items():
        kind = experts_type(name) if callable(experts_type) else experts_type
        if data.ndim == 3 and kind != F32:
            packed = _quantize(data, kind, name)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=kind)
        else:
            writer.add_tensor(name, data)
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


PROMPT = torch.randint(3, VOCAB, (23,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_gguf_matches_transformers(family, tmp_path, tokenizer_fields):  # noqa: F811
    model = _tiny(family)
    arch = FAMILIES[family][2]
    path = tmp_path / f"{family}.gguf"
    _write(path, model, arch, tokenizer_fields)
    loaded = load_model(path, "float32")
    assert loaded.config.architecture == model.config.model_type
    assert loaded.config.moe is not None
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(loaded, PROMPT), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("arch", "extra", "message"),
    [
        (
            "qwen3moe",
            lambda w: w.add_tensor(
                "blk.0.ffn_gate_up_exps.weight", np.ones((6, 64, HIDDEN), np.float32)
            ),
            "model: GGUF tensor 'blk.0.ffn_gate_up_exps.weight' is not supported",
        ),
        (
            "llama",  # llama.cpp's first Mixtral files: a matrix per expert
            lambda w: w.add_tensor("blk.0.ffn_gate.0.weight", np.ones((96, HIDDEN), np.float32)),
            "model: GGUF tensor 'blk.0.ffn_gate.0.weight' is not supported",
        ),
        (
            "qwen3moe",
            lambda w: w.add_uint32("qwen3moe.expert_gating_func", 2),
            "model: GGUF qwen3moe.expert_gating_func 2 is not supported (1, softmax)",
        ),
        (
            "qwen3moe",
            lambda w: w.add_float32("qwen3moe.expert_weights_scale", 2.5),
            "model: GGUF qwen3moe.expert_weights_scale 2.5 is not supported (1 or 0, unscaled)",
        ),
    ],
    ids=["fused-gate-up-experts", "per-expert-matrices", "sigmoid-router", "scaled-weights"],
)
def test_moe_gguf_layouts_it_does_not_implement_are_refused(
    arch,
    extra,
    message,
    tmp_path,
    tokenizer_fields,  # noqa: F811
):
    family = {"llama": "mixtral", "qwen3moe": "qwen3moe"}[arch]
    path = tmp_path / "unsupported.gguf"
    _write(path, _tiny(family), arch, tokenizer_fields, extra=extra)
    with pytest.raises(ValueError) as refused:
        load_model(path, "float32")
    assert str(refused.value).startswith(message)


def _file_reference(model, path) -> transformers.PreTrainedModel:
    """``model`` with its experts as ``gguf`` reads and dequantises them from ``path``
    (transformers' MoE in float32 on the file's numbers; the file's other tensors are
    ``model``'s own, float32)."""
    reference = copy.deepcopy(model)
    stacks = {
        t.name: torch.from_numpy(quants.dequantize(t.data, t.tensor_type).copy())
        for t in GGUFReader(path).tensors
        if len(t.shape) == 3
    }
    with torch.no_grad():
        for i, layer in enumerate(reference.model.layers):
            if f"blk.{i}.ffn_down_exps.weight" not in stacks:
                continue  # a dense layer
            gate, up, down = (
                stacks[f"blk.{i}.ffn_{n}_exps.weight"] for n in ("gate", "up", "down")
            )
            layer.mlp.experts.gate_up_proj.copy_(torch.cat((gate, up), dim=1))
            layer.mlp.experts.down_proj.copy_(down)
    return reference


PACKED = [(family, types) for family in sorted(FAMILIES) for types in ("Q4_0", "Q8_0", "Q4_K_M")]


@pytest.fixture(scope="module", params=PACKED, ids=["-".join(p) for p in PACKED])
def packed_moe(request, tmp_path_factory, tokenizer_fields):  # noqa: F811
    """(path, our float32 load, transformers on the file's experts) of a family's tiny
    model whose experts the file stores quantised."""
    family, types = request.param
    model = _tiny(family, **_sized(family, types))
    path = tmp_path_factory.mktemp("packed-moe") / f"{family}-{types}.gguf"
    _write(path, model, FAMILIES[family][2], tokenizer_fields, EXPERT_TYPES[types])
    return path, load_model(path, "float32"), _file_reference(model, path)


def _moes(loaded) -> list[SparseMoE]:
    return [layer.moe for layer in loaded.model.layers if layer.moe is not None]


def test_packed_experts_give_transformers_logits_and_greedy_tokens(packed_moe):
    path, ours, reference = packed_moe
    assert all(moe.packed_gate_up and moe.packed_down for moe in _moes(ours))
    refs = TransformersReference(reference)
    engine = Engine(EngineConfig(num_kv_blocks=64), loaded=ours)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:3], PROMPT[5:16]]
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0, -1]
        # float32 sums in another order; the random K-quant blocks' logits are large
        scale = max(expected.abs().max().item(), 1.0)
        torch.testing.assert_close(
            prefill_logits(ours, ids), expected, atol=1e-5 * scale, rtol=1e-4
        )
        engine.add_request(f"r{i}", ids, greedy)
    outputs = run_engine(engine)
    for i, ids in enumerate(prompts):
        assert_greedy_matches(tokens_of(outputs[f"r{i}"]), refs.greedy(tuple(ids), 16))


def test_the_experts_hold_the_files_bytes_and_no_dense_copy(packed_moe):
    path, ours, _ = packed_moe
    tensors = GGUFFile(path).tensors
    experts = {t.name: t for t in tensors if len(t.shape) == 3}
    moes = _moes(ours)
    gate_up = [part for moe in moes for parts in moe.packed_gate_up for part in parts]
    down = [weight for moe in moes for weight in moe.packed_down]
    # gate and up of one type: fused, one matrix (and one matmul) per expert
    assert all(len(parts) == 1 for moe in moes for parts in moe.packed_gate_up)
    file_type = {
        kind: {GGMLQuantizationType(t.tensor_type).name for n, t in experts.items() if kind in n}
        for kind in ("gate", "down")
    }
    assert {w.qtype.name for w in gate_up} == file_type["gate"]
    assert {w.qtype.name for w in down} == file_type["down"]
    # as many bytes as the file's expert tensors, and no dense stack
    assert sum(w.nbytes for w in gate_up + down) == sum(t.data.nbytes for t in experts.values())
    assert all(moe.gate_up.numel() == 0 and moe.down.numel() == 0 for moe in moes)
    # the dense matrices are the file's float32 ones, element for element: nothing more
    model = ours.model
    dense = [t for t in (*model.parameters(), *model.buffers()) if t.dim() >= 2]
    assert {t.dtype for t in dense} == {torch.float32}
    f32 = [t for t in tensors if len(t.shape) == 2 and t.tensor_type == F32]
    assert sum(t.numel() for t in dense) == sum(t.data.size for t in f32)
    assert model.native_layers() is not None  # the native stack takes them as they are


K_PACKED = [p for p in PACKED if p[1] == "Q4_K_M"]


@pytest.mark.parametrize("packed_moe", K_PACKED, ids=["-".join(p) for p in K_PACKED], indirect=True)
def test_the_int8_mode_multiplies_k_quant_experts_with_int8_inputs(packed_moe):
    """``dtype="int8"``: the packed K-quant experts multiply inputs quantised to int8 per
    256, as the mode's projections do (``quant_matmul(..., int8=True)``). Teacher-forced
    over the prompt, the next-token distributions keep the int8 mode's contract
    (``test_int8_mode.py``: mean KL <= 2e-2 nats) against transformers running the file's
    experts, and differ from the exact mode's."""
    if not int8_mode_available():
        pytest.skip("the int8 K-quant kernel needs AVX512-VNNI; int8 is the exact mode here")
    path, exact, reference = packed_moe
    ours = load_model(path, "int8")
    assert ours.precision == "int8" and all(moe.int8 for moe in _moes(ours))
    kl = []
    for n in range(4, len(PROMPT) + 1):
        with torch.no_grad():
            expected = reference(torch.tensor([PROMPT[:n]])).logits[0, -1].log_softmax(-1)
        got = prefill_logits(ours, PROMPT[:n]).log_softmax(-1)
        kl.append((expected.exp() * (expected - got)).sum().item())
    assert sum(kl) / len(kl) <= MAX_MEAN_KL
    assert not torch.equal(prefill_logits(ours, PROMPT), prefill_logits(exact, PROMPT))


def test_only_k_quant_experts_take_int8_inputs(packed_moe):
    """The int8 mode asked for a file whose experts are Q4_0 or Q8_0: they multiply as in
    the exact mode, and the model says which mode it runs."""
    if not int8_mode_available():
        pytest.skip("the int8 K-quant kernel needs AVX512-VNNI; int8 is the exact mode here")
    path, _, _ = packed_moe
    loaded = load_model(path, "int8")
    k_quant = path.stem.endswith("Q4_K_M")
    assert [moe.int8 for moe in _moes(loaded)] == [k_quant] * len(_moes(loaded))
    assert loaded.precision == ("int8" if k_quant else "float32")


def test_unpacked_loads_keep_dense_experts(packed_moe):
    """``packed_weights=False`` and a bfloat16 model expand the experts (today's dense
    stacks); float32 computes what the packed experts compute."""
    path, ours, _ = packed_moe
    dense = load_model(path, "float32", packed_weights=False)
    assert all(not moe.packed_gate_up and moe.down.numel() for moe in _moes(dense))
    expected = prefill_logits(ours, PROMPT)
    scale = max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(
        prefill_logits(dense, PROMPT), expected, atol=1e-5 * scale, rtol=1e-4
    )
    bf16 = _moes(load_model(path, "bfloat16"))
    assert all(not m.packed_gate_up and m.down.dtype == torch.bfloat16 for m in bf16)


LAYERS = [(family, types) for family in sorted(FAMILIES) for types in EXPERT_TYPES]


@pytest.mark.parametrize(("family", "types"), LAYERS, ids=["-".join(p) for p in LAYERS])
def test_expert_kernels_match_transformers_moe_layers(family, types):
    """One MoE layer, our ``SparseMoE`` with packed experts against transformers' MoE
    block holding the same experts dequantised (float32), for 64 tokens."""
    model = _tiny(family, **_sized(family, types))
    block = model.model.layers[0].mlp
    config = ModelConfig.from_hf(model.config.to_dict())
    ours = SparseMoE(config, Linear)
    experts = block.experts
    gate, up = experts.gate_up_proj.detach().chunk(2, dim=1)  # [E, I, H] each
    stacks = {"gate": gate, "up": up, "down": experts.down_proj.detach()}
    packed, dense = {}, {}
    for name, stack in stacks.items():
        kind = EXPERT_TYPES[types](f"blk.0.ffn_{name}_exps.weight")
        raw = _quantize(stack.numpy(), kind, name)
        shape = tuple(stack.shape[1:])
        packed[name] = [PackedWeight.from_raw(r, kind, shape) for r in raw]
        dense[name] = torch.from_numpy(quants.dequantize(raw, kind))
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.cat((dense["gate"], dense["up"]), dim=1))
        experts.down_proj.copy_(dense["down"])
    ours.load_experts(packed["gate"], packed["up"], packed["down"], "experts")
    ours.gate.load_weight([block.gate.weight.detach()], "gate")
    if ours.shared_gate_up is not None:
        shared = block.shared_expert
        ours.shared_gate_up.load_weight(
            [shared.gate_proj.weight.detach(), shared.up_proj.weight.detach()], "shared"
        )
        ours.shared_down.load_weight([shared.down_proj.weight.detach()], "shared_down")
        ours.shared_expert_gate.load_weight([block.shared_expert_gate.weight.detach()], "g")
    assert ours.gate_up.numel() == 0 and ours.down.numel() == 0
    assert [len(parts) for parts in ours.packed_gate_up] == [2 if "/" in types else 1] * len(
        packed["gate"]
    )
    x = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = block(x[None])[0]
    got = ours(x)
    scale = max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(got, expected, atol=1e-5 * scale, rtol=1e-4)

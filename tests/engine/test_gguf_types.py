"""GGUF loading for each weight type: a tiny Llama written as GGUF, read by us and by
transformers (which dequantises with its own code), logits compared in float32.

The tokenizer fields are the built-in SmolLM2 file's first 2,048 tokens and the merges
among them, so both loaders see a complete GGUF (with the whole vocabulary, parsing its
~150,000 strings took most of each test). Tolerance: atol = rtol = 1e-4 (both sides hold
the same dequantised values; differences are summation order).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, quants

from tessera.workers.model.gguf_file import GGUFFile
from tessera.workers.model.loader import load_model
from tests.helpers import prefill_logits

pytestmark = pytest.mark.slow

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 96, 2, 4, 2, 2048
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",  # the converter's --fuse-qkv (and Phi-3's own)
}


def _permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k layout (what its converter writes), the inverse of our loader's."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


#: Where a family's converter names a layer tensor differently from Llama's.
_FAMILY_NAMES = {
    "gemma": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    base, kind = ".".join(rest[:-1]), rest[-1]
    family = "gemma" if arch.startswith("gemma") else arch
    names = {**_LAYER_NAMES, **_FAMILY_NAMES.get(family, {})}
    return f"blk.{layer}.{names[base]}.{kind}"


@pytest.fixture(scope="module")
def tokenizer_fields(smollm2_path) -> dict[str, list]:
    """The built-in file's tokenizer fields, cut to its first ``VOCAB`` tokens (the
    specials, the byte alphabet and the first merges' results) and the merges whose parts
    and result are all among them."""
    fields = GGUFFile(smollm2_path).fields
    tokens = fields["tokenizer.ggml.tokens"][:VOCAB]
    kept = set(tokens)
    merges = []
    for merge in fields["tokenizer.ggml.merges"]:
        left, right = merge.split(" ")
        if left in kept and right in kept and left + right in kept:
            merges.append(merge)
    return {
        "tokens": tokens,
        "token_type": fields["tokenizer.ggml.token_type"][:VOCAB],
        "merges": merges,
    }


def _random_k_blocks(block_bytes: int, scales: tuple[int, ...]) -> Callable[..., np.ndarray]:
    """Random valid blocks of a K-quant type (``gguf`` can read them but not write them):
    random bytes, with the f16 scales at byte offsets ``scales`` of each block drawn
    small and finite; drawn from ``seed``, else from the shape."""

    def blocks(shape: tuple[int, int], seed: int | None = None) -> np.ndarray:
        rows, cols = shape
        rng = np.random.default_rng(rows * 7919 + cols if seed is None else seed)
        data = rng.integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
        for offset in scales:
            f16 = rng.uniform(1e-3, 1e-2, (rows, cols // 256)).astype(np.float16)
            data[:, :, offset : offset + 2] = f16.view(np.uint8).reshape(rows, cols // 256, 2)
        return data.reshape(rows, -1)

    return blocks


#: How a test writes each K-quant type: its block size in bytes, its f16 scales' offsets.
_K_QUANTS = {
    GGMLQuantizationType.Q4_K: _random_k_blocks(144, (0, 2)),
    GGMLQuantizationType.Q5_K: _random_k_blocks(176, (0, 2)),
    GGMLQuantizationType.Q6_K: _random_k_blocks(210, (208,)),
}


def quantize_k(data: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """``data`` [rows, cols] float32 as K-quant super-blocks (uint8 [rows, cols / 256 *
    block bytes]): a plain quantiser (each sub-block's range, no search as llama.cpp's),
    so a model's own weights can be written as a K-quant file."""
    rows, cols = data.shape
    x = data.astype(np.float32).reshape(rows, cols // 256, 256)
    if kind == GGMLQuantizationType.Q6_K:  # 16 sub-blocks of 16, q - 32 in -32..31
        sub = x.reshape(rows, -1, 16, 16)
        scale = np.abs(sub).max(-1) / 31.5  # [rows, S, 16]
        d = (np.abs(scale).max(-1) / 127).astype(np.float16)
        df = d.astype(np.float32)[..., None]
        sc = np.where(df > 0, np.rint(scale / np.where(df > 0, df, 1)), 0).clip(-128, 127)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint(sub / np.where(step > 0, step, 1)), 0).clip(-32, 31)
        q = (q + 32).astype(np.uint8).reshape(rows, -1, 2, 4, 32)  # [.., half, r, i]
        ql = (q[:, :, :, 0:2] & 0x0F) | ((q[:, :, :, 2:4] & 0x0F) << 4)  # r and r + 2
        qh = sum((q[:, :, :, r] >> 4) << (2 * r) for r in range(4))
        parts = [
            ql.reshape(rows, -1, 128),
            qh.astype(np.uint8).reshape(rows, -1, 64),
            sc.astype(np.int8).view(np.uint8),
            d.view(np.uint8).reshape(rows, -1, 2),
        ]
        return np.concatenate(parts, axis=-1).reshape(rows, -1)
    levels = 15 if kind == GGMLQuantizationType.Q4_K else 31
    sub = x.reshape(rows, -1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - low) / levels  # [rows, S, 8]
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (-low.min(-1) / 63).astype(np.float16)
    df, dmf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.where(df > 0, np.rint(scale / np.where(df > 0, df, 1)), 0).clip(0, 63)
    m = np.where(dmf > 0, np.rint(-low / np.where(dmf > 0, dmf, 1)), 0).clip(0, 63)
    step = (df * sc)[..., None]
    offset = (dmf * m)[..., None]
    q = np.where(step > 0, np.rint((sub + offset) / np.where(step > 0, step, 1)), 0)
    q = q.clip(0, levels).astype(np.uint8)  # [rows, S, 8, 32]
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    scales = np.concatenate(  # the inverse of kquants.scale_min
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            m[..., :4] | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )
    qs = (q[:, :, 0::2] & 0x0F) | ((q[:, :, 1::2] & 0x0F) << 4)  # [rows, S, 4, 32]
    parts = [d.view(np.uint8).reshape(rows, -1, 2), dmin.view(np.uint8).reshape(rows, -1, 2)]
    parts.append(scales)
    if kind == GGMLQuantizationType.Q5_K:
        qh = sum(((q[:, :, j] >> 4) & 1).astype(np.uint8) << j for j in range(8))
        parts.append(qh.astype(np.uint8))
    parts.append(qs.reshape(rows, -1, 128))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _write_gguf(
    path,
    model,
    qtype: GGMLQuantizationType,
    tokenizer: dict[str, list],
    extra: Callable[[GGUFWriter], None] | None = None,
    arch: str = "llama",
    head_dim: int | None = None,
    rope_dims: int | None = None,
    types: Callable[[str], GGMLQuantizationType] | None = None,
    k_quantize: bool = False,
) -> None:
    """``model`` as llama.cpp's converter writes it; ``extra`` adds fields or tensors;
    ``types`` gives a matrix's type by its Hugging Face name (a mix such as Q4_K_M's),
    else every matrix is ``qtype``. K-quant matrices are random blocks, or with
    ``k_quantize`` the model's own weights (``quantize_k``)."""
    config = model.config
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, KV_HEADS
    head_dim = head_dim or hidden // heads
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(rope_dims or head_dim)
    if head_dim != hidden // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["token_type"])
    writer.add_token_merges(tokenizer["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        data = tensor.float().numpy().copy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # the converter stores Gemma's norms as 1 + w
        # the converter permutes q and k, their biases too, into llama.cpp's rotary layout
        if arch == "llama" and name.endswith(
            ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
        ):
            data = _permute_rotary(data, heads if "q_proj" in name else kv_heads)
        matrix_type = qtype if types is None else types(name)
        kind = matrix_type if data.ndim == 2 else GGMLQuantizationType.F32  # norms stay F32
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name, arch), data)
        else:
            if kind in _K_QUANTS:
                packed = quantize_k(data, kind) if k_quantize else _K_QUANTS[kind](data.shape)
            else:
                packed = quants.quantize(data, kind)
            writer.add_tensor(
                _gguf_name(name, arch), packed, raw_shape=packed.shape, raw_dtype=kind
            )
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


#: The tests' models' shape (each family's config takes these fields).
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=FFN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def _tiny_llama(**config) -> transformers.LlamaForCausalLM:
    """The tests' Llama, random; ``config`` adds to or overrides its ``LlamaConfig``."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **config}))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            lambda w: (
                w.add_rope_scaling_type(RopeScalingType.YARN),
                w.add_rope_scaling_factor(4.0),
                w.add_rope_scaling_orig_ctx_len(64),
                w.add_rope_scaling_yarn_log_mul(0.1),
            ),
            "model: GGUF llama.rope.scaling.yarn_log_multiplier 0.1",
        ),
        (
            lambda w: w.add_rope_scaling_type(RopeScalingType.LONGROPE),
            "model: GGUF LongRoPE scaling without a 'rope_factors_short.weight' tensor",
        ),
        (
            lambda w: w.add_tensor("blk.0.attn_sinks.weight", np.ones(HEADS, np.float32)),
            "model: GGUF tensor 'blk.0.attn_sinks.weight' is not supported: this loader reads "
            "the token embedding, the output norm and head, and per layer attn_norm, ffn_norm, "
            "attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down",
        ),
        (
            lambda w: (
                w.add_rope_scaling_type(RopeScalingType.LINEAR),
                w.add_rope_scaling_factor(2.0),
                w.add_tensor("rope_freqs.weight", np.ones(HIDDEN // HEADS // 2, np.float32)),
            ),
            "model: GGUF llama.rope.scaling.type 'linear' and a 'rope_freqs.weight' tensor: "
            "one RoPE scaling at a time",
        ),
        (
            lambda w: w.add_tensor("blk.0.ffn_gate_exps.weight", np.ones((2, 4), np.float32)),
            "model: GGUF tensor 'blk.0.ffn_gate_exps.weight' is not supported",
        ),
    ],
    ids=[
        "yarn-log-multiplier",
        "longrope-without-factors",
        "unknown-tensor",
        "two-rope-scalings",
        "experts",
    ],
)
def test_gguf_metadata_and_tensors_it_does_not_implement_are_refused(
    extra, message, tmp_path, tokenizer_fields
):
    """A file whose metadata or tensors change the computation in a way this loader does
    not implement is refused, naming the key or tensor: never loaded and silently wrong,
    never a bare ``KeyError`` or unpacking error."""
    path = tmp_path / "unsupported.gguf"
    _write_gguf(path, _tiny_llama(), GGMLQuantizationType.F32, tokenizer_fields, extra)
    with pytest.raises(ValueError) as refused:
        load_model(path, "float32")
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize(
    "qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
)
def test_gguf_weight_type_matches_transformers(qtype, tmp_path, tokenizer_fields, caplog):
    """Each type read by us and by transformers (both dequantise with ``gguf``; Q4_0,
    Q4_1, Q8_0 and the K-quants stay packed on our side). The K-quants' blocks are random (``gguf``
    cannot write them), on a model 256 wide (their blocks' width); the other types are
    expanded at load, which one log line says."""
    torch.manual_seed(0)
    wide = qtype.endswith("_K")
    model = _tiny_llama(hidden_size=256, intermediate_size=512) if wide else _tiny_llama()
    path = tmp_path / f"tiny-{qtype}.gguf"
    _write_gguf(path, model, GGMLQuantizationType[qtype], tokenizer_fields)

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with caplog.at_level("INFO", logger="tessera.workers.model.gguf_model"):
        ours = load_model(path, "float32")
    expanded = [r.message for r in caplog.records if "expanded to float32" in r.message]
    if qtype in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"):
        assert expanded == []
    else:
        assert len(expanded) == 1 and expanded[0].startswith(f"{path.name}: {qtype} expanded")
    prompt = ours.tokenizer("Quantised weights, read two ways.").input_ids
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(ours, prompt), expected, atol=1e-4, rtol=1e-4)
    if (
        qtype != "F32" and not wide
    ):  # the quantisation really happened: weights differ from the originals
        assert not torch.equal(
            ours.model.layers[0].down_proj.dense_weight().t(),
            model.model.layers[0].mlp.down_proj.weight,
        )


def test_qwen3_gguf_matches_transformers(tmp_path, tokenizer_fields):
    """A Qwen3 GGUF (its q/k norms as attn_q_norm / attn_k_norm, heads of
    ``attention.key_length``, no rotary permutation) read by us and by transformers."""
    torch.manual_seed(0)
    # head_dim 128: what transformers assumes for a Qwen3 GGUF (it reads no head size)
    config = transformers.Qwen3Config(**TINY, head_dim=128)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1.0, 0.5)  # so that a dropped norm shows
    path = tmp_path / "tiny-qwen3.gguf"
    _write_gguf(path, model, GGMLQuantizationType.F32, tokenizer_fields, arch="qwen3", head_dim=128)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    ours = load_model(path, "float32")
    assert ours.config.qk_norm and ours.config.head_dim == 128
    prompt = ours.tokenizer("Normalised heads, read two ways.").input_ids
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(ours, prompt), expected, atol=1e-4, rtol=1e-4)


def _llama3_rope_factors(theta: float, dim: int, scaling: dict) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for Llama 3's RoPE scaling:
    per frequency, what its wavelength is divided by (1 for short wavelengths, ``factor``
    for long ones, interpolated between)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, dim, 2):
        wavelength = 2 * np.pi * theta ** (i / dim)
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_gguf_with_rope_freqs_matches_transformers(tmp_path, tokenizer_fields):
    """A Llama 3 GGUF (RoPE scaled per frequency by its ``rope_freqs`` tensor) read by us,
    against transformers running the Hugging Face model it was written from (transformers'
    own GGUF reader leaves ``rope_freqs`` out)."""
    torch.manual_seed(0)
    scaling = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    model = _tiny_llama(rope_parameters=scaling).eval()
    factors = _llama3_rope_factors(10000.0, HIDDEN // HEADS, scaling)
    # all three bands: short wavelengths kept, long ones divided by 8, some between
    assert factors.min() == 1.0 and factors.max() == 8.0
    assert ((factors > 1.0) & (factors < 8.0)).any()
    path = tmp_path / "tiny-llama3.gguf"
    _write_gguf(
        path,
        model,
        GGMLQuantizationType.F32,
        tokenizer_fields,
        lambda w: w.add_tensor("rope_freqs.weight", factors),
    )
    ours = load_model(path, "float32")
    # a prompt past the original context, where the scaling changes the angles
    prompt = ours.tokenizer(" ".join(["Positions far along, read two ways."] * 6)).input_ids
    assert len(prompt) > 32
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(ours, prompt), expected, atol=1e-4, rtol=1e-4)


def test_llama_gguf_with_biases_matches_transformers(tmp_path, tokenizer_fields):
    """A Llama with attention and MLP biases (its q/k biases permuted as the converter
    writes them), read by us, against transformers running the model it was written from."""
    torch.manual_seed(0)
    model = _tiny_llama(attention_bias=True, mlp_bias=True).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # random, so that a dropped or unpermuted one shows
                param.normal_(0.0, 0.5)
    path = tmp_path / "tiny-biased.gguf"
    _write_gguf(path, model, GGMLQuantizationType.F32, tokenizer_fields)
    ours = load_model(path, "float32")
    assert ours.config.qkv_bias and ours.config.o_bias and ours.config.mlp_bias
    prompt = ours.tokenizer("Biased projections, read two ways.").input_ids
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(ours, prompt), expected, atol=1e-4, rtol=1e-4)


def _peaked(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with random norm weights (so a dropped norm, or a 1 + w read as w, shows)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.5, 0.5)
    return model.eval()


#: A prompt several windows long (the Gemma and Phi-3 cases' windows are 8 tokens).
_LONG_PROMPT = " ".join(["Windows slide along, read two ways."] * 5)


def _gemma2_extra(w: GGUFWriter) -> None:
    w.add_attn_logit_softcapping(5.0)
    w.add_final_logit_softcapping(3.0)
    w.add_sliding_window(8)


def _gemma3_extra(w: GGUFWriter) -> None:
    w.add_sliding_window(8)
    w.add_rope_scaling_type(RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(4.0)
    w.add_float32("gemma3.rope.freq_base_swa", 10000.0)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_gguf_matches_transformers(family, tmp_path, tokenizer_fields):
    """A Gemma 2 / Gemma 3 GGUF as the converter writes it (norms stored as 1 + w, four
    norms a layer, soft-caps and the window as keys, Gemma 3's local RoPE base), read by
    us, against transformers running the model it was written from, on a prompt several
    windows long."""
    torch.manual_seed(0)
    # rope_theta 10000 everywhere: the file's freq_base is the global layers' base
    common = {**TINY, "head_dim": 32, "sliding_window": 8, "tie_word_embeddings": True}
    if family == "gemma2":
        config = transformers.Gemma2Config(
            **common, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
            query_pre_attn_scalar=32, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        )  # fmt: skip
        extra = _gemma2_extra
    else:
        config = transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 6}, query_pre_attn_scalar=32,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
            },
        )  # fmt: skip
        extra = _gemma3_extra
    model = _peaked(transformers.AutoModelForCausalLM.from_config(config))
    path = tmp_path / f"tiny-{family}.gguf"
    _write_gguf(
        path, model, GGMLQuantizationType.F32, tokenizer_fields, extra, arch=family, head_dim=32
    )
    ours = load_model(path, "float32")
    assert ours.config.architecture == {"gemma2": "gemma2", "gemma3": "gemma3_text"}[family]
    prompt = ours.tokenizer(_LONG_PROMPT).input_ids
    assert len(prompt) > 3 * 8
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(ours, prompt), expected, atol=1e-4, rtol=1e-4)


def test_phi3_gguf_matches_transformers(tmp_path, tokenizer_fields):
    """A Phi-3 GGUF as the converter writes it (q/k/v as one ``attn_qkv``, gate/up as one
    ``ffn_up``, partial rotary as ``rope.dimension_count``, LongRoPE's factors as tensors
    and its attention factor as a key, a sliding window), read by us, against transformers
    running the model it was written from, on a prompt inside the original context."""
    torch.manual_seed(0)
    short, long = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5], [2.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    config = transformers.Phi3Config(
        **TINY, sliding_window=8, original_max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": short, "long_factor": long,
        },
    )  # fmt: skip
    model = _peaked(transformers.Phi3ForCausalLM(config))
    factor = 256 / 64
    attn_factor = math.sqrt(1 + math.log(factor) / math.log(64))

    def extra(w: GGUFWriter) -> None:
        w.add_sliding_window(8)
        w.add_rope_scaling_type(RopeScalingType.LONGROPE)
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_rope_scaling_attn_factors(attn_factor)
        w.add_tensor("rope_factors_long.weight", np.array(long, np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(short, np.float32))

    path = tmp_path / "tiny-phi3.gguf"
    _write_gguf(
        path, model, GGMLQuantizationType.F32, tokenizer_fields, extra, arch="phi3", rope_dims=12
    )
    ours = load_model(path, "float32")
    assert ours.config.rotary_dims == 12 and ours.config.layer_windows == (8, 8)
    prompt = ours.tokenizer(_LONG_PROMPT).input_ids
    assert 3 * 8 < len(prompt) <= 64
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(ours, prompt), expected, atol=1e-4, rtol=1e-4)


def test_yarn_gguf_matches_transformers(tmp_path, tokenizer_fields):
    """A Qwen2 with YaRN RoPE (Qwen2.5's long-context setting) as the converter writes it
    (``rope.scaling.type`` yarn, its factor, original context and betas), read by us,
    against transformers running the model it was written from, on a prompt past the
    original context."""
    torch.manual_seed(0)
    scaling = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
    }  # fmt: skip
    model = _peaked(
        transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY, rope_parameters=scaling))
    )

    def extra(w: GGUFWriter) -> None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(16)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)

    path = tmp_path / "tiny-yarn.gguf"
    _write_gguf(path, model, GGMLQuantizationType.F32, tokenizer_fields, extra, arch="qwen2")
    ours = load_model(path, "float32")
    assert ours.config.rope_scaling["rope_type"] == "yarn"
    prompt = ours.tokenizer(_LONG_PROMPT).input_ids
    assert len(prompt) > 16
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(ours, prompt), expected, atol=1e-4, rtol=1e-4)


def test_a_llama_gguf_with_a_window_is_a_mistral(tmp_path, tokenizer_fields):
    """``llama.attention.sliding_window`` (a Mistral as llama.cpp names it) windows every
    layer, as transformers' Mistral with that window computes, on a prompt several windows
    long: the key is read, not ignored."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(**TINY, sliding_window=8)
    model = _peaked(transformers.MistralForCausalLM(config))
    path = tmp_path / "tiny-mistral.gguf"
    _write_gguf(
        path, model, GGMLQuantizationType.F32, tokenizer_fields, lambda w: w.add_sliding_window(8)
    )
    ours = load_model(path, "float32")
    assert ours.config.architecture == "mistral" and ours.config.layer_windows == (8, 8)
    prompt = ours.tokenizer(_LONG_PROMPT).input_ids
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(ours, prompt), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("arch", "extra", "message"),
    [
        (
            "qwen2",
            lambda w: w.add_sliding_window(8),
            "model: GGUF qwen2.attention.sliding_window 8 is not supported without "
            "qwen2.attention.sliding_window_pattern (its windows cover some layers only)",
        ),
        (
            "llama",
            lambda w: (
                w.add_sliding_window(8),
                w.add_uint32("llama.attention.sliding_window_pattern", 2),
            ),
            "model: GGUF llama.attention.sliding_window_pattern 2 is not supported",
        ),
        (
            "llama",
            lambda w: w.add_tensor(
                "blk.0.attn_q.bias",
                np.zeros((1, 40), np.uint8),
                raw_dtype=GGMLQuantizationType.Q8_1,
            ),
            "model: GGUF tensor 'blk.0.attn_q.bias' has type Q8_1, which gguf cannot dequantise",
        ),
    ],
    ids=["qwen2-window-without-pattern", "llama-window-period", "unreadable-type"],
)
def test_windows_and_types_it_cannot_read_are_refused(
    arch, extra, message, tmp_path, tokenizer_fields
):
    model = (
        _tiny_llama()
        if arch == "llama"
        else transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY))
    )
    path = tmp_path / f"refused-{arch}.gguf"
    _write_gguf(path, model, GGMLQuantizationType.F32, tokenizer_fields, extra, arch=arch)
    with pytest.raises(ValueError) as refused:
        load_model(path, "float32")
    assert str(refused.value).startswith(message)


def test_a_gguf_with_fused_qkv_matches_transformers(tmp_path, tokenizer_fields):
    """A Llama converted with ``--fuse-qkv``: one ``attn_qkv`` tensor (and bias) a layer,
    q's and k's rows interleaved as the converter always writes them."""
    torch.manual_seed(0)
    model = _peaked(_tiny_llama(attention_bias=True))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    tensors = model.state_dict()
    state = {}
    for name, tensor in tensors.items():
        if "k_proj" in name or "v_proj" in name:
            continue
        if "q_proj" in name:
            q, k, v = (
                tensors[name.replace("q_proj", p)].numpy() for p in ("q_proj", "k_proj", "v_proj")
            )
            fused = [_permute_rotary(q, HEADS), _permute_rotary(k, KV_HEADS), v]
            state[name.replace("q_proj", "qkv_proj")] = torch.from_numpy(np.concatenate(fused))
        else:
            state[name] = tensor

    class Fused:  # what _write_gguf reads of a model: its config and its tensors
        config = model.config

        @staticmethod
        def state_dict() -> dict[str, torch.Tensor]:
            return state

    path = tmp_path / "tiny-fused.gguf"
    _write_gguf(path, Fused, GGMLQuantizationType.F32, tokenizer_fields)
    ours = load_model(path, "float32")
    prompt = ours.tokenizer("Fused projections, read two ways.").input_ids
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(ours, prompt), expected, atol=1e-4, rtol=1e-4)

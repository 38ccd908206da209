"""A GGUF whose matrices are K-quants (a Q4_K_M / Q5_K_M file's mix) stays packed: the
engine's greedy tokens and the model's logits against transformers reading the same
file (which dequantises with ``gguf`` and multiplies in float32), and the loaded model
holds the file's bytes, no dense copy of a matrix."""

from __future__ import annotations

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType

from tessera.workers.api import SamplingParams
from tessera.workers.config import EngineConfig
from tessera.workers.engine.engine import Engine
from tessera.workers.model.gguf_file import GGUFFile
from tessera.workers.model.loader import load_model
from tessera.workers.quant import PackedWeight
from tests.engine.test_gguf_types import _tiny_llama, _write_gguf, tokenizer_fields  # noqa: F401
from tests.helpers import (
    TransformersReference,
    assert_greedy_matches,
    prefill_logits,
    run_engine,
    tokens_of,
)

pytestmark = pytest.mark.slow

Q4_K, Q5_K, Q6_K = (GGMLQuantizationType[n] for n in ("Q4_K", "Q5_K", "Q6_K"))
#: llama.cpp's _M mixes: the embedding, head, attn_v and ffn_down at Q6_K, the rest at
#: the mix's type.
_SIX_BITS = ("embed_tokens.weight", "lm_head.weight", "v_proj.weight", "down_proj.weight")
MIXES = {"Q4_K_M": Q4_K, "Q5_K_M": Q5_K}
PROMPTS = ["Packed super-blocks, read two ways.", "Hi", "One two three four five six seven"]
MAX_NEW = 24


def _mix(base: GGMLQuantizationType):
    return lambda name: Q6_K if name.endswith(_SIX_BITS) else base


@pytest.fixture(scope="module", params=list(MIXES))
def k_model(request, tmp_path_factory, tokenizer_fields):  # noqa: F811
    """(path, our model, transformers' reading of the file): Q4_K_M with a tied head
    (the packed embedding multiplies), Q5_K_M with its own."""
    torch.manual_seed(0)
    tied = request.param == "Q4_K_M"
    model = _tiny_llama(hidden_size=256, intermediate_size=512, tie_word_embeddings=tied)
    path = tmp_path_factory.mktemp("kquant") / f"tiny-{request.param}.gguf"
    _write_gguf(path, model, Q4_K, tokenizer_fields, types=_mix(MIXES[request.param]))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return path, load_model(path, "float32"), reference


def test_logits_and_greedy_tokens_match_transformers(k_model):
    path, ours, reference = k_model
    refs = TransformersReference(reference)
    engine = Engine(EngineConfig(num_kv_blocks=64), loaded=ours)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    prompts = [ours.tokenizer(p).input_ids for p in PROMPTS]
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0, -1]
        # float32 sums in another order: the random blocks' logits reach ~800, where
        # that moves them by up to ~5e-4 (the torch path, gguf's weights and torch.mm,
        # too); 1e-5 of the largest is ~20 of its ulps
        scale = expected.abs().max().item()
        torch.testing.assert_close(
            prefill_logits(ours, ids), expected, atol=1e-5 * scale, rtol=1e-4
        )
        engine.add_request(f"r{i}", ids, greedy)
    outputs = run_engine(engine)
    for i, ids in enumerate(prompts):
        assert_greedy_matches(tokens_of(outputs[f"r{i}"]), refs.greedy(tuple(ids), MAX_NEW))


def test_the_model_holds_the_files_bytes_and_no_dense_matrix(k_model):
    path, ours, _ = k_model
    model = ours.model
    file_types = {t.name: int(t.tensor_type) for t in GGUFFile(path).tensors}
    matrices = [t for t in GGUFFile(path).tensors if len(t.shape) == 2]
    assert {GGMLQuantizationType(file_types[t.name]).name for t in matrices} == {
        "Q6_K",
        GGMLQuantizationType(MIXES[path.stem.removeprefix("tiny-")]).name,
    }
    linears = [m for m in model.modules() if hasattr(m, "packed_parts")]
    packed = [model.packed_embedding] + [
        part for m in linears for part in ((m.packed,) if m.packed is not None else m.packed_parts)
    ]
    assert all(isinstance(p, PackedWeight) and p.qtype.is_k for p in packed)
    # q/k (Q4_K or Q5_K) and v (Q6_K) stay apart, gate/up (one type) fused
    assert [len(layer.qkv_proj.packed_parts) for layer in model.layers] == [2] * len(model.layers)
    assert all(layer.gate_up_proj.packed is not None for layer in model.layers)
    # every matrix of the file, packed once, as many bytes as the file holds
    assert sum(p.nbytes for p in packed) == sum(int(t.data.nbytes) for t in matrices)
    dense = [
        (name, tuple(t.shape))
        for name, t in (*model.named_parameters(), *model.named_buffers())
        if t.dim() >= 2 and t.numel() > 0
    ]
    assert dense == []  # no float copy of any matrix (norms are 1-D)


def test_the_native_stack_takes_k_quants_and_mixed_parts_as_op_by_op(k_model):
    """The native decode stack multiplies K-quant weights (and a fused projection's
    parts of different types) through the same kernel as op by op: a step of decodes and
    a prompt chunk gives the same logits up to the order of float32 sums, and the same
    argmax."""
    from tests.engine.test_native_decode import one_step

    _, ours, _ = k_model
    assert ours.model.native_layers() is not None
    native, native_cache = one_step(ours, native=True, chunks=[(5, 21)])
    op_by_op, cache = one_step(ours, native=False, chunks=[(5, 21)])
    scale = op_by_op.abs().max()  # (random blocks' logits reach ~700: a sum's order moves
    assert (native - op_by_op).abs().max() <= 1e-4 * scale  # them by ~1e-5 of that)
    assert torch.equal(native.argmax(-1), op_by_op.argmax(-1))
    # the K/V written, within the order of sums (the kernel's loops differ by row count)
    torch.testing.assert_close(native_cache, cache, equal_nan=True, atol=1e-3, rtol=1e-3)

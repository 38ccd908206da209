"""The int8 mode's quality contract on a K-quant file (``dtype="int8"``): its
Q4_K/Q5_K/Q6_K matrices and K-quant head multiply activations quantised to int8 per 256
(``quant_matmul(..., int8=True)``, as llama.cpp multiplies Q4_K with Q8_K), against the
reference: transformers reading the same file (float32; the exact mode equals it,
``test_gguf_kquants.py``).

The file: a random Llama (hidden 512, 4 layers, 8 heads of 64, 2 KV heads, MLP 1,024,
init std 0.05, final norm weight 3: the exact mode's top-1 probability averages ~0.30)
whose own weights are quantised as a Q4_K_M mix (``quantize_k``: Q6_K head, attn_v and
ffn_down, Q4_K the rest; the head untied, a Q6_K ``Linear``), with the first 2,048 tokens
of SmolLM2's vocabulary. The shipped texts (``tests/data/quality*.txt``) are
teacher-forced in windows of 256 tokens (the file's context), 2,816 positions.

The fast mode's contract (``test_fast_mode.py``: argmax agreement >= 99%, every
difference a near-tie, mean KL <= 2e-4 nats, perplexity within 1%) is not met with int8
inputs: measured (Xeon, AVX512-VNNI) agreement 91.6%, largest top-2 gap where they differ
0.61, mean KL 1.05e-2 nats, perplexity 474,587 vs 475,454 (ratio 0.998). The same
quantisation done in torch, then the exact kernel, gives 91.41% and 1.054e-2 (the loss
is int8's, not the kernel's); bf16 inputs give 98.47% and 4.3e-4 on this model, which
misses it too. So ``auto`` is the exact mode for a K-quant file, and int8 is a mode of
its own, asked for by name, with this contract: agreement >= 90%, mean KL <= 2e-2
nats, perplexity within 1%.
"""

from __future__ import annotations

import pytest
import torch

from tessera.workers.model.loader import LoadedModel, int8_mode_available, load_model
from tests.engine.test_fast_mode import TEXTS, teacher_forced_logits
from tests.engine.test_gguf_kquants import Q4_K, _mix
from tests.engine.test_gguf_types import _tiny_llama, _write_gguf, tokenizer_fields  # noqa: F401

pytestmark = pytest.mark.slow

WINDOW = 256  # the test file's context length
MIN_AGREEMENT = 0.90
MAX_MEAN_KL = 2e-2  # nats
MAX_PERPLEXITY_RATIO = 1.01
INIT_STD = 0.05
NORM_SCALE = 3.0  # peaked logits: a random model's are near-uniform


@pytest.fixture(scope="module")
def k_file(tmp_path_factory, tokenizer_fields):  # noqa: F811
    if not int8_mode_available():
        pytest.skip("the int8 K-quant kernel needs AVX512-VNNI; int8 is the exact mode here")
    torch.manual_seed(0)
    model = _tiny_llama(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
    )
    with torch.no_grad():
        model.model.norm.weight.mul_(NORM_SCALE)
    path = tmp_path_factory.mktemp("kquant_fast") / "random-Q4_K_M.gguf"
    _write_gguf(path, model, Q4_K, tokenizer_fields, types=_mix(Q4_K), k_quantize=True)
    return path


@pytest.fixture(scope="module")
def modes(k_file) -> tuple[LoadedModel, LoadedModel]:
    exact, int8 = load_model(k_file, "float32"), load_model(k_file, "int8")
    assert exact.precision == "float32" and int8.precision == "int8"
    return exact, int8


def test_the_int8_mode_multiplies_k_quants_with_int8_inputs(modes):
    exact, int8 = modes
    model = int8.model
    assert model.rounded_inputs() == {"int8"} and model.lm_head.int8
    assert not model.uses_bf16_kernels() and int8.kernels == ""
    for layer in model.layers:
        for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            assert linear.int8 and linear.rounded_inputs == "int8"
        assert len(layer.qkv_proj.packed_parts) == 2  # Q4_K q/k and Q6_K v, both int8
    assert not exact.model.rounded_inputs() and not exact.model.head_int8
    assert int8.kv_dtype == torch.float16


def test_auto_is_the_exact_mode_for_a_k_quant_file(k_file):
    """Neither bf16 nor int8 inputs meet the fast mode's contract on K-quants: ``auto``
    keeps them exact."""
    auto = load_model(k_file, "auto")
    assert auto.precision == "float32" and not auto.model.rounded_inputs()


@pytest.fixture(scope="module")
def measured(k_file, modes) -> dict[str, float]:
    """The int8 mode against the reference: transformers reading the same file
    (``gguf``'s dequantisation, a float32 forward)."""
    import transformers

    exact, fast = modes  # (the int8 mode)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        k_file.parent, gguf_file=k_file.name, dtype=torch.float32
    ).eval()
    tokens = [t for text in TEXTS for t in exact.tokenizer(text).input_ids]
    windows = [tokens[i : i + WINDOW] for i in range(0, len(tokens) - WINDOW + 1, WINDOW)]
    agree = positions = 0
    kl_sum = nll_exact = nll_fast = 0.0
    gaps: list[float] = []
    for window in windows:
        with torch.no_grad():
            exact_logits = reference(torch.tensor([window])).logits[0].float()
        fast_logits = teacher_forced_logits(fast, window)
        same = exact_logits.argmax(-1) == fast_logits.argmax(-1)
        agree += int(same.sum())
        positions += len(window)
        top2 = exact_logits.topk(2, dim=-1).values
        gaps += (top2[:, 0] - top2[:, 1])[~same].tolist()
        exact_logp, fast_logp = exact_logits.log_softmax(-1), fast_logits.log_softmax(-1)
        kl_sum += float((exact_logp.exp() * (exact_logp - fast_logp)).sum())
        targets = torch.tensor(window[1:])[:, None]
        nll_exact += float(-exact_logp[:-1].gather(1, targets).sum())
        nll_fast += float(-fast_logp[:-1].gather(1, targets).sum())
    targets_total = positions - len(windows)
    result = {
        "positions": positions,
        "agreement": agree / positions,
        "largest_gap_where_they_differ": max(gaps, default=0.0),
        "mean_kl": kl_sum / positions,
        "perplexity_exact": float(torch.tensor(nll_exact / targets_total).exp()),
        "perplexity_fast": float(torch.tensor(nll_fast / targets_total).exp()),
    }
    print(f"int8 mode vs transformers: {result}")
    return result


def test_next_token_agreement(measured):
    assert measured["positions"] > 2500
    assert measured["agreement"] >= MIN_AGREEMENT, measured


def test_mean_kl_divergence_is_bounded(measured):
    assert measured["mean_kl"] <= MAX_MEAN_KL, measured


def test_perplexity_within_one_percent(measured):
    ratio = measured["perplexity_fast"] / measured["perplexity_exact"]
    assert 1 / MAX_PERPLEXITY_RATIO <= ratio <= MAX_PERPLEXITY_RATIO, measured


def test_the_int8_mode_really_differs(modes):
    """The comparison can fail: int8 inputs move the logits."""
    exact, fast = modes
    ids = exact.tokenizer(TEXTS[0]).input_ids[:64]
    a, b = teacher_forced_logits(exact, ids), teacher_forced_logits(fast, ids)
    assert not torch.allclose(a, b, atol=1e-3)


def test_the_native_stack_multiplies_as_op_by_op_in_the_int8_mode(modes):
    """The native decode stack takes the int8 kernel too (not the exact one): a step of
    decodes and a prompt chunk gives op by op's logits within the order of float32 sums,
    row by row, wherever both paths round the row's inputs to the same int8. The native
    norms and attention sum in another order than torch's, and where that last bit moves
    one of a row's values across a rounding boundary (or changes its block's amax), the
    row's int8 inputs differ by a step and the difference grows through the layers: such
    rows stay within a few of int8's steps, far below its distance from the exact mode."""
    from tests.engine.test_native_decode import one_step

    exact, int8 = modes
    assert int8.model.native_layers() is not None
    native, _ = one_step(int8, native=True, chunks=[(5, 21)])
    op_by_op, _ = one_step(int8, native=False, chunks=[(5, 21)])
    exact_logits, _ = one_step(exact, native=True, chunks=[(5, 21)])
    scale = op_by_op.abs().max()
    rows = (native - op_by_op).abs().amax(dim=-1)
    assert (rows <= 1e-4 * scale).float().mean() >= 0.8, rows / scale
    assert rows.max() <= 0.05 * scale, rows / scale
    assert (native - exact_logits).abs().max() > 1e-3 * scale  # int8's rounding, not exact's

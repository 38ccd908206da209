"""The quality contracts of the two reduced-precision modes, against the float32
reference on the same GGUF file (transformers' float32 forward of the dequantised file,
which the exact mode equals: the other engine tests).

- The fast mode (``dtype="auto"`` where the CPU has AVX512_BF16; what ``tessera serve``
  and ``generate`` run by default there): a float32 model whose Q4 matrices and Q8_0
  tied head multiply inputs rounded to bf16 through the native kernels (the file's fp16
  scales, float32 sums and outputs); norms, RoPE, attention, SwiGLU and the residual
  stay float32; the KV cache is float16.
- The bfloat16 mode (``dtype="bfloat16"``): also bf16 activations between the
  matmuls and a bf16 KV cache (half the KV memory and bandwidth), the Q4 matrices and
  the head through the same kernels (or, without AVX512_BF16, torch's int4 layout for
  small batches and a dense bf16 copy for large ones, and the float32 head).

Each contract (also in README.md), teacher-forced over a fixed set of sequences (four
texts shipped in ``tests/data/quality*.txt``: prose, field notes, Python and a dialogue;
and four prompts with transformers' greedy continuations, 2,261 positions):

- the mode's next-token argmax equals the reference's at >= ``min_agreement`` of
  positions (fast: 99%, the bar the defaults require; bfloat16: 97.5%), and every position
  where they differ is a near-tie of the reference (its top-2 logits less than
  ``NEAR_TIE`` apart);
- the mean KL divergence KL(exact || mode) of the next-token distributions is at most
  ``max_mean_kl`` nats (fast: 2e-4; bfloat16: 2e-3);
- the perplexity of the shipped texts is within 1% of the reference's.

Each contract holds on both paths a prompt can take (``path``): op by op, and the native
layer stack the engine serves with. Measured (AMD EPYC Zen 5, AVX512_BF16), native / op
by op: fast mode 99.51% (2,250 of 2,261) / 99.51% (2,250), every difference at a top-2
gap below 0.042, mean KL 8.7e-5 / 8.4e-5 nats, perplexity 15.672 / 15.672 vs 15.674;
bfloat16 98.72% (2,232) / 99.20% (2,243), gaps below 0.16, KL 3.5e-4, 15.705 / 15.692.
Which near-ties flip is chance, and it moves with the CPU (torch's and MKL's kernels
differ between machines, in the reference too): the set held only the first text and
the prompts (688 positions) until a Zen 5 EPYC measured the fast mode's op-by-op path
at 98.98% there (681, one flip under the bar; a Zen 4 EPYC had 99.27%, 683). One
position was 0.15% of that set, and the measurement's standard error ~0.36%; on this
one it is ~0.15%, and the fast mode sits 11 flips above its bar.
Most of the bfloat16 mode's extra differences come from its bf16 KV cache (rounding only
the KV to bf16 flipped 6 of the 688 near-ties) and from rounding the matmuls' outputs,
RoPE and SwiGLU to bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from tessera.workers.api import SamplingParams
from tessera.workers.config import EngineConfig
from tessera.workers.engine.engine import Engine
from tessera.workers.engine.model_runner import Chunk, ModelRunner
from tessera.workers.kv.kv_cache import allocate_kv_cache
from tessera.workers.kv.manager import KVCacheManager
from tessera.workers.model.loader import LoadedModel, fast_mode_available, load_model
from tessera.workers.quant.kernels import _cpu_flags, native_kernels
from tests.helpers import run_engine, tokens_of

pytestmark = pytest.mark.slow

#: Shipped texts (prose, field notes, Python, a dialogue), teacher-forced whole.
TEXTS = tuple(
    (Path(__file__).parents[1] / "data" / name).read_text()
    for name in ("quality.txt", "quality_notes.txt", "quality_code.txt", "quality_dialogue.txt")
)
PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "def merge_sorted(a, b):\n    ",
    "Write a short poem about a cat watching the rain.",
    "List three differences between a list and a tuple in Python.",
)
NEAR_TIE = 0.25  # logits: the reference's top-2 gap where a mode may differ
MAX_PERPLEXITY_RATIO = 1.01
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Contract:
    dtype: str  # EngineConfig.dtype
    min_agreement: float
    max_mean_kl: float  # nats


CONTRACTS = {
    "fast": Contract("auto", min_agreement=0.99, max_mean_kl=2e-4),
    "bfloat16": Contract("bfloat16", min_agreement=0.975, max_mean_kl=2e-3),
}


@pytest.fixture(scope="module")
def fast(smollm2_path) -> LoadedModel:
    """The fast mode, or a skip where this CPU cannot run it (``dtype="auto"`` is then
    the exact mode, which the other engine tests check)."""
    if not fast_mode_available():
        pytest.skip("the fast mode needs the AVX512_BF16 kernel; auto is float32 here")
    loaded = load_model(smollm2_path, "auto")
    assert loaded.precision == "fast" and loaded.dtype == torch.float32
    return loaded


@pytest.fixture(scope="module")
def bf16(smollm2_path) -> LoadedModel:
    return load_model(smollm2_path, "bfloat16")


@pytest.fixture(scope="module", params=list(CONTRACTS))
def mode(request) -> tuple[Contract, LoadedModel]:
    return CONTRACTS[request.param], request.getfixturevalue(
        "fast" if request.param == "fast" else "bf16"
    )


def teacher_forced_logits(
    loaded: LoadedModel, tokens: list[int], native: bool = False
) -> torch.Tensor:
    """float32 next-token logits at every position of ``tokens``, one prefill pass: op by
    op, or (``native``) as the engine serves such a prompt, each token a row of the native
    stack (``model_runner.NATIVE_SPLIT_CONTEXT``)."""
    num_blocks = -(-len(tokens) // BLOCK_SIZE)
    kv = KVCacheManager(num_blocks, BLOCK_SIZE)
    cache = allocate_kv_cache(
        loaded.config, num_blocks, BLOCK_SIZE, loaded.kv_dtype, torch.device("cpu")
    )
    assert kv.allocate("s", len(tokens))
    runner = ModelRunner(loaded.model, kv, cache, native_decode=native)
    assert runner.native_prompts == native  # the path asked for is the one that runs
    return runner.execute([Chunk("s", tokens, 0, logits_rows=range(len(tokens)))]).float()


def reference_logits(hf_reference, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 next-token logits at every position of ``tokens``."""
    with torch.no_grad():
        return hf_reference.model(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module")
def sequences(smollm2, hf_reference) -> list[list[int]]:
    """The texts, then each prompt with transformers' greedy 48-token continuation."""
    prompts = [smollm2.tokenizer(p).input_ids for p in PROMPTS]
    continued = [p + list(hf_reference.greedy(tuple(p), 48).token_ids) for p in prompts]
    return [*(smollm2.tokenizer(text).input_ids for text in TEXTS), *continued]


@pytest.fixture(scope="module", params=["op-by-op", "native"])
def path(request) -> bool:
    """Whether prompts run through the native stack (what the engine serves with, its
    ``native_decode`` default) or op by op; each path is held to the contract."""
    native = request.param == "native"
    if native and native_kernels() is None:
        pytest.skip("the native extension could not be built here (warned at build)")
    return native


@pytest.fixture(scope="module")
def measured(hf_reference, mode, path, sequences) -> tuple[Contract, dict[str, float]]:
    contract, loaded = mode
    agree = positions = 0
    kl_sum = 0.0
    gaps: list[float] = []  # the reference's top-2 gap where the argmaxes differ
    nll = {"reference": 0.0, "fast": 0.0}  # summed over the texts' next tokens
    targets_total = 0
    for index, tokens in enumerate(sequences):
        exact_logits = reference_logits(hf_reference, tokens)
        fast_logits = teacher_forced_logits(loaded, tokens, path)
        same = exact_logits.argmax(-1) == fast_logits.argmax(-1)
        agree += int(same.sum())
        top2 = exact_logits.topk(2, dim=-1).values
        gaps += (top2[:, 0] - top2[:, 1])[~same].tolist()
        positions += len(tokens)
        exact_logp = exact_logits.log_softmax(-1)
        fast_logp = fast_logits.log_softmax(-1)
        kl_sum += float((exact_logp.exp() * (exact_logp - fast_logp)).sum())
        if index < len(TEXTS):  # the texts' perplexity: each next token under each mode
            targets = torch.tensor(tokens[1:])
            targets_total += len(targets)
            for name, logp in (("reference", exact_logp), ("fast", fast_logp)):
                nll[name] += float(-logp[:-1].gather(1, targets[:, None]).sum())
    result = {
        "positions": positions,
        "agreement": agree / positions,
        "mean_kl": kl_sum / positions,
        "largest_gap_where_they_differ": max(gaps, default=0.0),
        "perplexity_reference": float(torch.tensor(nll["reference"] / targets_total).exp()),
        "perplexity_fast": float(torch.tensor(nll["fast"] / targets_total).exp()),
    }
    print(f"{contract.dtype} ({'native' if path else 'op by op'}) vs transformers: {result}")
    return contract, result


def test_next_token_agreement(measured):
    contract, result = measured
    assert result["positions"] > 2200
    assert result["agreement"] >= contract.min_agreement, result
    assert result["largest_gap_where_they_differ"] < NEAR_TIE, result


def test_mean_kl_divergence_is_bounded(measured):
    contract, result = measured
    assert result["mean_kl"] <= contract.max_mean_kl, result


def test_perplexity_within_one_percent(measured):
    _, result = measured
    ratio = result["perplexity_fast"] / result["perplexity_reference"]
    assert 1 / MAX_PERPLEXITY_RATIO <= ratio <= MAX_PERPLEXITY_RATIO, result


def test_each_mode_really_differs_from_the_reference(hf_reference, mode, sequences):
    """The comparison can fail: each mode computes different numbers (bf16 inputs,
    4-bit weights through the bf16 kernel)."""
    contract, loaded = mode
    exact = reference_logits(hf_reference, sequences[1])
    other = teacher_forced_logits(loaded, sequences[1])
    assert not torch.allclose(exact, other, atol=1e-3)
    layer = loaded.model.layers[0]
    assert layer.gate_up_proj.int4 is not None and loaded.model.packed_embedding is not None
    assert loaded.precision == ("fast" if contract.dtype == "auto" else contract.dtype)


def test_seeded_sampling_is_reproducible_across_batch_mixes(mode):
    """A seeded request samples the same tokens alone and in a batch with others."""
    contract, loaded = mode
    sampled = SamplingParams(max_tokens=32, temperature=1.0, seed=1234, ignore_eos=True)
    prompt = "Once upon a time in a small village"

    def run(others: int) -> list[int]:
        engine = Engine(EngineConfig(dtype=contract.dtype, num_kv_blocks=256), loaded=loaded)
        # the mode's KV cache and block hash keys (a block of one precision is not another's)
        expected_kv = torch.float16 if contract.dtype == "auto" else torch.bfloat16
        assert engine.runner.kv_cache.dtype == expected_kv
        assert engine.hash_keys[1] == ("fast" if contract.dtype == "auto" else "bfloat16")
        # and the bf16 kernels' path, from the CPU's own flags: AMX and AVX-512 sum a
        # block in different orders; without AVX512_BF16 the bfloat16 mode takes none
        flags = set(_cpu_flags().split())
        path = (
            ("amx" if {"amx_bf16", "amx_tile"} <= flags else "avx512_bf16")
            if "avx512_bf16" in flags
            else ""
        )
        assert loaded.kernels == path
        assert engine.hash_keys[2:] == ((path,) if path else ())
        engine.add_request("seeded", prompt, sampled)
        for index in range(others):
            engine.add_request(
                f"other{index}",
                f"Another prompt, number {index}, about something else",
                SamplingParams(max_tokens=40, temperature=0.7, seed=index),
            )
        return tokens_of(run_engine(engine)["seeded"])

    alone = run(0)
    assert run(3) == alone
    assert run(9) == alone


def test_greedy_steps_take_the_heads_own_argmax(mode, monkeypatch):
    """A step whose every row is a plain argmax (greedy requests: a prompts' step, decode
    steps, and steps that mix decodes with a later prompt's chunks, one chunk with no row
    to sample) asks the forward for the argmax alone (``argmax_only``: the native Q8_0 head
    writes no logits; with AVX512_VNNI it screens them in int8, ``q8_screen_argmax``), and
    gets the tokens that the argmax of the logits gives. A step that needs the logits (a
    request with logprobs among them) gets them, and where the head runs on the native
    Q8_0 kernel, each row's argmax taken as it wrote them (``taken_argmax``: no second
    read), with the same tokens again."""
    from tessera.workers.engine import run as engine_module
    from tessera.workers.engine.model_runner import ModelRunner
    from tessera.workers.quant.int4 import Q8Weight
    from tessera.workers.quant.kernels import argmax_rows

    contract, loaded = mode
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    # 24 tokens in two chunks of a 16-token step budget, beside the others' decodes
    late = loaded.tokenizer.encode(" ".join(["the lighthouse keeper climbed"] * 6))[:24]

    def run(logprobs: bool = False) -> dict[str, list[int]]:
        config = EngineConfig(dtype=contract.dtype, num_kv_blocks=64, max_num_batched_tokens=16)
        engine = Engine(config, loaded=loaded)
        for index, prompt in enumerate(prompts):
            engine.add_request(f"r{index}", prompt, greedy)
        if logprobs:  # its 40 tokens outlast the others: every step has its row
            many = replace(greedy, max_tokens=40, logprobs=1)
            engine.add_request("logprobs", prompts[0], many)
        outputs: dict[str, list] = {}
        for _ in range(3):
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
        engine.add_request("late", late, greedy)
        for rid, deltas in run_engine(engine).items():
            outputs.setdefault(rid, []).extend(deltas)
        return {rid: tokens_of(outputs[rid]) for rid in ("r0", "r1", "r2", "late")}

    taken: list[bool] = []
    real = engine_module.taken_argmax

    def spy(logits):
        indices = real(logits)
        taken.append(indices is not None)
        return indices

    asked: list[tuple[str, bool, list[int]]] = []
    real_execute, real_decodes = ModelRunner.execute, ModelRunner.execute_decodes

    def checked(out, rows: int, argmax_only: bool):
        # the argmax (int64 [rows]) or the logits (float32 [rows, SmolLM2's 49,152 tokens])
        want = (torch.int64, (rows,)) if argmax_only else (torch.float32, (rows, 49152))
        assert (out.dtype, tuple(out.shape)) == want
        return out

    def spy_execute(self, chunks, argmax_only=False):
        asked.append(("execute", argmax_only, []))
        rows = sum(len(chunk.logits_rows) for chunk in chunks)
        return checked(real_execute(self, chunks, argmax_only), rows, argmax_only)

    def spy_decodes(self, seq_ids, token_ids, starts, argmax_only=False, logits_for=()):
        asked.append(("decodes", argmax_only, list(logits_for)))
        out = real_decodes(self, seq_ids, token_ids, starts, argmax_only, logits_for)
        if logits_for:  # the others' argmax, and these rows' logits
            argmax, logits = out
            checked(argmax, len(seq_ids) - len(logits_for), True)
            checked(logits, len(logits_for), False)
            return out
        return checked(out, len(seq_ids), argmax_only)

    screened: list[int] = []
    native = native_kernels()
    if native is not None and native.q8_screen_available():
        real_screen = native.q8_screen_argmax

        def spy_screen(x, *args):
            screened.append(len(x))
            return real_screen(x, *args)

        monkeypatch.setattr(native, "q8_screen_argmax", spy_screen)
    monkeypatch.setattr(engine_module, "taken_argmax", spy)
    monkeypatch.setattr(ModelRunner, "execute", spy_execute)
    monkeypatch.setattr(ModelRunner, "execute_decodes", spy_decodes)
    with_head = run()
    # the prompts' step, two decode steps, the late prompt's two chunks beside decodes
    # (the first samples nothing for it), then decode steps: every one the argmax alone
    kinds = [kind for kind, _, _ in asked[:5]]
    assert kinds == ["execute", "decodes", "decodes", "execute", "execute"]
    steps = len(asked)
    assert steps >= 14 and all(only and not rows for _, only, rows in asked)
    assert not taken  # no logits written, none read
    head = loaded.model.head_q8
    if head is not None and head.screen is not None and not native.amx_in_use():
        assert len(screened) == steps  # every step's argmax through the screen
    asked.clear()
    assert run(logprobs=True) == with_head
    # every step gives the logprobs row its logits: all the logits, or (a decode step
    # beside other rows) its row's and the others' argmax
    assert len(asked) >= steps and all(not only or rows for _, only, rows in asked)
    assert any(rows for _, _, rows in asked)
    native_head = head is not None  # else the head is quant_matmul
    assert len(taken) == len(asked) and all(t == native_head for t in taken)  # every step's
    monkeypatch.setattr(engine_module, "taken_argmax", lambda logits: None)
    assert run(logprobs=True) == with_head  # argmax_rows over the logits: the same tokens
    if native_head:  # its argmax as argmax_rows reads it from the logits: the same tokens
        monkeypatch.setattr(Q8Weight, "argmax", lambda self, x: argmax_rows(self.matmul(x)))
        assert run() == with_head

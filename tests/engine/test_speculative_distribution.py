"""Speculative sampling keeps the target's distribution: a chi-square test.

Tiny random target and draft models with a 16-token vocabulary (so the exact joint
distribution of two tokens is cheap to compute with transformers) that disagree
often. Thousands of seeded requests each generate four tokens; the second and third
come out of one verification step (two drafts, accept / reject, residual sampling).
Their joint frequencies are compared with the target's exact joint distribution
(computed by transformers, summed over the first token): the test fails when the
chi-square p-value is below ``ALPHA``. The same statistic against the *draft's*
distribution must be far below it, so the test can tell the two apart.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tessera.workers.api import SamplingParams, SpeculativeParams

VOCAB = 16
NUM_REQUESTS = 3000
ALPHA = 1e-3  # fail when a distribution this far off would arise by chance less often
TEMPERATURE = 0.9
TOP_K = 8
# Every token occurs in the ngram prompt, so prompt lookup always proposes something.
PROMPTS = {
    "draft": [1, 7, 4, 9, 12, 3],
    "ngram": [7, 2, 12, 5, 0, 9, 14, 3, 11, 6, 1, 15, 8, 13, 4, 10, 7, 2],
}


def tiny_model(path, seed: int, smollm2):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,  # peaked, distinct distributions
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    smollm2.tokenizer.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, smollm2):
    target_path = tmp_path_factory.mktemp("tiny16-target")
    draft_path = tmp_path_factory.mktemp("tiny16-draft")
    target = tiny_model(target_path, 1, smollm2)
    draft = tiny_model(draft_path, 2, smollm2)
    return target_path, target, draft_path, draft


def processed(logits: torch.Tensor) -> torch.Tensor:
    """The sampler's distribution: temperature, then top-k, then softmax."""
    x = logits.float() / TEMPERATURE
    kth = x.topk(TOP_K, dim=-1).values[..., -1:]
    return x.masked_fill(x < kth, -math.inf).softmax(dim=-1)


def exact_joint(model, prompt: list[int]) -> torch.Tensor:
    """[VOCAB, VOCAB]: P(token 2 = a, token 3 = b), summed over token 1."""
    with torch.no_grad():
        p1 = processed(model(torch.tensor([prompt])).logits[0, -1])  # [V]
        one = torch.tensor([prompt + [t] for t in range(VOCAB)])
        p2 = processed(model(one).logits[:, -1])  # [t1, t2]
        two = torch.tensor([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        p3 = processed(model(two).logits[:, -1]).view(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
    return torch.einsum("a,ab,abc->bc", p1, p2, p3).double()


def chi_square_p_value(counts: Counter, expected_probs: torch.Tensor, total: int) -> float:
    """Pearson's test; cells expecting fewer than 5 are pooled into one."""
    expected = (expected_probs.flatten() * total).tolist()
    observed = [counts.get(divmod(cell, VOCAB), 0) for cell in range(VOCAB * VOCAB)]
    cells, pooled_e, pooled_o = [], 0.0, 0
    for o, e in zip(observed, expected, strict=True):
        if e >= 5:
            cells.append((o, e))
        else:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
    if pooled_e > 0:
        cells.append((pooled_o, pooled_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_sampling_has_the_targets_distribution(tiny_pair, method):
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine

    target_path, target, draft_path, draft = tiny_pair
    engine = Engine(
        EngineConfig(
            model=str(target_path),
            draft_model=str(draft_path),
            block_size=4,
            num_kv_blocks=1200,
            max_num_seqs=256,
        )
    )
    prompt = PROMPTS[method]
    sampling = {
        "max_tokens": 4,
        "temperature": TEMPERATURE,
        "top_k": TOP_K,
        "ignore_eos": True,
        "speculative": SpeculativeParams(method, 2, adaptive=False),
    }
    for seed in range(NUM_REQUESTS):
        engine.add_request(f"s{seed}", prompt, SamplingParams(seed=seed, **sampling))
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    engine.check_integrity()
    pairs = Counter((t[1], t[2]) for t in tokens.values())
    assert sum(pairs.values()) == NUM_REQUESTS
    stats = engine.stats()
    # every request verified two drafts right after its first token
    assert stats.spec_steps >= NUM_REQUESTS
    assert 0 < stats.spec_accepted < stats.spec_proposed
    if method == "draft":
        assert stats.spec_acceptance_rate < 0.8  # the draft disagrees often
    p_target = chi_square_p_value(pairs, exact_joint(target, prompt), NUM_REQUESTS)
    assert p_target > ALPHA, f"chi-square p = {p_target:.2e} against the target"
    if method == "draft":
        p_draft = chi_square_p_value(pairs, exact_joint(draft, prompt), NUM_REQUESTS)
        assert p_draft < 1e-9, f"the test cannot tell the draft apart (p = {p_draft:.2e})"

"""Sampler against straightforward references: loops over Python floats, not our tensors."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.workers.api import SamplingParams
from tessera.workers.decoding.sampling import (
    Sampler,
    SamplingRow,
    TokenSpan,
    argmax_only,
    random_generator,
)

# Upper 0.1% points of the chi-square distribution (alpha = 0.001), keyed by degrees of
# freedom. The seeds are fixed, so a pass is deterministic; alpha is the chance that a
# correct sampler would have failed with some other set of seeds.
CHI2_CRITICAL_ALPHA_0001 = {4: 18.467, 7: 24.322}
NUM_SEEDS = 4000


def row(params: SamplingParams, seed: int = 0, token_index: int = 0, **kw) -> SamplingRow:
    kw.setdefault("prompt_token_ids", ())
    kw.setdefault("output_token_ids", ())
    return SamplingRow(params=params, seed=seed, token_index=token_index, **kw)


def softmax(xs: list[float]) -> list[float]:
    finite = [x for x in xs if x != -math.inf]
    m = max(finite)
    exps = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    total = sum(exps)
    return [e / total for e in exps]


def ref_penalised(
    logits, prompt, output, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0
):
    out = list(logits)
    for t in set(prompt) | set(output):  # Hugging Face repetition penalty
        rep = repetition_penalty
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):  # OpenAI presence / frequency penalties
        out[t] -= presence_penalty + frequency_penalty * output.count(t)
    return out


def ref_probs(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> list[float]:
    """The documented order: temperature, min-p, top-k, top-p (renormalised), softmax."""
    x = [v / temperature for v in logits]
    p = softmax(x)
    p_max = max(p)
    keep = [i for i in range(len(x)) if p[i] >= min_p * p_max]
    keep.sort(key=lambda i: (-x[i], i))
    if top_k > 0:
        keep = keep[:top_k]
    q = softmax([x[i] for i in keep])
    kept, mass = [], 0.0
    for i, qi in zip(keep, q, strict=True):
        kept.append(i)
        mass += qi
        if mass >= top_p:
            break
    kept = set(kept)
    return softmax([x[i] if i in kept else -math.inf for i in range(len(x))])


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(6, 50, generator=torch.Generator().manual_seed(1234)) * 2


def test_greedy_is_torch_argmax_including_ties_and_bf16():
    x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    x[3, [10, 500]] = 100.0  # a tie: the first index wins
    x[4] = 0.0
    for t in (x, x.to(torch.bfloat16)):
        got = [r.token_id for r in Sampler().sample(t, [row(SamplingParams(temperature=0))] * 64)]
        assert got == torch.argmax(t, dim=-1).tolist()
    assert got[3] == 10 and got[4] == 0


def test_a_given_argmax_stands_for_the_greedy_rows_and_must_fit_them():
    """``argmax`` (the head's own, ``kernels.taken_argmax``) is what plain greedy rows
    take, its indices as given; rows that sample or are penalised compute their own."""
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    given = torch.tensor([7, 8, 9])  # not x's argmax: shows that the rows took it
    greedy, penalised = (
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=1.5),
    )
    got = Sampler().sample(x, [row(greedy), row(penalised), row(greedy)], argmax=given)
    assert [r.token_id for r in got] == [7, int(x[1].argmax()), 9]
    assert given.tolist() == [7, 8, 9]  # the caller's tensor is not written into
    with pytest.raises(ValueError, match=r"^argmax \(2,\) does not match 3 rows$"):
        Sampler().sample(x, [row(greedy)] * 3, argmax=given[:2])


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"temperature": 0.5},
        {"logit_bias": ((3, 5.0),)},
        {"repetition_penalty": 1.2},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"min_tokens": 2},
        {"logprobs": 0},
        {"n": 2},
        {"best_of": 2},
        {"beam_width": 2},
    ],
)
def test_argmax_only_rows_are_exactly_the_plain_greedy_ones(kw):
    """What ``argmax_only`` promises the engine: such a row's token is the argmax and it
    carries no logprob, whatever its row says; every other setting is not argmax-only."""
    params = SamplingParams(**{"temperature": 0.0, **kw})
    assert argmax_only(params) == (kw == {})
    x = torch.randn(2, 100, generator=torch.Generator().manual_seed(3))
    rows = [row(params, seed=5, token_index=0, output_token_ids=(1, 2, 3))] * 2
    if argmax_only(params):
        expected = [(int(x[0].argmax()), None), (int(x[1].argmax()), None)]
        assert Sampler().sample(x, rows) == expected


def test_same_key_same_token_whatever_the_batch():
    x = torch.zeros(1, 1000)  # uniform: the token is decided by the noise alone
    p = SamplingParams(temperature=1.0, top_p=0.9)
    alone = Sampler().sample(x, [row(p, seed=7, token_index=3)])[0].token_id
    others = [row(SamplingParams(temperature=0.5, top_k=3), seed=s) for s in range(5)]
    batch = others[:3] + [row(p, seed=7, token_index=3)] + others[3:]
    big = torch.randn(6, 1000)
    big[3] = 0.0
    assert Sampler().sample(big, batch)[3].token_id == alone


def test_token_index_and_seed_change_the_stream():
    x = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0)
    by_index = {Sampler().sample(x, [row(p, seed=7, token_index=i)])[0].token_id for i in range(20)}
    by_seed = {Sampler().sample(x, [row(p, seed=s)])[0].token_id for s in range(20)}
    assert len(by_index) > 10 and len(by_seed) > 10
    g1, g2 = random_generator(1, 2), random_generator(1, 2)
    assert torch.equal(torch.rand(5, generator=g1), torch.rand(5, generator=g2))


@pytest.mark.parametrize(
    "params",
    # 5e-324 (the smallest double) is 0 in float32: the best token survives even so
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_p=5e-324)],
)
def test_truncation_to_one_token_is_greedy(logits, params):
    logits = torch.cat([logits, torch.zeros(1, 50), torch.tensor([[0.0] * 40 + [1.0] * 10])])
    rows = [row(params, seed=s) for s in range(len(logits))]
    got = [r.token_id for r in Sampler().sample(logits, rows)]
    assert got == torch.argmax(logits, dim=-1).tolist()


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0.7},
        {"min_p": 0.05},
        {"top_k": 5},
        {"top_p": 0.6},
        {"temperature": 1.3, "min_p": 0.02, "top_k": 12, "top_p": 0.8},
    ],
)
def test_probs_match_reference_truncation(logits, kw):
    rows = [row(SamplingParams(**kw)) for _ in range(len(logits))]
    got = Sampler().probs(logits, rows)
    want = torch.tensor([ref_probs(r, **kw) for r in logits.tolist()])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.sum(dim=1), torch.ones(len(logits)))


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.97])
def test_top_p_over_a_wide_flat_vocabulary(top_p):
    # Flat logits put the cut past the first candidate rounds (hundreds or thousands of
    # tokens deep), which small-vocabulary tests never reach.
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(5)) * 0.1
    got = Sampler().probs(x, [row(SamplingParams(top_p=top_p))] * 3)
    want = torch.tensor([ref_probs(r, top_p=top_p) for r in x.tolist()])
    assert (got > 0).sum(dim=1).tolist() == (want > 0).sum(dim=1).tolist()
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize(
    ("kw", "kept"),
    [
        ({"top_k": 1}, [1]),
        ({"top_k": 3}, [1, 2, 3]),
        ({"top_p": 0.3}, [1, 2]),
        ({"top_p": 0.5}, [1, 2, 3]),
    ],
)
def test_ties_at_the_cut_go_to_the_lowest_ids(kw, kept):
    x = torch.tensor([[0.0, 2.0, 2.0, 2.0, 2.0, 0.0]])  # ids 1-4 tie; each holds 0.228
    got = Sampler().probs(x, [row(SamplingParams(**kw))])[0]
    want = torch.zeros(6)
    want[kept] = 1 / len(kept)
    torch.testing.assert_close(got, want)


def test_min_p_drops_unlikely_tokens():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    got = Sampler().probs(x, [row(SamplingParams(min_p=0.2))])[0]
    # 0.05 < 0.2 * 0.5 is dropped; 0.15 >= 0.1 survives
    torch.testing.assert_close(got, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_penalties_match_reference(logits):
    prompt, output = (1, 2, 3, 3, 40), (3, 5, 5, 5, 7, 49)
    kws = [
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.8},
        {"presence_penalty": 1.5},
        {"frequency_penalty": -0.7},
        {"repetition_penalty": 2.0, "presence_penalty": 0.5, "frequency_penalty": 0.4},
        {"repetition_penalty": 1.5, "temperature": 0.0},
    ]
    rows = [
        row(SamplingParams(**kw), prompt_token_ids=prompt, output_token_ids=output) for kw in kws
    ]
    got = Sampler().probs(logits, rows)
    for i, kw in enumerate(kws):
        kw = {k: v for k, v in kw.items() if k != "temperature"}
        penalised = ref_penalised(logits[i].tolist(), list(prompt), list(output), **kw)
        if rows[i].params.greedy:
            want = [0.0] * len(penalised)
            want[max(range(len(penalised)), key=lambda t: (penalised[t], -t))] = 1.0
        else:
            want = softmax(penalised)
        torch.testing.assert_close(got[i], torch.tensor(want), atol=1e-6, rtol=1e-5)


def test_suppressed_ids_are_never_sampled():
    x = torch.tensor([[5.0, 5.0, 0.0, 0.0, -1.0]]).repeat(300, 1)
    banned = (0, 1)
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)):
        rows = [row(params, seed=s, suppressed_token_ids=banned) for s in range(300)]
        got = {r.token_id for r in Sampler().sample(x, rows)}
        assert got.isdisjoint(banned)
        assert got == ({2, 3, 4} if not params.greedy else {2})


@pytest.mark.parametrize(
    ("kw", "by"),
    [({}, "seed"), ({}, "token_index"), ({"temperature": 0.7, "top_k": 5}, "seed")],
)
def test_sampled_frequencies_match_the_distribution(kw, by):
    raw = [0.0, 0.5, 1.0, -1.0, 2.0, 0.3, -0.5, 1.5]
    expected = ref_probs(raw, **kw)
    x = torch.tensor([raw]).repeat(NUM_SEEDS, 1)
    rows = [row(SamplingParams(**kw), **{by: i}) for i in range(NUM_SEEDS)]
    counts = [0] * len(raw)
    for r in Sampler().sample(x, rows):
        counts[r.token_id] += 1
    support = [t for t, p in enumerate(expected) if p > 0]
    assert all(counts[t] == 0 for t in range(len(raw)) if t not in support)
    chi2 = sum(
        (counts[t] - NUM_SEEDS * expected[t]) ** 2 / (NUM_SEEDS * expected[t]) for t in support
    )
    assert chi2 < CHI2_CRITICAL_ALPHA_0001[len(support) - 1], (chi2, counts)


def test_logprobs_are_raw_log_softmax_with_sorted_top(logits):
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=2.0, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(),
    ]
    rows = [row(p, seed=3, prompt_token_ids=(1, 2)) for p in params]
    out = Sampler().sample(logits[:3], rows)
    for i in range(2):
        raw = softmax(logits[i].tolist())
        lp = out[i].logprob
        assert lp.token_id == out[i].token_id
        assert lp.logprob == pytest.approx(math.log(raw[lp.token_id]), abs=1e-5)
        ranked = sorted(range(len(raw)), key=lambda t: -raw[t])[: params[i].logprobs]
        assert [t for t, _ in lp.top] == ranked
        assert [v for _, v in lp.top] == pytest.approx([math.log(raw[t]) for t in ranked], abs=1e-5)
    assert out[1].logprob.top == () and out[2].logprob is None


def test_probs_rows_sum_to_one_and_greedy_is_one_hot(logits):
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_k=3)] * 2
    probs = Sampler().probs(logits, [row(p) for p in params])
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(len(params)))
    assert probs.dtype == torch.float32
    assert probs[0].tolist() == torch.nn.functional.one_hot(logits[0].argmax(), 50).float().tolist()


def test_callers_logits_are_not_modified(logits):
    before = logits.clone()
    rows = [
        row(SamplingParams(repetition_penalty=2.0), output_token_ids=(1,), seed=i) for i in range(6)
    ]
    Sampler().sample(logits, rows)
    assert torch.equal(logits, before)


def test_rows_must_match_logits():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 4), [row(SamplingParams())])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_distribution_and_is_batch_independent(logits):
    params = [SamplingParams(temperature=0), SamplingParams(top_k=7, top_p=0.8, min_p=0.01)]
    rows = [row(p, seed=9, output_token_ids=(1, 2)) for p in params * 3]
    cpu = Sampler().probs(logits, rows)
    torch.testing.assert_close(Sampler().probs(logits.cuda(), rows).cpu(), cpu)
    alone = Sampler().sample(logits[1:2].cuda(), rows[1:2])[0].token_id
    assert Sampler().sample(logits.cuda(), rows)[1].token_id == alone


def test_a_token_span_reads_as_the_slice_it_stands_for():
    tokens = [5, 6, 7, 8, 9]
    span = TokenSpan(tokens, 1, 4)
    tokens.append(10)  # the list grows past the span (the engine appends the sampled token)
    assert list(span) == [6, 7, 8] and len(span) == 3 and 7 in span and 9 not in span
    assert (span[0], span[-1], span[1:]) == (6, 8, [7, 8])
    with pytest.raises(IndexError, match="token index 3 out of range for 3 tokens"):
        span[3]

"""Parallel tokens: a set shares one position and sees itself by a mask; its logits and
the next step's equal a dense transformers forward with the same position ids and 4-D
mask; width-1 sets are ordinary decoding."""

from __future__ import annotations

import pytest
import torch

from tessera.workers.api import InvalidRequestError, ParallelTokensParams, Resume, SamplingParams
from tessera.workers.decoding.parallel_tokens import parallel_mask
from tessera.workers.engine.model_runner import Chunk, ModelRunner
from tessera.workers.kv.kv_cache import allocate_kv_cache
from tessera.workers.kv.manager import KVCacheManager
from tests.helpers import run_engine, tokens_of

PROMPT = "The cat sat on the mat. Then the dog"


def reference_mask(num_tokens: int, sets: list[tuple[int, int]], mode: str) -> torch.Tensor:
    """Bool [T, T], built here independently: causal, and inside a set each token sees
    only itself (isolated) or the whole set (visible)."""
    allowed = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    for first, width in sets:
        for i in range(first, first + width):
            for j in range(first, first + width):
                allowed[i, j] = mode == "visible" or i == j
    return allowed


def hf_logits(model, token_ids, positions, allowed) -> torch.Tensor:
    """transformers' dense forward with explicit position ids and a 4-D additive mask."""
    mask = torch.zeros(allowed.shape, dtype=torch.float32)
    mask = mask.masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([token_ids]),
            position_ids=torch.tensor([positions]),
            attention_mask=mask,
        )
    return out.logits[0].float()


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from tessera.workers.model.loader import load_model

    path, hf_model = tiny_llama
    return load_model(path, "float32"), hf_model


def ours(loaded, prompt, members, after, mode) -> tuple[torch.Tensor, torch.Tensor]:
    """The set's logits [w, V] and the next token's [V], through the paged KV cache in
    three steps: the prompt, the set at one position, one more token."""
    n, w = len(prompt), len(members)
    kv = KVCacheManager(num_blocks=8, block_size=4)
    cache = allocate_kv_cache(loaded.config, 8, 4, torch.float32, torch.device("cpu"))
    runner = ModelRunner(loaded.model, kv, cache)
    assert kv.allocate("s", n + w + 1)
    runner.execute([Chunk("s", prompt, 0, logits_rows=(n - 1,))])
    mask = parallel_mask([(n, w)], n, n + w, mode)
    set_logits = runner.execute(
        [Chunk("s", members, n, positions=[n] * w, mask=mask, logits_rows=range(w))]
    )
    next_logits = runner.execute([Chunk("s", [after], n + w, positions=[n + 1], logits_rows=(0,))])
    return set_logits, next_logits[0]


@pytest.mark.parametrize("mode", ["isolated", "visible"])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_set_logits_equal_a_dense_forward_with_positions_and_mask(tiny, mode, width):
    loaded, hf_model = tiny
    gen = torch.Generator().manual_seed(width)
    prompt = torch.randint(0, 512, (11,), generator=gen).tolist()
    members = torch.randperm(512, generator=gen)[:width].tolist()
    after = 17
    set_logits, next_logits = ours(loaded, prompt, members, after, mode)
    n = len(prompt)
    expected = hf_logits(
        hf_model,
        prompt + members + [after],
        list(range(n)) + [n] * width + [n + 1],
        reference_mask(n + width + 1, [(n, width)], mode),
    )
    torch.testing.assert_close(set_logits, expected[n : n + width], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(next_logits, expected[n + width], atol=1e-4, rtol=1e-4)
    if width == 1:  # a one-token set is ordinary decoding
        plain = hf_logits(
            hf_model, prompt + members + [after], list(range(n + 2)), reference_mask(n + 2, [], "")
        )
        torch.testing.assert_close(next_logits, plain[n + 1], atol=1e-4, rtol=1e-4)


def test_isolated_and_visible_sets_differ(tiny):
    loaded, _ = tiny
    prompt, members = list(range(20, 31)), [40, 41]
    isolated = ours(loaded, prompt, members, 17, "isolated")
    visible = ours(loaded, prompt, members, 17, "visible")
    # visible members see each other, isolated ones do not; the token after the set
    # sees what they computed, so it differs too
    for member in range(2):
        assert (isolated[0][member] - visible[0][member]).abs().max() > 1e-3
    assert (isolated[1] - visible[1]).abs().max() > 1e-3
    # an isolated member is exactly a one-token set: the other member changes nothing
    alone = ours(loaded, prompt, members[:1], 17, "isolated")
    torch.testing.assert_close(isolated[0][0], alone[0][0], atol=1e-5, rtol=1e-5)


def parallel(threshold=0.1, width=4, mode="isolated", **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0)
    return SamplingParams(
        max_tokens=24,
        ignore_eos=True,
        parallel_tokens=ParallelTokensParams(threshold, width, mode),
        **kwargs,
    )


@pytest.mark.parametrize("mode", ["isolated", "visible"])
def test_the_engines_sets_follow_a_dense_forward_over_its_output(make_engine, hf_reference, mode):
    """Each set's probabilities are those of the mean of the previous set's members'
    next-token distributions in one dense transformers forward over the whole output."""
    engine = make_engine()
    engine.add_request("p", PROMPT, parallel(0.05, 3, mode))
    deltas = run_engine(engine)["p"]
    sets = [s for d in deltas for s in d.parallel_sets]
    prompt = engine.tokenize(PROMPT)
    assert [t for s in sets for t in s.token_ids] == tokens_of(deltas)
    assert any(len(s.token_ids) > 1 for s in sets), "no set of two or more tokens"
    token_ids, positions, spans = list(prompt), list(range(len(prompt))), []
    for s in sets:
        assert s.position == positions[-1] + 1
        spans.append((len(token_ids), len(s.token_ids)))
        token_ids += s.token_ids
        positions += [s.position] * len(s.token_ids)
    wide = [span for span in spans if span[1] > 1]
    logits = hf_logits(
        hf_reference.model, token_ids, positions, reference_mask(len(token_ids), wide, mode)
    )
    previous = [len(prompt) - 1]  # rows whose mean distribution chose the next set
    for s, (first, width) in zip(sets, spans, strict=True):
        mean = logits[previous].softmax(dim=-1).mean(dim=0)
        assert s.token_ids[0] == int(mean.argmax())
        torch.testing.assert_close(
            torch.tensor(s.probs), mean[list(s.token_ids)], atol=1e-4, rtol=1e-3
        )
        assert all(p >= 0.05 for p in s.probs[1:])
        previous = list(range(first, first + width))


def test_width_one_sets_are_ordinary_decoding(make_engine):
    engine = make_engine()
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    seeded = {"temperature": 0.9, "seed": 5}
    engine.add_request("plain", PROMPT, greedy)
    engine.add_request("one", PROMPT, parallel(threshold=1.0))
    engine.add_request("width1", PROMPT, parallel(threshold=0.01, width=1))
    engine.add_request("plain-s", PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, **seeded))
    engine.add_request("one-s", PROMPT, parallel(threshold=1.0, **seeded))
    out = run_engine(engine)
    assert tokens_of(out["one"]) == tokens_of(out["plain"]) == tokens_of(out["width1"])
    assert tokens_of(out["one-s"]) == tokens_of(out["plain-s"])
    assert all(len(s.token_ids) == 1 for d in out["one"] for s in d.parallel_sets)


def test_sets_survive_batching_chunking_preemption_and_prefix_caching(make_engine):
    system = (
        "You are a helpful assistant. You write short, clear and friendly answers, and you "
        "never repeat the question back to the user. "
    )
    prompts = [system + p for p in (PROMPT, "Once upon a time,", "The best way to learn is")]
    modes = ["isolated", "visible", "isolated"]

    def run(engine) -> dict[str, list[int]]:
        for i, (prompt, mode) in enumerate(zip(prompts, modes, strict=True)):
            engine.add_request(f"r{i}", prompt, parallel(0.05, 4, mode))
        return {k: tokens_of(v) for k, v in run_engine(engine).items()}

    alone = {}
    for i, (prompt, mode) in enumerate(zip(prompts, modes, strict=True)):
        engine = make_engine()
        engine.add_request(f"r{i}", prompt, parallel(0.05, 4, mode))
        alone[f"r{i}"] = tokens_of(run_engine(engine)[f"r{i}"])
    # 18 blocks of 4 tokens hold one ~60-token sequence but not three (the system prompt
    # is shared); 6-token steps chunk the prompts
    tight = make_engine(num_kv_blocks=18, block_size=4, max_num_batched_tokens=6)
    assert run(tight) == alone
    assert tight.stats().preemptions > 0
    # the same prompts again: their blocks come from the prefix cache, outputs unchanged
    engine = make_engine()
    assert run(engine) == alone
    assert run(engine) == alone
    assert engine.stats().prefix_cache.hits > 0


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"threshold": 0.0}, "parallel_tokens.threshold", "must be in (0, 1], got 0.0"),
        ({"max_width": 17}, "parallel_tokens.max_width", "must be in [1, 16], got 17"),
        ({"mode": "shared"}, "parallel_tokens.mode", "must be one of isolated, visible"),
    ],
)
def test_bad_parallel_settings_name_the_field(kwargs, field, message):
    with pytest.raises(InvalidRequestError) as error:
        ParallelTokensParams(**kwargs)
    assert error.value.field == field and message in str(error.value)


def test_parallel_tokens_are_refused_where_they_do_not_apply(make_engine):
    for kwargs, other in [({"n": 2}, "n"), ({"beam_width": 2}, "beam_width")]:
        with pytest.raises(InvalidRequestError, match=f"parallel_tokens: .*{other} > 1"):
            SamplingParams(parallel_tokens=ParallelTokensParams(), **kwargs)
    engine = make_engine(max_num_batched_tokens=2)
    with pytest.raises(InvalidRequestError, match="parallel_tokens.max_width: 4 exceeds"):
        engine.add_request("w", "Hi", parallel())
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="resume: a parallel_tokens request"):
        engine.add_request("r", "Hi", parallel(), resume=Resume((5,)))

"""A model of a family with windows, soft-caps and Gemma's norms (a tiny random Gemma 2),
served by `tessera serve` in the exact mode and called with the official `openai`
client: its greedy completions, whole and streamed, are transformers' tokens for the
same weights, on prompts several sliding windows long."""

from __future__ import annotations

import pytest
import torch

from tests.cluster.serve_process import serve_process
from tests.engine.test_model_families import build
from tests.helpers import NEAR_TIE_GAP, Reference, TransformersReference

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

API_KEY = "families-key-7d1e"
MODEL = "tiny-gemma2"
NAMESPACE = "serve-families-test"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def served(ray_session, tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("serve-families")
    model = build("gemma2", root / "gemma2", smollm2.tokenizer)
    settings = (
        f"model: {root / 'gemma2'}\n"
        f"served_model_name: {MODEL}\n"
        "num_kv_blocks: 64\n"
        "block_size: 4\n"
        "device: cpu\n"
        "report_interval_s: 0.1\n"
    )
    with serve_process(root, settings, API_KEY, NAMESPACE) as server:
        yield server, TransformersReference(model), smollm2.tokenizer


def assert_same_tokens(ours: list[str], reference: Reference, tokenizer) -> None:
    """The served tokens (``logprobs``' token strings, each token decoded alone) are
    the reference's, or part from them only where the reference had a near-tie."""
    expected = [tokenizer.decode([t]) for t in reference.token_ids]
    for i, (a, b) in enumerate(zip(ours, expected, strict=False)):
        if a != b:
            assert reference.top2_gaps[i] < NEAR_TIE_GAP, f"token {i}: {a!r}, not {b!r}"
            return
    assert len(ours) == len(expected)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (30, 9, 21)]


def test_completions_are_transformers_tokens(served):
    server, reference, tokenizer = served
    client = server.client()
    for prompt in prompts():
        done = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        (choice,) = done.choices
        expected = reference.greedy(tuple(prompt), MAX_TOKENS)
        assert_same_tokens(choice.logprobs.tokens, expected, tokenizer)


def test_streamed_completions_are_transformers_tokens(served):
    server, reference, tokenizer = served
    prompt = prompts()[0]
    stream = server.client().completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens = [
        token for chunk in stream for choice in chunk.choices if choice.logprobs
        for token in choice.logprobs.tokens
    ]  # fmt: skip
    assert_same_tokens(tokens, reference.greedy(tuple(prompt), MAX_TOKENS), tokenizer)

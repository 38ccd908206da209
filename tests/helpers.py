"""Helpers shared by the tests: the transformers reference and engine drivers."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from workers.api import RequestOutput

#: DESIGN.md's exactness rule: a greedy divergence from transformers is acceptable only
#: at a step where the reference's top-2 logit gap is below this.
NEAR_TIE_GAP = 1e-4

torch.manual_seed(0)


@dataclass(frozen=True)
class Reference:
    token_ids: tuple[int, ...]
    top2_gaps: tuple[float, ...]  # reference's logit gap between its top two, per step


class TransformersReference:
    """transformers' greedy decoding of the same weights, float32, one prompt at a time."""

    def __init__(self, model) -> None:
        self.model = model

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one instance per session
    def greedy(self, prompt_ids: tuple[int, ...], max_new_tokens: int) -> Reference:
        # No EOS at all (rather than min_new_tokens, which would mask EOS's logit): the
        # engine's ignore_eos keeps generating past EOS with the logits unchanged.
        config = copy.deepcopy(self.model.generation_config)
        config.eos_token_id = None
        out = self.model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            generation_config=config,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=2,
        )
        gaps = []
        for logits in out.logits:
            top2 = logits[0].float().topk(2).values
            gaps.append(float(top2[0] - top2[1]))
        return Reference(tuple(out.sequences[0, len(prompt_ids) :].tolist()), tuple(gaps))


def assert_greedy_matches(ours: list[int] | tuple[int, ...], ref: Reference) -> None:
    """Token-identical, or diverging only where the reference had a near-tie (DESIGN.md)."""
    ours = list(ours)
    for i, (a, b) in enumerate(zip(ours, ref.token_ids, strict=False)):
        if a != b:
            assert ref.top2_gaps[i] < NEAR_TIE_GAP, (
                f"diverged at token {i}: ours {a}, transformers {b}, reference top-2 gap "
                f"{ref.top2_gaps[i]:.3g} >= {NEAR_TIE_GAP}"
            )
            return  # after a legitimate near-tie split the continuations may differ
    assert len(ours) == len(ref.token_ids), f"lengths differ: {len(ours)} vs {len(ref.token_ids)}"


def run_engine(
    engine, check: bool = True, max_steps: int = 10_000
) -> dict[str, list[RequestOutput]]:
    """Step until idle, checking the pool's integrity after every step."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if check:
            engine.check_integrity()
    raise AssertionError(f"engine still busy after {max_steps} steps")


def tokens_of(deltas: list[RequestOutput]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def text_of(deltas: list[RequestOutput]) -> str:
    return "".join(d.text for d in deltas)

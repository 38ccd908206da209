"""Placement policies: which healthy worker gets a request.

A policy sees one ``Candidate`` per worker that may take the request now (healthy,
of the right role, not draining, below its capacity) and picks one. Policies are
chosen by name (``POLICIES``); they keep no state beyond the worker round robin chose last.

``PrefixAffinity`` (the default) scores each candidate by

    score = PREFIX * matched / prompt_blocks + HEADROOM * (1 - kv_usage) - QUEUE * load
            + LORA * holds_adapter

where ``matched`` is the number of leading prompt blocks the worker's prefix cache
already holds, ``load`` its share of used capacity (ongoing requests / capacity) and
``holds_adapter`` whether the request's LoRA adapter is in one of its slots (another
worker loads it when it must: a slot's write costs a little, a busier worker more).
A prompt hit outweighs any load difference, so requests sharing a prefix follow it,
unless the best match is overloaded (KV nearly full, or far busier than the
least-loaded worker): then the request goes to the least-loaded worker instead, which
will build its own copy of the prefix. (An engine's waiting queue is not a sign of
overload: requests wait there briefly while their prompts are prefilled in chunks.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

PREFIX = 1.0
HEADROOM = 0.25
QUEUE = 0.5
LORA = 0.2
#: KV usage at or above which a worker counts as overloaded for affinity.
OVERLOAD_KV_USAGE = 0.95
#: How much more loaded (share of capacity) than the least-loaded worker the best
#: prefix match may be before affinity gives way to balance.
OVERLOAD_IMBALANCE = 0.5


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: str
    ongoing: int  # requests placed and not released
    capacity: int  # ongoing requests it takes before new ones queue (> ongoing here)
    kv_usage: float  # share of its KV pool in use (last report)
    matched_blocks: int  # leading prompt blocks it holds
    holds_adapter: bool = False  # the request's LoRA adapter is in one of its slots

    @property
    def load(self) -> float:
        return self.ongoing / self.capacity


class PlacementPolicy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Candidate], prompt_blocks: int) -> Candidate:
        """Pick one of ``candidates`` (never empty) for a prompt of ``prompt_blocks``
        full blocks."""
        ...


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    """Lowest load, then most KV headroom; ties go to the first worker id."""
    return min(candidates, key=lambda c: (c.load, c.kv_usage, c.worker_id))


class LeastLoaded:
    name = "least_loaded"

    def choose(self, candidates: Sequence[Candidate], prompt_blocks: int) -> Candidate:
        return least_loaded(candidates)


class RoundRobin:
    """Each placement goes to the next worker, by worker id, that can take it."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None  # the worker id chosen last

    def choose(self, candidates: Sequence[Candidate], prompt_blocks: int) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        after = [c for c in ordered if self._last is None or c.worker_id > self._last]
        chosen = (after or ordered)[0]
        self._last = chosen.worker_id
        return chosen


class PrefixAffinity:
    name = "prefix_affinity"

    def score(self, candidate: Candidate, prompt_blocks: int) -> float:
        matched = candidate.matched_blocks / prompt_blocks if prompt_blocks else 0.0
        return (
            PREFIX * matched
            + HEADROOM * (1 - candidate.kv_usage)
            - QUEUE * candidate.load
            + LORA * candidate.holds_adapter
        )

    def overloaded(self, candidate: Candidate, least: Candidate) -> bool:
        return (
            candidate.kv_usage >= OVERLOAD_KV_USAGE
            or candidate.load - least.load > OVERLOAD_IMBALANCE
        )

    def choose(self, candidates: Sequence[Candidate], prompt_blocks: int) -> Candidate:
        least = least_loaded(candidates)
        best = max(candidates, key=lambda c: (self.score(c, prompt_blocks), c is least))
        if best.matched_blocks and self.overloaded(best, least):
            return least
        return best


POLICIES: dict[str, type[PlacementPolicy]] = {
    policy.name: policy for policy in (PrefixAffinity, RoundRobin, LeastLoaded)
}


def make_policy(name: str) -> PlacementPolicy:
    if name not in POLICIES:
        raise ValueError(f"placement: must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()

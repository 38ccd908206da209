"""The load generator's schedules: what each request sends and when it is due.

Arrivals are seeded: a Poisson process (or gamma gaps, ``burstiness``) at one request a
second, scaled by 1/rate, so schedules at different rates differ only in pace.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

#: Prompt token ids are drawn from [low, high): ordinary tokens of any vocabulary of
#: 30k or more (SmolLM2's has 49152), so a prompt's length in tokens is exact.
TOKEN_IDS = (1000, 30000)


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float  # from the start of the run
    prompt: list[int] | str  # token ids (completions only) or text
    output_tokens: int  # max_tokens
    prompt_tokens: int | None = None  # known in advance (token ids); else from usage

    @property
    def known_prompt_tokens(self) -> int | None:
        return len(self.prompt) if isinstance(self.prompt, list) else self.prompt_tokens


def unit_gaps(seed: int, burstiness: float = 1.0) -> Iterator[float]:
    """Gaps between arrivals at one request per second, seeded: exponential (a Poisson
    process) at burstiness 1, else gamma with shape ``burstiness`` and mean 1 (below 1
    burstier, above more even). A rate scales the same gaps by 1/rate."""
    draws = random.Random(seed)
    while True:
        if burstiness == 1.0:
            yield draws.expovariate(1.0)
        else:
            yield draws.gammavariate(burstiness, 1.0 / burstiness)


def arrival_times(count: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """``count`` arrival times at ``rate`` requests/s: the first at 0; all at 0 when the
    rate is infinite (every request sent at once)."""
    if math.isinf(rate):
        return [0.0] * count
    times, arrival = [], 0.0
    for gap in unit_gaps(seed, burstiness):
        if len(times) == count:
            break
        times.append(arrival)
        arrival += gap / rate
    return times


def token_prompt(ids: random.Random, length: int) -> list[int]:
    return [ids.randrange(*TOKEN_IDS) for _ in range(length)]


def build_schedule(
    lengths: list[tuple[int, int]],
    rate: float,
    rate_index: int,
    seed: int,
    num_requests: int | None,
    duration_s: float | None,
    salt: str = "",
) -> list[Request]:
    """Poisson arrivals at ``rate`` with (prompt, output) lengths drawn from ``lengths``:
    the first at 0, then exponential gaps. The token ids are drawn from ``seed`` and
    ``salt``, fresh per rate (no prefix hits between runs), the rest from ``seed``."""
    draws = random.Random(seed + 1)  # the same unit-rate gaps and length draws at every rate
    ids = random.Random(f"{seed}-{salt}-ids-{rate_index}")
    requests: list[Request] = []
    arrival = 0.0
    gaps = unit_gaps(seed)
    while num_requests is None or len(requests) < num_requests:
        if duration_s is not None and arrival >= duration_s:
            break
        prompt_tokens, output_tokens = draws.choice(lengths)
        requests.append(Request(arrival, token_prompt(ids, prompt_tokens), output_tokens))
        arrival += next(gaps) / rate
    return requests


def build_closed(
    lengths: list[tuple[int, int]], index: int, seed: int, num_requests: int, salt: str = ""
) -> list[Request]:
    """``num_requests`` due at once (a closed loop sends each when a slot frees); token
    ids as in ``build_schedule``."""
    draws = random.Random(seed + 1)
    ids = random.Random(f"{seed}-{salt}-ids-closed-{index}")
    requests = []
    for _ in range(num_requests):
        prompt_tokens, output_tokens = draws.choice(lengths)
        requests.append(Request(0.0, token_prompt(ids, prompt_tokens), output_tokens))
    return requests

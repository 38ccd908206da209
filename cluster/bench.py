"""The load generator's client core: the streaming sender and the timing math (the
schedules it sends are ``bench_schedule``'s).

``tessera bench serve`` (``cli_bench``) and ``benchmarks/serve_load.py`` both drive an
OpenAI-compatible server with these; each rule lives here once.

What is timed, per request, on this client from the moment it is sent: TTFT, to the
first chunk with text; ITL, the gaps between successive chunks with text (a chunk that
carries k tokens, by ``usage.completion_tokens``, gives k gaps of 1/k its time, see
``spread_gaps``); TPOT = (e2e - TTFT) / (completion tokens - 1); E2EL, to the end of
the stream. A request fails on an HTTP status other than 200, an error event in the
stream, or a transport error; a failed request counts nowhere but ``failed``.

aiohttp is imported when a client opens, not with this module (``tessera --help``).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tessera.cluster.bench_schedule import Request

if TYPE_CHECKING:
    import aiohttp

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)
#: The metrics a summary gives percentiles of, by the names of vLLM's bench serve.
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, slots=True)
class Target:
    role: str  # "ours" or "peer" (serve_load), "server" (tessera bench serve)
    name: str
    url: str  # the base URL, without /v1
    model: str
    headers: dict[str, str]


@dataclass(slots=True)
class Outcome:
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens, when it says
    itls_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


# ------------------------------------------------------------------ timing math
def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread_gaps(times: list[float], tokens: int) -> list[float]:
    """Inter-token latencies from the arrival times of the chunks with text.

    The first chunk carries the first token; the other ``tokens - 1`` are spread evenly
    over the later chunks (the stream does not say which chunk carried how many), and a
    chunk's gap is split equally among its tokens. A chunk given no token (more chunks
    than tokens) hands its gap on to the next one, so the ITLs always sum to
    ``times[-1] - times[0]``.
    """
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    rest = tokens - 1
    if not gaps or rest <= 0:
        return []
    if rest == len(gaps):
        return gaps
    itls: list[float] = []
    pending = 0.0
    for j, gap in enumerate(gaps):
        count = (j + 1) * rest // len(gaps) - j * rest // len(gaps)
        pending += gap
        if count:
            itls.extend([pending / count] * count)
            pending = 0.0
    return itls


def metric_samples(outcomes: Sequence[Outcome]) -> dict[str, list[float]]:
    """Seconds per metric over the successful requests: TTFT, TPOT (requests of two
    tokens or more), ITL (pooled over every token) and E2EL."""
    ok = [o for o in outcomes if o.ok]
    return {
        "ttft": [o.ttft_s for o in ok],
        "tpot": [o.tpot_s for o in ok if o.tpot_s is not None],
        "itl": [gap for o in ok for gap in o.itls_s],
        "e2el": [o.e2e_s for o in ok],
    }


def meets_slos(outcome: Outcome, slos_s: dict[str, float]) -> bool:
    """Succeeded and within every SLO (metric -> seconds: ttft, tpot, e2el); a request of
    one token has no TPOT and meets a TPOT SLO."""
    if not outcome.ok:
        return False
    values = {"ttft": outcome.ttft_s, "tpot": outcome.tpot_s, "e2el": outcome.e2e_s}
    return all(values[m] is None or values[m] <= limit for m, limit in slos_s.items())


def summary(
    requests: Sequence[Request],
    outcomes: Sequence[Outcome],
    duration_s: float,
    slos_s: dict[str, float] | None = None,
    metrics: Sequence[str] = METRICS,
    percentiles: Sequence[float] = (99,),
) -> dict[str, Any]:
    """The run's numbers under the names of vLLM's bench serve: counts, throughputs over
    ``duration_s`` (first send to last finish), and per metric the mean, median, standard
    deviation and ``percentiles`` in milliseconds (None where no request gave one).
    Input tokens are the server's ``usage.prompt_tokens``, else the prompt's known
    length."""
    ok = [(q, o) for q, o in zip(requests, outcomes, strict=True) if o.ok]
    total_input = sum(
        o.prompt_tokens if o.prompt_tokens is not None else (q.known_prompt_tokens or 0)
        for q, o in ok
    )
    total_output = sum(o.completion_tokens for _, o in ok)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "request_goodput": None
        if not slos_s
        else sum(meets_slos(o, slos_s) for o in outcomes) / duration_s,
    }
    samples = metric_samples(outcomes)
    for metric in metrics:
        values = [v * 1e3 for v in samples[metric]]
        result[f"mean_{metric}_ms"] = statistics.fmean(values) if values else None
        result[f"median_{metric}_ms"] = statistics.median(values) if values else None
        result[f"std_{metric}_ms"] = statistics.pstdev(values) if values else None
        for q in percentiles:
            result[f"p{q:g}_{metric}_ms"] = percentile(values, q)
    return result


# ------------------------------------------------------------------ the client
def http_client(request_timeout_s: float = 600.0) -> aiohttp.ClientSession:
    """An aiohttp client with no cap on connections and no limit on a whole stream
    (``request_timeout_s`` bounds each read). aiohttp, as vLLM's own serving benchmark:
    the client shares the server's cores, and httpx's streams cost ~2.5x the CPU per
    event (0.07 against 0.03 ms)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=request_timeout_s)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


def request_body(
    target: Target, request: Request, endpoint: str, temperature: float, ignore_eos: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": request.output_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # a Tessera/vLLM extra: exactly max_tokens tokens
    if endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def _has_text(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


async def send(
    client: aiohttp.ClientSession,
    target: Target,
    request: Request,
    *,
    endpoint: str = COMPLETIONS,
    temperature: float = 0.0,
    ignore_eos: bool = True,
) -> Outcome:
    """Stream one request and time it (the module's docstring says what is timed)."""
    import aiohttp
    from aiohttp.http_exceptions import HttpProcessingError

    body = request_body(target, request, endpoint, temperature, ignore_eos)
    text_times: list[float] = []
    usage: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        async with client.post(
            f"{target.url}{endpoint}", json=body, headers=target.headers
        ) as response:
            if response.status != 200:
                detail = (await response.read()).decode(errors="replace")[:300]
                return Outcome(error=f"HTTP {response.status}: {detail}")
            async for line in response.content:  # one line at a time
                now = time.perf_counter()
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:") :].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk or chunk.get("object") == "error":
                    return Outcome(error=f"stream error: {json.dumps(chunk)[:300]}")
                if _has_text(chunk):
                    text_times.append(now)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, HttpProcessingError, TimeoutError, ValueError) as error:
        return Outcome(error=f"{type(error).__name__}: {error}")  # ValueError: bad JSON
    end = time.perf_counter()
    if not text_times:
        return Outcome(error="the stream carried no text")
    tokens = usage.get("completion_tokens") or len(text_times)
    return Outcome(
        ttft_s=text_times[0] - start,
        e2e_s=end - start,
        completion_tokens=tokens,
        prompt_tokens=usage.get("prompt_tokens"),
        itls_s=spread_gaps(text_times, tokens),
    )


async def run_schedule(
    sender: Callable[[Request], Awaitable[Outcome]],
    schedule: Sequence[Request],
    *,
    max_concurrency: int | None = None,
    desc: str = "requests",
    disable_tqdm: bool = False,
) -> tuple[list[Outcome], float, float]:
    """Send each request at its arrival time, at most ``max_concurrency`` in flight (a
    request due while all are busy waits for one to end); (outcomes in the schedule's
    order, wall seconds from the first send to the last finish, worst send lag)."""
    from tqdm import tqdm

    bar = tqdm(total=len(schedule), desc=desc, unit="req", disable=disable_tqdm)
    failed = 0
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def fire(request: Request) -> Outcome:
        nonlocal failed
        if slots is None:
            outcome = await sender(request)
        else:
            async with slots:
                outcome = await sender(request)
        failed += not outcome.ok
        bar.set_postfix(failed=failed, refresh=False)
        bar.update()
        return outcome

    tasks = []
    lag = 0.0
    start = time.perf_counter()
    for request in schedule:
        delay = start + request.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(lag, time.perf_counter() - start - request.arrival_s)
        tasks.append(asyncio.create_task(fire(request)))
    outcomes = await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    bar.close()
    return list(outcomes), wall, lag


async def resolve(
    client: aiohttp.ClientSession,
    role: str,
    name: str,
    url: str,
    model: str | None,
    api_key: str | None,
    wait_s: float,
) -> Target:
    """The target, its model id from ``GET /v1/models`` unless given; waits ``wait_s``
    for the server to answer. Raises ``ConnectionError`` naming the URL."""
    import aiohttp

    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + wait_s
    while model is None:
        try:
            async with client.get(f"{url}/v1/models", headers=headers) as response:
                response.raise_for_status()
                model = (await response.json())["data"][0]["id"]
        except (aiohttp.ClientError, TimeoutError, KeyError, IndexError) as error:
            if time.monotonic() > deadline:
                raise ConnectionError(f"no model list at {url}/v1/models ({error})") from None
            await asyncio.sleep(1.0)
    return Target(role, name, url, model, headers)

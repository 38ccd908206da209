"""Hostile neighbours of a valid load: the traffic `benchmarks/soak.py --hostile` sends
beside it, and the outcome of every request it makes.

Each kind runs in its own task until its deadline, one request at a time:

- ``fuzz``: the OpenAPI fuzzer's cases (``benchmarks/openapi_fuzz.py``), positive and
  negative for every POST route, in turn; each response must pass its checks.
- ``redos``: requests built to make a replica's CPU-bound steps slow: a tool offered
  and ``structured_outputs.regex`` forcing ``<tool_call>`` then thousands of spaces (the
  answer is parsed for tool calls), stop strings at and over their caps, a huge
  ``cache_salt``, grammars at and over ``max_grammar_bytes``, a prompt longer than any
  context, JSON nested 200,000 deep, a body over ``max_request_bytes``.
- ``slow_body``: ``SLOW_BODIES`` connections at once that send their headers, then the
  body a byte a second; the server must answer 408 (or 503 past ``max_pending_bodies``).
- ``grpc``: ``Generate`` messages over ``max_request_bytes`` at the gRPC port, with and
  without the key (RESOURCE_EXHAUSTED), and one just under it (INVALID_ARGUMENT).
- ``kv_pull``: ``PullBlocks`` at each prefill worker's KV port without the cluster's
  secret: no token, a malformed one, one signed with another secret, an oversize
  message (UNAUTHENTICATED, or RESOURCE_EXHAUSTED for the last).

An outcome is an HTTP status, a gRPC code or what a connection did; each variant lists
those it expects, and any other is *unexpected*.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx

from benchmarks.openapi_fuzz import REFUSAL_WITHIN_S, problems
from tessera.cluster.front_end import MAX_CACHE_SALT_CHARS
from tessera.cluster.serve_config import ServeConfig
from tessera.protos.tessera.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
)
from tessera.workers.params import MAX_STOP, MAX_STOP_CHARS
from tessera.workers.process.kv_auth import AUTH_KEY, ClusterSecret

#: The kinds of hostile traffic (the module's docstring).
KINDS = ("fuzz", "redos", "slow_body", "grpc", "kv_pull")
MAX_REQUEST_BYTES: int = ServeConfig.model_fields["max_request_bytes"].default
MAX_GRAMMAR_BYTES: int = ServeConfig.model_fields["max_grammar_bytes"].default
#: Concurrent slow-body connections (below ``max_pending_bodies``'s default, 64).
SLOW_BODIES = 4
#: A slow body's declared length; one byte of it goes out a second.
SLOW_BODY_BYTES = 1000
#: Spaces the ReDoS regex forces after ``<tool_call>``, and the tokens it may take.
REDOS_SPACES = 5000
REDOS_MAX_TOKENS = 256
#: Seconds each kind waits between its requests (the hostile client shares the CPUs).
PAUSE_S = 0.5
#: Most problems kept for the report, per kind.
KEPT_PROBLEMS = 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


@dataclass
class Outcomes:
    """Every hostile request's outcome, per kind and variant."""

    counts: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    unexpected: collections.Counter = field(default_factory=collections.Counter)
    slowest_s: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def add(self, name: str, outcome: str, seconds: float, expected: bool) -> None:
        self.counts[name][outcome] += 1
        self.slowest_s[name] = max(self.slowest_s.get(name, 0.0), seconds)
        if not expected:
            self.unexpected[name] += 1

    def record(self) -> dict[str, Any]:
        return {
            name: {
                "outcomes": dict(self.counts[name].most_common()),
                "unexpected": self.unexpected[name],
                "slowest_s": round(self.slowest_s[name], 3),
            }
            for name in sorted(self.counts)
        }


def _letters(rng: random.Random, size: int) -> str:
    """``size`` random hex digits (fast: the hostile client shares the CPUs)."""
    return rng.randbytes((size + 1) // 2).hex()[:size]


def _body(model: str, fields: dict[str, Any]) -> bytes:
    return json.dumps({"model": model, "temperature": 0, **fields}).encode()


def redos_bodies(model: str, rng: random.Random) -> list[tuple[str, str, bytes, tuple[int, ...]]]:
    """(variant, path, body, expected statuses) of the ReDoS and oversize requests, but
    the grammar that must be new each time (``grammar_body``). Refused ones are refused
    by their size, before any cache, so these are built once."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    prompt = "Once upon a time"
    too_large = "(a|" + "a" * MAX_GRAMMAR_BYTES + ")*"
    bodies = [
        (
            "tool_call then spaces",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Call the lookup tool."}],
                "tools": [tool],
                "structured_outputs": {"regex": f"<tool_call> {{{REDOS_SPACES}}}"},
                "max_tokens": REDOS_MAX_TOKENS,
            },
            (200,),
        ),
        (
            "stop strings at the cap",
            "/v1/completions",
            {
                "prompt": prompt,
                "stop": [_letters(rng, MAX_STOP_CHARS) for _ in range(MAX_STOP)],
                "max_tokens": 16,
            },
            (200,),
        ),
        (
            "stop strings over the cap",
            "/v1/completions",
            {"prompt": prompt, "stop": [_letters(rng, MAX_STOP_CHARS + 1)] * MAX_STOP},
            (400,),
        ),
        (
            "cache_salt of 3 MiB",
            "/v1/completions",
            {"prompt": prompt, "cache_salt": _letters(rng, 3 * 2**20)},
            (400,),
        ),
        (
            "cache_salt at the cap",
            "/v1/completions",
            {"prompt": prompt, "cache_salt": _letters(rng, MAX_CACHE_SALT_CHARS), "max_tokens": 4},
            (200,),
        ),
        (
            "grammar over max_grammar_bytes",
            "/v1/completions",
            {
                "prompt": prompt,
                "structured_outputs": {"regex": too_large},
            },
            (400,),
        ),
        (
            "prompt longer than any context",
            "/v1/completions",
            {"prompt": _letters(rng, 3 * 2**20)},
            (400,),
        ),
        (
            "body over max_request_bytes",
            "/v1/completions",
            {"prompt": _letters(rng, MAX_REQUEST_BYTES + 1024)},
            (413,),
        ),
    ]
    out = [(variant, path, _body(model, fields), ok) for variant, path, fields, ok in bodies]
    out.append(("JSON nested 200,000 deep", "/v1/completions", b"[" * 200_000, (400,)))
    return out


def grammar_body(model: str, rng: random.Random) -> tuple[str, str, bytes, tuple[int, ...]]:
    """A regex of random words just under ``max_grammar_bytes``, new each call (compiled
    grammars are cached); the server compiles it, or refuses it, off its event loop."""
    words = "|".join(_letters(rng, 12) for _ in range(MAX_GRAMMAR_BYTES // 14))
    fields = {
        "prompt": "One word:",
        "structured_outputs": {"regex": f"({words[: MAX_GRAMMAR_BYTES - 2]})"},
        "max_tokens": 4,
    }
    return "grammar under max_grammar_bytes", "/v1/completions", _body(model, fields), (200, 400)


class Hostile:
    """The hostile traffic against one server."""

    def __init__(
        self,
        url: str,
        api_key: str,
        model: str,
        grpc_target: str,
        kv_targets: dict[str, str],
        fuzz_cases: list[tuple[str, str, dict[str, Any]]],
        seed: int = 0,
    ) -> None:
        """``kv_targets``: prefill worker id -> its KV address; ``fuzz_cases``: (mode,
        label, httpx request arguments) of the OpenAPI fuzzer's cases."""
        self.url, self.model = url, model
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.grpc_target, self.kv_targets = grpc_target, kv_targets
        self.fuzz_cases = fuzz_cases
        self.rng = random.Random(seed)
        self.redos = redos_bodies(model, self.rng)
        self.outcomes = Outcomes()

    async def run(self, seconds: float, kinds: tuple[str, ...] = KINDS) -> Outcomes:
        """Every kind in ``kinds`` for ``seconds``."""
        stop = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits, trust_env=False, timeout=60) as client:
            tasks = {
                "fuzz": lambda: [self._fuzz(client, stop)],
                "redos": lambda: [self._redos(client, stop)],
                "slow_body": lambda: [self._slow_body(stop) for _ in range(SLOW_BODIES)],
                "grpc": lambda: [self._grpc(stop)],
                "kv_pull": lambda: [self._kv_pulls(stop)],
            }
            await asyncio.gather(*(task for kind in kinds for task in tasks[kind]()))
        return self.outcomes

    # ------------------------------------------------------------------ HTTP
    async def _fuzz(self, client: httpx.AsyncClient, stop: float) -> None:
        n = 0
        while time.monotonic() < stop and self.fuzz_cases:
            mode, label, request = self.fuzz_cases[n % len(self.fuzz_cases)]
            n += 1
            start = time.monotonic()
            try:
                response = await client.request(**request)
                seconds = time.monotonic() - start
                status, content = response.status_code, response.content
                content_type = response.headers.get("content-type", "")
                found = problems(status, content_type, content, seconds, mode)
                outcome = f"HTTP {status}"
            except httpx.TransportError as error:
                outcome, found = type(error).__name__, [f"{type(error).__name__}: {error}"]
                seconds = time.monotonic() - start
            self.outcomes.add(f"fuzz {mode}", outcome, seconds, not found)
            if found and len(self.outcomes.problems) < KEPT_PROBLEMS:
                self.outcomes.problems.append(f"{label}: {'; '.join(found)}")
            await asyncio.sleep(PAUSE_S)

    async def _redos(self, client: httpx.AsyncClient, stop: float) -> None:
        headers = {**self.headers, "Content-Type": "application/json"}
        while time.monotonic() < stop:
            for variant, path, content, expected in [
                *self.redos,
                grammar_body(self.model, self.rng),
            ]:
                if time.monotonic() >= stop:
                    return
                start = time.monotonic()
                try:
                    response = await client.post(
                        f"{self.url}{path}", content=content, headers=headers
                    )
                    outcome, status = f"HTTP {response.status_code}", response.status_code
                except httpx.TransportError as error:
                    outcome, status = type(error).__name__, None
                seconds = time.monotonic() - start
                # a refusal must come at once, whatever the body
                quick = status is None or status < 400 or seconds <= REFUSAL_WITHIN_S
                ok = status in expected and quick
                self.outcomes.add(f"redos: {variant}", outcome, seconds, ok)
                await asyncio.sleep(PAUSE_S)

    async def _slow_body(self, stop: float) -> None:
        """Headers, then a byte a second until the server answers or closes."""
        parts = urlsplit(self.url)
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Authorization: {self.headers['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {SLOW_BODY_BYTES}\r\n\r\n"
        ).encode()
        while time.monotonic() < stop:
            start = time.monotonic()
            try:
                reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
            except OSError as error:
                self.outcomes.add("slow body", type(error).__name__, 0.0, False)
                await asyncio.sleep(1.0)
                continue
            answer = asyncio.ensure_future(reader.readline())
            try:
                writer.write(head)
                for _ in range(SLOW_BODY_BYTES - 1):
                    done, _ = await asyncio.wait({answer}, timeout=1.0)
                    if done:
                        break
                    writer.write(b" ")
                    await writer.drain()
                line = await asyncio.wait_for(answer, timeout=30)
                outcome = f"HTTP {line.split()[1].decode()}" if line else "closed"
            except (ConnectionError, TimeoutError, IndexError) as error:
                outcome = type(error).__name__
            finally:
                answer.cancel()
                writer.close()
            seconds = time.monotonic() - start
            self.outcomes.add("slow body", outcome, seconds, outcome in ("HTTP 408", "HTTP 503"))

    # ------------------------------------------------------------------ gRPC
    async def _grpc(self, stop: float) -> None:
        metadata = (("authorization", self.headers["Authorization"]),)
        over = _generate(self.model, "x" * (MAX_REQUEST_BYTES + 64 * 1024))
        under = _generate(self.model, "x" * (MAX_REQUEST_BYTES - 64 * 1024))
        variants = [
            ("over max_request_bytes, with the key", over, metadata, ("RESOURCE_EXHAUSTED",)),
            ("over max_request_bytes, no key", over, (), ("RESOURCE_EXHAUSTED",)),
            ("just under it, with the key", under, metadata, ("INVALID_ARGUMENT",)),
            ("small, no key", _generate(self.model, "Hello"), (), ("UNAUTHENTICATED",)),
        ]
        async with grpc.aio.insecure_channel(self.grpc_target, options=CHANNEL_OPTIONS) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while time.monotonic() < stop:
                for variant, request, call_metadata, expected in variants:
                    code, seconds = await _call(stub.Generate(request, metadata=call_metadata))
                    self.outcomes.add(f"grpc: {variant}", code, seconds, code in expected)
                    await asyncio.sleep(PAUSE_S)

    async def _kv_pulls(self, stop: float) -> None:
        if not self.kv_targets:
            self.outcomes.add("kv pull", "no prefill worker found", 0.0, False)
            return
        channels = {
            worker: grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            for worker, address in self.kv_targets.items()
        }
        oversize = kv_transfer_pb2.PullBlocksRequest(
            version=1, request_id="hostile", prompt_token_ids=[7] * (4 * 2**20), block_size=16
        )  # ~8 MiB of varints, built once
        try:
            while time.monotonic() < stop:
                for worker, channel in channels.items():
                    stub = kv_transfer_pb2_grpc.KVTransferStub(channel)
                    now = int(time.time())
                    forged = f"{now}.{secrets.token_hex(16)}.{secrets.token_hex(32)}"
                    other, _ = ClusterSecret.generate().pull_token(worker)
                    pull = kv_transfer_pb2.PullBlocksRequest(
                        version=1,
                        request_id=f"hostile-{secrets.token_hex(4)}",
                        prompt_token_ids=[self.rng.randrange(1, 1000) for _ in range(64)],
                        block_size=16,
                        max_chunk_bytes=2**20,
                    )
                    variants = [
                        ("no token", (), pull),
                        ("malformed token", ((AUTH_KEY, "x" * 10_000),), pull),
                        ("forged token", ((AUTH_KEY, forged),), pull),
                        ("token of another secret", ((AUTH_KEY, other),), pull),
                        ("8 MiB message, no token", (), oversize),
                    ]
                    for variant, metadata, request in variants:
                        code, seconds = await _call(stub.PullBlocks(request, metadata=metadata))
                        expected = ("UNAUTHENTICATED", "RESOURCE_EXHAUSTED")
                        self.outcomes.add(f"kv pull: {variant}", code, seconds, code in expected)
                        await asyncio.sleep(PAUSE_S)
        finally:
            for channel in channels.values():
                await channel.close()


def _generate(model: str, text: str) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(version=1, model=model, text=text)
    request.sampling.max_tokens = 4
    return request


async def _call(call, timeout_s: float = 30.0) -> tuple[str, float]:
    """A streaming call read to its end: (its status code's name, seconds)."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async for _ in call:
                pass
        code = "OK"
    except grpc.aio.AioRpcError as error:
        code = error.code().name
    except TimeoutError:
        call.cancel()
        code = f"no answer in {timeout_s:g} s"
    return code, time.monotonic() - start

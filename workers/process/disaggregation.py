"""Prefill/decode disaggregation on one worker: three parts, as the design note splits it.

- ``PrefillOrchestrator`` (on a prefill worker) answers ``KVTransfer.PullBlocks``: it
  runs the prompt through its engine as a one-token request, then reads the prompt's
  full blocks the receiver lacks out of its prefix cache (where they stay, for the next
  turn of a conversation, until pressure evicts them) and hands them to the transport.
- ``DecodeOrchestrator`` (on a decode worker) pulls those blocks before it admits the
  request: it reserves pool blocks for what its own prefix cache lacks, writes each
  block as it arrives (the transport has checked its checksum), and registers them in
  its prefix cache; the request then takes them as prefix hits and computes only its
  tail (the last, partly filled block), then decodes in the continuous batch. Any
  failure (bad checksum, short stream, deadline, lost prefill worker, no room) discards
  what arrived and the request prefills here instead: the output is the same, and
  ``fallbacks`` counts it by reason. A request resumed after a failover pulls its
  prompt's blocks the same way (``resumed_pulls``) and recomputes only the tokens it
  had generated: the prompt is not prefilled again.
- ``PhaseManager`` tracks each disaggregated request: waiting -> prefilling (where) ->
  transferring -> decoding -> finished, in the worker's stats and its log.

Exactness: a transferred block holds exactly the K/V the receiver would compute (same
weights, dtype, tokens and positions), so prefix hits on it give the same tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import Counter
from dataclasses import dataclass

from tessera.protos.tessera.v1 import generation_pb2, kv_transfer_pb2
from tessera.workers.api import LoraRef, PrefillSource, SamplingParams, cache_key
from tessera.workers.decoding.sampling_fields import (
    message_values,
    options_message,
    sampling_params,
)
from tessera.workers.engine.async_engine import AsyncEngine, release_openmp_pool
from tessera.workers.process.kv_transfer import (
    API_VERSION,
    BlockLayout,
    ClusterSecret,
    KVTransferClient,
    PrefillResult,
    TLSFiles,
    TransferError,
    usable_blocks,
)
from tessera.workers.process.protocol import TransferCounters

logger = logging.getLogger(__name__)

#: Request phases of a disaggregated request, in order.
PHASES = ("waiting", "prefilling", "transferring", "decoding", "finished")


def fingerprint(hash_keys: tuple[str, ...]) -> str:
    """What must match for blocks to be interchangeable: the model and dtype."""
    return "|".join(hash_keys)


def first_token_sampling(params: SamplingParams) -> SamplingParams:
    """The prefill worker's request: one token, one output, as the real request's first."""
    return dataclasses.replace(
        params,
        max_tokens=1,
        min_tokens=min(params.min_tokens, 1),
        n=1,
        best_of=None,
        beam_width=1,
        stop=(),
    )


# Sampling travels as the gRPC API's SamplingOptions, through the one wire table.
#: The sampling fields that decide a prompt's first token (what a prefill worker
#: samples); the rest (stop strings, n, beams, speculation, parallel tokens) are the
#: decode worker's.
FIRST_TOKEN_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                      "presence_penalty", "frequency_penalty", "logprobs", "min_tokens",
                      "stop_token_ids", "ignore_eos", "logit_bias")  # fmt: skip


def sampling_options(params: SamplingParams) -> generation_pb2.SamplingOptions:
    return options_message(generation_pb2.SamplingOptions, params, FIRST_TOKEN_FIELDS)


def sampling_from_options(options: generation_pb2.SamplingOptions, seed: int) -> SamplingParams:
    """The prefill worker's one-token request: the first-token fields, and the seed the
    decode worker derived."""
    values = message_values(options, FIRST_TOKEN_FIELDS)
    return sampling_params(values | {"max_tokens": 1, "seed": seed})


class PhaseManager:
    """Each disaggregated request's phase (and where it prefilled), for stats and logs."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.phases: dict[str, tuple[str, str | None]] = {}

    def enter(self, request_id: str, phase: str, where: str | None = None) -> None:
        assert phase in PHASES, phase
        self.phases[request_id] = (phase, where)
        logger.info(
            "request %s: %s%s on %s", request_id, phase, f" ({where})" if where else "",
            self.worker_id,
        )  # fmt: skip
        if phase == "finished":
            del self.phases[request_id]

    def counts(self) -> dict[str, int]:
        return dict(Counter(phase for phase, _ in self.phases.values()))


class PrefillOrchestrator:
    """Serves ``PullBlocks`` from this worker's engine."""

    def __init__(self, engine: AsyncEngine, counters: TransferCounters) -> None:
        self.engine = engine
        self.counters = counters
        self._ids = 0
        self.active = 0  # pulls being served now
        self.last_active = time.monotonic()  # when the last one ended (or this started)

    async def handle(
        self, request: kv_transfer_pb2.PullBlocksRequest, time_remaining: float | None
    ) -> PrefillResult:
        # Counted for the worker's idleness: a short prefill may start and end between
        # two load reports, and the prefill pool scales down by idleness.
        self.active += 1
        try:
            return await self._handle(request)
        finally:
            self.active -= 1
            self.last_active = time.monotonic()

    async def _handle(self, request: kv_transfer_pb2.PullBlocksRequest) -> PrefillResult:
        engine = self.engine.engine
        if request.block_size != engine.config.block_size:
            raise ValueError(
                f"block_size: the sender's blocks hold {engine.config.block_size} tokens, "
                f"the request asks for {request.block_size}"
            )
        if request.model_fingerprint != fingerprint(engine.hash_keys):
            raise ValueError(
                f"model_fingerprint: {request.model_fingerprint!r} is not this worker's "
                f"{fingerprint(engine.hash_keys)!r}"
            )
        token_ids = list(request.prompt_token_ids)
        sampling = sampling_from_options(request.sampling, request.seed)
        lora = None
        if request.lora_name:
            lora = LoraRef(request.lora_name, request.lora_path, request.lora_digest)
        self._ids += 1
        prefill_id = f"{request.request_id}:prefill:{self._ids}"
        salt = request.cache_salt or None
        stream = await self.engine.add_request(
            prefill_id, token_ids, sampling, cache_salt=salt, lora=lora
        )
        first = None
        async for delta in stream:  # one delta: the prompt's first token
            first = delta
        hashes = engine.handoff.prompt_hashes(token_ids, cache_key(salt, lora))
        wanted = hashes[request.skip_blocks : usable_blocks(len(token_ids), request.block_size)]
        blocks = await self.engine.run(engine.handoff.export, wanted)
        if blocks is None:
            raise RuntimeError("the prompt's blocks were evicted before they could be sent")
        if first is None or not first.token_ids:
            raise RuntimeError(f"the prefill of {request.request_id} sampled no token")
        token = kv_transfer_pb2.FirstToken(token_id=first.token_ids[0])
        if first.logprobs:
            logprob = first.logprobs[0]
            token.logprob.token_id = logprob.token_id
            token.logprob.logprob = logprob.logprob
        self.counters.served += 1
        return PrefillResult(blocks=blocks, first_token=token)


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """A worker's KV-transfer server and client settings."""

    host: str | None = None  # None: this worker's node IP, as Ray reports it
    port: int = 0  # 0: a free port
    timeout_s: float = 30.0  # deadline of one pull (the client's and the server's)
    tls: TLSFiles | None = None  # mutual TLS between workers
    tls_server_name: str | None = None  # the name workers' certificates carry (None: the IP)
    # The cluster's, from its launcher: pulls are admitted, and answers taken, with it.
    secret: ClusterSecret | None = None
    max_concurrent_pulls: int = 64  # a prefill worker refuses pulls beyond these at once


class DecodeOrchestrator:
    """Pulls a request's prompt blocks into this worker's prefix cache before admission."""

    def __init__(
        self,
        engine: AsyncEngine,
        client: KVTransferClient,
        counters: TransferCounters,
        phases: PhaseManager,
        timeout_s: float,
    ) -> None:
        self.engine = engine
        self.client = client
        self.counters = counters
        self.phases = phases
        self.timeout_s = timeout_s

    async def pull(
        self,
        request_id: str,
        token_ids: list[int],
        sampling: SamplingParams,
        cache_salt: str | None,
        source: PrefillSource,
        resumed: bool = False,
        lora: LoraRef | None = None,
    ) -> None:
        """Bring the prompt's blocks here; on any failure, leave nothing behind (the
        request then prefills here). Never raises for a transfer problem. ``resumed``:
        the request resumes after a failover (counted in ``resumed_pulls``; only its
        prompt's blocks move, the tokens generated before are recomputed here)."""
        engine = self.engine.engine
        handoff = engine.handoff
        bs = engine.config.block_size
        key = cache_key(cache_salt, lora)
        hashes = handoff.prompt_hashes(token_ids, key)[: usable_blocks(len(token_ids), bs)]
        if not hashes:  # a prompt shorter than a block and a token: nothing to move
            return
        if source.hash_keys is not None and source.hash_keys != engine.hash_keys:
            self._fallback(
                request_id,
                "hash_keys",
                f"worker {source.worker_id} computes K/V as {source.hash_keys}, this one as "
                f"{engine.hash_keys}",
            )
            return
        # what a block must be here (a group's: every rank's heads)
        layout = BlockLayout.of_cache(engine.runner.kv_cache, handoff.kv_heads)
        have = await self.engine.run(handoff.cached_prefix, hashes)
        if have == len(hashes):
            self.counters.local_hits += 1
            return
        self.phases.enter(request_id, "prefilling", source.worker_id)
        reserving = asyncio.ensure_future(self.engine.run(handoff.reserve, have, hashes[have:]))
        try:
            reservation = await asyncio.shield(reserving)
        except asyncio.CancelledError:  # the caller left: free what the thread reserves
            reserving.add_done_callback(functools.partial(_release_when_reserved, handoff))
            raise
        if reservation is None:
            self._fallback(request_id, "no_room", "no free blocks to receive into")
            return
        seed = sampling.seed if sampling.seed is not None else 0
        request = kv_transfer_pb2.PullBlocksRequest(
            version=API_VERSION,
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling=sampling_options(first_token_sampling(sampling)),
            seed=seed,
            cache_salt=cache_salt or "",
            lora_name="" if lora is None else lora.name,
            lora_path="" if lora is None else lora.path,
            lora_digest="" if lora is None else lora.digest,
            skip_blocks=have,
            block_size=bs,
            model_fingerprint=fingerprint(engine.hash_keys),
        )
        started = time.perf_counter()

        def on_block(index: int, kv) -> None:
            if (kv.dtype, tuple(kv.shape)) != (layout.dtype, layout.shape):  # never broadcast
                raise TransferError("protocol", f"block {index} is {kv.dtype} {tuple(kv.shape)}")
            if self.phases.phases.get(request_id, ("",))[0] != "transferring":
                self.phases.enter(request_id, "transferring", source.worker_id)
            handoff.write(reservation, index, kv)

        try:
            result = await self.client.pull_blocks(
                source.address,
                request,
                timeout_s=self.timeout_s,
                on_block=on_block,
                layout=layout,
                worker_id=source.worker_id,
            )
        except asyncio.CancelledError:  # the caller left (or its deadline passed)
            handoff.release(reservation)  # at once: this task may not await any more
            raise
        except TransferError as error:
            await self.engine.run(handoff.release, reservation)
            self._fallback(request_id, error.reason, error.message)
            return
        except Exception as error:  # a bug here must not lose the request
            await self.engine.run(handoff.release, reservation)
            self._fallback(request_id, "internal", f"{type(error).__name__}: {error}")
            return
        finally:
            release_openmp_pool()  # on_block's copies ran parallel regions on this thread
        await self.engine.run(handoff.commit, reservation)
        self.counters.pulls += 1
        self.counters.resumed_pulls += resumed
        self.counters.blocks_received += result.blocks
        self.counters.bytes_received += result.bytes
        self.counters.seconds += time.perf_counter() - started
        self.phases.enter(request_id, "decoding")

    def _fallback(self, request_id: str, reason: str, message: str) -> None:
        self.counters.fallbacks[reason] += 1
        logger.warning("request %s: KV transfer failed (%s: %s); prefilling here",
                       request_id, reason, message)  # fmt: skip
        self.phases.enter(request_id, "decoding", "local prefill")


def _release_when_reserved(handoff, reserving: asyncio.Future) -> None:
    """A reservation made for a caller that left meanwhile goes straight back."""
    if not reserving.cancelled() and reserving.exception() is None and reserving.result():
        handoff.release(reserving.result())

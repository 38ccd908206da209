"""Who may pull KV blocks, and what one pull may cost, over real gRPC servers on
127.0.0.1: the cluster secret checked before the request is read, tokens bound to one
worker and used once, the decode side taking blocks only from the worker it named, the
refusal to listen beyond loopback unprotected, the caps on pulls at once and blocks per
pull, the server's own deadline (a reader that stops reading included), and blocks
checked against the receiver's own cache before anything is allocated."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from tessera.protos.tessera.v1 import kv_transfer_pb2 as pb
from tessera.workers.process import kv_wire
from tessera.workers.process.kv_auth import AUTH_KEY, REPLAY_WINDOW_S, ClusterSecret, PullGate
from tessera.workers.process.kv_transfer import (
    BlockAssembler,
    BlockLayout,
    KVServerSecurityError,
    KVTransferServer,
    PrefillResult,
    PullLimits,
    TLSFiles,
    TransferError,
    block_chunks,
)
from tests.unit.test_kv_transfer import (
    BS,
    FIRST,
    LAYOUT,
    D,
    H,
    L,
    collector,
    make_blocks,
    make_request,
    pull,
    serving,
)
from tests.unit.test_kv_transfer import start_server as _start_server

start_server = _start_server  # the fixture, shared
SECRET = ClusterSecret.generate()
WORKER = "prefill-0"
METHOD = "/tessera.v1.KVTransfer/PullBlocks"


def counting(blocks: list[torch.Tensor]):
    """``serving``, counting the requests that reached the handler."""
    calls: list[pb.PullBlocksRequest] = []
    serve = serving(blocks)

    async def handler(request, time_remaining):
        calls.append(request)
        return await serve(request, time_remaining)

    return calls, handler


async def raw_call(address: str, body: bytes, metadata=(), timeout: float = 5.0):
    """One PullBlocks call with ``body`` sent as it is (parsed or not by the server)."""
    async with grpc.aio.insecure_channel(address) as channel:
        method = channel.unary_stream(METHOD)  # no serializers: bytes in, bytes out
        call = method(body, metadata=metadata, timeout=timeout)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call:
                pass
    return refused.value


# --- the secret ---------------------------------------------------------------------------


async def test_a_pull_with_the_secret_for_this_worker_is_served(start_server):
    calls, handler = counting(make_blocks())
    server = await start_server(handler, gate=PullGate(WORKER, SECRET))
    result, got = await pull(server.address, make_request(), secret=SECRET, worker_id=WORKER)
    assert result.first_token == FIRST and [i for i, _ in got] == [2, 3, 4]
    assert (len(calls), server.stats.transfers, server.stats.unauthenticated) == (1, 1, 0)


@pytest.mark.parametrize(
    ("secret", "worker_id"),
    [(None, None), (ClusterSecret.generate(), WORKER), (SECRET, "prefill-1")],
    ids=["no-token", "another-secret", "meant-for-another-worker"],
)
async def test_a_pull_without_a_valid_token_is_refused_before_the_handler(
    start_server, secret, worker_id
):
    calls, handler = counting(make_blocks())
    server = await start_server(handler, gate=PullGate(WORKER, SECRET))
    with pytest.raises(TransferError) as caught:
        await pull(server.address, make_request(), secret=secret, worker_id=worker_id)
    assert caught.value.reason == "unauthenticated"
    assert caught.value.message == "UNAUTHENTICATED: unauthenticated"
    assert calls == [] and server.stats.unauthenticated == 1


async def test_the_token_is_checked_before_the_request_is_parsed(start_server):
    """Bytes that are no PullBlocksRequest: without a token they are refused as
    unauthenticated, never read; with one, they fail parsing (so parsing comes after)."""
    calls, handler = counting(make_blocks())
    server = await start_server(handler, gate=PullGate(WORKER, SECRET))
    garbage = b"\xff" * 64
    refused = await raw_call(server.address, garbage)
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
    token, _ = SECRET.pull_token(WORKER)
    parsed = await raw_call(server.address, garbage, metadata=((AUTH_KEY, token),))
    assert parsed.code() != grpc.StatusCode.UNAUTHENTICATED
    assert calls == []


async def test_a_token_is_taken_once(start_server):
    """A token seen on the wire cannot be replayed, with this request or another."""
    calls, handler = counting(make_blocks())
    server = await start_server(handler, gate=PullGate(WORKER, SECRET))
    token, _ = SECRET.pull_token(WORKER)
    request = make_request().SerializeToString()
    async with grpc.aio.insecure_channel(server.address) as channel:
        method = channel.unary_stream(METHOD)
        first = [m async for m in method(request, metadata=((AUTH_KEY, token),), timeout=5)]
    assert len(first) > 1 and len(calls) == 1
    replayed = await raw_call(server.address, request, metadata=((AUTH_KEY, token),))
    assert replayed.code() == grpc.StatusCode.UNAUTHENTICATED and len(calls) == 1


def test_a_gate_refuses_stale_and_malformed_tokens_and_forgets_old_nonces():
    gate = PullGate(WORKER, SECRET)
    now = 1_000_000.0
    stale, _ = SECRET.pull_token(WORKER, now=now - REPLAY_WINDOW_S - 1)
    assert gate.admit(stale, now=now) is None
    fresh, nonce = SECRET.pull_token(WORKER, now=now)
    ts, _, mac = fresh.split(".")
    for bad in (None, "", "a.b", fresh + ".x", f"{ts}.{nonce}.{'0' * len(mac)}", "é" * 300):
        assert gate.admit(bad, now=now) is None
    assert gate.admit(fresh, now=now) == nonce
    assert gate.admit(fresh, now=now + 1) is None  # once
    later, _ = SECRET.pull_token(WORKER, now=now + 3 * REPLAY_WINDOW_S)
    assert gate.admit(later, now=now + 3 * REPLAY_WINDOW_S) is not None
    assert nonce not in gate._seen  # past the window it cannot come back anyway


def test_the_secret_never_shows_and_survives_pickling():
    import pickle

    secret = ClusterSecret.generate()
    assert repr(secret) == "ClusterSecret(<hidden>)" and secret._key.hex() not in repr(secret)
    back = pickle.loads(pickle.dumps(secret))  # as Ray passes it to a worker actor
    assert back == secret and back != ClusterSecret.generate()
    with pytest.raises(ValueError, match="at least 32 bytes"):
        ClusterSecret(b"short")


async def test_the_decode_side_takes_blocks_only_from_the_worker_it_named(start_server):
    """Whoever answers at the address without the worker's proof (here a server that
    does not know the secret) gets no block taken."""
    impostor = await start_server(serving(make_blocks()))
    got, on_block = collector()
    from tessera.workers.process.kv_transfer import pull_blocks

    with pytest.raises(TransferError, match="did not prove to be prefill-0") as caught:
        await pull_blocks(
            impostor.address, make_request(), timeout_s=5.0, on_block=on_block, layout=LAYOUT,
            secret=SECRET, worker_id=WORKER,
        )  # fmt: skip
    assert caught.value.reason == "unauthenticated" and got == []


def test_a_server_beyond_loopback_needs_the_secret_or_mutual_tls(tmp_path):
    handler = serving(make_blocks())
    for host in ("0.0.0.0", "10.1.2.3", "::", "tessera-prefill.local"):
        with pytest.raises(KVServerSecurityError) as refused:
            KVTransferServer(handler, host)
        text = str(refused.value)
        assert text.startswith(f"kv_transfer_host: a KV-transfer server on {host} ")
        assert "cluster secret" in text and "kv_transfer_tls_cert" in text
    KVTransferServer(handler, "0.0.0.0", gate=PullGate(WORKER, SECRET))
    KVTransferServer(handler, "0.0.0.0", tls=TLSFiles("c", "k", "ca"))
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        KVTransferServer(handler, host)


# --- what one pull may cost ------------------------------------------------------------------


async def test_pulls_beyond_the_cap_are_refused_at_once(start_server):
    release = asyncio.Event()
    entered = asyncio.Event()

    async def slow(request, time_remaining):
        entered.set()
        await release.wait()
        return PrefillResult(blocks=make_blocks()[request.skip_blocks :], first_token=FIRST)

    server = await start_server(slow, limits=PullLimits(max_concurrent_pulls=1))
    first = asyncio.ensure_future(pull(server.address, make_request()))
    await asyncio.wait_for(entered.wait(), 5)
    started = time.perf_counter()
    with pytest.raises(TransferError) as caught:
        await pull(server.address, make_request())
    assert caught.value.reason == "busy" and time.perf_counter() - started < 2
    release.set()
    result, _ = await first
    assert result.first_token == FIRST
    assert (server.stats.busy, server.stats.transfers, server.active) == (1, 1, 0)


async def test_a_pull_for_more_blocks_than_the_cap_is_refused_before_the_handler(start_server):
    calls, handler = counting(make_blocks())
    server = await start_server(handler, limits=PullLimits(max_blocks_per_pull=2))
    with pytest.raises(TransferError, match="at most 2 blocks") as caught:
        await pull(server.address, make_request(skip_blocks=2))  # 3 blocks
    assert caught.value.reason == "remote" and calls == []
    await pull(server.address, make_request(skip_blocks=3))  # 2: served
    assert len(calls) == 1


async def test_the_servers_deadline_ends_a_slow_prefill(start_server):
    async def never(request, time_remaining):
        await asyncio.sleep(60)

    server = await start_server(never, limits=PullLimits(timeout_s=0.5))
    started = time.perf_counter()
    with pytest.raises(TransferError) as caught:
        await pull(server.address, make_request(), timeout_s=30.0)  # the client would wait
    assert caught.value.reason == "deadline" and time.perf_counter() - started < 3
    assert (server.stats.deadlines, server.stats.failures, server.active) == (1, 1, 0)


async def test_a_reader_that_stops_reading_frees_the_server_at_its_deadline(start_server):
    """64 blocks of 512 KiB (32 MiB, far past gRPC's flow-control windows) to a caller
    that never reads: the server's writes wait, and its deadline ends the pull, so the
    host copies it holds go with it."""
    blocks = [torch.zeros(L, 2, BS, H, 4096) for _ in range(64)]  # [3, 2, 4, 2, 4096]

    async def handler(request, time_remaining):
        return PrefillResult(blocks=blocks, first_token=FIRST)

    server = await start_server(handler, limits=PullLimits(timeout_s=1.0))
    prompt = list(range(64 * BS + 1))
    request = pb.PullBlocksRequest(prompt_token_ids=prompt, block_size=BS)
    async with grpc.aio.insecure_channel(server.address) as channel:
        method = channel.unary_stream(METHOD)
        call = method(request.SerializeToString(), timeout=60)
        await call.initial_metadata()  # the call is up; nothing more is read
        deadline = time.monotonic() + 10
        while server.active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert server.active == 0 and server.stats.deadlines == 1
        assert server.stats.bytes_sent < sum(kv.nbytes for kv in blocks)
        call.cancel()


# --- blocks against the receiver's own cache ---------------------------------------------------


@pytest.mark.parametrize(
    "kv",
    [
        torch.zeros(1, 2, BS, 1, 1),  # would broadcast into every layer and head
        torch.zeros(L + 1, 2, BS, H, D),  # the sender's layer count
        torch.zeros(L, 2, BS, H, D, dtype=torch.float16),  # the sender's dtype
        torch.zeros(L, 2, BS, H * 2, D // 2),  # as many bytes a layer, another shape
    ],
    ids=["broadcasting", "more-layers", "other-dtype", "same-bytes-other-shape"],
)
def test_a_chunk_unlike_the_local_cache_is_refused_before_any_allocation(kv, monkeypatch):
    allocated = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    assembler = BlockAssembler(0, LAYOUT, num_blocks=1)
    (chunk, *_) = block_chunks(kv, 0, 1 << 20)
    with pytest.raises(TransferError) as caught:
        assembler.add(chunk)
    assert caught.value.reason == "protocol" and allocated == []


def test_the_allocation_is_the_local_layouts_whatever_the_sender_claims():
    """A chunk claiming a million layers of a block is refused, not allocated."""
    (chunk,) = block_chunks(make_blocks(1)[0], 0, 1 << 20)
    chunk.num_layers = 10**6
    with pytest.raises(TransferError, match="1000000 layers"):
        BlockAssembler(0, LAYOUT, num_blocks=1).add(chunk)


async def test_a_server_sending_blocks_of_another_shape_fails_the_pull_with_nothing_taken(
    start_server,
):
    tiny = [torch.ones(1, 2, BS, 1, 1) for _ in range(5)]  # [1, 2, bs, 1, 1]
    server = await start_server(serving(tiny))
    got, on_block = collector()
    with pytest.raises(TransferError) as caught:
        await pull(server.address, make_request())
    assert caught.value.reason == "protocol" and got == []


def test_a_layout_reads_a_cache():
    cache = torch.zeros(L, 2, 7, BS, H, D, dtype=torch.bfloat16)  # [L, 2, blocks, bs, H, D]
    layout = BlockLayout.of_cache(cache)
    assert layout == BlockLayout(torch.bfloat16, L, (2, BS, H, D))
    assert layout.shape == (L, 2, BS, H, D) and layout.block_size == BS
    assert layout.layer_bytes == 2 * BS * H * D * 2
    assert kv_wire.BlockLayout is BlockLayout


def test_the_launcher_gives_each_cluster_a_secret_of_its_own_that_no_log_shows():
    from tessera.cluster.cluster_config import ClusterConfig
    from tessera.cluster.launch import scheduler_config

    config = ClusterConfig.create(prefill_workers=1, decode_workers=1, device="cpu")
    first, second = (scheduler_config(config, "cpu", 0.0, 1.0) for _ in range(2))
    assert isinstance(first.kv_transfer.secret, ClusterSecret)
    assert first.kv_transfer.secret != second.kv_transfer.secret
    assert "ClusterSecret(<hidden>)" in repr(first)
    assert first.kv_transfer.secret._key.hex() not in repr(first)

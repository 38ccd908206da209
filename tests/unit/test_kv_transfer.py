"""KV transfer over real gRPC servers on 127.0.0.1: exact round trips (float32,
bfloat16), chunking arithmetic, each injected fault and error status mapped to its
failure reason, mutual TLS, and the byte counters. Who may pull and what a pull may
cost (the secret, the caps, the deadline, the layout checks) is in
``test_kv_transfer_admission``."""

from __future__ import annotations

import datetime
import ipaddress
import math
import time

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tessera.protos.tessera.v1 import kv_transfer_pb2 as pb
from tessera.protos.tessera.v1.kv_transfer_pb2_grpc import KVTransferStub
from tessera.workers.process.kv_server import FAILED_TEXT, MISMATCH_TEXT
from tessera.workers.process.kv_transfer import (
    API_VERSION,
    BlockAssembler,
    BlockLayout,
    KVTransferClient,
    KVTransferServer,
    PrefillResult,
    TLSFiles,
    TransferError,
    block_chunks,
    pull_blocks,
)

L, BS, H, D = 3, 4, 2, 8  # layers, block size, kv heads, head dim
NUM_BLOCKS = 5
LAYER_BYTES = 2 * BS * H * D * 4  # one float32 layer of one block: 512
#: The receiver's cache: what every block it takes must be.
LAYOUT = BlockLayout(torch.float32, L, (2, BS, H, D))


def make_blocks(n: int = NUM_BLOCKS, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(L, 2, BS, H, D, generator=gen).to(dtype) for _ in range(n)]


def make_request(skip_blocks: int = 2, **kwargs) -> pb.PullBlocksRequest:
    # NUM_BLOCKS full blocks and one token more: the tail block stays the receiver's
    prompt = list(range(NUM_BLOCKS * BS + 1))
    return pb.PullBlocksRequest(
        version=API_VERSION, request_id="r", prompt_token_ids=prompt, skip_blocks=skip_blocks,
        block_size=BS, **kwargs,
    )  # fmt: skip


FIRST = pb.FirstToken(token_id=42)


def serving(blocks: list[torch.Tensor]):
    """A handler that 'prefills' by returning the blocks the request lacks."""

    async def handler(request: pb.PullBlocksRequest, time_remaining: float | None):
        return PrefillResult(blocks=blocks[request.skip_blocks :], first_token=FIRST)

    return handler


@pytest.fixture
async def start_server():
    """Start servers with ``await start_server(handler, **kwargs)``; stops exactly those."""
    started = []

    async def start(handler, **kwargs) -> KVTransferServer:
        server = KVTransferServer(handler, **kwargs)
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop(0)


def collector():
    """An ``on_block`` that keeps what it gets, in order."""
    got: list[tuple[int, torch.Tensor]] = []
    return got, lambda i, kv: got.append((i, kv))


async def pull(address, request, timeout_s=5.0, layout=LAYOUT, **kwargs):
    got, on_block = collector()
    result = await pull_blocks(
        address, request, timeout_s=timeout_s, on_block=on_block, layout=layout, **kwargs
    )
    return result, got


# --- chunking and assembly on their own -------------------------------------------------


@pytest.mark.parametrize("limit", [LAYER_BYTES, 2 * LAYER_BYTES, 2 * LAYER_BYTES + 1, 1 << 20])
def test_a_block_splits_by_layers_under_the_limit_and_reassembles(limit):
    (kv,) = make_blocks(1)
    chunks = block_chunks(kv, 7, limit)
    per_chunk = min(limit // LAYER_BYTES, L)
    assert len(chunks) == math.ceil(L / per_chunk)
    assert [(c.layer_start, c.layer_end) for c in chunks] == [
        (s, min(s + per_chunk, L)) for s in range(0, L, per_chunk)
    ]
    assert all(len(c.data) <= limit and c.block_index == 7 and c.num_layers == L for c in chunks)
    assembler = BlockAssembler(7, LAYOUT, num_blocks=1)
    done = [assembler.add(c) for c in chunks]
    assert done[:-1] == [None] * (len(chunks) - 1)
    index, back = done[-1]
    assert index == 7 and torch.equal(back, kv)
    assembler.finish()


def test_a_limit_below_one_layer_names_the_numbers():
    (kv,) = make_blocks(1)
    with pytest.raises(ValueError, match=f"{LAYER_BYTES} bytes, over the chunk limit of 100"):
        block_chunks(kv, 0, 100)


def test_the_assembler_refuses_gaps_reorders_and_early_first_tokens():
    a, b = (block_chunks(kv, i, LAYER_BYTES) for i, kv in enumerate(make_blocks(2)))
    with pytest.raises(TransferError, match="expected block 0 from layer 1") as caught:
        _feed(a[0], a[2])
    assert caught.value.reason == "protocol"
    with pytest.raises(TransferError, match="expected block 0 from layer 0"):
        _feed(b[0])
    with pytest.raises(TransferError, match="first token inside block 0"):
        _feed(a[0], finish=True)
    with pytest.raises(TransferError, match="first token after 1/2"):
        _feed(*a, finish=True)
    a[1].shape[1] = 3  # the data no longer matches the shape
    with pytest.raises(TransferError, match=r"3 layers of \(3, 4, 2, 8\), not 3 of"):
        _feed(*a)


def _feed(*chunks: pb.KVChunk, finish: bool = False) -> None:
    assembler = BlockAssembler(0, LAYOUT, num_blocks=2)
    for chunk in chunks:
        assembler.add(chunk)
    if finish:
        assembler.finish()


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_round_trip_is_exact_from_skip_blocks_on(start_server, dtype):
    blocks = make_blocks(dtype=dtype)
    server = await start_server(serving(blocks))
    layout = BlockLayout(dtype, L, (2, BS, H, D))
    result, got = await pull(server.address, make_request(skip_blocks=2), layout=layout)
    assert [i for i, _ in got] == [2, 3, 4]
    for i, kv in got:
        assert kv.dtype == dtype and torch.equal(kv, blocks[i])
    assert result.first_token == FIRST and result.blocks == 3
    payload = sum(kv.nbytes for kv in blocks[2:])
    assert result.bytes == payload == server.stats.bytes_sent
    assert (server.stats.transfers, server.stats.failures) == (1, 0)


async def test_small_chunks_split_every_block_and_one_channel_serves_many_pulls(start_server):
    blocks = make_blocks()
    server = await start_server(serving(blocks), max_chunk_bytes=2 * LAYER_BYTES + 1)
    client = KVTransferClient()
    try:
        for _ in range(2):
            got, on_block = collector()
            request = make_request(skip_blocks=1)
            result = await client.pull_blocks(
                server.address, request, timeout_s=5.0, on_block=on_block, layout=LAYOUT
            )
            assert [i for i, _ in got] == [1, 2, 3, 4]
            assert all(torch.equal(kv, blocks[i]) for i, kv in got)
        assert len(client._stubs) == 1
    finally:
        await client.close()
    assert server.stats.chunks_sent == 2 * 4 * math.ceil(L / 2)  # 2 layers per chunk
    assert server.stats.bytes_sent == 2 * result.bytes


async def test_the_request_limit_applies_under_the_servers(start_server):
    server = await start_server(serving(make_blocks()))
    await pull(server.address, make_request(max_chunk_bytes=LAYER_BYTES))
    assert server.stats.chunks_sent == 3 * L  # one layer per chunk
    with pytest.raises(TransferError, match="over the chunk limit of 100") as caught:
        await pull(server.address, make_request(max_chunk_bytes=100))
    assert caught.value.reason == "remote"


# --- failures --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "reason", "timeout_s"),
    [("corrupt", "checksum", 5.0), ("cut", "short_stream", 5.0), ("stall", "deadline", 0.5)],
)
async def test_an_injected_fault_fails_with_its_reason_once(start_server, fault, reason, timeout_s):
    server = await start_server(serving(make_blocks()))
    server.inject_fault(fault)
    started = time.perf_counter()
    with pytest.raises(TransferError) as caught:
        await pull(server.address, make_request(), timeout_s=timeout_s)
    assert caught.value.reason == reason
    assert time.perf_counter() - started < 3.0
    result, _ = await pull(server.address, make_request())  # the fault was spent
    assert result.first_token == FIRST
    assert (server.stats.transfers, server.stats.failures) == (1, 1)


async def test_a_stopped_server_is_unavailable(start_server):
    server = await start_server(serving(make_blocks()))
    await server.stop(0)
    with pytest.raises(TransferError) as caught:
        await pull(server.address, make_request(), timeout_s=2.0)
    assert caught.value.reason == "unavailable"


async def test_a_bad_version_is_an_invalid_argument_naming_the_field(start_server):
    server = await start_server(serving(make_blocks()))
    with pytest.raises(TransferError, match="INVALID_ARGUMENT: version: .* got 7") as caught:
        await pull(server.address, pb.PullBlocksRequest(version=7, skip_blocks=2))
    assert caught.value.reason == "remote"
    assert server.stats.failures == 1


@pytest.mark.parametrize(
    ("error", "code", "text"),
    [
        (ValueError("model_fingerprint: not /models/private/x.gguf|float32"), "INVALID_ARGUMENT",
         MISMATCH_TEXT),
        (KeyError("/models/private/x.gguf"), "INTERNAL", FAILED_TEXT),
    ],
)  # fmt: skip
async def test_a_handler_error_reaches_the_client_as_remote_and_generic(
    start_server, error, code, text, caplog
):
    """Peers learn that the pull failed, never the handler's words (a model's path, an
    exception's text): those go to the prefill worker's log."""

    async def failing(request, time_remaining):
        raise error

    server = await start_server(failing)
    with pytest.raises(TransferError) as caught:
        await pull(server.address, make_request())
    assert caught.value.reason == "remote"
    assert caught.value.message == f"{code}: {text}"
    assert "/models/private" not in str(caught.value)
    assert "/models/private" in caplog.text


async def test_the_handler_sees_the_clients_deadline(start_server):
    seen = []

    async def handler(request, time_remaining):
        seen.append(time_remaining)
        return PrefillResult(blocks=make_blocks()[2:], first_token=FIRST)

    server = await start_server(handler)
    await pull(server.address, make_request(), timeout_s=3.0)
    # gRPC carries the deadline as a duration and the server adds it to its own clock,
    # so what the handler sees can exceed the client's timeout by a few milliseconds
    assert 0 < seen[0] <= 3.05


# --- mutual TLS ------------------------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(
    subject: str, key, issuer: str, issuer_key, *, ca: bool = False, dns: str | None = None
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:  # the IP dialled, or only a name (one certificate for every worker)
        name = (
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")) if dns is None else x509.DNSName(dns)
        )
        builder = builder.add_extension(x509.SubjectAlternativeName([name]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write_pki(
    directory, ca_name: str, leaves: list[str], dns: str | None = None
) -> dict[str, TLSFiles]:
    """A CA and leaf certificates it signs (for 127.0.0.1, or only for the name ``dns``),
    as PEM files; leaf name -> its TLSFiles."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_path = directory / f"{ca_name}.pem"
    ca_path.write_bytes(
        _cert(ca_name, ca_key, ca_name, ca_key, ca=True).public_bytes(serialization.Encoding.PEM)
    )
    files = {}
    for leaf in leaves:
        key = ec.generate_private_key(ec.SECP256R1())
        cert_path, key_path = directory / f"{leaf}.crt", directory / f"{leaf}.key"
        cert_path.write_bytes(
            _cert(leaf, key, ca_name, ca_key, dns=dns).public_bytes(serialization.Encoding.PEM)
        )
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        files[leaf] = TLSFiles(cert=cert_path, key=key_path, ca=ca_path)
    return files


async def test_mutual_tls_round_trips_and_refuses_strangers(start_server, tmp_path):
    pki = _write_pki(tmp_path, "ca", ["server", "client"])
    other = _write_pki(tmp_path, "other-ca", ["stranger"])
    blocks = make_blocks()
    server = await start_server(serving(blocks), tls=pki["server"])
    result, got = await pull(server.address, make_request(), tls=pki["client"])
    assert result.first_token == FIRST and all(torch.equal(kv, blocks[i]) for i, kv in got)

    # A certificate from another CA, though it trusts the server's.
    stranger = TLSFiles(other["stranger"].cert, other["stranger"].key, pki["client"].ca)
    for tls in (stranger, None):
        with pytest.raises(TransferError) as caught:
            await pull(server.address, make_request(), timeout_s=2.0, tls=tls)
        assert caught.value.reason == "unavailable"

    # TLS, trusting the server, but presenting no certificate.
    creds = grpc.ssl_channel_credentials(pki["client"].ca.read_bytes())
    async with grpc.aio.secure_channel(server.address, creds) as channel:
        call = KVTransferStub(channel).PullBlocks(make_request(), timeout=2.0)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.stats.transfers == 1


async def test_one_shared_certificate_serves_every_worker_under_a_pinned_name(
    start_server, tmp_path
):
    """A certificate that names no IP, only 'tessera-kv', held by every worker: the client
    checks that name instead of the address it dials (the pod IP), so one Secret serves a
    whole cluster; without the pinned name the check fails."""
    (shared,) = _write_pki(tmp_path, "ca", ["worker"], dns="tessera-kv").values()
    blocks = make_blocks()
    server = await start_server(serving(blocks), tls=shared)
    result, got = await pull(
        server.address, make_request(), tls=shared, tls_server_name="tessera-kv"
    )
    assert result.first_token == FIRST and all(torch.equal(kv, blocks[i]) for i, kv in got)
    with pytest.raises(TransferError) as caught:  # checked against 127.0.0.1: refused
        await pull(server.address, make_request(), timeout_s=2.0, tls=shared)
    assert caught.value.reason == "unavailable"
    with pytest.raises(TransferError):  # and a name the certificate does not carry
        await pull(server.address, make_request(), timeout_s=2.0, tls=shared,
                   tls_server_name="other")  # fmt: skip
    assert server.stats.transfers == 1

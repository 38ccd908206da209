"""A worker's channel socket. The client's side, on a socket of the test's own: which
peer it accepts, and how a broken or closed socket reads (a lost worker, so that its
requests fail over). The worker's side, on a stand-in worker (``WorkerActor``'s socket
methods, no engine or Ray): shutdown, refused callers, a caller that stops reading.
tests/cluster/test_cluster.py runs a real worker's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from tessera.workers.api import RequestOutput
from tessera.workers.process import channel as channel_module
from tessera.workers.process.actor import WorkerActor
from tessera.workers.process.channel import END, frame, peer_credentials
from tessera.workers.process.channel_reader import _connect_unix, _frame
from tests.helpers import LINUX_ONLY

pytestmark = LINUX_ONLY


async def serving(reply: bytes):
    """An abstract Unix socket whose server writes ``reply`` to each caller and hangs up."""

    async def answer(reader, writer):
        writer.write(reply)
        await writer.drain()
        writer.close()

    path = f"\0tessera-test-{secrets.token_hex(4)}"
    return path, await asyncio.start_unix_server(answer, path)


async def test_a_batch_reads_as_sent_then_a_closed_socket_is_a_lost_worker():
    batch = [("r1", RequestOutput("r1", 0, [5, 6], "hi")), ("r1", END)]
    path, server = await serving(frame([]) + frame(batch))
    async with server:
        reader, writer = await _connect_unix(path, os.getpid())
        assert peer_credentials(writer.get_extra_info("socket"))[:2] == (os.getpid(), os.getuid())
        assert await _frame(reader) == []
        assert await _frame(reader) == batch
        with pytest.raises(RayActorError, match="channel socket"):
            await _frame(reader)
        writer.close()


async def test_a_frame_cut_short_is_a_lost_worker():
    path, server = await serving(frame([("r1", END)])[:-3])
    async with server:
        reader, writer = await _connect_unix(path, os.getpid())
        with pytest.raises(RayActorError, match="IncompleteReadError"):
            await _frame(reader)
        writer.close()


async def test_a_socket_held_by_another_process_is_refused():
    path, server = await serving(frame([]))
    async with server:
        with pytest.raises(ConnectionRefusedError, match=f"held by process {os.getpid()}, not 1"):
            await _connect_unix(path, 1)
    with pytest.raises(ConnectionRefusedError):  # nobody holds it any more
        await _connect_unix(path, os.getpid())


class _Call:
    """One method of a stand-in worker handle: ``remote(...)`` as Ray's, answering
    ``answer(*args)``."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.calls: list[tuple] = []

    def remote(self, *args):
        self.calls.append(args)
        return self.answer(*args)


async def test_a_socket_that_hangs_up_before_the_channel_opens_leaves_the_ray_stream(
    monkeypatch,
):
    """A worker that refuses the caller (wrong user, bad line, a bug) is not a lost
    worker: the channel opens as a Ray stream (here a stand-in worker's)."""
    from tessera.workers.process import channel_reader as reader_module
    from tessera.workers.process.channel import ChannelSocket
    from tessera.workers.process.channel_reader import ChannelReader

    path, server = await serving(b"")  # hangs up at once, as on a wrong token
    monkeypatch.setattr(reader_module, "_node_id", lambda: "node-1")
    cancelled = []
    monkeypatch.setattr(reader_module.ray, "cancel", cancelled.append)  # no Ray here

    async def address():
        return ChannelSocket("node-1", path, os.getpid(), "t0ken")

    async def batches(channel_id, keepalive_s):
        yield asyncio.sleep(0, result=[])  # a Ray stream yields refs: awaitables

    async def touched(channel_id):
        return False  # the stand-in's keepalive ends at once

    worker = type("Worker", (), {})()
    worker.channel_socket = _Call(address)
    worker.deltas = _Call(batches)
    worker.touch = _Call(touched)
    async with server:
        channel = ChannelReader(worker, ("w1", "inc-1"), "c1", True, lambda channel: None)
        await asyncio.wait_for(asyncio.shield(channel.opened), 5)
        assert channel.socket is None and channel.stream is not None
        assert worker.deltas.calls == [(channel.id, reader_module.CHANNEL_KEEPALIVE_S)]
        await channel.aclose()
        assert cancelled == [channel.stream]  # closing it cancels the stream


def stand_in_worker(monkeypatch, **fields) -> SimpleNamespace:
    """A worker with ``WorkerActor``'s socket methods and none of its engine or Ray (its
    node id is "n1"); ``fields`` add to or replace its attributes."""

    async def closed() -> None:
        pass

    monkeypatch.setattr(
        channel_module.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "n1")
    )
    worker = SimpleNamespace(
        incarnation=1,
        worker_id="w1",
        _socket=None,
        _socket_server=None,
        _refused=channel_module.Refusals("w1"),
        kv_server=None,
        decode=SimpleNamespace(client=SimpleNamespace(close=closed)),
        engine=SimpleNamespace(close=closed),
        **fields,
    )
    worker._start_socket = lambda: WorkerActor._start_socket(worker)
    worker._serve_socket = lambda reader, writer: WorkerActor._serve_socket(worker, reader, writer)
    return worker


async def test_a_worker_shutting_down_closes_a_socket_still_starting(monkeypatch):
    """``WorkerActor.shutdown`` while its socket is starting (``_start_socket``): callers
    from then on get no socket, and the one that asked before gets an address that
    refuses, since shutdown closes the server once it is up."""
    up = asyncio.Event()
    start_unix_server = asyncio.start_unix_server

    async def slow_start(*args, **kwargs):
        await up.wait()
        return await start_unix_server(*args, **kwargs)

    monkeypatch.setattr(asyncio, "start_unix_server", slow_start)
    worker = stand_in_worker(monkeypatch)
    asked = asyncio.ensure_future(WorkerActor.channel_socket(worker))
    await asyncio.sleep(0.05)  # its server is starting
    stopping = asyncio.ensure_future(WorkerActor.shutdown(worker))
    await asyncio.sleep(0.05)
    assert await WorkerActor.channel_socket(worker) is None
    up.set()
    await asyncio.wait_for(stopping, 5)
    address = await asked
    assert address.node_id == "n1"
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_unix_connection(address.path)


async def test_refused_callers_are_warned_of_once_a_minute_and_counted(monkeypatch, caplog):
    """A caller with a wrong token, or with a line that is not one, is hung up on; the
    worker warns of the first refusal, then at most once a minute, counting those
    refused meanwhile (logged at debug level)."""
    worker = stand_in_worker(monkeypatch)
    address = await WorkerActor.channel_socket(worker)
    caplog.set_level(logging.DEBUG, logger=channel_module.__name__)

    async def refused(line: bytes) -> None:
        reader, writer = await _connect_unix(address.path, address.pid)
        writer.write(line)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # hung up on
        writer.close()

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    def a_minute_later() -> None:
        worker._refused.warned -= channel_module.REFUSAL_WARNING_S

    wrong = json.dumps({"channel": "c1", "keepalive_s": 5, "token": "wrong"}).encode() + b"\n"
    caller = "worker w1 refused a channel socket caller"
    token = f"{caller} with a wrong token (process {os.getpid()})"
    line = f"{caller} whose line failed or never came (process {os.getpid()}): "
    try:
        for _ in range(3):
            await refused(wrong)
        assert warnings() == [token]
        assert [r.getMessage() for r in caplog.records].count(token) == 3  # two at debug level
        a_minute_later()
        await refused(b"not json\n")
        await refused(wrong)
        a_minute_later()
        await refused(wrong)
        assert warnings() == [
            token,
            line + "JSONDecodeError('Expecting value: line 1 column 1 (char 0)')"
            " (2 more refused since the last warning)",
            token + " (1 more refused since the last warning)",
        ]
    finally:
        await WorkerActor.shutdown(worker)


async def test_a_caller_that_stops_reading_is_hung_up_on_after_its_keepalive(monkeypatch, caplog):
    """The worker's writes wait ``keepalive_s`` at most for a caller that reads nothing
    (its socket's buffer full); then the channel ends (which aborts its requests) and
    the caller is hung up on."""
    sent, ended = [], asyncio.Event()

    async def batches(channel_id, keepalive_s):
        try:
            while True:
                sent.append(channel_id)
                yield [("r1", b"x" * 1_000_000)]
        finally:
            ended.set()

    async def read_to_the_end(reader) -> None:
        with contextlib.suppress(ConnectionResetError):
            while await reader.read(1 << 20):  # what was in the buffers, then the hang-up
                pass

    worker = stand_in_worker(monkeypatch, _batches=batches)
    address = await WorkerActor.channel_socket(worker)
    try:
        line = {"channel": "c1", "keepalive_s": 0.3, "token": address.token}
        reader, writer = await _connect_unix(address.path, address.pid)
        writer.write(json.dumps(line).encode() + b"\n")
        await asyncio.wait_for(ended.wait(), 5)
        assert 1 <= len(sent) < 10  # it waited for the caller, and stopped
        await asyncio.wait_for(read_to_the_end(reader), 5)
        writer.close()
        # logged before the worker hung up
        assert any("channel c1: TimeoutError()" in r.getMessage() for r in caplog.records)
    finally:
        await WorkerActor.shutdown(worker)

"""The client's side of a worker's channel socket, on a socket of the test's own:
which peer it accepts, and how a broken or closed socket reads (a lost worker, so
that its requests fail over). tests/cluster/test_cluster.py runs a real worker's."""

from __future__ import annotations

import asyncio
import os
import secrets

import pytest
from ray.exceptions import RayActorError

from tessera.cluster.client import _connect_unix, _frame
from tessera.workers.api import RequestOutput
from tessera.workers.protocol import END, frame, peer_credentials

pytestmark = pytest.mark.skipif(not hasattr(os, "getuid"), reason="Unix sockets")


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

"""The caller's end of a delta channel (``channel``): reads one worker's batches and
hands each item to its request.

A front end keeps one ``ChannelReader`` per worker incarnation it uses. A worker on
the caller's node sends the batches over its Unix socket (``ChannelSocket``: a
fraction of the CPU a Ray stream item costs each side); one on another node as a Ray
stream (``DeltaChannels.deltas``). A channel that fails (the worker died, or its
socket broke) tells every request on it, with a ``ChannelGone``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from tessera.workers.api import InvalidRequestError
from tessera.workers.process.channel import CHANNEL_KEEPALIVE_S, peer_credentials, read_frame

logger = logging.getLogger(__name__)


class ChannelGone:
    """A channel's last word to its requests: its worker is gone (``error``)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class ChannelReader:
    """A caller's delta channel to one worker incarnation: reads its batches and hands
    each ``(request id, item)`` to ``routes[request id]``, the request's delivery (the
    caller adds and removes them; items of requests not routed are dropped).

    ``worker`` is the worker's Ray handle, ``key`` names the incarnation (for the
    caller and the log), ``channel_id`` is the channel's name on the worker, and
    ``sockets`` whether to read from the worker's Unix socket where it is on this node.
    ``forget(reader)`` runs when the channel closes, before its requests hear
    ``ChannelGone``."""

    def __init__(
        self,
        worker,
        key: tuple[str, str],
        channel_id: str,
        sockets: bool,
        forget: Callable[[ChannelReader], None],
    ) -> None:
        self.worker = worker
        self.key = key
        self.id = channel_id
        self.sockets = sockets
        self.forget = forget
        self.routes: dict[str, Callable[[Any], None]] = {}  # worker request id -> delivery
        self.stream = None  # the Ray stream, where the channel is one
        self.socket: asyncio.StreamWriter | None = None  # the worker's socket, where not
        self.opened = asyncio.get_running_loop().create_future()
        self.opened.add_done_callback(lambda opened: opened.cancelled() or opened.exception())
        self._task = asyncio.get_running_loop().create_task(self._read())
        self._keepalive: asyncio.Task | None = None

    async def _open(self) -> Callable[[], Awaitable[list]]:
        """Open the channel (the worker's socket where it is on this node, else its Ray
        stream) and read its empty first batch; return what reads the next batch. A
        socket that closes before that batch (the worker refused the caller) leaves
        the Ray stream to open: it fails only if the worker is gone."""
        address = None
        if self.sockets:
            try:
                address = await self.worker.channel_socket.remote()
            except RayActorError:
                raise
            except Exception as error:  # a worker's bug: its Ray stream still works
                logger.warning("channel socket %s: %r; using a Ray stream", self.key, error)
        if address is not None and address.node_id == _node_id():
            try:
                reader, self.socket = await _connect_unix(address.path, address.pid)
                hello = {"channel": self.id, "keepalive_s": CHANNEL_KEEPALIVE_S}
                self.socket.write(json.dumps({**hello, "token": address.token}).encode() + b"\n")
                await _frame(reader)  # the worker's empty first batch: it is open
                return functools.partial(_frame, reader)
            except (OSError, RayActorError) as error:
                logger.warning("channel socket %s: %s; using a Ray stream", self.key, error)
                if self.socket is not None:
                    self.socket.close()
                    self.socket = None
        self.stream = self.worker.deltas.remote(self.id, CHANNEL_KEEPALIVE_S)
        await _next(self.stream)  # the worker's empty first batch: it is open
        return functools.partial(_next, self.stream)

    async def _read(self) -> None:
        error: Exception = RayActorError()  # cancelled: as if the worker had gone
        try:
            receive = await self._open()
            self.opened.set_result(None)
            self._keepalive = asyncio.get_running_loop().create_task(self._touch())
            while True:
                for request_id, item in await receive():
                    deliver = self.routes.get(request_id)
                    if deliver is not None:
                        deliver(item)
        except StopAsyncIteration:  # the worker ended its Ray stream (it is shutting down)
            pass
        except Exception as failure:  # RayActorError: the worker is gone (or its socket)
            error = failure
        finally:
            if not self.opened.done():
                self.opened.set_exception(error)
            self.close(error)

    async def _touch(self) -> None:
        """Tell the worker this caller is alive (else it closes the channel)."""
        with contextlib.suppress(Exception):  # the worker is gone: _read hears it
            while await self.worker.touch.remote(self.id):
                await asyncio.sleep(CHANNEL_KEEPALIVE_S / 3)

    async def aclose(self) -> None:
        """Stop reading (the caller is closing) and wait until its tasks have ended."""
        await cancel_and_wait(self._task)  # its ``finally`` closes the channel, once it ran
        await cancel_and_wait(self._keepalive)
        if not self.opened.done():  # cancelled before it ran
            self.opened.set_exception(RayActorError())
            self.close(RayActorError())

    def close(self, error: Exception) -> None:
        """Forget the channel; its requests hear ``error`` (their worker is gone)."""
        if self._keepalive is not None:
            self._keepalive.cancel()
        self.forget(self)
        for deliver in self.routes.values():
            deliver(ChannelGone(error))
        self.routes.clear()
        if self.socket is not None:
            self.socket.close()
        if self.stream is not None:
            with contextlib.suppress(Exception):  # a channel that failed but still runs
                ray.cancel(self.stream)


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` and wait until it has ended (a task of another event loop,
    one an ``asyncio.run`` has closed, is only cancelled)."""
    if task is None or task.done():
        return
    task.cancel()
    if task.get_loop() is asyncio.get_running_loop():
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def worker_result(ref) -> Any:
    """A worker call's result; a bad request raises its own error."""
    try:
        return await ref
    except RayTaskError as error:
        if isinstance(error.cause, InvalidRequestError):
            raise error.cause from None
        raise


async def _next(stream) -> Any:
    """The next item of a worker's stream."""
    return await worker_result(await stream.__anext__())


async def _frame(reader: asyncio.StreamReader) -> list:
    """The next batch from a worker's channel socket; ``RayActorError`` once the worker
    has closed it (it ended the channel, or its process is gone) or it broke."""
    try:
        return await read_frame(reader)
    except Exception as error:  # closed (EOFError), broken (OSError), or unreadable
        raise RayActorError(error_msg=f"the worker's channel socket: {error!r}") from None


async def _connect_unix(path: str, pid: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """``asyncio.open_unix_connection(path)`` for an abstract socket's path, which
    uvloop (the loop of Ray Serve's replicas) refuses as a path but takes connected;
    ``ConnectionRefusedError`` unless process ``pid`` holds the other end (a name that
    a dead worker left is anyone's to take)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, path)
        peer, _, _ = peer_credentials(sock)
        if peer != pid:
            raise ConnectionRefusedError(f"{path!r} is held by process {peer}, not {pid}")
        return await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


def _node_id() -> str:
    """This process's Ray node."""
    return ray.get_runtime_context().get_node_id()

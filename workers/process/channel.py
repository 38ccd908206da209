"""The delta channel, the worker's end and its wire: how deltas reach a front end.

A front end opens one channel to each worker it uses and starts requests on it
(``WorkerActor.start`` answers ``Accepted``): over the worker's Unix socket when it
runs on the worker's node (``channel_socket``), else as a Ray streaming generator
(``deltas``). Every item of the channel is a batch: the ``(request id, item)`` pairs
that came since the last one (a ``RequestOutput``, a ``StreamFailure``, or ``END``),
sent every ``stream_interval`` engine steps or at once for a request's first delta,
last delta or failure (``Outbox``), whatever the number of requests (one Ray stream
item costs a millisecond or more of CPU on each side, a socket's frame a fraction; one
per token per request was most of the front end's cost). A channel that ends (its
caller closed or cancelled it, or stopped touching it: Ray does not end a stream whose
caller died) aborts every request it still carries: their blocks go back at once.

The worker's end is ``DeltaChannels``, which ``WorkerActor`` inherits; the caller's is
``channel_reader.ChannelReader``. Everything here imports nothing heavy (no torch):
the front end reads the wire without loading the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import pickle
import secrets
import socket
import struct
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray

from tessera.workers.api import RequestOutput

if TYPE_CHECKING:
    from tessera.workers.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

#: Seconds a channel holds items while no new item comes for it (its requests' engine
#: not stepping, waiting for free blocks say) before it sends them anyway.
HOLD_S = 0.5
#: Seconds a caller of the channel socket has to send its line.
SOCKET_HELLO_S = 10.0
#: Seconds between two warnings of refused channel-socket callers (the rest are counted).
REFUSAL_WARNING_S = 60.0
#: A worker closes a channel its caller has not touched for this long (Ray does not end
#: a stream whose caller died), which aborts the requests on it; callers touch their
#: channels three times as often.
CHANNEL_KEEPALIVE_S = 30.0
#: The item that ends one request's deltas on a channel (all its outputs finished).
END = None
#: A frame's header: the byte length of the pickled batch that follows.
FRAME_HEADER = 4


@dataclass(frozen=True, slots=True)
class StreamFailure:
    """A request's stream failed on its worker after it started (an engine step
    raised): the last item of that request on its channel."""

    message: str


@dataclass(frozen=True, slots=True)
class ChannelSocket:
    """Where a front end on the worker's node opens channels without Ray
    (``DeltaChannels.channel_socket``): a Unix socket in Linux's abstract namespace (no
    file; gone with the worker's process). The caller checks that the process it
    reached is ``pid`` (``peer_credentials``), then writes one line, the JSON of
    ``{"channel": id, "keepalive_s": s, "token": token}``; the worker, having checked
    that the caller runs as its own user, answers with the channel's batches, each a
    ``frame``, the first one empty (the channel is open). Either side closing the
    connection ends the channel. A Ray stream item costs each side a millisecond or
    more of CPU, an asyncio stream's message a fraction of that (docs/performance.md,
    "The front end's delta channels")."""

    node_id: str  # Ray's node id: other nodes use the Ray stream
    path: str
    pid: int  # the worker's process
    token: str = field(repr=False)  # the worker's secret: a caller learns it through Ray


def frame(batch: list) -> bytes:
    """One batch as a frame: its pickle's length (4 bytes, big-endian), then the pickle."""
    data = pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(FRAME_HEADER, "big") + data


def peer_credentials(sock) -> tuple[int, int, int]:
    """The (pid, uid, gid) of the process at the other end of a Unix socket."""
    credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    pid, uid, gid = struct.unpack("iII", credentials)  # struct ucred: pid_t, uid_t, gid_t
    return pid, uid, gid


async def read_frame(reader: asyncio.StreamReader) -> list:
    """The next batch; ``asyncio.IncompleteReadError`` once the worker has closed."""
    size = int.from_bytes(await reader.readexactly(FRAME_HEADER), "big")
    return pickle.loads(await reader.readexactly(size))


class ChannelClosedError(RuntimeError):
    """``start`` named a channel this worker does not have open (never opened, or
    ended: cancelled, or not touched for its keepalive). The request fails at once,
    with this message, and nothing of it runs; the caller's reader sees the channel
    end, and its next request opens a new one."""


class Refusals:
    """The log of a worker's refused channel-socket callers: a warning at most once every
    ``REFUSAL_WARNING_S``, which counts those refused since the last one; the others at
    debug level. So a local caller that connects over and over cannot flood the log.
    ``reason`` is a %-format literal (never a caller's text); its values go in ``args``."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.warned = -REFUSAL_WARNING_S  # when the last warning was logged (monotonic)
        self.unwarned = 0  # refusals since then

    def __call__(self, reason: str, *args: object) -> None:
        now = time.monotonic()
        if now - self.warned < REFUSAL_WARNING_S:
            self.unwarned += 1
            logger.debug(
                "worker %s refused a channel socket caller " + reason, self.worker_id, *args
            )
            return
        since = f" ({self.unwarned} more refused since the last warning)" if self.unwarned else ""
        logger.warning(
            "worker %s refused a channel socket caller " + reason + since, self.worker_id, *args
        )
        self.warned, self.unwarned = now, 0


class Outbox:
    """One caller's open channel on the worker: the items not yet sent, and the
    requests on it.

    Items wait for a batch until one of them is urgent (a request's first delta, a
    finished one, its end or its failure: put at once) or ``interval`` engine steps have
    passed since the last batch (``stream_interval``; a step of a request with several
    outputs, parallel tokens or drafts carries several of its tokens). So every
    request's tokens of those steps travel together, in one batch for all of them
    rather than one at each request's own turn: a batch (a Ray item, or a socket's
    frame) costs each side a fixed amount of CPU."""

    def __init__(self, keepalive_s: float, interval: int = 1) -> None:
        self.pending: list[tuple[str, RequestOutput | StreamFailure | None]] = []
        self.urgent = False
        self.ready = asyncio.Event()
        self.forwards: dict[str, asyncio.Task] = {}  # request id -> its forwarding task
        self.keepalive_s = keepalive_s
        self.interval = interval
        self.sent_step = 0  # the engine's step count at the last batch
        self.touched = time.monotonic()

    def put(
        self, request_id: str, *items: RequestOutput | StreamFailure | None, urgent: bool = True
    ) -> None:
        self.pending.extend((request_id, item) for item in items)
        self.urgent |= urgent
        self.ready.set()

    def due(self, step: int) -> bool:
        """Whether a batch goes now, the engine having run ``step`` steps so far (with
        ``interval`` 1, whenever anything is held)."""
        return bool(self.pending) and (
            self.urgent or self.interval <= 1 or step - self.sent_step >= self.interval
        )

    def take(self, step: int) -> list[tuple[str, RequestOutput | StreamFailure | None]]:
        """What is held, as a batch sent at the engine's ``step``."""
        batch, self.pending = self.pending, []
        self.urgent = False
        self.sent_step = step
        self.ready.clear()
        return batch


class DeltaChannels:
    """A worker's end of its delta channels: the Ray stream (``deltas``), the Unix
    socket (``channel_socket``), the keepalive (``touch``), and the forwarding of one
    request's deltas onto its channel (``_forward``).

    The class that inherits it sets these in its ``__init__`` (``shutdown`` closes the
    socket): ``worker_id`` and ``incarnation`` (who the worker is), ``engine`` (its
    ``AsyncEngine``: ``stream_interval`` and the step count), ``_channels`` (``{}``, the
    open channels by the caller's id), ``_socket`` and ``_socket_server`` (None until
    ``channel_socket`` starts them) and ``_refused`` (``Refusals(worker_id)``)."""

    worker_id: str
    incarnation: str
    engine: AsyncEngine
    _channels: dict[str, Outbox]
    _socket: asyncio.Future[ChannelSocket | None] | None
    _socket_server: asyncio.AbstractServer | None
    _refused: Refusals

    async def deltas(
        self, channel_id: str, keepalive_s: float = CHANNEL_KEEPALIVE_S
    ) -> AsyncIterator[list]:
        """Open channel ``channel_id`` as a Ray stream of its batches (``_batches``)."""
        async with contextlib.aclosing(self._batches(channel_id, keepalive_s)) as batches:
            async for batch in batches:
                yield batch

    async def channel_socket(self) -> ChannelSocket | None:
        """Where a caller on this worker's node opens channels without Ray (a Unix
        socket, started at the first call); None where there is none (not Linux, or
        the worker is shutting down)."""
        if self._socket is None:
            self._socket = asyncio.ensure_future(self._start_socket())
        return await asyncio.shield(self._socket)

    async def _start_socket(self) -> ChannelSocket | None:
        if sys.platform != "linux":  # abstract Unix sockets are Linux's
            return None
        path = f"\0tessera-{self.incarnation}-{secrets.token_hex(4)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            node_id = ray.get_runtime_context().get_node_id()
            sock.bind(path)  # bound here: uvloop refuses an abstract socket's path
            self._socket_server = await asyncio.start_unix_server(self._serve_socket, sock=sock)
        except Exception as error:  # the Ray stream still works
            sock.close()
            logger.warning("worker %s: no channel socket (%r): Ray streams", self.worker_id, error)
            return None
        return ChannelSocket(node_id, path, os.getpid(), secrets.token_hex(16))

    async def _serve_socket(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One channel on this worker's socket (``ChannelSocket``): the caller's line,
        then the channel's batches as frames, until either side closes it. A caller
        of another user, without the token, or with a bad line, is hung up on (and
        logged, ``Refusals``); one that stops reading for ``keepalive_s`` is gone."""
        tasks: list[asyncio.Future] = []
        pid = None  # the caller's process, once known
        try:
            address = await asyncio.shield(self._socket)
            if address is None:  # shutting down
                return
            pid, uid, _ = peer_credentials(writer.get_extra_info("socket"))
            if uid != os.getuid():
                self._refused("of another user (uid %d, process %d)", uid, pid)
                return
            hello = json.loads(await asyncio.wait_for(reader.readline(), SOCKET_HELLO_S))
            if not hmac.compare_digest(str(hello["token"]), address.token):
                self._refused("with a wrong token (process %d)", pid)
                return
            channel_id, keepalive_s = str(hello["channel"]), float(hello["keepalive_s"])
            batches = self._batches(channel_id, keepalive_s)

            async def send() -> None:
                async with contextlib.aclosing(batches):
                    async for batch in batches:
                        writer.write(frame(batch))
                        await asyncio.wait_for(writer.drain(), keepalive_s)

            tasks = [asyncio.ensure_future(send()), asyncio.ensure_future(reader.read(1))]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # b"": it closed
            sent = tasks[0]
            if sent.done() and not sent.cancelled() and sent.exception() is not None:
                error = sent.exception()
                level = logging.DEBUG if isinstance(error, ConnectionError) else logging.WARNING
                logger.log(level, "worker %s: channel %s: %r", self.worker_id, channel_id, error)
        except Exception as error:  # a bad or broken hello: nothing was opened
            self._refused("whose line failed or never came (process %s): %r", pid, error)
        finally:
            for task in tasks:
                task.cancel()  # ends the channel: its requests are aborted
            await asyncio.gather(*tasks, return_exceptions=True)
            writer.transport.abort()  # at once, whatever is unsent

    async def _batches(self, channel_id: str, keepalive_s: float) -> AsyncIterator[list]:
        """Open channel ``channel_id``: yield an empty batch at once (it is open), then
        the batches of ``(request id, item)`` its requests produce (``Outbox``: at
        once for an urgent item, else every ``stream_interval`` engine steps, or once
        no new item has come for ``HOLD_S``), until the caller closes it, or stops
        calling ``touch`` for ``keepalive_s``; that aborts the requests still on it."""
        if channel_id in self._channels:
            raise ValueError(f"channel {channel_id!r} is already open")
        engine = self.engine.engine
        channel = Outbox(keepalive_s, engine.config.stream_interval)
        channel.sent_step = engine.num_steps
        self._channels[channel_id] = channel
        try:
            yield []
            while True:
                with contextlib.suppress(TimeoutError):
                    wait = HOLD_S if channel.pending else keepalive_s
                    await asyncio.wait_for(channel.ready.wait(), wait)
                if time.monotonic() - channel.touched > keepalive_s:
                    logger.warning(
                        "channel %s was not touched for %g s: its caller is gone; aborting "
                        "its %d requests",
                        channel_id,
                        keepalive_s,
                        len(channel.forwards),
                    )
                    return
                stalled = not channel.ready.is_set()  # no item came for HOLD_S
                step = engine.num_steps
                if channel.due(step) or (channel.pending and stalled):
                    yield channel.take(step)
                else:
                    channel.ready.clear()
        finally:
            del self._channels[channel_id]
            for forward in list(channel.forwards.values()):
                forward.cancel()  # closes the request's stream, which aborts it

    async def touch(self, channel_id: str) -> bool:
        """The caller of channel ``channel_id`` is alive; False if it is not open."""
        channel = self._channels.get(channel_id)
        if channel is not None:
            channel.touched = time.monotonic()
        return channel is not None

    @staticmethod
    async def _forward(
        stream: AsyncIterator[RequestOutput], channel: Outbox, request_id: str
    ) -> None:
        """Put the request's deltas on its channel, then ``END``: its first delta, a
        finished one, the end and a failure as urgent (they go at once, with what the
        channel holds), the rest to wait for the channel's next batch."""
        sent = False
        try:
            async for delta in stream:
                channel.put(request_id, delta, urgent=not sent or delta.finished)
                sent = True
            channel.put(request_id, END)
        except Exception as error:  # an engine step failed: the caller's stream raises
            channel.put(request_id, StreamFailure(f"{type(error).__name__}: {error}"))
        finally:
            await stream.aclose()  # aborts the request if it is not over (cancelled)
            channel.forwards.pop(request_id, None)

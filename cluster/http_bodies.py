"""Request bodies as the HTTP door reads them: JSON (415 for another ``Content-Type``,
``HttpAccess.check_json``), within ``max_request_bytes`` (413 above it, by
``Content-Length`` at once or as soon as the body passes it), within
``body_timeout_s`` of their headers (408, and the connection closed), and only
``max_pending_bodies`` slow ones at a time per replica (503 beyond).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request

from tessera.cluster.http_access import HttpAccess
from tessera.cluster.openai_errors import RETRY_AFTER_S, APIError
from tessera.cluster.serve_config import ServeConfig

#: A request body not complete this long after its headers is a slow one (see ``BodyReader``).
BODY_GRACE_S = 0.5


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is over the limit of {limit} bytes (max_request_bytes)",
        code="request_too_large",
    )


async def _read_body(request: Request, limit: int) -> bytes:
    """The whole body; ``request.state.body_bytes`` counts what came so far."""
    chunks = []
    request.state.body_bytes = 0
    async for chunk in request.stream():
        request.state.body_bytes += len(chunk)
        if request.state.body_bytes > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class BodyReader:
    """One replica's body reads: it counts those in progress that are slow."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.slow = 0

    async def read(self, request: Request) -> bytes:
        """The body, within ``max_request_bytes`` and ``body_timeout_s``.

        A body still incomplete after ``BODY_GRACE_S`` is slow: at most
        ``max_pending_bodies`` slow ones are read at once per replica, the next gets 503
        at once. Bodies that arrive with their headers (every ordinary client's) never
        count, so stalled uploads cannot crowd them out.
        """
        HttpAccess.check_json(request)
        config = self.config
        limit = config.max_request_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        reading = asyncio.ensure_future(_read_body(request, limit))
        started = time.monotonic()
        try:
            done, _ = await asyncio.wait({reading}, timeout=BODY_GRACE_S)
            if done:
                return reading.result()
            if self.slow >= config.max_pending_bodies:
                raise APIError(
                    503,
                    f"{self.slow} requests are already slow to send their bodies to "
                    "this replica, its limit (max_pending_bodies); retry shortly",
                    type="overloaded_error",
                    code="overloaded",
                    # its body may still come: close rather than read it
                    headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
                )
            self.slow += 1
            try:
                remaining = config.body_timeout_s - (time.monotonic() - started)
                return await asyncio.wait_for(asyncio.shield(reading), max(remaining, 0))
            finally:
                self.slow -= 1
        except TimeoutError:
            expected = f" of {length}" if length else ""
            raise APIError(
                408,
                f"the request body did not arrive within {config.body_timeout_s:g} s "
                f"(body_timeout_s): {request.state.body_bytes}{expected} bytes came",
                code="timeout",
                headers={"Connection": "close"},
            ) from None
        finally:
            reading.cancel()

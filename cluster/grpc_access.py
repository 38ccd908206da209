"""Who reaches what through the gRPC door: request ids scoped to their caller, and
messages no larger than ``max_request_bytes``.

**Request ids are scoped to their caller.** A ``Generate`` runs in the cluster under
``scoped_id(caller, request_id)``, a keyed hash of the id the caller gave (or the
server picked) and the credential it presented; ``Abort`` reaches the same id only
with the same credential, and never a request of the HTTP door (whose ids the server
picks) or one that another key started. Callers that share one key (or a keyless
server's callers) share one scope: ids that the server or the client library picks
are random (122 bits), so only whoever saw one can abort its request. Two callers who
pick the same id do not collide; one caller who reuses an id while it runs gets
``INVALID_ARGUMENT``.

**Messages** are bounded by gRPC itself: Ray Serve's proxy, and a replica's own gRPC
server behind HAProxy, refuse a message larger than ``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE``
with ``RESOURCE_EXHAUSTED`` before reading it. ``tessera serve`` sets it to
``max_request_bytes`` in a Ray it starts (``server.local_ray_env``);
``check_message_limit`` warns where a replica finds it larger.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

from tessera.cluster.openai_errors import invalid

logger = logging.getLogger(__name__)

#: The longest request id a caller may give (every response repeats it).
MAX_REQUEST_ID_CHARS = 256


def scoped_id(caller: bytes, request_id: str) -> str:
    """The id a gRPC request runs under in the cluster: a hash keyed by the caller's
    credential (``caller``) of the id it gave, so that ``Abort`` reaches only
    requests started with the same credential, and never the HTTP door's."""
    digest = hmac.new(caller, request_id.encode(), hashlib.sha256).hexdigest()
    return f"grpc-{digest[:32]}"


def check_request_id(request_id: str, allow_empty: bool = False) -> None:
    """A request id: not empty (unless the server may pick one), at most
    ``MAX_REQUEST_ID_CHARS`` (every response repeats it)."""
    if not request_id and not allow_empty:
        raise invalid("request_id", "must not be empty")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(
            "request_id",
            f"is {len(request_id)} characters, over the limit of {MAX_REQUEST_ID_CHARS}",
        )


def caller(grpc_context) -> bytes:
    """The credential a call presented: its ``authorization`` metadata (b"" without)."""
    metadata = dict(grpc_context.invocation_metadata())
    return str(metadata.get("authorization", "")).encode()


def check_message_limit(max_request_bytes: int) -> None:
    """Warn when this process's gRPC servers read messages larger than
    ``max_request_bytes``: Ray Serve sizes them from ``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE``
    in its processes' environment, which ``tessera serve`` sets only in a Ray it
    starts (a Ray joined with ``--address``, or KubeRay's, needs it on its nodes)."""
    from ray.serve._private.constants import RAY_SERVE_GRPC_MAX_MESSAGE_SIZE as limit

    if limit > max_request_bytes:
        logger.warning(
            "gRPC messages up to %d bytes are read before any check, more than "
            "max_request_bytes (%d): set RAY_SERVE_GRPC_MAX_MESSAGE_SIZE=%d in the "
            "environment of the Ray nodes",
            limit,
            max_request_bytes,
            max_request_bytes,
        )

"""Who may call the HTTP door, and with what: the API key, the ``Host`` a keyless
local server answers to, and JSON bodies only.

- **The key** (``api_key``): every route but ``/health`` needs ``Authorization: Bearer
  <key>`` when one is set: the OpenAI routes, ``/tokenize``, ``/detokenize``, ``/docs``,
  ``/openapi.json`` and ``/metrics`` (unless ``metrics_open``, for a scrape network
  that cannot send it). Compared in constant time (``tessera.cluster.auth``).
- **The Host** of a server with no key, listening on loopback: only ``localhost``,
  ``127.0.0.1`` or ``[::1]``, with or without a port (any: behind ``serve run`` or a
  proxy the app does not know the port it is reached on). A web page's script can send
  requests to 127.0.0.1 through a name of its own that resolves there (DNS
  rebinding); its requests carry that name, so they are refused (403). A server with a
  key, or listening beyond loopback, is named however its network names it.
- **JSON bodies**: a POST whose ``Content-Type`` is set and is not JSON gets 415, so
  that a cross-site form or ``text/plain`` POST (which a browser sends without asking
  the server first) is never read as a request. No ``Content-Type`` at all is read as
  JSON, as FastAPI does.
"""

from __future__ import annotations

import ipaddress

from fastapi import Request

from tessera.cluster.auth import expected_authorization, key_matches
from tessera.cluster.openai_errors import APIError
from tessera.cluster.serve_config import ServeConfig

#: The names a keyless loopback server answers to (each alone or with a ``:<port>``).
LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listening address) reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _name(host: str) -> str:
    """A ``Host`` header's name, its ``:<port>`` (digits only) dropped, lowercased."""
    name, colon, port = host.lower().rpartition(":")
    if colon and port.isdigit() and (name.endswith("]") or ":" not in name):
        return name
    return host.lower()


def is_json(content_type: str) -> bool:
    """``application/json``, or a ``+json`` type (``application/merge-patch+json``),
    with or without parameters."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json":
        return True
    return media.startswith("application/") and media.endswith("+json")


class HttpAccess:
    """One replica's access rules, from its ``ServeConfig``."""

    def __init__(self, config: ServeConfig) -> None:
        self.api_key = expected_authorization(config.api_key)
        self.metrics_open = config.metrics_open
        self.hosts: frozenset[str] | None = None  # None: any Host
        if self.api_key is None and is_loopback(config.host):
            self.hosts = frozenset(LOCAL_NAMES)

    def check_host(self, request: Request) -> None:
        """403 for a ``Host`` this server does not answer to (see the module)."""
        if self.hosts is None:
            return
        host = request.headers.get("host")
        if host is not None and _name(host) not in self.hosts:
            raise APIError(
                403,
                f"Host: {host[:100]!r} is not a name of this server: a server with no API "
                "key on loopback answers only to localhost, 127.0.0.1 or [::1]; set an API "
                "key to serve it under other names",
                type="permission_error",
                param="Host",
                code="invalid_host",
            )

    def authorize(self, request: Request) -> None:
        """The ``Host`` check, then the API key (401 without it, or with another)."""
        self.check_host(request)
        if self.api_key is None:
            return
        given = request.headers.get("authorization")
        if given is None:
            raise APIError(
                401,
                "missing API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        if not key_matches(self.api_key, given):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    def authorize_metrics(self, request: Request) -> None:
        """``/metrics``: as every route, unless ``metrics_open`` (the Host check stays)."""
        if self.metrics_open:
            self.check_host(request)
        else:
            self.authorize(request)

    @staticmethod
    def check_json(request: Request) -> None:
        """415 for a body whose ``Content-Type`` is set and is not JSON."""
        content_type = request.headers.get("content-type")
        if content_type is not None and not is_json(content_type):
            raise APIError(
                415,
                f"Content-Type: the body must be JSON (application/json), got "
                f"{content_type[:100]!r}",
                param="Content-Type",
                code="unsupported_media_type",
            )

"""The API key check both front doors share: HTTP's ``Authorization`` header and gRPC's
``authorization`` metadata carry ``Bearer <key>``, compared in constant time."""

from __future__ import annotations

import hmac


def bearer(api_key: str) -> str:
    """The value a client sends for ``api_key``: ``Bearer <key>``."""
    return f"Bearer {api_key}"


def expected_authorization(api_key: str | None) -> bytes | None:
    """What a request must present, as bytes; None when no key is set (open access)."""
    return bearer(api_key).encode() if api_key else None


def key_matches(expected: bytes, presented: str) -> bool:
    """Whether the presented ``authorization`` value is the expected one. Constant time,
    so the answer's timing tells nothing about how much of the key was right."""
    return hmac.compare_digest(presented.encode(), expected)

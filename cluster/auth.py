"""The API key check both front doors share: HTTP's ``Authorization`` header and gRPC's
``authorization`` metadata carry ``Bearer <key>``, compared in constant time."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import SecretStr


def bearer(api_key: str) -> str:
    """The value a client sends for ``api_key``: ``Bearer <key>``."""
    return f"Bearer {api_key}"


def expected_authorization(api_key: SecretStr | str | None) -> bytes | None:
    """What a request must present, as bytes; None when no key is set (open access)."""
    if api_key is not None and not isinstance(api_key, str):  # pydantic's SecretStr
        api_key = api_key.get_secret_value()
    return bearer(api_key).encode() if api_key else None


def key_matches(expected: bytes, presented: str) -> bool:
    """Whether the presented ``authorization`` value is the expected one. Constant time,
    so the answer's timing tells nothing about how much of the key was right."""
    return hmac.compare_digest(presented.encode(), expected)

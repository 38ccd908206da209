"""The OpenAI error objects: every way a request fails becomes an ``APIError``, which
the HTTP app renders as ``{"error": {"message", "type", "param", "code"}}`` and the gRPC
API maps to a status code. Ray's own errors name actors, processes and nodes: the log
has them, the client a short reason.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.exceptions import RayError

from tessera.scheduler.api import (
    DeadlineError,
    NoWorkerError,
    OverloadedError,
    RequestIdInUseError,
)
from tessera.workers.api import InvalidRequestError

logger = logging.getLogger(__name__)

#: Seconds a client is told to wait before retrying an overloaded cluster.
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error response: HTTP ``status`` and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(param: str | None, message: str) -> APIError:
    """A 400 for one field; the message starts with the field's name."""
    if param is not None and not message.startswith(f"{param}:"):
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code="invalid_value")


def api_error(error: BaseException) -> APIError:
    """The HTTP error for whatever ended a request (the gRPC API maps it to a status
    code)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return invalid(error.field, str(error))
    if isinstance(error, RequestIdInUseError):
        return invalid("request_id", str(error))
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(error, DeadlineError):
        return APIError(408, str(error), type="timeout_error", code="timeout")
    if isinstance(error, OverloadedError):
        return APIError(429, str(error), type="overloaded_error", code="overloaded", headers=retry)
    if isinstance(error, NoWorkerError):
        return APIError(503, str(error), type="unavailable_error", code="no_worker", headers=retry)
    # Ray's errors name actors, processes and nodes: the log has them, the client not.
    logger.error("request failed: %s: %s", type(error).__name__, error)
    if isinstance(error, RayError):
        return APIError(
            503,
            "a part of the cluster failed while serving the request; retry",
            type="unavailable_error",
            code="unavailable",
            headers=retry,
        )
    return internal_error(error)


def internal_error(error: BaseException) -> APIError:
    """A 500 that names the error's type only (its text may carry internals)."""
    return APIError(
        500,
        f"internal error ({type(error).__name__}); the server's log has the details",
        "internal_error",
    )

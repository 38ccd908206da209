"""The FastAPI app the HTTP door serves, and what it does for every route: errors as
OpenAI's error objects, and a header naming the replica that answered.

The routes themselves are the methods of ``OpenAIServer`` (``tessera.cluster.serve_app``),
Serve's ingress deployment over this app.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException

from tessera.cluster.openai_errors import APIError, internal_error

logger = logging.getLogger(__name__)

#: The response header that names the front-end replica that served the request.
REPLICA_HEADER = "x-tessera-replica"


def replica_name() -> str:
    """This Serve replica's id within its deployment ("local" outside a replica)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a replica (RayServeException)
        return "local"


class _ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that served it, so a
    client (an operator, a test) knows which replica held its stream."""

    def __init__(self, app) -> None:
        self.app = app
        self.header: tuple[bytes, bytes] | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.header is None:
            self.header = (REPLICA_HEADER.encode(), replica_name().encode())

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_named)


# /docs and /openapi.json are the ingress's own routes, behind the API key (serve_app).
api = FastAPI(
    title="Tessera",
    summary="An OpenAI-compatible LLM server",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
)
api.add_middleware(_ReplicaHeader)


@api.exception_handler(APIError)
async def _render_api_error(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


@api.exception_handler(HTTPException)
async def _render_http_error(request: Request, error: HTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {error.detail}"
    return JSONResponse(
        APIError(error.status_code, message, type=kind).body(), status_code=error.status_code
    )


@api.exception_handler(Exception)
async def _render_internal_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("internal error on %s %s", request.method, request.url.path)
    return JSONResponse(internal_error(error).body(), status_code=500)

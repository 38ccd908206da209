"""``POST /v1/embeddings``: OpenAI's request body, its checks, and the answer.

Each input (text, or token ids) becomes one prompt; the scheduler places the request
on a worker like any other (``ClusterClient.embed``), whose engine runs the prompts
through the model once, without sampling (``workers.engine.embedding``), and pools
their final hidden states. ``dimensions`` must equal the model's hidden size: the
vectors are not truncated.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import Field

from tessera.cluster.front_end import FrontEnd
from tessera.cluster.openai_errors import api_error, invalid
from tessera.cluster.openai_requests import Body
from tessera.workers.validation import MAX_EMBEDDING_INPUTS, check_embedding_inputs

ENDPOINT = "embeddings"


class EmbeddingRequest(Body):
    """OpenAI's embeddings body."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, texts, token ids, or lists of token ids: one embedding each"
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: little-endian float32 bytes"
    )
    dimensions: int | None = Field(None, description="must be the model's hidden size")
    user: str | None = None
    timeout: float | None = Field(None, gt=0, description="seconds to wait for a worker")

    def inputs(self) -> list[tuple[str | list[int], str]]:
        """Each input with the field that names it in errors."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [(value, "input")]  # one text, or one list of token ids
        return [(item, f"input[{i}]") for i, item in enumerate(value)]


async def embeddings(front: FrontEnd, body: EmbeddingRequest) -> dict[str, Any]:
    """The answer to ``body``; ``APIError`` for anything refused or failed."""
    front.check_model(body.model)
    size = front.hidden_size
    if body.dimensions is not None and body.dimensions != size:
        raise invalid(
            "dimensions",
            f"this model's embeddings have {size} dimensions; truncation is not "
            f"supported (got {body.dimensions})",
        )
    items = body.inputs()
    if not items:
        raise invalid("input", "must not be empty")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise invalid("input", f"at most {MAX_EMBEDDING_INPUTS} inputs, got {len(items)}")
    prompts: list[list[int]] = []
    for value, field in items:
        if isinstance(value, str) and not value:
            raise invalid(field, "must not be empty")
        ids = await front.token_ids(value, field)
        if len(ids) > front.max_model_len:
            raise invalid(
                field,
                f"{len(ids)} tokens, more than the model's context of {front.max_model_len} tokens",
            )
        if len(ids) > front.pool_tokens:
            raise invalid(field, f"{len(ids)} tokens, more than the KV pool's {front.pool_tokens}")
        prompts.append(ids)
    try:  # (the worker checks them too; the same function names the same field)
        check_embedding_inputs(prompts, front.vocab_size, front.max_model_len)
        vectors = await front.client.embed(f"embd-{uuid.uuid4().hex}", prompts, body.timeout)
    except Exception as error:
        raise api_error(error) from None
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(row, body.encoding_format)}
        for i, row in enumerate(vectors)
    ]
    tokens = sum(map(len, prompts))
    return {
        "object": "list",
        "data": data,
        "model": front.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _encode(row: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    return row.tolist()


def count(front: FrontEnd, status: int) -> None:
    """Count an embeddings request in the requests metric."""
    front.metrics.requests.labels(ENDPOINT, str(status)).inc()

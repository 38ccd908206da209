"""vLLM's LoRA routes: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

An adapter is registered with the scheduler (``scheduler.loras``), so every front-end
replica serves it; a request chooses it by ``model``. A worker reads and checks the
folder before the name is served: a bad adapter is a 400 saying what is wrong with it.
"""

from __future__ import annotations

import re

from pydantic import Field

from tessera.cluster.front_end import FrontEnd
from tessera.cluster.openai_errors import APIError, api_error, invalid
from tessera.cluster.openai_requests import Body
from tessera.workers.api import InvalidRequestError, LoraRef

#: What an adapter's name may be: it travels as ``model`` in every request.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


class LoadLoraRequest(Body):
    lora_name: str = Field(description="the name requests choose it by, as their model")
    lora_path: str = Field(
        min_length=1,
        max_length=4096,
        description="its folder (adapter_config.json, adapter_model.safetensors)",
    )


class UnloadLoraRequest(Body):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's clients may send it; names identify adapters here


def check_name(front: FrontEnd, name: str) -> None:
    if not NAME.fullmatch(name):
        raise invalid(
            "lora_name",
            f"must be 1-128 letters, digits or ._:/@+- (starting with a letter or digit), "
            f"got {name[:200]!r}",
        )
    if name == front.model_name:
        raise invalid("lora_name", f"{name!r} is the base model's name")


def check_allowed(front: FrontEnd) -> None:
    """Loading and unloading at runtime is on (``allow_runtime_lora_updating``): it lets
    a caller with the API key make the workers read any folder they can."""
    if not front.config.allow_runtime_lora_updating:
        raise APIError(
            403,
            "loading and unloading LoRA adapters at runtime is off on this server (start "
            "it with --allow-runtime-lora-updating; --lora-modules loads them at start)",
            type="permission_error",
            code="runtime_lora_updating_off",
        )


async def load(front: FrontEnd, body: LoadLoraRequest) -> LoraRef:
    """Serve ``body.lora_path`` as ``body.lora_name``; ``APIError`` if it cannot be."""
    check_allowed(front)
    check_name(front, body.lora_name)
    try:
        return await front.client.load_lora(body.lora_name, body.lora_path)
    except InvalidRequestError as error:  # Ray's error is also the scheduler's
        cause = getattr(error, "cause", error)
        raise invalid(cause.field, cause.message) from None
    except Exception as error:
        raise api_error(error) from None


async def unload(front: FrontEnd, body: UnloadLoraRequest) -> None:
    """Stop serving ``body.lora_name``; a 404 if it is not served."""
    check_allowed(front)
    if not await front.client.unload_lora(body.lora_name):
        raise APIError(
            404,
            f"lora_name: no LoRA adapter {body.lora_name[:200]!r} is loaded",
            param="lora_name",
            code="lora_not_found",
        )

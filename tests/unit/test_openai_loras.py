"""The LoRA routes' checks before any work: runtime loading off by default (a 403 that
says how to turn it on), and adapter names refused in words."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tessera.cluster import openai_loras
from tessera.cluster.openai_errors import APIError
from tessera.cluster.openai_loras import LoadLoraRequest, UnloadLoraRequest
from tessera.cluster.serve_config import ServeConfig


def front(**settings) -> SimpleNamespace:
    """What the routes read of a front end before they call the cluster."""
    return SimpleNamespace(config=ServeConfig(**settings), model_name="base", client=None)


def test_runtime_loading_is_refused_unless_allowed():
    assert ServeConfig.model_fields["allow_runtime_lora_updating"].default is False
    body = LoadLoraRequest(lora_name="a", lora_path="/adapters/a")
    for call in (
        openai_loras.load(front(), body),
        openai_loras.unload(front(), UnloadLoraRequest(lora_name="a")),
    ):
        with pytest.raises(APIError) as refused:
            asyncio.run(call)
        assert refused.value.status == 403
        assert str(refused.value) == (
            "loading and unloading LoRA adapters at runtime is off on this server (start "
            "it with --allow-runtime-lora-updating; --lora-modules loads them at start)"
        )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("base", "lora_name: 'base' is the base model's name"),
        (
            "",
            "lora_name: must be 1-128 letters, digits or ._:/@+- (starting with a letter or "
            "digit), got ''",
        ),
        (
            "-x",
            "lora_name: must be 1-128 letters, digits or ._:/@+- (starting with a letter or "
            "digit), got '-x'",
        ),
        (
            "a" * 129,
            "lora_name: must be 1-128 letters, digits or ._:/@+- (starting with a "
            f"letter or digit), got {'a' * 129!r}",
        ),
    ],
)
def test_bad_names_are_refused_in_words(name, message):
    allowed = front(allow_runtime_lora_updating=True)
    with pytest.raises(APIError) as refused:
        asyncio.run(openai_loras.load(allowed, LoadLoraRequest(lora_name=name, lora_path="/a")))
    assert (refused.value.status, str(refused.value)) == (400, message)


def test_a_server_without_lora_refuses_to_load_one():
    """The scheduler's registry, on a cluster whose workers serve no adapter: no worker is
    asked; the answer names the setting."""
    from tessera.scheduler.loras import LoraRegistry
    from tessera.workers.api import InvalidRequestError
    from tessera.workers.config import EngineConfig

    registry = LoraRegistry()
    registry.config = SimpleNamespace(engine=EngineConfig())
    registry.loras = {}
    with pytest.raises(InvalidRequestError) as refused:
        asyncio.run(registry.load_lora("a", "/adapters/a"))
    assert str(refused.value) == (
        "lora_name: this server serves no LoRA adapters (start it with --enable-lora or "
        "--lora-modules)"
    )

"""Renders of the chart, made once per session: the default values and the GPU example."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.helm import GPU_EXAMPLE, documents, template


@pytest.fixture(scope="session")
def default_render() -> list[dict[str, Any]]:
    return documents(template())


@pytest.fixture(scope="session")
def gpu_render() -> list[dict[str, Any]]:
    return documents(template(GPU_EXAMPLE))


@pytest.fixture(scope="session", params=["default", "gpu-disagg"])
def render(request, default_render, gpu_render) -> list[dict[str, Any]]:
    """Each supported configuration's render, in turn."""
    return default_render if request.param == "default" else gpu_render

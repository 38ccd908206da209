"""Renders of the chart, made once per session: the default values and the GPU examples."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.helm import GPU_EXAMPLE, GPU_TP_EXAMPLE, documents, template


@pytest.fixture(scope="session")
def default_render() -> list[dict[str, Any]]:
    return documents(template())


@pytest.fixture(scope="session")
def gpu_render() -> list[dict[str, Any]]:
    return documents(template(GPU_EXAMPLE))


@pytest.fixture(scope="session")
def gpu_tp_render() -> list[dict[str, Any]]:
    return documents(template(GPU_TP_EXAMPLE))


@pytest.fixture(scope="session", params=["default", "gpu-disagg", "gpu-tensor-parallel"])
def render(request, default_render, gpu_render, gpu_tp_render) -> list[dict[str, Any]]:
    """Each supported configuration's render, in turn."""
    renders = {"default": default_render, "gpu-disagg": gpu_render}
    return renders.get(request.param, gpu_tp_render)

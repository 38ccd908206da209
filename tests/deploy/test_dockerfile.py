"""The Dockerfile (it cannot be built here: no Docker engine) stays in step with what it
must match: the Ray version the chart declares to KubeRay, and the README's torch pin."""

from __future__ import annotations

import re

import yaml

from tests.deploy.helm import CHART, REPO


def build_args() -> dict[str, str]:
    """The Dockerfile's ARG defaults."""
    text = (REPO / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))


def test_base_image_is_the_ray_version_the_chart_declares():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert build_args()["RAY_VERSION"] == values["rayVersion"]


def test_torch_is_pinned_as_in_the_readme():
    (readme_pin,) = set(re.findall(r"torch==([0-9.]+)", (REPO / "README.md").read_text()))
    assert build_args()["TORCH_VERSION"] == readme_pin

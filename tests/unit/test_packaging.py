"""Installing Tessera adds one import name, ``tessera``: a built wheel holds nothing else
at top level, every module of the four folders is in it under ``tessera.``, and the
folders refuse to be imported by their bare names."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("protos", "workers", "scheduler", "cluster")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """``pip wheel --no-deps .`` against the installed setuptools (no build isolation:
    nothing is downloaded)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    (path,) = out.glob("tessera-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def test_the_wheel_installs_only_tessera_at_top_level(wheel):
    top = {name.split("/")[0] for name in wheel.namelist()}
    (dist_info,) = [name for name in top if name.endswith(".dist-info")]
    assert top == {"tessera", dist_info}
    assert not any(name == "tessera/__init__.py" for name in wheel.namelist())  # a namespace


def test_every_module_of_the_folders_is_in_the_wheel(wheel):
    """The package list in pyproject.toml is explicit: a new subpackage must join it."""
    expected = {
        "tessera/" + path.relative_to(ROOT).as_posix()
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert expected - set(wheel.namelist()) == set()


def test_the_wheel_carries_the_proto_files(wheel):
    names = set(wheel.namelist())
    assert "tessera/protos/tessera/v1/generation.proto" in names
    assert "tessera/protos/tessera/v1/kv_transfer.proto" in names


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_bare_folder_name_does_not_import(folder):
    """Even from the repository root, where the folder is on ``sys.path``: a second copy
    of a module under another name would hold a second copy of its classes."""
    result = subprocess.run(
        [sys.executable, "-c", f"import {folder}"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 1
    assert f"ImportError: import tessera.{folder}, not {folder}" in result.stderr


def test_the_console_script_points_into_tessera():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'tessera = "tessera.cluster.cli:main"' in text

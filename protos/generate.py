"""Generate the Python stubs of ``protos/tessera/v1/*.proto`` (``*_pb2.py``, ``.pyi``
and ``*_pb2_grpc.py``): ``python -m protos.generate``. The stubs are committed and
never edited by hand; ``tests/unit/test_protos.py`` regenerates them and compares."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: imports read protos.tessera.v1
PROTOS = sorted((ROOT / "protos" / "tessera" / "v1").glob("*.proto"))


def generate(out: Path = ROOT) -> list[Path]:
    """Write the stubs under ``out`` (mirroring ``protos/tessera/v1``); return them."""
    from grpc_tools import protoc

    sources = [str(p.relative_to(ROOT)) for p in PROTOS]
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")
    stubs = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    return sorted(p for p in (out / "protos/tessera/v1").iterdir() if p.name.endswith(stubs))


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(ROOT))

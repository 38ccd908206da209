"""Generate the Python stubs of ``protos/tessera/v1/*.proto`` (``*_pb2.py``, ``.pyi``
and ``*_pb2_grpc.py``): ``python -m tessera.protos.generate``. The stubs are committed
and never edited by hand; ``tests/unit/test_protos.py`` regenerates them and compares.

The folder ``protos/`` is installed as ``tessera.protos``, so the stubs must import
each other as ``tessera.protos.tessera.v1``: protoc runs over a staged copy of the
``.proto`` files at that path (``tessera/protos/tessera/v1/*.proto``), which is also
the name each file has in the descriptor pool and in gRPC reflection.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
SOURCE = ROOT / "protos" / "tessera" / "v1"
PROTOS = sorted(SOURCE.glob("*.proto"))
IMPORT_PATH = Path("tessera/protos/tessera/v1")  # where the stubs live, as imported


def generate(out: Path = SOURCE) -> list[Path]:
    """Write the stubs into ``out`` (default: next to the ``.proto`` files); return them."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        staged, built = Path(tmp) / "in", Path(tmp) / "out"
        (staged / IMPORT_PATH).mkdir(parents=True)
        built.mkdir()
        for proto in PROTOS:
            shutil.copy(proto, staged / IMPORT_PATH / proto.name)
        sources = [str(IMPORT_PATH / p.name) for p in PROTOS]
        args = [
            "grpc_tools.protoc",
            f"-I{staged}",
            f"--python_out={built}",
            f"--pyi_out={built}",
            f"--grpc_python_out={built}",
            *sources,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {sources}")
        stubs = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for path in sorted((built / IMPORT_PATH).iterdir()):
            if path.name.endswith(stubs):
                written.append(Path(shutil.copy(path, out / path.name)))
    return written


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(ROOT))

"""The committed gRPC stubs are exactly what ``python -m tessera.protos.generate`` makes of
the ``.proto`` files, and every message an RPC sends carries ``version``."""

from __future__ import annotations

import pytest

from tessera.protos import generate
from tessera.protos.tessera.v1 import generation_pb2, kv_transfer_pb2


def test_the_committed_stubs_match_a_fresh_generation(tmp_path):
    fresh = generate.generate(tmp_path)
    committed = sorted((generate.ROOT / "protos/tessera/v1").glob("*_pb2*.py*"))
    assert [p.name for p in fresh] == [p.name for p in committed]
    assert len(fresh) == 3 * len(generate.PROTOS)  # _pb2.py, _pb2.pyi, _pb2_grpc.py each
    for new, old in zip(fresh, committed, strict=True):
        assert new.read_text() == old.read_text(), (
            f"{old.relative_to(generate.ROOT)} differs from the .proto: run "
            "`python -m tessera.protos.generate` and commit the result"
        )


@pytest.mark.parametrize("module", [generation_pb2, kv_transfer_pb2])
def test_every_rpc_message_has_a_version_field(module):
    for service in module.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            for message in (method.input_type, method.output_type):
                field = message.fields_by_name.get("version")
                assert field is not None, f"{message.full_name} has no version field"
                assert field.number == 1 and field.type == field.TYPE_UINT32

"""``GGUFFile`` against ``gguf.GGUFReader`` (the reference): the same fields and tensors,
from the built-in model and from a file written with every value and tensor type the
loader meets; and clear errors for what it cannot read."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from tessera.workers.model.gguf_file import GGUFFile
from tessera.workers.model.loader import builtin_model_path

#: fields GGUFReader adds from the header itself, not key/value pairs of the file
HEADER_FIELDS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


def assert_same_as_gguf(path) -> GGUFFile:
    ours, reference = GGUFFile(path), GGUFReader(str(path))
    assert list(ours.fields) == [k for k in reference.fields if k not in HEADER_FIELDS]
    for key, field in reference.fields.items():
        if key not in HEADER_FIELDS:
            expected = field.contents()
            assert ours.fields[key] == expected, key
            assert type(ours.fields[key]) is type(expected), key
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in theirs.shape), mine.name
        assert mine.data.dtype == theirs.data.dtype, mine.name
        assert mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data, equal_nan=True), mine.name
    return ours


def test_the_builtin_model_reads_as_gguf_reads_it():
    ours = assert_same_as_gguf(builtin_model_path())
    assert ours.fields["general.architecture"] == "llama"
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert len(ours.tensors) == 272


def test_every_value_and_tensor_type(tmp_path):
    path = tmp_path / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1 / 3)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "déjà vu ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "ü ✓"])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5), dtype=np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        data = rng.standard_normal((4, 64), dtype=np.float32)
        writer.add_tensor(qtype.name, quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = assert_same_as_gguf(path)
    assert ours.fields["t.strs"] == ["a", "", "ü ✓"] and ours.fields["t.u64"] == 2**63 + 5
    assert ours.tensors[3].data.shape == (4, 64 // 32 * 34)  # Q8_0: rows of block bytes


def test_what_it_cannot_read_is_named(tmp_path):
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match=r"weights.gguf' is not a GGUF file \(no GGUF magic\)"):
        GGUFFile(not_gguf)
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(ValueError, match=r"v1.gguf' is GGUF version 1; supported: \(2, 3\)"):
        GGUFFile(old)
    swapped = tmp_path / "be.gguf"
    swapped.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    with pytest.raises(ValueError, match=r"be.gguf' is a big-endian GGUF file"):
        GGUFFile(swapped)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"empty.gguf' is not a GGUF file \(4 bytes\)"):
        GGUFFile(empty)
    cut = tmp_path / "cut.gguf"  # a download stopped inside the vocabulary
    with open(builtin_model_path(), "rb") as whole:
        cut.write_bytes(whole.read(100_000))
    with pytest.raises(ValueError, match=r"cut.gguf' is not a whole GGUF file: "):
        GGUFFile(cut)
    unknown = tmp_path / "unknown.gguf"
    key = b"general.name"
    # one field, its value type 99; an array of 77s, of one item and of none (never read)
    for value, kind in [(struct.pack("<I", 99), 99)] + [
        (struct.pack("<IIQ", 9, 77, count), 77) for count in (1, 0)
    ]:
        unknown.write_bytes(
            b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + value
        )
        with pytest.raises(
            ValueError, match=rf"field 'general.name' has an unknown value type {kind}"
        ):
            GGUFFile(unknown)


def test_a_released_tensors_pages_leave_the_process_and_read_the_same_again():
    """``release`` drops a copied tensor's pages of the map from the process's resident
    memory (the load then holds the file's bytes once); read again, the view gives the
    same bytes as gguf's reader."""
    import psutil

    path = builtin_model_path()
    ours, reference = GGUFFile(path), GGUFReader(str(path))
    mapped = [m for m in psutil.Process().memory_maps(grouped=True) if m.path == str(path)]
    before = sum(m.rss for m in mapped)
    total = 0
    for tensor in ours.tensors:
        total += int(np.asarray(tensor.data).view(np.uint8).sum(dtype=np.int64))  # touch
    touched = sum(m.rss for m in psutil.Process().memory_maps(grouped=True) if m.path == str(path))
    for tensor in ours.tensors:
        ours.release(tensor)
    after = sum(m.rss for m in psutil.Process().memory_maps(grouped=True) if m.path == str(path))
    size = path.stat().st_size
    assert touched - before > size // 2 and after < touched - size // 2, (before, touched, after)
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert np.array_equal(mine.data, theirs.data, equal_nan=True), mine.name

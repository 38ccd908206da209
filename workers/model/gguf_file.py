"""A GGUF file's metadata and tensors, read in one pass over its header.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array: for
SmolLM2's 49,152 tokens and ~48,900 merges that took 4.8-5.3 s of each model load (a worker,
``tessera generate``, every test process), against 0.24 s here. This reader decodes the
same header (GGUF versions 2 and 3, little-endian) with ``struct`` and gives each tensor's
data as the same numpy view of the memory-mapped file that ``GGUFReader`` gives: F32 /
F16 / F64 / I8..I64 tensors as arrays of that type, quantised ones as ``uint8`` rows of
their bytes (``gguf.quants.quant_shape_to_byte_shape``), the shape reversed from the
file's (innermost) order. ``tests/unit/test_gguf_file.py`` checks both readers agree on
every field and tensor of the built-in model.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
HEADER_BYTES = 24  # magic, version, tensor count, field count

#: struct formats of the scalar value types (little-endian)
_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
#: numpy types of the tensor types stored element by element (the rest: bytes per row)
_ELEMENT_TYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor: ``shape`` in the file's order (a matrix is ``[in, out]``), ``data`` a
    read-only view of the file (``GGUFReader``'s ``ReaderTensor.data``)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """``fields``: every metadata key and its value (a number, bool or str; a list for
    an array). ``tensors``: in the file's order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < HEADER_BYTES:
            raise ValueError(f"model: {str(self.path)!r} is not a GGUF file ({size} bytes)")
        self._map = np.memmap(self.path, mode="r")
        try:
            self._read()
        except (struct.error, TypeError, UnicodeDecodeError) as error:  # cut short, or garbled
            raise ValueError(
                f"model: {str(self.path)!r} is not a whole GGUF file: {error}"
            ) from None

    def _read(self) -> None:
        buf = memoryview(self._map)
        if bytes(buf[:4]) != MAGIC:
            raise ValueError(f"model: {str(self.path)!r} is not a GGUF file (no GGUF magic)")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in VERSIONS:
            if version & 0xFFFF == 0:
                raise ValueError(f"model: {str(self.path)!r} is a big-endian GGUF file")
            raise ValueError(
                f"model: {str(self.path)!r} is GGUF version {version}; supported: {VERSIONS}"
            )
        self._buf = buf
        num_tensors, num_fields = struct.unpack_from("<QQ", buf, 8)
        self._offset = HEADER_BYTES
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._u32(), key)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (ndims,) = struct.unpack_from("<I", buf, self._offset)
            dims = struct.unpack_from(f"<{ndims}Q", buf, self._offset + 4)
            qtype, offset = struct.unpack_from("<IQ", buf, self._offset + 4 + 8 * ndims)
            self._offset += 4 + 8 * ndims + 12
            if qtype not in GGMLQuantizationType._value2member_map_:
                raise ValueError(f"model: GGUF tensor {name!r} has an unknown type {qtype}")
            infos.append((name, dims, GGMLQuantizationType(qtype), offset))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"model: GGUF general.alignment {alignment!r} is not a power of two")
        start = -(-self._offset // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, qtype, offset in infos:
            if name in seen:
                raise ValueError(f"model: GGUF tensor {name!r} appears twice")
            seen.add(name)
            self.tensors.append(self._tensor(name, dims, qtype, start + offset))
        del self._buf  # the tensors' views keep the map alive

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the file's pages under ``tensor.data`` from this process's memory once
        its bytes were copied out (they stay in the system's page cache): a load then
        holds the file's bytes once, not as the map and the copies both. Reading the
        view again reads the file again."""
        mapped = getattr(self._map, "_mmap", None)  # numpy's mmap.mmap under the memmap
        if mapped is None or not hasattr(mapped, "madvise"):
            return  # (another numpy, or no madvise here: the pages stay until the map goes)
        start = tensor.data.ctypes.data - self._map.ctypes.data
        first = start // mmap.PAGESIZE * mmap.PAGESIZE  # (a neighbour's page: read again)
        mapped.madvise(mmap.MADV_DONTNEED, first, start + tensor.data.nbytes - first)

    def _tensor(
        self, name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType, offset: int
    ) -> GGUFTensor:
        count = int(np.prod(dims, dtype=np.int64))
        shape = tuple(reversed(dims))
        element = _ELEMENT_TYPES.get(qtype)
        if element is None:
            block, size = GGML_QUANT_SIZES[qtype]
            element, count = np.uint8, count * size // block
            shape = quant_shape_to_byte_shape(shape, qtype)
        data = np.ndarray((count,), element, self._map, offset).reshape(shape)
        return GGUFTensor(name, qtype, tuple(dims), data)

    def _u32(self) -> int:
        (value,) = struct.unpack_from("<I", self._buf, self._offset)
        self._offset += 4
        return value

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._buf, self._offset)
        start = self._offset + 8
        self._offset = start + length
        return str(self._buf[start : self._offset], "utf-8")

    @staticmethod
    def _kind(kind: int, key: str) -> GGUFValueType:
        """Field ``key``'s value type (or its array's item type), known or a named error."""
        if kind not in GGUFValueType._value2member_map_:
            raise ValueError(f"model: GGUF field {key!r} has an unknown value type {kind}")
        return GGUFValueType(kind)

    def _value(self, kind: int, key: str) -> Any:
        """The value of field ``key`` (for its errors) of value type ``kind``."""
        kind = self._kind(kind, key)
        if kind is GGUFValueType.STRING:
            return self._string()
        if kind is GGUFValueType.ARRAY:
            item = self._kind(self._u32(), key)  # checked even where the array is empty
            (count,) = struct.unpack_from("<Q", self._buf, self._offset)
            self._offset += 8
            if item in _SCALARS:  # numbers in one unpack
                fmt = _SCALARS[item]
                values = struct.unpack_from(f"<{count}{fmt[1]}", self._buf, self._offset)
                self._offset += count * struct.calcsize(fmt)
                return list(values)
            return [self._value(item, key) for _ in range(count)]
        fmt = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self._buf, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

"""The header of a GGUF file (llama.cpp's format, versions 2 and 3), read in one pass: its
metadata as Python values and where each tensor's data lies in the file.

The `gguf` library's reader builds a numpy view per metadata item: on the default model
(a 49,152-token vocabulary and as many merges) that took ~8 s of every worker's start-up on a
2-core machine; this reads the same header in well under a second. Values come out as
``GGUFReader``'s ``field.contents()`` gives them: scalars as int / float / bool / str, arrays
as lists. Tensor data is memory-mapped, not read.

Layout (little-endian): magic ``GGUF``, uint32 version, uint64 tensor count, uint64 metadata
count; each metadata item a string key, a uint32 value type and the value (strings are a
uint64 length and UTF-8 bytes; arrays a uint32 element type, a uint64 count and the
elements); each tensor a name, a uint32 dimension count, uint64 dimensions (the fastest
varying first), a uint32 ggml type and a uint64 offset into the data section, which starts
at the next multiple of ``general.alignment`` (default 32) after the header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types → struct format of one scalar (8: string, 9: array are read apart).
_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
# ggml types stored as plain numbers (every other type is blocks of bytes).
_PLAIN_TENSORS = {
    0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
    28: np.float64,
}  # fmt: skip


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF header (or the file ends inside it)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    ggml_type: int
    data: np.ndarray  # memory-mapped, read-only: numbers, or [rows..., bytes per row] blocks

    @property
    def n_bytes(self) -> int:
        return self.data.nbytes


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]  # in file order


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise GGUFFormatError(f"the header runs past the end of the file (at byte {self.pos})")
        view = self.buf[self.pos : end]
        self.pos = end
        return view

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack_from("<" + fmt, self.take(size))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as err:
            raise GGUFFormatError(f"a string at byte {self.pos} is not UTF-8: {err}") from None

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            element_type, count = self.scalar("I"), self.scalar("Q")
            if element_type == _STRING:
                return [self.string() for _ in range(count)]
            if element_type == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            fmt = _fmt(element_type)
            raw = self.take(count * struct.calcsize(fmt))
            return np.frombuffer(raw, dtype=np.dtype("<" + fmt)).tolist()
        return self.scalar(_fmt(value_type))


def _fmt(value_type: int) -> str:
    if value_type not in _SCALARS:
        raise GGUFFormatError(f"unknown GGUF value type {value_type}")
    return _SCALARS[value_type]


def read_header(path: str | Path) -> GGUFHeader:
    """Parse ``path``'s header; GGUFFormatError if it is not a well-formed GGUF file or its
    tensors' data does not fit in it."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped))
    if bytes(cursor.take(4)) != MAGIC:
        raise GGUFFormatError("no GGUF magic at the start")
    version = cursor.scalar("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} (versions 2 and 3 are read)")
    tensor_count, metadata_count = cursor.scalar("Q"), cursor.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(metadata_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("I"))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(cursor.scalar("Q") for _ in range(cursor.scalar("I")))
        infos.append((name, dims, cursor.scalar("I"), cursor.scalar("Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0:
        raise GGUFFormatError(f"general.alignment is {alignment}")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, ggml_type, offset in infos:
        if name in tensors:
            raise GGUFFormatError(f"tensor {name} appears twice")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except ValueError:
            raise GGUFFormatError(f"tensor {name} has unknown ggml type {ggml_type}") from None
        count = int(np.prod(dims, dtype=np.int64))
        nbytes = count // block * type_size
        start = data_start + offset
        if start + nbytes > len(mapped):
            raise GGUFFormatError(
                f"tensor {name} needs {nbytes} bytes from byte {start}, the file ends at "
                f"{len(mapped)}: truncated"
            )
        raw = mapped[start : start + nbytes]
        shape = tuple(reversed(dims))
        if ggml_type in _PLAIN_TENSORS:
            data = raw.view(_PLAIN_TENSORS[ggml_type]).reshape(shape)
        else:  # rows of blocks: [..., bytes per row], as gguf's dequantiser takes them
            data = raw.reshape(*shape[:-1], dims[0] // block * type_size)
        tensors[name] = TensorInfo(name, dims, ggml_type, data)
    return GGUFHeader(version, metadata, tensors)

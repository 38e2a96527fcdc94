"""engine.gguf_header against the gguf library's reader: the same metadata and tensors, and a
clear error for every malformed header."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from engine.gguf_header import GGUFFormatError, read_header
from tests.engine.gguf_files import write_gguf


def _write_all_value_types(path) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -3000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -7)
    writer.add_float32("t.f32", 0.25)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, -1.5])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.empty", [])
    writer.add_tensor("plain", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("half", np.ones((2, 8), dtype=np.float16))
    blocks = np.zeros((2, 34), dtype=np.uint8)  # Q8_0: 32 values in 34 bytes per block
    writer.add_tensor("q8", blocks, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _same_as_gguf_reader(path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    header = read_header(path)
    expected = {n: f.contents() for n, f in reader.fields.items() if not n.startswith("GGUF.")}
    assert header.metadata == expected
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        ours = header.tensors[tensor.name]
        assert ours.ggml_type == int(tensor.tensor_type)
        assert list(ours.dims) == tensor.shape.tolist()
        assert ours.n_bytes == tensor.n_bytes
        assert ours.data.dtype == tensor.data.dtype and ours.data.shape == tensor.data.shape
        assert np.array_equal(ours.data, tensor.data)


def test_every_value_type_and_tensor_kind_as_the_gguf_library_reads_them(tmp_path):
    path = tmp_path / "types.gguf"
    _write_all_value_types(path)
    _same_as_gguf_reader(path)
    header = read_header(path)
    assert header.metadata["t.str"] == "héllo" and header.metadata["t.strs"] == ["a", "", "ü"]
    assert header.metadata["t.bool"] is True and header.metadata["t.u64"] == 2**40


@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0", "Q4_1"])
def test_a_model_file_as_the_gguf_library_reads_it(tmp_path, tensor_type):
    path = write_gguf(tmp_path / "m.gguf", tensor_type=tensor_type)
    _same_as_gguf_reader(path)


def test_malformed_headers_are_refused_with_a_reason(tmp_path):
    good = write_gguf(tmp_path / "m.gguf").read_bytes()

    def refused(data: bytes, match: str) -> None:
        path = tmp_path / "bad.gguf"
        path.write_bytes(data)
        with pytest.raises(GGUFFormatError, match=match):
            read_header(path)

    refused(b"GGML" + good[4:], "magic")
    refused(good[:4] + struct.pack("<I", 7) + good[8:], "version 7")
    refused(good[:200], "past the end")  # cut inside the metadata
    refused(good[: len(good) - 100], "truncated")  # cut inside the tensor data
    # a metadata item whose value type does not exist (the first key follows the counts)
    key_len = struct.unpack_from("<Q", good, 24)[0]
    at = 32 + key_len
    refused(good[:at] + struct.pack("<I", 99) + good[at + 4 :], "value type 99")

"""Hostile GGUF files: every malformation the reader must refuse with BadGGUF and a message.

The files are built byte by byte here (struct, independent of gguf-py's writer), so each
test states exactly which field lies.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from ggtorch.errors import BadGGUF
from ggtorch.io.gguf import read_gguf
from tests.families import VOCABULARIES, gguf_py_reader
from tests.fixtures import FOLDER as FIXTURES
from tests.llama_cpp_files import vocab_file

ALIGN = 32
F32, Q4_0 = 0, 2


def gguf_string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def build(kvs: list[bytes] | None = None, tensors: list[tuple[str, list[int], int, int]] | None = None,
          data: bytes | None = None, version: int = 3, n_tensors: int | None = None,
          n_kv: int | None = None) -> bytes:
    """A GGUF file: raw kv records, tensor infos (name, ne, type, offset), then aligned data."""
    kvs = kvs if kvs is not None else [gguf_string("general.architecture") + struct.pack("<I", 8)
                                       + gguf_string("llama")]
    tensors = tensors if tensors is not None else [("a", [4, 2], F32, 0), ("b", [32], Q4_0, 32)]
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                len(kvs) if n_kv is None else n_kv)
    out += b"".join(kvs)
    for name, ne, ttype, offset in tensors:
        out += gguf_string(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ttype, offset)
    out += b"\0" * (-len(out) % ALIGN)
    return out + (data if data is not None else bytes(range(32)) + bytes(18))


def write(tmp_path: Path, blob: bytes, name: str = "x.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(blob)
    return path


def test_the_builder_makes_a_valid_file(tmp_path: Path) -> None:
    f = read_gguf(write(tmp_path, build()))
    assert f.architecture == "llama"
    assert f.tensors["a"].shape == (2, 4)
    assert np.array_equal(f.tensors["a"].data, np.arange(32, dtype=np.uint8))
    assert f.tensors["b"].nbytes == 18


CASES = {
    "empty": (b"", "empty"),
    "wrong magic": (b"GGML" + build()[4:], "not a GGUF file"),
    "version 1": (build(version=1), "version 1 is not supported"),
    "version 4": (build(version=4), "version 4 is not supported"),
    "big endian": (build(version=3 << 24), "big-endian"),
    "truncated header": (build()[:10], "runs past the end"),
    "too many tensors": (build(n_tensors=1 << 60), "claims 1152921504606846976 tensors"),
    "too many kvs": (build(n_kv=1 << 40), "claims 1099511627776 key/values"),
    "more kvs than present": (build(n_kv=2), "tensor"),
    "key length past eof": (build(kvs=[struct.pack("<Q", 1 << 50) + b"k"]), "length"),
    "string value past eof": (build(kvs=[gguf_string("k") + struct.pack("<IQ", 8, 1 << 40)]), "value of key 'k'"),
    "array length past eof": (build(kvs=[gguf_string("k") + struct.pack("<IIQ", 9, 6, 1 << 61)]), "of array 'k'"),
    "string array past eof": (build(kvs=[gguf_string("k") + struct.pack("<IIQ", 9, 8, 1 << 40)]), "strings of array"),
    "unknown value type": (build(kvs=[gguf_string("k") + struct.pack("<I", 99)]), "not a GGUF value type"),
    "duplicate key": (build(kvs=[gguf_string("k") + struct.pack("<II", 4, 1)] * 2), "key 'k' occurs twice"),
    "key not utf-8": (build(kvs=[gguf_string(b"\xff\xfe") + struct.pack("<II", 4, 1)]), "not valid UTF-8"),
    "bad alignment": (build(kvs=[gguf_string("general.alignment") + struct.pack("<II", 4, 3)]), "power of two"),
    "offset outside data": (build(tensors=[("a", [4, 2], F32, 1 << 40)]), "outside the data section"),
    "size outside data": (build(tensors=[("a", [4, 1 << 30], F32, 0)]), "outside the data section"),
    "truncated data": (build()[:-5], "outside the data section"),
    "overlap": (build(tensors=[("a", [8, 2], F32, 0), ("b", [32], Q4_0, 32)], data=bytes(128)), "overlap"),
    "unknown ggml type": (build(tensors=[("a", [4, 2], 77, 0)]), "unknown ggml type 77"),
    "shape overflow": (build(tensors=[("a", [1 << 40, 1 << 40], F32, 0)]), "overflows"),
    "block size": (build(tensors=[("b", [31], Q4_0, 0)]), "not a multiple of the Q4_0 block size 32"),
    "duplicate tensor": (build(tensors=[("a", [4, 2], F32, 0), ("a", [4, 2], F32, 32)]), "'a' occurs twice"),
    "too many dims": (build(tensors=[("a", [1, 1, 1, 1, 1], F32, 0)]), "5 dimensions"),
    "misaligned offset": (build(tensors=[("a", [4, 2], F32, 4)]), "not a multiple of the alignment"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_file_is_refused_with_a_message(tmp_path: Path, case: str) -> None:
    blob, message = CASES[case]
    path = write(tmp_path, blob)
    start = time.perf_counter()
    with pytest.raises(BadGGUF, match=message) as err:
        read_gguf(path)
    assert str(path) in str(err.value)
    assert time.perf_counter() - start < 2.0  # no loop over a count the file merely claims


def _assert_reads_like_gguf_py(path: Path, reader: GGUFReader | None = None) -> None:
    """read_gguf's metadata, value types and tensors equal gguf-py's GGUFReader's (``reader``, if given)."""
    ours = read_gguf(path)
    reader = reader or GGUFReader(path)
    fields = {key: field for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    python_type = {GGUFValueType.BOOL: bool, GGUFValueType.FLOAT32: float, GGUFValueType.FLOAT64: float,
                   GGUFValueType.STRING: str}
    for key, field in fields.items():
        vtype = field.types[0]
        assert ours.value_types[key][0] == vtype, key
        value = ours.metadata[key]
        if vtype == GGUFValueType.STRING:
            assert value == bytes(field.parts[-1]).decode("utf-8", errors="replace")
        elif vtype != GGUFValueType.ARRAY:
            assert value == field.parts[-1][0] and type(value) is python_type.get(vtype, int), key
        else:
            etype = field.types[-1]
            if field.data:
                assert ours.value_types[key][1] == etype, key
            if etype == GGUFValueType.STRING:
                expected = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
            else:
                expected = [v for i in field.data for v in field.parts[i].tolist()]
                assert all(type(v) is python_type.get(etype, int) for v in value), key
            assert value == expected, key
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type and info.shape == tuple(reversed(t.shape.tolist()))
        assert info.data.tobytes() == np.asarray(t.data).view(np.uint8).tobytes()


REAL_FILES = ["stories260K", "llama-spm", "phi-3", "llama-bpe",
              pytest.param("qwen2", marks=pytest.mark.xdist_group("qwen2_tied"))]
"""The GGUF files the tests read and did not write: tests/fixtures' model and llama.cpp's vocabularies (by name).
Qwen's runs beside the qwen2_tied preset of tests/families.py, which reads it with gguf-py too (seconds over its 151k
tokens; once per process)."""


def real_file(name: str) -> Path:
    return FIXTURES / f"{name}.gguf" if name == "stories260K" else vocab_file(name)


def test_every_real_file_is_listed() -> None:
    listed = {p.values[0] if hasattr(p, "values") else p for p in REAL_FILES}
    fixtures = {p.stem for p in FIXTURES.glob("*.gguf")}
    assert fixtures | (set(VOCABULARIES) - {"stories"}) <= listed


@pytest.mark.parametrize("name", REAL_FILES)
def test_every_real_file_reads_like_gguf_py(llama_cpp: Path, name: str) -> None:
    """The walk accepts real files (the model, the vocabularies) and reads them as gguf-py does."""
    path = real_file(name)
    _assert_reads_like_gguf_py(path, gguf_py_reader(path))


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0"])
def test_quantized_model_reads_like_gguf_py(random_llama: Callable[..., Path], ftype: str) -> None:
    """A llama.cpp-quantized file: mixed block types, llama.cpp's own keys (quantization version)."""
    _assert_reads_like_gguf_py(random_llama(ftype))

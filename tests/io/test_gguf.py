"""ggtorch's GGUF writer on metadata: the bytes gguf-py's writer writes (tests/io/test_gguf_hostile.py reads)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from ggtorch.io import gguf as ggtorch_gguf
from ggtorch.io.gguf import read_gguf, write_gguf

V = GGUFValueType
EVERY_ARRAY = {
    "t.u8": ([0, 7, 255], V.UINT8), "t.i8": ([-128, 0, 127], V.INT8), "t.u16": ([0, 65535], V.UINT16),
    "t.i16": ([-32768, 5], V.INT16), "t.u32": ([0, 2**32 - 1], V.UINT32), "t.i32": ([-(2**31), 3], V.INT32),
    "t.u64": ([0, 2**64 - 1], V.UINT64), "t.i64": ([-(2**63), 9], V.INT64),
    "t.f32": ([0.1, -2.5e-8, 3.4e38, float("inf")], V.FLOAT32), "t.f64": ([0.1, -1e-300], V.FLOAT64),
    "t.bool": ([True, False, True], V.BOOL), "t.str": (["", "a", "ünï ✓", "Ġthe", "\n" * 3], V.STRING),
    "t.one": (["only"], V.STRING),
}
"""An array of every element type GGUF has, with its extreme values (and an empty string)."""


def written_by(writer: type[GGUFWriter], path: Path, metadata: dict, value_types: dict,
               monkeypatch: pytest.MonkeyPatch) -> bytes:
    with monkeypatch.context() as m:
        m.setattr(ggtorch_gguf, "_Writer", writer)
        write_gguf(path, "llama", metadata, [], value_types)
    return path.read_bytes()


@pytest.mark.parametrize("source", ["every array type", "stories260K"])
def test_metadata_is_written_as_gguf_py_writes_it(source: str, stories260k: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if source == "every array type":
        metadata = {key: value for key, (value, _) in EVERY_ARRAY.items()}
        value_types = {key: (V.ARRAY, sub) for key, (_, sub) in EVERY_ARRAY.items()}
    else:
        f = read_gguf(stories260k)
        metadata, value_types = f.metadata, f.value_types
    ours = written_by(ggtorch_gguf._Writer, tmp_path / "ours.gguf", metadata, value_types, monkeypatch)
    theirs = written_by(GGUFWriter, tmp_path / "theirs.gguf", metadata, value_types, monkeypatch)
    assert ours == theirs
    reader = GGUFReader(tmp_path / "ours.gguf")  # and gguf-py reads back what was given
    for key, value in metadata.items():
        if key != "general.architecture":
            assert_same_value(reader.fields[key].contents(), value, key)


def assert_same_value(read: object, given: object, key: str) -> None:
    """Strings, integers and booleans exactly; floats to f32's precision (gguf-py returns f32 values as Python floats of
    the stored f32, the metadata may hold the float64 they were given as)."""
    if isinstance(given, list):
        assert isinstance(read, list) and len(read) == len(given), key
        for r, g in zip(read, given, strict=True):
            assert_same_value(r, g, key)
    elif isinstance(given, float):
        assert read == pytest.approx(given, rel=1e-7), key
    else:
        assert type(read) is type(given) and read == given, key

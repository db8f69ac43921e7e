"""GGUF files in and out: the bottom layer of ggtorch.

Reading goes through ``gguf.GGUFReader`` over a copy-on-write memory map, so opening a
multi-GB model costs no copy: a tensor's raw bytes are a view into the file until a
consumer (dequantization, ``.to(device)``) reads them. Everything read from a file is
untrusted; malformed files raise :class:`BadGGUF` with the file's name, never a numpy or
struct error from deep inside.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from .errors import BadGGUF

GGUF_MAGIC_BYTES = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file, still in its ggml encoding."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    """Shape in torch order (ggml's ``ne`` reversed): a linear weight is ``(n_out, n_in)``."""
    data: np.ndarray
    """The raw bytes (uint8, 1-D), a view into the memory-mapped file."""

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def raw(self) -> torch.Tensor:
        """The raw bytes as a CPU uint8 tensor sharing memory with the file mapping."""
        return torch.from_numpy(self.data)


@dataclass
class GGUFFile:
    """Metadata and tensors of one GGUF file."""

    path: Path
    metadata: dict[str, Any]
    """Key → typed Python value (str, int, float, bool, or a list of those)."""
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    """Key → (value type, element type for arrays): what a faithful copy needs."""
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def require(self, key: str) -> Any:
        """The value of a required key, or a BadGGUF that names the key and the file."""
        if key not in self.metadata:
            raise BadGGUF(f"{self.path}: required metadata key '{key}' is missing; "
                          "the file is incomplete or was written by an incompatible converter")
        return self.metadata[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def _field_value(field: Any) -> Any:
    """Turn a GGUFReader field into a plain Python value (str, int, float, bool or list)."""
    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        etype = field.types[-1] if len(field.types) > 1 else None
        if etype == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if etype == GGUFValueType.ARRAY:
            return [None for _ in field.data]  # nested arrays: no llama key uses them
        values = [field.parts[i] for i in field.data]
        if not values:
            return []
        return np.concatenate(values).tolist()
    if vtype == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]][0]
    if vtype == GGUFValueType.BOOL:
        return bool(value)
    if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return float(value)
    return int(value)


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open a GGUF file memory-mapped; raise BadGGUF for anything malformed."""
    path = Path(path)
    if not path.is_file():
        raise BadGGUF(f"{path}: no such file; check the path")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC_BYTES:
        raise BadGGUF(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
                      "convert it with llama.cpp's convert_hf_to_gguf.py first")
    try:
        # 'c' (copy-on-write) gives writable arrays, so torch.from_numpy shares the pages
        # without a warning, and nothing ever writes back to the file.
        reader = GGUFReader(path, "c")
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, MemoryError, UnicodeDecodeError) as e:
        raise BadGGUF(f"{path}: corrupt or truncated GGUF file ({e}); re-download or re-convert it") from None

    metadata: dict[str, Any] = {}
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = _field_value(field)
        except (IndexError, ValueError) as e:
            raise BadGGUF(f"{path}: metadata key '{key}' is corrupt ({e})") from None
        etype = field.types[-1] if field.types[0] == GGUFValueType.ARRAY and len(field.types) > 1 else None
        value_types[key] = (field.types[0], etype)

    file_size = reader.data.shape[0]
    tensors: dict[str, TensorInfo] = {}
    for t in reader.tensors:
        try:
            ggml_type = GGMLQuantizationType(int(t.tensor_type))
        except ValueError:
            raise BadGGUF(f"{path}: tensor '{t.name}' has unknown ggml type {int(t.tensor_type)}") from None
        if t.name in tensors:
            raise BadGGUF(f"{path}: tensor name '{t.name}' occurs twice")
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        start, nbytes = int(t.data_offset), int(t.n_bytes)
        if start + nbytes > file_size:
            raise BadGGUF(f"{path}: tensor '{t.name}' extends past the end of the file; "
                          "the file is truncated, re-download it")
        data = reader.data[start:start + nbytes]
        tensors[t.name] = TensorInfo(t.name, ggml_type, shape, data)
    return GGUFFile(path, metadata, value_types, tensors)


def raw_nbytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this type and torch-order shape occupies in a GGUF file."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n = int(np.prod(shape, dtype=np.int64))
    return n // block_size * type_size


@dataclass(frozen=True)
class TensorOut:
    """A tensor to write: its raw ggml bytes, type and torch-order shape."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # raw bytes (uint8) or an f32/f16 array of the shape


def _add_value(writer: GGUFWriter, key: str, value: Any,
               vtype: tuple[GGUFValueType, GGUFValueType | None] | None) -> None:
    if vtype is None:
        writer.add_key_value(key, value, _guess_type(value),
                             sub_type=_guess_type(value[0]) if isinstance(value, list) and value else None)
        return
    main, sub = vtype
    if main == GGUFValueType.ARRAY:
        writer.add_key_value(key, list(value), main, sub_type=sub)
    else:
        writer.add_key_value(key, value, main)


def _guess_type(value: Any) -> GGUFValueType:
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32 if 0 <= value < 2**32 else GGUFValueType.INT64
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, (list, tuple)):
        return GGUFValueType.ARRAY
    raise TypeError(f"cannot store {type(value).__name__} in GGUF metadata")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it over ``path``.

    A crash or Ctrl-C mid-write leaves the previous file untouched: readers see either the
    old file or the complete new one, never a truncated one.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


def write_gguf(path: str | os.PathLike[str], arch: str, metadata: dict[str, Any],
               tensors: Iterable[TensorOut],
               value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] | None = None) -> None:
    """Write a GGUF file atomically.

    ``metadata`` values keep the GGUF types given in ``value_types`` (as read from another
    file) and otherwise get a natural type (int → u32, float → f32). ``tensors`` may be a
    generator: tensor data is streamed one tensor at a time, so only the tensor infos (not
    the data) need to exist up front.
    """
    tensors = list(tensors)
    value_types = value_types or {}
    with atomic_path(path) as tmp:
        writer = GGUFWriter(tmp, arch)
        for key, value in metadata.items():
            if key in ("general.architecture", ) or key.startswith("GGUF."):
                continue
            _add_value(writer, key, value, value_types.get(key))
        for t in tensors:
            expected = raw_nbytes(t.ggml_type, t.shape)
            if t.data.nbytes != expected:
                raise ValueError(f"tensor {t.name}: {t.data.nbytes} bytes, expected {expected} "
                                 f"for {t.ggml_type.name} {t.shape}")
            writer.add_tensor_info(t.name, _byte_shape(t), np.dtype(np.uint8), expected, raw_dtype=t.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            writer.write_tensor_data(np.ascontiguousarray(t.data).view(np.uint8).reshape(_byte_shape(t)))
        writer.close()


def _byte_shape(t: TensorOut) -> tuple[int, ...]:
    """Torch-order shape with the last axis in bytes, as GGUFWriter takes raw tensors."""
    block_size, type_size = GGML_QUANT_SIZES[t.ggml_type]
    return (*t.shape[:-1], t.shape[-1] // block_size * type_size)

"""GGUF files in and out: the bottom layer of ggtorch.

Reading walks the header once with bounds checks (``_HeaderReader``: gguf-py's GGUFReader
trusts what a file claims and is slow over a large vocabulary; the walk's results are
tested equal to its) and maps the data copy-on-write, so opening a multi-GB model costs no
copy: a tensor's raw bytes are a view into the file until a consumer (dequantization,
``.to(device)``) reads them. gguf-py supplies the format's constants and block sizes, and
writes. Everything read from a file is untrusted; malformed files raise :class:`BadGGUF`
with the file's name, never a numpy or struct error from deep inside.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFEndian, GGUFValueType, GGUFWriter
from gguf.gguf_writer import WriterState

from ggtorch.errors import BadGGUF, NonFiniteValues
from ggtorch.io.atomic import atomic_path

GGUF_MAGIC_BYTES = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_STRING = 1 << 30  # no legitimate key, name or token string comes near 1 GiB
_U64 = struct.Struct("<Q")
_INT64_MAX = (1 << 63) - 1
_STRUCT = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {vtype: np.dtype(fmt) for vtype, fmt in _STRUCT.items()}


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
        return int(math.prod(self.shape))

    def raw(self) -> torch.Tensor:
        """The raw bytes as a CPU uint8 tensor sharing memory with the file mapping."""
        return torch.from_numpy(self.data)


def release_pages(info: TensorInfo) -> None:
    """Drop the tensor's pages of the file mapping from this process's memory (Linux, else nothing).

    After the loader has copied a tensor (dequantized it, converted it, moved it to a GPU),
    the pages it read stay mapped, and counted in RSS next to the copy, for as long as the
    file is open. The mapping is copy-on-write and the loader never writes to it, so
    MADV_DONTNEED only forgets clean pages: a later read faults the file's bytes back in.
    Only whole pages inside the tensor are released (a neighbour's bytes are never touched).
    """
    mm = _mmap_of(info.data)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED") or info.nbytes == 0:
        return
    start = info.data.ctypes.data - np.frombuffer(mm, dtype=np.uint8).ctypes.data  # offset in the mapping
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + info.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        mm.madvise(mmap.MADV_DONTNEED, first, last - first)


def _mmap_of(array: np.ndarray) -> mmap.mmap | None:
    """The mmap object under a numpy view of a np.memmap, if any."""
    obj: Any = array
    while obj is not None:
        mm = getattr(obj, "_mmap", None)
        if isinstance(mm, mmap.mmap):
            return mm
        obj = getattr(obj, "base", None)
    return None


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

    @property
    def kind(self) -> str:
        """What the file holds: ``model``, ``LoRA adapter``, ``training checkpoint`` or ``vocabulary`` (a tokenizer
        without weights), as a message names it."""
        if self.get("general.type") == "adapter":
            return "LoRA adapter"
        if self.get("training.type"):
            return "training checkpoint"
        if not self.tensors and "tokenizer.ggml.model" in self.metadata:
            return "vocabulary"
        return "model"


KIND_ADVICE = {
    "model": "pass it where a model goes (-m, --model-base)",
    "LoRA adapter": "pass it where adapters go (export-lora --lora, llama.cpp's --lora), with the model it was "
                    "trained on as the model",
    "training checkpoint": "resume its run with --checkpoint-in, write its adapter with --only-write-lora, or merge "
                           "it with export-lora --lora",
    "vocabulary": "it holds a tokenizer and no weights; `ggtorch train --vocab-model` builds a model over it",
}
"""What to do with a GGUF of each kind (GGUFFile.kind) that was given where another kind goes."""


def require_kind(f: GGUFFile, *expected: str, flag: str = "") -> GGUFFile:
    """``f`` when it is of one of the ``expected`` kinds; else BadGGUF naming what it is and where it goes."""
    if f.kind in expected:
        return f
    given = f"{flag} {f.path}" if flag else str(f.path)
    raise BadGGUF(f"{given} is a {f.kind}, not a {' or '.join(expected)}: {KIND_ADVICE[f.kind]}")


@dataclass
class _Header:
    """What a GGUF header holds: typed metadata and where each tensor's bytes are."""

    metadata: dict[str, Any]
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    tensors: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int, int]]
    """(name, ggml type, torch-order shape, offset from the file's start, bytes), in file order."""


class _HeaderReader:
    """A bounded walk over a GGUF header that reads it and proves it self-consistent.

    gguf-py's GGUFReader trusts counts and lengths (a lying header makes it allocate huge
    arrays, loop for hours or fail deep inside numpy) and builds a numpy view per array
    element, which makes opening a model with a large vocabulary slow. This walk
    checks every count against the bytes left before using it, never allocates in proportion
    to a count the file merely claims, decodes arrays in one pass (numbers with one numpy
    view), and raises BadGGUF naming what is wrong. Its results equal GGUFReader's (tested).
    """

    def __init__(self, path: Path, buf: mmap.mmap | bytes) -> None:
        self.path, self.buf, self.size, self.offs = path, buf, len(buf), 0

    def fail(self, what: str) -> BadGGUF:
        return BadGGUF(f"{self.path}: corrupt GGUF file: {what}; re-download or re-convert it")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.offs + n > self.size:
            raise self.fail(f"{what} at byte {self.offs} runs past the end of the file "
                            f"({self.size} bytes); the file is truncated or its header lies")

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        n = struct.calcsize(fmt)
        self.need(n, what)
        values = struct.unpack_from(fmt, self.buf, self.offs)
        self.offs += n
        return values

    def u32(self, what: str) -> int:
        return int(self.unpack("<I", what)[0])

    def u64(self, what: str) -> int:
        return int(self.unpack("<Q", what)[0])

    def skip_string(self, what: str) -> None:
        n = self.u64(f"length of {what}")
        if n > MAX_STRING:
            raise self.fail(f"{what} claims a length of {n} bytes")
        self.need(n, what)
        self.offs += n

    def string(self, what: str) -> str:
        start = self.offs + 8
        self.skip_string(what)
        try:
            return bytes(self.buf[start:self.offs]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.u32(what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"{what} is {raw}, not a GGUF value type") from None

    def value_string(self, what: str) -> str:
        """A string value (invalid UTF-8 replaced, as in token texts of some converters)."""
        start = self.offs + 8
        self.skip_string(what)
        return self.buf[start:self.offs].decode("utf-8", errors="replace")

    def string_array(self, count: int, key: str) -> list[str]:
        """``count`` string values of array ``key`` in one tight loop (a vocabulary has hundreds of thousands),
        with :meth:`value_string`'s checks and messages."""
        buf, offs, size, out = self.buf, self.offs, self.size, []
        for i in range(count):
            start = offs + 8
            if start > size:
                self.offs = offs
                self.need(8, f"length of string {i} of array '{key}'")
            (n,) = _U64.unpack_from(buf, offs)
            if n > MAX_STRING:
                raise self.fail(f"string {i} of array '{key}' claims a length of {n} bytes")
            offs = start + n
            if offs > size:
                self.offs = start
                self.need(n, f"string {i} of array '{key}'")
            out.append(buf[start:offs].decode("utf-8", errors="replace"))
        self.offs = offs
        return out

    def value(self, key: str) -> tuple[GGUFValueType, GGUFValueType | None, Any]:
        """One value: its type, its element type (arrays) and the value as plain Python."""
        vtype = self.value_type(f"type of key '{key}'")
        if vtype == GGUFValueType.STRING:
            return vtype, None, self.value_string(f"string value of key '{key}'")
        if vtype != GGUFValueType.ARRAY:
            (value,) = self.unpack(_STRUCT[vtype], f"value of key '{key}'")
            return vtype, None, value
        etype = self.value_type(f"element type of array '{key}'")
        count = self.u64(f"length of array '{key}'")
        if etype == GGUFValueType.ARRAY:
            raise self.fail(f"key '{key}' is an array of arrays, which no model key uses")
        if etype == GGUFValueType.STRING:
            self.need(8 * count, f"{count} strings of array '{key}'")  # each string has an 8-byte length
            return vtype, etype, self.string_array(count, key)
        nbytes = _NUMPY[etype].itemsize * count
        self.need(nbytes, f"{count} values of array '{key}'")
        values = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.offs).tolist()
        self.offs += nbytes
        return vtype, etype, values

    def run(self) -> _Header:
        self.need(4, "magic")
        magic = bytes(self.buf[0:4])
        if magic != GGUF_MAGIC_BYTES:
            raise BadGGUF(f"{self.path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
                          "convert it with llama.cpp's convert_hf_to_gguf.py first")
        self.offs = 4
        version = self.u32("version")
        if version & 0xFFFF == 0 and version != 0:
            raise BadGGUF(f"{self.path}: big-endian GGUF files are not supported; "
                          "re-convert the model on a little-endian machine")
        if version not in SUPPORTED_VERSIONS:
            raise BadGGUF(f"{self.path}: GGUF version {version} is not supported "
                          f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))}); re-convert the model")
        n_tensors = self.u64("tensor count")
        n_kv = self.u64("key/value count")
        rest = self.size - self.offs
        if n_kv * 13 > rest:  # smallest key/value: 8-byte key length, type, 1-byte value
            raise self.fail(f"header claims {n_kv} key/values but only {rest} bytes follow; "
                            "the file is truncated or its header lies")
        if n_tensors * 24 > rest:  # smallest tensor info: name length, n_dims, type, offset
            raise self.fail(f"header claims {n_tensors} tensors but only {rest} bytes follow; "
                            "the file is truncated or its header lies")

        metadata: dict[str, Any] = {}
        value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        alignment = GGUF_DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = self.string(f"name of key/value {i}")
            if key in metadata:
                raise self.fail(f"metadata key '{key}' occurs twice")
            vtype, etype, value = self.value(key)
            metadata[key], value_types[key] = value, (vtype, etype)
            if key == "general.alignment":
                if vtype != GGUFValueType.UINT32 or value == 0 or value & (value - 1):
                    raise self.fail(f"general.alignment must be a power of two stored as uint32, got {value!r}")
                alignment = int(value)

        infos: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int, int]] = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = self.string(f"name of tensor {i}")
            if name in names:
                raise self.fail(f"tensor name '{name}' occurs twice")
            names.add(name)
            n_dims = self.u32(f"dimension count of tensor '{name}'")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self.fail(f"tensor '{name}' has {n_dims} dimensions (ggml allows 1 to {MAX_DIMS})")
            dims = self.unpack(f"<{n_dims}Q", f"shape of tensor '{name}'")
            raw_type = self.u32(f"type of tensor '{name}'")
            try:
                ggml_type = GGMLQuantizationType(raw_type)
                block_size = GGML_QUANT_SIZES[ggml_type][0]
            except (ValueError, KeyError):
                raise self.fail(f"tensor '{name}' has unknown ggml type {raw_type}") from None
            offset = self.u64(f"data offset of tensor '{name}'")
            n = 1
            for d in dims:
                n *= d
                if n > _INT64_MAX or d > _INT64_MAX:
                    raise self.fail(f"tensor '{name}' has shape {list(dims)} whose size overflows int64")
            shape = tuple(reversed(dims))
            if not whole_blocks(ggml_type, shape):
                raise self.fail(f"tensor '{name}' has a row of {dims[0]} elements, not a multiple of "
                                f"the {ggml_type.name} block size {block_size}")
            if offset % alignment:
                raise self.fail(f"tensor '{name}' starts at offset {offset}, not a multiple of the "
                                f"alignment {alignment}")
            infos.append((name, ggml_type, shape, offset, raw_nbytes(ggml_type, shape)))

        data_start = -(-self.offs // alignment) * alignment
        data_size = self.size - data_start
        if infos and data_size < 0:
            raise self.fail("the data section is missing")
        prev_end, prev_name = 0, ""
        for name, _, _, offset, nbytes in sorted(infos, key=lambda t: t[3]):
            if offset + nbytes > data_size:
                raise self.fail(f"tensor '{name}' (bytes {offset}..{offset + nbytes} of the data section) "
                                f"lies outside the data section of {max(data_size, 0)} bytes; "
                                "the file is truncated")
            if offset < prev_end:
                raise self.fail(f"tensors '{prev_name}' and '{name}' overlap in the data section")
            prev_end, prev_name = offset + nbytes, name
        return _Header(metadata, value_types,
                       [(name, t, shape, data_start + offset, nbytes) for name, t, shape, offset, nbytes in infos])


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open a GGUF file memory-mapped; raise BadGGUF for anything malformed."""
    path = Path(path)
    if path.is_dir():
        raise BadGGUF(f"{path} is a folder, not a GGUF file; give the .gguf file inside it")
    if not path.is_file():
        raise BadGGUF(f"{path}: no such file; check the path")
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        raise BadGGUF(f"{path}: cannot be read ({e.strerror or e})") from None
    with f:
        if os.fstat(f.fileno()).st_size == 0:
            raise BadGGUF(f"{path}: the file is empty; re-download it")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = _HeaderReader(path, buf).run()
    # 'c' (copy-on-write) gives writable arrays, so torch.from_numpy shares the pages
    # without a warning, and nothing ever writes back to the file.
    data = np.memmap(path, mode="c")
    tensors = {name: TensorInfo(name, ggml_type, shape, data[start:start + nbytes])
               for name, ggml_type, shape, start, nbytes in header.tensors}
    return GGUFFile(path, header.metadata, header.value_types, tensors)


def whole_blocks(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
    """Whether rows of this torch-order shape split into whole blocks of ``ggml_type`` (ggml
    stores no partial block, so other shapes have no bytes in that type)."""
    return not shape or shape[-1] % GGML_QUANT_SIZES[ggml_type][0] == 0


def raw_nbytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this type and torch-order shape occupies (rows of whole blocks)."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    # math.prod, not numpy's: this runs for every decoded chunk, where numpy's fixed cost per call adds up
    return int(math.prod(shape)) // block_size * type_size


def check_raw(raw: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, ...],
              name: str | None = None) -> None:
    """Raise unless ``raw`` is uint8 holding exactly the bytes of a ``ggml_type`` tensor of ``shape``
    (whole blocks per row): what every reader of raw blocks checks before it decodes or views them."""
    qtype = GGMLQuantizationType(ggml_type)
    label = f"tensor '{name}'" if name else "a tensor"
    if raw.dtype != torch.uint8:
        raise TypeError(f"{label}: raw ggml data must be a uint8 tensor, got {raw.dtype}")
    if not whole_blocks(qtype, shape):
        raise BadGGUF(f"{label}: rows of {shape[-1]} values are not a whole number of "
                      f"{qtype.name} blocks of {GGML_QUANT_SIZES[qtype][0]}; the tensor's shape or type is wrong")
    expected = raw_nbytes(qtype, shape)
    if raw.numel() != expected:
        raise BadGGUF(f"{label}: {raw.numel()} bytes of data, but {qtype.name} {shape} takes "
                      f"{expected}; the file is truncated or the shape/type is wrong")


@dataclass(frozen=True)
class TensorOut:
    """A tensor to write: its raw ggml bytes, type and torch-order shape."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # raw bytes (uint8) or an f32/f16 array of the shape


class _Writer(GGUFWriter):
    """gguf-py's writer with arrays packed in one pass: its element-by-element packing takes seconds over a
    vocabulary's tokens, scores, types and merges. The bytes are gguf-py's (tested)."""

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool,
                  sub_type: GGUFValueType | None = None) -> bytes:
        if (vtype != GGUFValueType.ARRAY or sub_type not in (*_NUMPY, GGUFValueType.STRING) or not val
                or self.endianess != GGUFEndian.LITTLE):
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<IQ", sub_type, len(val))
        if add_vtype:
            head = struct.pack("<I", vtype) + head
        if sub_type != GGUFValueType.STRING:
            return head + np.asarray(val, dtype=_NUMPY[sub_type]).tobytes()
        encoded = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in val]
        return head + b"".join(part for e in encoded for part in (_U64.pack(len(e)), e))

    def write_tensor_data(self, tensor: np.ndarray[Any, Any], tensor_endianess: GGUFEndian | None = None) -> None:
        """gguf-py's step with the bytes written through the file object: ``ndarray.tofile`` can lose a short write
        on a full disk without raising, and the file would look complete."""
        if self.state not in (WriterState.TI_DATA, WriterState.WEIGHTS) or len(self.fout) != 1:
            raise ValueError(f"expected one output file holding tensor info or weights, got {self.state}")
        fout = self.fout[0]
        info = self.tensors[0].pop(next(iter(self.tensors[0])))
        if info.nbytes != tensor.nbytes:
            raise ValueError(f"{tensor.nbytes} bytes for a tensor of {info.nbytes}")
        self.write_padding(fout, fout.tell())
        fout.write(memoryview(np.ascontiguousarray(tensor)).cast("B"))
        self.write_padding(fout, tensor.nbytes)
        self.state = WriterState.WEIGHTS


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


def write_gguf(path: str | os.PathLike[str], arch: str, metadata: dict[str, Any],
               tensors: Iterable[TensorOut],
               value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] | None = None) -> None:
    """Write a GGUF file atomically (see write_gguf_streaming for data produced one tensor at a time).

    ``metadata`` values keep the GGUF types given in ``value_types`` (as read from another
    file) and otherwise get a natural type (int → u32, float → f32).
    """
    tensors = list(tensors)
    write_gguf_streaming(path, arch, metadata, [(t.name, t.ggml_type, t.shape) for t in tensors],
                         (t.data for t in tensors), value_types)


_FLOAT_VIEWS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                GGMLQuantizationType.F64: np.float64}


def all_finite(arr: np.ndarray, ggml_type: GGMLQuantizationType) -> bool:
    """Whether a float tensor's values (raw bytes or typed) are all finite; True for the block types, whose scales
    their writers compute from finite floats."""
    raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    if ggml_type in _FLOAT_VIEWS:
        return bool(np.isfinite(raw.view(_FLOAT_VIEWS[ggml_type])).all())
    if ggml_type == GGMLQuantizationType.BF16:  # an exponent of all ones is inf or NaN
        return not bool(((raw.view(np.uint16) >> 7) & 0xFF == 0xFF).any())
    return True


def _byte_shape(t: TensorOut) -> tuple[int, ...]:
    """Torch-order shape with the last axis in bytes, as GGUFWriter takes raw tensors."""
    return (*t.shape[:-1], raw_nbytes(t.ggml_type, t.shape[-1:]))


def write_gguf_streaming(path: str | os.PathLike[str], arch: str, metadata: dict[str, Any],
                         infos: Sequence[tuple[str, GGMLQuantizationType, tuple[int, ...]]],
                         data: Iterable[np.ndarray],
                         value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] | None = None) -> None:
    """Write a GGUF file atomically from tensor infos known up front and data produced lazily.

    ``infos`` are (name, ggml type, torch-order shape); ``data`` yields each tensor's raw bytes
    (or f32/f16 values) in the same order, so a caller can compute one tensor, have it written,
    and drop it: peak memory is one tensor, not the model.
    """
    sizes: list[int] = []  # what the writer meant to write, checked against what reached the disk
    with atomic_path(path, lambda _: sizes[0]) as tmp:
        writer = _Writer(tmp, arch)
        try:
            sizes.append(_fill(writer, Path(path), metadata, infos, data, value_types or {}))
        finally:
            with contextlib.suppress(OSError):  # after a failure, that failure is the story, not a failing flush
                writer.close()


def _fill(writer: _Writer, path: Path, metadata: dict[str, Any],
          infos: Sequence[tuple[str, GGMLQuantizationType, tuple[int, ...]]], data: Iterable[np.ndarray],
          value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]) -> int:
    """Write the header, the tensor infos and each tensor's data; the number of bytes written, flushed."""
    for key, value in metadata.items():
        if key in ("general.architecture", ) or key.startswith("GGUF."):
            continue
        _add_value(writer, key, value, value_types.get(key))
    outs = [TensorOut(name, ggml_type, tuple(shape), np.empty(0, np.uint8)) for name, ggml_type, shape in infos]
    for t in outs:
        writer.add_tensor_info(t.name, _byte_shape(t), np.dtype(np.uint8), raw_nbytes(t.ggml_type, t.shape),
                               raw_dtype=t.ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    produced = 0
    for t, arr in zip(outs, data, strict=False):
        expected = raw_nbytes(t.ggml_type, t.shape)
        if arr.nbytes != expected:
            raise ValueError(f"tensor {t.name}: {arr.nbytes} bytes, expected {expected} "
                             f"for {t.ggml_type.name} {t.shape}")
        if not all_finite(arr, t.ggml_type):
            raise NonFiniteValues(f"{path}: tensor '{t.name}' holds NaN or inf values, so the file was not "
                                  f"written (any previous {path.name} is kept as it was)")
        writer.write_tensor_data(np.ascontiguousarray(arr).view(np.uint8).reshape(_byte_shape(t)))
        produced += 1
    if produced != len(outs):
        raise ValueError(f"{produced} tensors' data produced for {len(outs)} tensor infos")
    assert writer.fout is not None
    writer.fout[0].flush()
    return writer.fout[0].tell()

"""Reading the fields of ggml blocks in torch: the pieces every per-type decoder shares.

A decoder gets its blocks as a ``(n_blocks, type_size)`` uint8 tensor and splits fields by
byte offset, as gguf-py does with numpy. Everything here stays on the blocks' device (no
host round trip) and uses only ops CUDA has for integers (shifts, masks, ``view`` of a
contiguous copy), so the same decoder runs on CPU and GPU. Bit fields are cut from integer
words of 2-8 bytes rather than byte by byte, and f32 values are written by a widening copy then
in-place arithmetic: torch's mixed-dtype and small-broadcast kernels are the slow part on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def split(blocks: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Split ``(n_blocks, type_size)`` into column groups of the given byte sizes (last: the rest)."""
    cuts = list(sizes) + [blocks.shape[-1] - sum(sizes)]
    return torch.split(blocks, cuts, dim=-1)


def f16(field: torch.Tensor) -> torch.Tensor:
    """Little-endian f16 fields ``(n, 2k)`` uint8 → ``(n, k)`` float32 (exact, like GGML_FP16_TO_FP32).

    The column slice is made contiguous first: viewing two bytes as float16 needs them
    adjacent and 2-byte aligned, which a slice at an odd offset of an 18-byte block is not.
    """
    return field.contiguous().view(torch.float16).to(torch.float32)


def u16(field: torch.Tensor) -> torch.Tensor:
    """Little-endian uint16 fields ``(n, 2k)`` uint8 → ``(n, k)`` int32."""
    pairs = field.reshape(*field.shape[:-1], -1, 2).to(torch.int32)
    return pairs[..., 0] | (pairs[..., 1] << 8)


def u32(field: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 fields ``(n, 4k)`` uint8 → ``(n, k)`` int64 (no sign trouble at bit 31)."""
    quads = field.reshape(*field.shape[:-1], -1, 4).to(torch.int64)
    return quads[..., 0] | (quads[..., 1] << 8) | (quads[..., 2] << 16) | (quads[..., 3] << 24)


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def words(qs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``qs``'s bytes, contiguous, viewed as the widest integer words its rows allow (``qs`` itself
    when none), and that word's width: one shift and mask then handles several bytes at once. (Traced by
    torch.compile, a contiguous copy is aligned by construction: a trace has no addresses to check.)"""
    qs = qs.contiguous()
    tracing = torch.compiler.is_compiling()
    for width, dtype in _WORDS:
        if qs.shape[-1] % width == 0:
            if not tracing and any(n % width for n in (qs.storage_offset(), qs.data_ptr(), *qs.stride()[:-1])):
                qs = qs.clone(memory_format=torch.contiguous_format)  # a view into a buffer: realign
            return qs.view(dtype), width
    return qs, 1


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``(..., k)`` bytes → ``(..., 2, k)``: all low nibbles, then all high nibbles.

    This is the order of the legacy and K-quant layouts: byte j holds element j in its low
    nibble and element j + k in its high nibble.
    """
    return crumbs(qs, 4)


def crumbs(qs: torch.Tensor, bits: int) -> torch.Tensor:
    """``(..., k)`` bytes → ``(..., 8 // bits, k)`` uint8: field i holds ``(qs >> bits*i) & mask``.

    On words the shift runs over several bytes and a mask repeated in every byte keeps each
    byte's own bits (those a shift moves in from the next byte, or from the sign, are masked
    off), so the result is the byte-wise one on any little-endian device.
    """
    mask = (1 << bits) - 1
    if torch.compiler.is_compiling():  # one fused kernel reads the bytes once whatever their grouping
        return torch.stack([(qs >> shift) & mask for shift in range(0, 8, bits)], dim=-2)
    packed, width = words(qs)
    wide = mask * int.from_bytes(b"\x01" * width, "little")
    # each shift written straight into its place, then one mask over all: two passes fewer per
    # field than shifting, masking and stacking copies
    fields = torch.empty(*packed.shape[:-1], 8 // bits, packed.shape[-1], dtype=packed.dtype, device=packed.device)
    for i, shift in enumerate(range(0, 8, bits)):
        torch.bitwise_right_shift(packed, shift, out=fields[..., i, :])
    return fields.bitwise_and_(wide).view(torch.uint8)


def bits_lsb_first(field: torch.Tensor) -> torch.Tensor:
    """``(n, k)`` bytes → ``(n, 8k)`` single bits, bit i of a little-endian integer at index i."""
    return torch.stack([(field >> i) & 1 for i in range(8)], dim=-1).reshape(*field.shape[:-1], -1)


_TABLES: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}


def table(name: str, values: Sequence[float] | Callable[[], torch.Tensor], device: torch.device,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A constant lookup table on ``device``, built once per (name, device, dtype).

    ``values`` is a sequence, or a function building a CPU tensor (called only on a miss,
    so big tables cost nothing until a type that needs them is first decoded).
    """
    key = (name, torch.device(device), dtype)
    cached = _TABLES.get(key)
    if cached is None:
        source = values() if callable(values) else torch.tensor(values)
        cached = source.to(device=device, dtype=dtype)
        _TABLES[key] = cached
    return cached


def lookup(values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``values[idx]`` for a small table: index_select on flat int32 indices, which is faster on
    CPU than advanced indexing with int64. Shape ``(*idx.shape, *values.shape[1:])``."""
    flat = torch.index_select(values, 0, idx.reshape(-1).to(torch.int32))
    return flat.view(*idx.shape, *values.shape[1:])

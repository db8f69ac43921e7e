"""Torch tensors → the raw bytes of a ggml type: the one encoder every GGUF writer uses.

Floats are quantized through gguf-py's numpy reference quantizers only where those are
bit-exact with llama.cpp's ``ggml_quantize_chunk`` (checked in tests/io/test_encode.py against
libggml itself): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, TQ1_0, TQ2_0, MXFP4. K-quants
and IQ types have no such quantizer here; :func:`fallback_type` names what a tensor meant to
be one of those is written as instead (Q8_0: finer than any of them and exact with llama.cpp;
F16 when the row length is not a multiple of Q8_0's block of 32). A tensor whose dtype a ggml
type holds as it is (f32 as F32, bf16 as BF16, int64 as I64, ...) is stored bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from ggtorch.errors import Unsupported
from ggtorch.io.gguf import whole_blocks

T = GGMLQuantizationType

QUANTIZABLE_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.TQ1_0, T.TQ2_0, T.MXFP4,
})
"""Types :func:`quantize` writes from floats, each bit-exact with llama.cpp's quantizer."""

STORAGE_TYPES: dict[torch.dtype, GGMLQuantizationType] = {
    torch.float32: T.F32, torch.float16: T.F16, torch.bfloat16: T.BF16, torch.float64: T.F64,
    torch.int64: T.I64, torch.int32: T.I32, torch.int16: T.I16, torch.int8: T.I8,
    torch.uint8: T.I8,  # bytes (RNG states): ggml has no unsigned type
}
"""torch dtype → the ggml type that holds its values unchanged (what checkpoints store)."""


def fallback_type(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> GGMLQuantizationType:
    """The type a tensor meant to be ``ggml_type`` is written as: itself when ggtorch can
    quantize it exactly, else Q8_0, else (rows not a multiple of the block) F16."""
    for candidate in (ggml_type, T.Q8_0):
        if candidate in QUANTIZABLE_TYPES and whole_blocks(candidate, shape):
            return candidate
    return T.F16


def encode(t: torch.Tensor, ggml_type: GGMLQuantizationType | None = None, *, name: str | None = None,
           fallback: bool = False) -> tuple[GGMLQuantizationType, np.ndarray]:
    """``(type written, raw bytes)`` of ``t``: uint8, one row of bytes per row of ``t`` (a 0-d
    tensor is one row of one value).

    ``ggml_type=None`` stores ``t``'s dtype exactly (:data:`STORAGE_TYPES`). Otherwise ``t`` is
    written as ``ggml_type``, or with ``fallback`` as :func:`fallback_type` of it; a type or
    row length that cannot be written raises :class:`Unsupported`. Writing runs once per tensor,
    so quantization goes through the CPU (gguf-py's numpy code).
    """
    what = f" for tensor '{name}'" if name else ""
    shape = tuple(t.shape) if t.dim() > 0 else (1,)
    if ggml_type is None:
        if t.dtype not in STORAGE_TYPES:
            raise TypeError(f"cannot store a {t.dtype} tensor{what} in GGUF exactly")
        ggml_type = STORAGE_TYPES[t.dtype]
    elif fallback:
        ggml_type = fallback_type(ggml_type, shape)
    t = t.detach().to("cpu").contiguous().reshape(shape)
    if STORAGE_TYPES.get(t.dtype) == ggml_type:  # the values as they are: no rounding, NaNs kept
        return ggml_type, t.view(torch.uint8).numpy()
    if ggml_type not in QUANTIZABLE_TYPES:
        raise Unsupported(f"ggtorch cannot quantize to {ggml_type.name}{what}; "
                          f"use one of {', '.join(sorted(x.name for x in QUANTIZABLE_TYPES))}")
    if not whole_blocks(ggml_type, shape):
        raise Unsupported(f"rows of {shape[-1]} values{what} do not split into {ggml_type.name} blocks of "
                          f"{GGML_QUANT_SIZES[ggml_type][0]}; use f16 or f32")
    out = quants.quantize(t.to(torch.float32).numpy(), ggml_type)
    return ggml_type, np.ascontiguousarray(out).view(np.uint8).reshape(*shape[:-1], -1)


def quantize(t: torch.Tensor, ggml_type: GGMLQuantizationType, name: str | None = None) -> np.ndarray:
    """Raw ggml bytes (uint8, one row of bytes per row) of the float tensor ``t`` as ``ggml_type``,
    which must be one of :data:`QUANTIZABLE_TYPES` (or the type that holds ``t``'s dtype)."""
    return encode(t, ggml_type, name=name)[1]

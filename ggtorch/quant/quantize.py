"""Float → ggml bytes, for writing merged weights back in a base model's types.

ggtorch quantizes through gguf-py's numpy reference quantizers only where they are bit-exact
with llama.cpp's ``ggml_quantize_chunk`` (checked in tests/export/test_merge.py against
libggml itself): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, TQ1_0, TQ2_0, MXFP4. K-quants
and IQ types have no such quantizer here; :func:`fallback_type` names what a tensor of those
types is written as instead (Q8_0: finer than any of them and exact with llama.cpp; F16 when
the row length is not a multiple of Q8_0's block of 32).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from ggtorch.errors import Unsupported

T = GGMLQuantizationType

QUANTIZABLE_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.TQ1_0, T.TQ2_0, T.MXFP4,
})
"""Types :func:`quantize` writes, each bit-exact with llama.cpp's quantizer."""


def fits(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
    """Whether rows of this shape split into whole blocks of ``ggml_type``."""
    return shape[-1] % GGML_QUANT_SIZES[ggml_type][0] == 0


def fallback_type(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> GGMLQuantizationType:
    """The type a tensor meant to be ``ggml_type`` is written as: itself when ggtorch can
    quantize it exactly, else Q8_0, else (rows not a multiple of the block) F16."""
    for candidate in (ggml_type, T.Q8_0):
        if candidate in QUANTIZABLE_TYPES and fits(candidate, shape):
            return candidate
    return T.F16


def quantize(t: torch.Tensor, ggml_type: GGMLQuantizationType, name: str | None = None) -> np.ndarray:
    """Raw ggml bytes (uint8, one row of bytes per row) of the float tensor ``t``.

    Export runs once per tensor, so this goes through the CPU (gguf-py's numpy code).
    """
    what = f" for tensor '{name}'" if name else ""
    if ggml_type not in QUANTIZABLE_TYPES:
        raise Unsupported(f"ggtorch cannot quantize to {ggml_type.name}{what}; "
                          f"use one of {', '.join(sorted(x.name for x in QUANTIZABLE_TYPES))}")
    shape = tuple(t.shape) if t.dim() > 0 else (1,)
    if not fits(ggml_type, shape):
        raise Unsupported(f"rows of {shape[-1]} values{what} do not split into {ggml_type.name} blocks of "
                          f"{GGML_QUANT_SIZES[ggml_type][0]}; use f16 or f32")
    arr = t.detach().to("cpu", torch.float32).contiguous().numpy().reshape(shape)
    if ggml_type == T.F32:
        out = arr
    elif ggml_type == T.F16:
        out = arr.astype(np.float16)
    else:
        out = quants.quantize(arr, ggml_type)
    return np.ascontiguousarray(out).view(np.uint8).reshape(*shape[:-1], -1)

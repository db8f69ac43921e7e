"""llama.cpp's own dequantization (ggml's ``to_float`` type traits) as a test oracle.

llama-cpp-python ships libggml; ``ggml_get_type_traits(type)->to_float`` is the very
``dequantize_row_*`` function llama.cpp runs, so comparing with it checks ggtorch against the
C reference directly, not only against gguf-py's numpy port of it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


class _TypeTraits(ctypes.Structure):
    # struct ggml_type_traits in ggml/include/ggml.h
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@pytest.fixture(scope="session")
def ggml_to_float() -> Callable[[np.ndarray, GGMLQuantizationType], np.ndarray]:
    """``to_float(raw_uint8, ggml_type) -> flat float32`` computed by llama.cpp's libggml."""
    import llama_cpp._ggml  # test-only dependency: the reference implementation

    lib = llama_cpp._ggml.libggml
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]

    def to_float(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        traits = lib.ggml_get_type_traits(int(ggml_type)).contents
        assert traits.blck_size == block_size and traits.type_size == type_size, ggml_type.name
        n = raw.size // type_size * block_size
        if ggml_type == GGMLQuantizationType.F32:  # no to_float: the bytes are the values
            return raw.view(np.float32).copy()
        out = np.empty(n, dtype=np.float32)
        _TO_FLOAT(traits.to_float)(raw.ctypes.data, out.ctypes.data, n)
        return out

    return to_float


@pytest.fixture(scope="session")
def ggml_quantize() -> Callable[[np.ndarray, GGMLQuantizationType], np.ndarray]:
    """``quantize(f32 (rows, cols), ggml_type) -> raw uint8 (rows, row bytes)`` by llama.cpp's
    ``ggml_quantize_chunk`` (the quantizer llama-quantize runs), with a flat importance
    matrix for the types that require one (IQ2_XXS, IQ2_XS, IQ1_S)."""
    import llama_cpp._ggml  # test-only dependency: the reference implementation

    lib = llama_cpp._ggml.libggml
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]

    def quantize(data: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
        data = np.ascontiguousarray(data, dtype=np.float32)
        n_rows, n_cols = data.shape
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        out = np.zeros((n_rows, n_cols // block_size * type_size), dtype=np.uint8)
        imatrix = np.ones(n_cols, dtype=np.float32)
        im_ptr = imatrix.ctypes.data if lib.ggml_quantize_requires_imatrix(int(ggml_type)) else None
        written = lib.ggml_quantize_chunk(int(ggml_type), data.ctypes.data, out.ctypes.data, 0, n_rows, n_cols, im_ptr)
        assert written == out.nbytes, (ggml_type.name, written, out.nbytes)
        return out

    return quantize

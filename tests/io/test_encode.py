"""The one tensor → ggml bytes encoder, against llama.cpp's quantizer and the tensors' own bytes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from ggtorch.errors import Unsupported
from ggtorch.io.encode import QUANTIZABLE_TYPES, STORAGE_TYPES, encode, fallback_type, quantize

T = GGMLQuantizationType


def _values(rows: int = 48, cols: int = 256) -> np.ndarray:
    """Normal values over a wide range of scales, with an all-zero block and an outlier block."""
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    x[:16] *= 1e-3
    x[16:32] *= 300
    x[32, :64] = 0
    x[33, 7] = 1e4
    return x


@pytest.mark.parametrize("ggml_type", sorted(QUANTIZABLE_TYPES - {T.F32}), ids=lambda t: t.name)
def test_quantize_is_bit_exact_with_llama_cpp(ggml_type: GGMLQuantizationType,
                                              ggml_quantize: Callable[..., np.ndarray]) -> None:
    x = _values()
    assert np.array_equal(quantize(torch.from_numpy(x), ggml_type), ggml_quantize(x, ggml_type))


def test_f32_is_the_values_bytes() -> None:
    x = _values()
    assert encode(torch.from_numpy(x), T.F32)[1].tobytes() == x.tobytes()


@pytest.mark.parametrize("dtype", list(STORAGE_TYPES), ids=str)
def test_exact_storage_keeps_every_bit(dtype: torch.dtype) -> None:
    """What checkpoints store: the dtype's own bytes (NaN payloads too), in the type that holds them."""
    raw = torch.from_numpy(np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8))
    raw[:4] = torch.tensor([0x81, 0x7F, 0x01, 0x7C], dtype=torch.uint8)  # signalling NaNs of bf16, f16
    t = raw.view(dtype).reshape(2, -1) if dtype.itemsize > 1 else raw.view(dtype).reshape(4, 16)
    ggml_type, data = encode(t)
    assert ggml_type == STORAGE_TYPES[dtype]
    assert data.dtype == np.uint8 and data.tobytes() == raw.numpy().tobytes()
    assert encode(torch.tensor(3, dtype=dtype))[1].size == dtype.itemsize  # a 0-d tensor is one value


def test_exact_storage_refuses_other_dtypes() -> None:
    with pytest.raises(TypeError, match="complex64"):
        encode(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize(("wanted", "cols", "written"), [
    (T.Q4_0, 64, T.Q4_0),  # bit-exact with llama.cpp: itself
    (T.Q4_K, 256, T.Q8_0),  # no exact quantizer here: the finer Q8_0
    (T.IQ2_XS, 256, T.Q8_0),
    (T.Q8_0, 48, T.F16),  # rows not whole Q8_0 blocks: F16
    (T.Q4_K, 40, T.F16),
    (T.BF16, 9, T.BF16),
], ids=lambda v: getattr(v, "name", str(v)))
def test_fallback_writes_what_llama_cpp_would_quantize(wanted: GGMLQuantizationType, cols: int,
                                                       written: GGMLQuantizationType,
                                                       ggml_quantize: Callable[..., np.ndarray]) -> None:
    x = _values(48, cols)
    assert fallback_type(wanted, x.shape) == written
    ggml_type, data = encode(torch.from_numpy(x), wanted, name="w", fallback=True)
    assert ggml_type == written
    assert np.array_equal(data, ggml_quantize(x, written))


@pytest.mark.parametrize(("ggml_type", "cols", "message"), [
    (T.Q4_K, 256, "cannot quantize to Q4_K for tensor 'w'"),
    (T.Q8_0, 48, "rows of 48 values for tensor 'w' do not split into Q8_0 blocks of 32"),
], ids=["no-quantizer", "partial-block"])
def test_without_fallback_unwritable_types_are_refused(ggml_type: GGMLQuantizationType, cols: int,
                                                       message: str) -> None:
    with pytest.raises(Unsupported, match=message):
        encode(torch.zeros(2, cols), ggml_type, name="w")

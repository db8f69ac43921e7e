"""F32, F16 and BF16: ggml's unquantized types (block size 1).

Like the block types, each takes a ``(n_values, type_size)`` uint8 view and returns
``(n_values, 1)`` values, here in their own dtype: widening f16/bf16 to f32 is exact, so
``dequantize`` casts them straight to the requested dtype in one pass, which gives the same
bits as going through f32 first.
"""

from __future__ import annotations

import torch


def _aligned(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks`` itself when its rows can be viewed as one wider element, else an aligned copy."""
    if blocks.is_contiguous() and blocks.data_ptr() % blocks.shape[-1] == 0:
        return blocks
    return blocks.clone(memory_format=torch.contiguous_format)


def dequantize_f32(blocks: torch.Tensor) -> torch.Tensor:
    """F32: the bytes are the values (a view of ``blocks`` when they are aligned)."""
    return _aligned(blocks).view(torch.float32)


def dequantize_f16(blocks: torch.Tensor) -> torch.Tensor:
    """F16 as float16 (ggml_fp16_to_fp32_row is the exact widening ``.to(torch.float32)`` does)."""
    return _aligned(blocks).view(torch.float16)


def dequantize_bf16(blocks: torch.Tensor) -> torch.Tensor:
    """BF16 as bfloat16 (ggml_bf16_to_fp32_row: the 16 bits become the top half of an f32)."""
    return _aligned(blocks).view(torch.bfloat16)

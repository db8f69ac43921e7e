"""Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: ggml's first quant types, 32 values per block.

Each function takes a ``(n_blocks, type_size)`` uint8 view and returns ``(n_blocks, 32)``
float32. Products of a small integer and an f16 scale are exact in f32, so the only
rounding is the final ``+ m`` of the types with a minimum, done once as in C.
"""

from __future__ import annotations

import torch

from ggtorch.quant.fields import bits_lsb_first, f16, nibbles, split


def _scaled(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """``q * d (+ m)`` in f32 (q: integer, d and m: (n, 1)): q is widened once (exactly) and scaled
    in place, and ``+ m`` rounds once, as in C. (A mixed int8 × f32 ``torch.mul`` gives the same
    values but takes a slower, unvectorized path on CPU.)"""
    out = q.to(torch.float32).mul_(d)
    return out if m is None else out.add_(m)


def _nibbles_flat(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes → 32 nibbles: element j in byte j's low nibble, element j + 16 in its high nibble."""
    return nibbles(qs).reshape(qs.shape[0], -1)


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_q4_0: block = d (f16), qs[16]; y = (q - 8) * d. The nibbles widen to f32 as
    unsigned bytes, which torch converts faster on CPU than int8, and lose their 8 there (exact in f32)."""
    d, qs = split(blocks, [2])
    return _nibbles_flat(qs).to(torch.float32).sub_(8).mul_(f16(d))


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_q4_1: block = d, m (f16), qs[16]; y = q * d + m."""
    d, m, qs = split(blocks, [2, 2])
    return _scaled(_nibbles_flat(qs), f16(d), f16(m))


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit values: the low nibbles of qs plus bit j of the little-endian uint32 qh as bit 4."""
    return _nibbles_flat(qs) | (bits_lsb_first(qh) << 4)


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_q5_0: block = d (f16), qh[4], qs[16]; y = (q - 16) * d."""
    d, qh, qs = split(blocks, [2, 4])
    q = (_q5(qh, qs) - 16).view(torch.int8)
    return _scaled(q, f16(d))


def dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_q5_1: block = d, m (f16), qh[4], qs[16]; y = q * d + m."""
    d, m, qh, qs = split(blocks, [2, 2, 4])
    return _scaled(_q5(qh, qs), f16(d), f16(m))


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_q8_0: block = d (f16), qs[32] (int8); y = q * d."""
    d, qs = split(blocks, [2])
    return _scaled(qs.view(torch.int8), f16(d))

"""TQ1_0, TQ2_0 (ternary) and MXFP4 (4-bit floats with a shared power-of-two scale).

Each function takes a ``(n_blocks, type_size)`` uint8 view and returns
``(n_blocks, block_size)`` float32; every product is of a small integer and a scale, exact
in f32.
"""

from __future__ import annotations

import torch

from .fields import crumbs, f16, lookup, nibbles, split, table

QK_K = 256


def _trits(q: torch.Tensor, n_digits: int) -> torch.Tensor:
    """Base-3 digits of TQ1_0 bytes, as in dequantize_row_tq1_0: digit n of byte q is
    ((q * 3^n mod 256) * 3) >> 8, most significant first. ``(..., k)`` → ``(..., n_digits, k)``."""
    q = q.to(torch.int32)
    return torch.stack([(((q * 3**n) & 0xFF) * 3) >> 8 for n in range(n_digits)], dim=-2)


def dequantize_tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_tq1_0: qs[48] (5 trits per byte), qh[4] (4 trits per byte), d; y = (t - 1) * d."""
    n = blocks.shape[0]
    qs, qh, d = split(blocks, [48, 4])
    t = torch.cat((
        _trits(qs[:, :32], 5).reshape(n, 160),
        _trits(qs[:, 32:], 5).reshape(n, 80),
        _trits(qh, 4).reshape(n, 16),
    ), dim=-1)
    return (t - 1).to(torch.float32) * f16(d)


def dequantize_tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_tq2_0: qs[64] (4 × 2 bits per byte, by 32-byte halves), d; y = (q - 1) * d."""
    n = blocks.shape[0]
    qs, d = split(blocks, [QK_K // 4])
    q = crumbs(qs.reshape(n, 2, 32), 2).reshape(n, QK_K)
    return (q.to(torch.float32) - 1) * f16(d)


# kvalues_mxfp4 in ggml-common.h: e2m1 values, doubled (the scale below is halved to match).
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """Mirrors ggml_e8m0_to_fp32_half: 2^(e - 128) as f32 bits (subnormal for e < 2)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_mxfp4: e (e8m0), qs[16]; y = kvalues_mxfp4[nibble] * d."""
    n = blocks.shape[0]
    e, qs = split(blocks, [1])
    kv = lookup(table("kvalues_mxfp4", KVALUES_MXFP4, blocks.device), nibbles(qs).reshape(n, 32))
    return kv * _e8m0_to_fp32_half(e)

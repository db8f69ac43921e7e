"""IQ4_NL and IQ4_XS: 4-bit indices into a fixed non-linear table of 16 values.

Each function takes a ``(n_blocks, type_size)`` uint8 view and returns
``(n_blocks, block_size)`` float32. ``scale * kvalue`` is exact in f32 (at most 11 + 6 + 7
significant bits), so any op order gives llama.cpp's bits.
"""

from __future__ import annotations

import torch

from .fields import crumbs, f16, nibbles, split, table

QK_K = 256

# kvalues_iq4nl in ggml-common.h: the 16 levels both types index.
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _kvalues(idx: torch.Tensor) -> torch.Tensor:
    """Look 4-bit indices up in kvalues_iq4nl (as float32, on the indices' device)."""
    return table("kvalues_iq4nl", KVALUES_IQ4NL, idx.device)[idx.long()]


def dequantize_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_iq4_nl: d (f16), qs[16]; y = d * kvalues[nibble]."""
    n = blocks.shape[0]
    d, qs = split(blocks, [2])
    return f16(d) * _kvalues(nibbles(qs).reshape(n, 32))


def dequantize_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_iq4_xs: d, scales_h (u16), scales_l[4], qs[128].

    Sub-block ib (32 values) has the 6-bit scale ls = nibble ib % 2 of scales_l[ib / 2] plus
    bits 2ib..2ib+1 of scales_h as bits 4-5, and dl = d * (ls - 32).
    """
    n = blocks.shape[0]
    d, scales_h, scales_l, qs = split(blocks, [2, 2, QK_K // 64])
    low = torch.stack((scales_l & 0x0F, scales_l >> 4), dim=-1).reshape(n, 8)
    high = crumbs(scales_h, 2).transpose(-1, -2).reshape(n, 8)  # byte b, shift 2k → ib = 4b + k
    dl = f16(d) * ((low | (high << 4)).to(torch.float32) - 32)
    q = _kvalues(nibbles(qs.reshape(n, 8, 16)).reshape(n, 8, 32))
    return (dl.unsqueeze(-1) * q).reshape(n, QK_K)

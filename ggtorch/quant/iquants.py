"""The IQ types: indices into fixed non-linear tables (IQ4_NL, IQ4_XS) or lattice grids
(IQ1_*, IQ2_*, IQ3_*).

Each function takes a ``(n_blocks, type_size)`` uint8 view and returns
``(n_blocks, block_size)`` float32. ``scale * kvalue`` is exact in f32 (at most 11 + 6 + 7
significant bits), so any op order gives llama.cpp's bits.
"""

from __future__ import annotations

import gguf.quants as gguf_quants
import torch
from gguf import GGMLQuantizationType

from ggtorch.quant.fields import bits_lsb_first, crumbs, f16, lookup, nibbles, split, table, u16, u32

T = GGMLQuantizationType
_GGUF_QUANTS = {
    T.IQ2_XXS: gguf_quants.IQ2_XXS,
    T.IQ2_XS: gguf_quants.IQ2_XS,
    T.IQ2_S: gguf_quants.IQ2_S,
    T.IQ3_XXS: gguf_quants.IQ3_XXS,
    T.IQ3_S: gguf_quants.IQ3_S,
    T.IQ1_S: gguf_quants.IQ1_S,
}

QK_K = 256

# kvalues_iq4nl in ggml-common.h: the 16 levels both types index.
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _kvalues(idx: torch.Tensor) -> torch.Tensor:
    """Look 4-bit indices up in kvalues_iq4nl (as float32, on the indices' device)."""
    return lookup(table("kvalues_iq4nl", KVALUES_IQ4NL, idx.device), idx)


def dequantize_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_iq4_nl: d (f16), qs[16]; y = d * kvalues[nibble]."""
    n = blocks.shape[0]
    d, qs = split(blocks, [2])
    return _kvalues(nibbles(qs).reshape(n, 32)).mul_(f16(d))


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
    return q.mul_(dl.unsqueeze(-1)).reshape(n, QK_K)


# ---- grid types: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M ----------------------
#
# Groups of 8 (or 4) values are indices into a fixed grid (iq2xxs_grid, ... in ggml-common.h),
# with per-group sign bits. The grids are taken from gguf-py (decoded once from its packed
# form) rather than retyped; products are again exact in f32: d (11 bits) times a small odd
# or half-integer scale times a grid value of at most 6 bits.


def _grid(qtype: GGMLQuantizationType, device: torch.device) -> torch.Tensor:
    """The type's grid as a float32 (n_entries, width) table on ``device``."""
    def build() -> torch.Tensor:
        cls = _GGUF_QUANTS[qtype]
        cls.init_grid()
        return torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy())
    return table(f"grid_{qtype.name}", build, device)


def _sign_bits(idx: torch.Tensor) -> torch.Tensor:
    """Byte → 8 factors: -1 where bit j is set, else 1 (kmask_iq2xs tests)."""
    def build() -> torch.Tensor:
        b = torch.arange(256).unsqueeze(-1)
        return 1 - 2 * ((b >> torch.arange(8)) & 1).to(torch.float32)
    return lookup(table("sign_bits", build, idx.device), idx)


def _ksigns(idx: torch.Tensor) -> torch.Tensor:
    """7-bit index → 8 sign factors through ksigns_iq2xs (the 8th bit makes the parity even)."""
    def build() -> torch.Tensor:
        ksigns = torch.frombuffer(bytearray(gguf_quants.IQ2_XXS.ksigns), dtype=torch.uint8).long()
        return 1 - 2 * ((ksigns.unsqueeze(-1) >> torch.arange(8)) & 1).to(torch.float32)
    return lookup(table("ksigns_iq2xs", build, idx.device), idx)


def dequantize_iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_iq2_xxs: d, then 8 × (4 grid indices, u32 of 4 × 7 sign bits | 4-bit scale).

    db = d * (0.5 + scale) * 0.25; y = db * grid[idx] * sign.
    """
    n = blocks.shape[0]
    d, qs = split(blocks, [2])
    qs = qs.reshape(n, 8, 8)
    aux = u32(qs[..., 4:]).squeeze(-1)  # (n, 8)
    db = f16(d) * (0.5 + (aux >> 28).to(torch.float32)) * 0.25
    signs = _ksigns(torch.stack([(aux >> shift) & 127 for shift in (0, 7, 14, 21)], dim=-1))  # (n, 8, 4, 8)
    grid = lookup(_grid(T.IQ2_XXS, blocks.device), qs[..., :4])  # (n, 8, 4, 8)
    return grid.mul_(db[..., None, None]).mul_(signs).reshape(n, QK_K)


def _half_scales(d: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """IQ2_XS/IQ2_S: db = d * (0.5 + nibble) * 0.25 per 16 values → (n, 8, 2)."""
    s = torch.stack((scales & 0x0F, scales >> 4), dim=-1).to(torch.float32)
    return d.unsqueeze(-1) * (0.5 + s) * 0.25


def dequantize_iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_iq2_xs: d, qs[32] (u16: 9-bit grid index | 7-bit ksigns index), scales[8]."""
    n = blocks.shape[0]
    d, qs, scales = split(blocks, [2, QK_K // 4])
    q = u16(qs).reshape(n, 8, 2, 2)  # (ib32, half, l % 2)
    grid = lookup(_grid(T.IQ2_XS, blocks.device), (q & 511))
    signs = _ksigns(q >> 9)
    db = _half_scales(f16(d), scales)
    return grid.mul_(db[..., None, None]).mul_(signs).reshape(n, QK_K)


def dequantize_iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_iq2_s: d, qs[32], signs[32], qh[8], scales[8].

    Group l of sub-block ib: grid index qs[4ib + l] | bits 2l..2l+1 of qh[ib] as bits 8-9,
    sign bits signs[4ib + l].
    """
    n = blocks.shape[0]
    d, qs, sg, qh, scales = split(blocks, [2, QK_K // 8, QK_K // 8, QK_K // 32])
    high = crumbs(qh, 2).transpose(-1, -2).to(torch.int32)  # (n, ib, l)
    idx = qs.reshape(n, 8, 4).to(torch.int32) | (high << 8)
    grid = lookup(_grid(T.IQ2_S, blocks.device), idx).reshape(n, 8, 2, 2, 8)
    signs = _sign_bits(sg).reshape(n, 8, 2, 2, 8)
    db = _half_scales(f16(d), scales)
    return grid.mul_(db[..., None, None]).mul_(signs).reshape(n, QK_K)


def dequantize_iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_iq3_xxs: d, qs[64] (grid indices, 4 values each), then 8 × u32 of
    4 × 7 sign bits | 4-bit scale; db = d * (0.5 + scale) * 0.5."""
    n = blocks.shape[0]
    d, qs, ss = split(blocks, [2, QK_K // 4])
    aux = u32(ss)  # (n, 8)
    db = f16(d) * (0.5 + (aux >> 28).to(torch.float32)) * 0.5
    signs = _ksigns(torch.stack([(aux >> shift) & 127 for shift in (0, 7, 14, 21)], dim=-1))  # (n, 8, 4, 8)
    grid = lookup(_grid(T.IQ3_XXS, blocks.device), qs.reshape(n, 8, 8)).reshape(n, 8, 4, 8)
    return grid.mul_(db[..., None, None]).mul_(signs).reshape(n, QK_K)


def dequantize_iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_iq3_s: d, qs[64], qh[8], signs[32], scales[4].

    Sub-block k: grid index m = qs[8k + m] | bit m of qh[k] as bit 8, signs[4k + l], and
    db = d * (1 + 2 * nibble k % 2 of scales[k / 2]).
    """
    n = blocks.shape[0]
    d, qs, qh, sg, scales = split(blocks, [2, QK_K // 4, QK_K // 32, QK_K // 8])
    idx = qs.to(torch.int32) | (bits_lsb_first(qh).to(torch.int32) << 8)
    grid = lookup(_grid(T.IQ3_S, blocks.device), idx).reshape(n, 8, 4, 8)
    signs = _sign_bits(sg).reshape(n, 8, 4, 8)
    s = torch.stack((scales & 0x0F, scales >> 4), dim=-1).reshape(n, 8).to(torch.float32)
    db = f16(d) * (1 + 2 * s)
    return grid.mul_(db[..., None, None]).mul_(signs).reshape(n, QK_K)


IQ1S_DELTA = 0.125


def dequantize_iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_iq1_s: d, qs[32], qh[8] (u16: 4 × 3 index bits, 3-bit scale, delta sign).

    y = d * (2 * scale + 1) * (grid[idx] + delta).
    """
    n = blocks.shape[0]
    d, qs, qh = split(blocks, [2, QK_K // 8])
    h = u16(qh)  # (n, 8)
    dl = f16(d) * (2 * ((h >> 12) & 7) + 1).to(torch.float32)
    delta = torch.where((h & 0x8000) != 0, -IQ1S_DELTA, IQ1S_DELTA).to(torch.float32)
    high = torch.stack([(h >> shift) & 7 for shift in (0, 3, 6, 9)], dim=-1)  # (n, 8, 4)
    idx = qs.reshape(n, 8, 4).to(torch.int32) | (high << 8)
    grid = lookup(_grid(T.IQ1_S, blocks.device), idx)  # (n, 8, 4, 8)
    return (dl[..., None, None] * (grid + delta[..., None, None])).reshape(n, QK_K)


def dequantize_iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_iq1_m: qs[32], qh[16], scales[8] (4 × u16: 3-bit scales, f16 d in the top nibbles).

    Nibble g of qh (low nibble of qh[2ib + l/2] first) gives index bits 8-10 of group g and,
    in its bit 3, the sign of delta.
    """
    n = blocks.shape[0]
    qs, qh, scales = split(blocks, [QK_K // 8, QK_K // 16])
    sc = u16(scales)  # (n, 4)
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    d = bits.view(torch.float16).to(torch.float32).reshape(n, 1, 1)
    s = torch.stack([(sc >> shift) & 7 for shift in (0, 3, 6, 9)], dim=-1).reshape(n, 8, 2)
    dl = d * (2 * s + 1).to(torch.float32)  # (n, ib, half)
    nib = torch.stack((qh & 0x0F, qh >> 4), dim=-1).reshape(n, 8, 2, 2)
    idx = qs.reshape(n, 8, 2, 2).to(torch.int32) | ((nib & 7).to(torch.int32) << 8)
    delta = torch.where((nib & 8) != 0, -IQ1S_DELTA, IQ1S_DELTA).to(torch.float32)
    grid = lookup(_grid(T.IQ1_S, blocks.device), idx)  # (n, 8, 2, 2, 8)
    return (dl[..., None, None] * (grid + delta[..., None])).reshape(n, QK_K)

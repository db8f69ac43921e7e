"""Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: super-blocks of 256 values with 6/4-bit sub-block scales.

Each function takes a ``(n_blocks, type_size)`` uint8 view and returns ``(n_blocks, 256)``
float32, laid out as the C loops write ``y``. The per-value product ``scale * q`` is exact in
f32 (at most 11 + 6 + 6 significant bits), so the only rounding is the ``- min`` of Q2_K,
Q4_K and Q5_K, done once as in C (with or without FMA contraction the result is the same).
"""

from __future__ import annotations

import torch

from ggtorch.quant.fields import crumbs, f16, nibbles, split, words

QK_K = 256


def _mul_sub(dl: torch.Tensor, q: torch.Tensor, ml: torch.Tensor) -> torch.Tensor:
    """``dl * q - ml`` for integer ``q``, in place on its one f32 copy: ``dl * q`` is exact in f32,
    so the ``- ml`` is the one rounding, as in C with or without FMA contraction. (``addcmul``
    gives the same values but runs its broadcast about twice as slowly on CPU.)"""
    return q.to(torch.float32).mul_(dl).sub_(ml)


def dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_q2_K: scales[16] (4-bit scale | 4-bit min), qs[64], d, dmin.

    Values come in 16 groups of 16 in the order (half h, shift j, sub s): group
    h*8 + j*2 + s takes bits 2j of qs[h*32 + s*16 + l] and scales[h*8 + j*2 + s].
    """
    n = blocks.shape[0]
    scales, qs, d, dmin = split(blocks, [QK_K // 16, QK_K // 4, 2])
    q = crumbs(qs.reshape(n, 2, 32), 2).reshape(n, 16, 16)
    dl = (f16(d) * (scales & 0x0F).to(torch.float32)).unsqueeze(-1)
    ml = (f16(dmin) * (scales >> 4).to(torch.float32)).unsqueeze(-1)
    return _mul_sub(dl, q, ml).reshape(n, QK_K)


def _q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """The 16 6-bit scales of Q3_K, as the aux[] shuffle in dequantize_row_q3_K: low nibbles
    from bytes 0-7 (all low, then all high nibbles), high 2 bits from bytes 8-11 at shifts 0,2,4,6."""
    n = scales.shape[0]
    low, high = scales[:, :8], scales[:, 8:]
    lo4 = nibbles(low).reshape(n, 16)
    hi2 = crumbs(high, 2).reshape(n, 16)
    return (lo4 | (hi2 << 4)).to(torch.float32) - 32


def dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_q3_K: hmask[32], qs[64], scales[12], d.

    Group (h, j, s) takes 2 low bits from qs[h*32 + s*16 + l] >> 2j and subtracts 4 unless
    bit h*4 + j of hmask[s*16 + l] is set.
    """
    n = blocks.shape[0]
    hmask, qs, scales, d = split(blocks, [QK_K // 8, QK_K // 4, 12])
    low = crumbs(qs.reshape(n, 2, 32), 2)  # (n, h, j, 32)
    high = crumbs(hmask, 1).reshape(n, 2, 4, 32)
    q = (low - ((1 - high) << 2)).view(torch.int8).to(torch.float32)  # uint8 wraps: q - 4 as int8
    dl = (f16(d) * _q3_k_scales(scales)).unsqueeze(-1)
    return q.reshape(n, 16, 16).mul_(dl).reshape(n, QK_K)


def _k4_scales_mins(scales: torch.Tensor) -> torch.Tensor:
    """Mirrors get_scale_min_k4 for j = 0..7: 6-bit scales and mins packed in 12 bytes, as f32
    (2, n, 8): the blocks' 8 scales, then their 8 mins.

    Scale j < 4 is the low 6 bits of byte j (min j: of byte 4 + j); scale j >= 4 is the low nibble
    of byte 8 + j - 4 under the top 2 bits of byte j - 4 (min: the high nibble, under byte j's).
    Cut from the three 4-byte words a, b, c at once, each byte keeping its own bits."""
    abc = words(scales)[0]  # (n, 3) int32: 12 bytes are 3 words
    a, b, c = abc[:, 0], abc[:, 1], abc[:, 2]
    packed = torch.stack([  # (sc | mn, n, lo | hi): (n, 3) words, a few bytes per block
        torch.stack([a & 0x3F3F3F3F, (c & 0x0F0F0F0F) | ((a >> 2) & 0x30303030)], dim=-1),
        torch.stack([b & 0x3F3F3F3F, ((c >> 4) & 0x0F0F0F0F) | ((b >> 2) & 0x30303030)], dim=-1)])
    return packed.view(torch.uint8).to(torch.float32)


def _k4_apply(d_dmin: torch.Tensor, scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """y = (d * sc) * q - (dmin * m) over 8 groups of 32 values; ``d_dmin`` the two f16 fields' 4 bytes."""
    d1, m1 = _k4_scales_mins(scales).mul_(f16(d_dmin).T.unsqueeze(-1)).unsqueeze(-1)  # (n, 8, 1) each
    return _mul_sub(d1, q, m1).reshape(q.shape[0], QK_K)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_q4_K: d, dmin, scales[12], qs[128]; group 2c+s is nibble s of qs[c*32 + l]."""
    n = blocks.shape[0]
    d_dmin, scales, qs = split(blocks, [4, 12])
    q = nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32)
    return _k4_apply(d_dmin, scales, q)


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_q5_K: d, dmin, scales[12], qh[32], qs[128]; group g adds bit g of qh[l] as 16."""
    n = blocks.shape[0]
    d_dmin, scales, qh, qs = split(blocks, [4, 12, QK_K // 8])
    low = nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32)
    high = crumbs(qh, 1)  # (n, g, 32): bit g of qh[l]
    return _k4_apply(d_dmin, scales, high.bitwise_left_shift_(4).bitwise_or_(low))  # in place on high's copy


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_q6_K: ql[128], qh[64], scales[16] (int8), d; y = d * sc * (q - 32).

    In half h, quarter k, position l: the low nibble k // 2 of ql[h*64 + (k%2)*32 + l], the
    2 bits qh[h*32 + l] >> 2k, and scale sc[h*8 + 2k + l // 16].
    """
    n = blocks.shape[0]
    ql, qh, scales, d = split(blocks, [QK_K // 2, QK_K // 4, QK_K // 16])
    low = nibbles(ql.reshape(n, 2, 64)).reshape(n, 2, 4, 32)  # k = nibble * 2 + (k % 2)
    high = crumbs(qh.reshape(n, 2, 32), 2)  # (n, h, k, 32)
    # (low | high << 4) - 32 in place on high's own copy: three passes with no new memory
    q = high.bitwise_left_shift_(4).bitwise_or_(low).sub_(32).view(torch.int8).to(torch.float32)
    dl = (f16(d) * scales.view(torch.int8).to(torch.float32)).unsqueeze(-1)
    return q.reshape(n, 16, 16).mul_(dl).reshape(n, QK_K)

"""TQ1_0, TQ2_0 (ternary), MXFP4 and NVFP4 (4-bit e2m1 floats with an e8m0 / ue4m3 scale).

Each function takes a ``(n_blocks, type_size)`` uint8 view and returns
``(n_blocks, block_size)`` float32; every product is of a small integer and a scale, exact
in f32.
"""

from __future__ import annotations

import math

import torch

from ggtorch.quant.fields import crumbs, f16, lookup, nibbles, split, table

QK_K = 256


def _trits_table() -> torch.Tensor:
    """Byte → its 5 base-3 digits minus 1, as float32 (256, 5), by dequantize_row_tq1_0's own
    arithmetic: digit n of byte q is ((uint8_t)(q * 3^n) * 3) >> 8, most significant first."""
    q = torch.arange(256, dtype=torch.int32).unsqueeze(-1)
    pow3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32)
    return ((((q * pow3) & 0xFF) * 3) >> 8).to(torch.float32) - 1


def _trits(q: torch.Tensor, n_digits: int) -> torch.Tensor:
    """``(n, k)`` bytes → ``(n, n_digits, k)`` trits minus 1 (-1, 0, 1) as float32."""
    t = lookup(table("tq1_0_trits", _trits_table, q.device), q)  # (n, k, 5)
    return t[..., :n_digits].transpose(-1, -2)


def dequantize_tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_tq1_0: qs[48] (5 trits per byte), qh[4] (4 trits per byte), d; y = (t - 1) * d."""
    n = blocks.shape[0]
    qs, qh, d = split(blocks, [48, 4])
    t = torch.cat((
        _trits(qs[:, :32], 5).reshape(n, 160),
        _trits(qs[:, 32:], 5).reshape(n, 80),
        _trits(qh, 4).reshape(n, 16),
    ), dim=-1)
    return t.mul_(f16(d))


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


def _ue4m3_half_table() -> torch.Tensor:
    """ggml_ue4m3_to_fp32 for all 256 bytes: unsigned e4m3 (bias 7, bit 7 ignored) times 0.5,
    with 0 and 0x7F (NaN) read as 0. Every value is exact in f32."""
    values = []
    for x in range(256):
        exp, man = (x >> 3) & 0xF, x & 0x7
        if x in (0, 0x7F):
            values.append(0.0)
        elif exp == 0:
            values.append(math.ldexp(man, -9) * 0.5)
        else:
            values.append(math.ldexp(1.0 + man / 8.0, exp - 7) * 0.5)
    return torch.tensor(values, dtype=torch.float32)


def dequantize_nvfp4(blocks: torch.Tensor) -> torch.Tensor:
    """Mirrors dequantize_row_nvfp4: d[4] (ue4m3, one per 16 values), qs[32];
    sub-block s: y = kvalues_mxfp4[nibble of qs[8s + j]] * d[s], low nibbles first."""
    n = blocks.shape[0]
    d, qs = split(blocks, [4])
    scale = lookup(table("ue4m3_half", _ue4m3_half_table, blocks.device), d)  # (n, 4)
    kv = lookup(table("kvalues_mxfp4", KVALUES_MXFP4, blocks.device), nibbles(qs.reshape(n, 4, 8)).reshape(n, 4, 16))
    return kv.mul_(scale.unsqueeze(-1)).reshape(n, 64)

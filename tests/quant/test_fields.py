"""Field extraction from ggml blocks against numpy's byte-wise shifts: word-wide masks must never
leak bits between bytes, whatever the field's offset, width and alignment."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ggtorch.quant.fields import crumbs, nibbles


def _numpy_fields(qs: np.ndarray, bits: int) -> np.ndarray:
    mask = (1 << bits) - 1
    return np.stack([(qs >> shift) & mask for shift in range(0, 8, bits)], axis=-2)


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("width", [1, 2, 3, 4, 6, 8, 16, 32])
@pytest.mark.parametrize("offset", range(8))
def test_crumbs_match_bytewise_shifts(bits: int, width: int, offset: int) -> None:
    """A field of ``width`` bytes at ``offset`` in 18-byte rows (a Q4_0 block's stride), every byte
    value present, including the top bit that an arithmetic shift of a signed word spreads."""
    rows = torch.arange(40 * 18, dtype=torch.int64).mul_(37).remainder_(256).to(torch.uint8).reshape(40, 18)
    rows[0, :] = 0xFF
    field = rows[:, offset:offset + width] if offset + width <= 18 else rows[:, :width]
    got = crumbs(field, bits)
    assert got.dtype == torch.uint8 and got.shape == (40, 8 // bits, field.shape[1])
    np.testing.assert_array_equal(got.numpy(), _numpy_fields(field.numpy(), bits))


def test_nibbles_of_higher_rank_views() -> None:
    """(n, groups, bytes) views as the K-quant decoders pass them, contiguous or not."""
    data = torch.randint(0, 256, (7, 4, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for view in (data[:, :, :32], data[:, :, 8:40], data[:, 1:3, 3:19], data[:1, :1]):
        np.testing.assert_array_equal(nibbles(view).numpy(), _numpy_fields(view.numpy(), 4))


def test_result_is_not_a_view_of_the_blocks() -> None:
    data = torch.full((4, 16), 0x21, dtype=torch.uint8)
    out = crumbs(data, 4)
    out.zero_()
    assert int(data[0, 0]) == 0x21

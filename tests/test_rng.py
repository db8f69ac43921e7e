"""rng: std::mt19937's stream, drawn in bounded chunks so that any length works."""

from __future__ import annotations

import numpy as np
import pytest

from ggtorch import rng
from ggtorch.rng import MT19937

MT19937_10000TH = 4123659995
"""The C++ standard's check of std::mt19937 ([rand.predef]): the 10000th output of a default-constructed engine."""


@pytest.mark.parametrize("chunk", [1, 7, 624, rng.CHUNK])
def test_a_chunked_draw_is_the_stream_a_single_draw_gives(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk boundaries do not show: the outputs are those of one output at a time, and the 10000th is the one the
    C++ standard names; draw and discard leave the engine at the same place."""
    one_at_a_time = MT19937(1234)
    expected = np.array([one_at_a_time() for _ in range(2000)], dtype=np.uint32)
    monkeypatch.setattr(rng, "CHUNK", chunk)
    assert np.array_equal(MT19937(1234).draw(2000), expected)
    assert MT19937().draw(10_000)[-1] == MT19937_10000TH
    drawn, skipped = MT19937(9), MT19937(9)
    drawn.draw(1001)
    skipped.discard(1001)
    assert drawn.state() == skipped.state()


def test_a_draw_over_2_to_the_31_bits_works() -> None:
    """2**26 + 1 outputs are more bits than one getrandbits call takes (an 8B model's LoRA init draws that many):
    the draw returns them all, continuing the stream a short draw starts."""
    n = 2**26 + 1
    values = MT19937().draw(n)
    assert values.shape == (n,) and values.dtype == np.uint32
    assert values[9_999] == MT19937_10000TH
    after = MT19937()
    after.discard(n - 1)  # more than 2**31 bits too
    assert values[-1] == after()

"""The old finetune's random streams, bit for bit: ``std::mt19937`` with libstdc++'s text state, and
libstdc++'s ``std::normal_distribution<float>`` over it (LoRA and new-model init).


The old llama.cpp finetune kept its data-shuffle RNG as the text that libstdc++ writes for
``os << rng`` (624 state words and the position, space-separated decimal) and seeded it with
``std::mt19937(seed)``. CPython's ``random.Random`` is the same Mersenne Twister: its
``getstate()``/``setstate()`` hold the same 624 words and the same position index, and
``getrandbits(32)`` returns the next tempered output unchanged, so it is used as the engine.
Only the seeding differs (``random.seed`` uses ``init_by_array``), hence :func:`seed_state`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import random
import sys
from collections.abc import Callable

import numpy as np

N = 624
"""State size in 32-bit words (``std::mt19937::state_size``)."""
DEFAULT_SEED = 5489
"""``std::mt19937::default_seed``."""
MAX = 0xFFFFFFFF
"""``std::mt19937::max()``."""
CHUNK = 1 << 20
"""Outputs drawn per ``getrandbits`` call: CPython refuses ``getrandbits(k)`` once k/32 outputs exceed a C int
(2**31 bits, 67M outputs), which an 8B model's LoRA init needs; 4 MiB a call costs nothing against that."""


def seed_state(seed: int) -> tuple[int, ...]:
    """State words of ``std::mt19937(seed)``: the classic ``init_genrand`` (seed taken mod 2**32)."""
    x = [seed & MAX]
    for i in range(1, N):
        prev = x[-1]
        x.append((1812433253 * (prev ^ (prev >> 30)) + i) & MAX)
    return tuple(x)


class MT19937:
    """A ``std::mt19937`` engine: same outputs, same libstdc++ text state."""

    def __init__(self, seed: int = DEFAULT_SEED) -> None:
        self._rng = random.Random()
        self._rng.setstate((3, seed_state(seed) + (N,), None))

    @classmethod
    def from_state(cls, text: str) -> MT19937:
        """An engine in the state libstdc++'s ``is >> rng`` would read from ``text``."""
        parts = text.split()
        if len(parts) != N + 1 or not all(p.isdigit() for p in parts):
            raise ValueError(f"not a std::mt19937 state: expected {N + 1} unsigned integers, got '{text[:60]}…'")
        values = [int(p) for p in parts]
        words, pos = values[:N], values[N]
        if any(w > MAX for w in words) or pos > N:
            raise ValueError("not a std::mt19937 state: a word exceeds 32 bits or the position exceeds 624")
        eng = cls.__new__(cls)
        eng._rng = random.Random()
        eng._rng.setstate((3, tuple(words) + (pos,), None))
        return eng

    def state(self) -> str:
        """The text libstdc++ writes for ``os << rng``: 624 words then the position, space-separated."""
        _, internal, _ = self._rng.getstate()
        return " ".join(str(v) for v in internal)

    def __call__(self) -> int:
        """The next 32-bit output (``rng()``)."""
        return self._rng.getrandbits(32)

    def draw(self, n: int) -> np.ndarray:
        """The next ``n`` outputs in order, as uint32 (one ``getrandbits`` call per :data:`CHUNK`, not n)."""
        out = np.empty(max(n, 0), dtype=np.uint32)
        order = "<" if sys.byteorder == "little" else ">"
        for start in range(0, n, CHUNK):
            k = min(CHUNK, n - start)
            # getrandbits(32·k) fills 32-bit words from least to most significant, one output each, so
            # consecutive calls give the outputs in order, as one call over all of them would
            raw = self._rng.getrandbits(32 * k).to_bytes(4 * k, sys.byteorder)
            out[start:start + k] = np.frombuffer(raw, dtype=np.dtype(order + "u4"))
        return out

    def discard(self, n: int) -> None:
        """Advance by ``n`` outputs (``rng.discard(n)``)."""
        for start in range(0, n, CHUNK):
            self._rng.getrandbits(32 * min(CHUNK, n - start))


def libstdcpp_normal(engine: MT19937, n: int) -> np.ndarray:
    """``n`` values of libstdc++'s ``std::normal_distribution<float>(0, 1)`` driven by ``engine``.

    Marsaglia's polar method as bits/random.tcc writes it, vectorized over pairs: uniforms are
    ``generate_canonical<float>`` (one 32-bit draw, ``float(draw) / 2^32``, 1 mapped to the
    float below 1); ``x = 2u - 1`` (in double, then float), pairs with ``r2 > 1`` or ``r2 == 0``
    are rejected, ``mult = sqrt(-2 log(r2) / r2)`` in float, and each accepted pair yields
    ``y·mult`` then ``x·mult``. ``log`` is the C library's ``logf`` (glibc's is not correctly
    rounded, so numpy's log would differ in the last bit); without a C ``logf`` it is rounded
    from double. Assumes no FMA contraction of ``x*x + y*y``, as in a default x86-64 build.
    """
    out: list[np.ndarray] = []
    have = 0
    below_one = np.nextafter(np.float32(1), np.float32(0))
    while have < n:
        pairs = int((n - have + 1) // 2 * 1.28) + 64  # acceptance is pi/4
        draws = engine.draw(2 * pairs).reshape(pairs, 2)
        u = draws.astype(np.float32) / np.float32(2.0 ** 32)
        u = np.where(u >= 1, below_one, u)
        xy = (2 * u.astype(np.float64) - 1.0).astype(np.float32)
        x, y = xy[:, 0], xy[:, 1]
        r2 = x * x + y * y
        ok = (r2 <= 1) & (r2 != 0)
        x, y, r2 = x[ok], y[ok], r2[ok]
        logr2 = _logf(r2)
        mult = np.sqrt(np.float32(-2) * logr2 / r2).astype(np.float32)
        vals = np.stack([y * mult, x * mult], axis=1).reshape(-1)
        out.append(vals)
        have += vals.size
    return np.concatenate(out)[:n].astype(np.float32) + np.float32(0)


@functools.cache
def _c_logf() -> Callable[[float], float] | None:
    path = ctypes.util.find_library("m")
    try:
        fn = ctypes.CDLL(path).logf if path else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn


def _logf(r: np.ndarray) -> np.ndarray:
    """C ``logf`` elementwise (float32), as ``std::log(float)`` computes it."""
    fn = _c_logf()
    if fn is None:
        return np.log(r.astype(np.float64)).astype(np.float32)
    return np.fromiter(map(fn, r.tolist()), dtype=np.float32, count=r.size)

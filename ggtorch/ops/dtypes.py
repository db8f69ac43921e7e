"""The float dtypes ggtorch computes and holds weights in, under the names flags and files use."""

from __future__ import annotations

import time
from typing import Literal

import torch

DTypeName = Literal["f32", "bf16", "f16"]

DTYPES: dict[str, torch.dtype] = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
"""--dtype / --base-dtype / adapter and PEFT dtypes -> torch dtype."""


def dtype_name(dtype: torch.dtype) -> str:
    """The flag name of a torch float dtype (``torch.bfloat16`` -> ``"bf16"``)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"{dtype} is not one of ggtorch's float dtypes ({', '.join(DTYPES)})")


def cpu_matmul_speed_vs_f32(dtype: torch.dtype, n: int = 256, rounds: int = 3) -> float:
    """How fast ``dtype`` matrix products run on this CPU against f32 ones (best of ``rounds`` n x n products).

    Measured, not read from CPU flags: whether a CPU multiplies bf16 or f16 natively (AVX512-BF16, AMX,
    AVX512-FP16, Arm's BF16/FP16 extensions) and whether torch's kernels use it differ across CPUs and builds.
    Without them torch converts every operand: bf16 products run a few times slower than f32, f16 ones up to a
    hundred times. Takes a few milliseconds (~0.2 s for f16 where it is not native)."""
    seconds: dict[torch.dtype, float] = {}
    for dt in (torch.float32, dtype):
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=gen).to(dt) for _ in range(2))
        a @ b  # warm-up: first-call setup
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        seconds[dt] = best
    return seconds[torch.float32] / max(seconds[dtype], 1e-9)

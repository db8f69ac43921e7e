"""The float dtypes ggtorch computes and holds weights in, under the names flags and files use."""

from __future__ import annotations

import math
import time
from typing import Literal

import torch

DTypeName = Literal["f32", "bf16", "f16"]

DTypeChoice = Literal["auto", "f32", "bf16", "f16"]
"""A --dtype flag: a float dtype, or ``auto`` (the device's choice: ``ggtorch.ops.policy.Policy.auto_dtype``)."""

DTYPES: dict[str, torch.dtype] = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
"""--dtype / --base-dtype / adapter and PEFT dtypes -> torch dtype."""


F32_MAX = float(torch.finfo(torch.float32).max)
"""The largest finite f32: a number a run keeps in f32 (optimizer settings, LoRA and merge scales) must fit it."""


def finite_in_f32(value: float) -> bool:
    """Whether ``value`` stays a finite number once rounded to f32 (1e39 is finite in Python, inf in f32)."""
    return math.isfinite(value) and abs(value) <= F32_MAX


def dtype_name(dtype: torch.dtype) -> str:
    """The flag name of a torch float dtype (``torch.bfloat16`` -> ``"bf16"``)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"{dtype} is not one of ggtorch's float dtypes ({', '.join(DTYPES)})")


def cpu_matmul_speed_vs_f32(dtype: torch.dtype, n: int = 256, rounds: int = 5) -> float:
    """How fast ``dtype`` matrix products run on one core of this CPU against f32 ones: the best of ``rounds`` n x n
    products each, the two dtypes taking turns on one thread, so that other processes' load (which stalls a
    multi-threaded product at its barriers) weighs on both alike.

    Measured, not read from CPU flags: whether a CPU multiplies bf16 or f16 natively (AVX512-BF16, AMX,
    AVX512-FP16, Arm's BF16/FP16 extensions) and whether torch's kernels use it differ across CPUs and builds.
    Without them torch converts every operand: bf16 products run a few times slower than f32, f16 ones up to a
    hundred times. Takes a few milliseconds (~0.3 s for f16 where it is not native)."""
    gen = torch.Generator().manual_seed(0)
    pair = torch.randn(2, n, n, generator=gen)
    operands = {dt: pair.to(dt) for dt in (torch.float32, dtype)}
    best = dict.fromkeys(operands, float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for a, b in operands.values():
            a @ b  # warm-up: first-call setup
        for _ in range(rounds):
            for dt, (a, b) in operands.items():
                t = time.perf_counter()
                a @ b
                best[dt] = min(best[dt], time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return best[torch.float32] / max(best[dtype], 1e-9)

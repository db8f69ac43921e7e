"""The compute-dtype speed probe against the CPU's own flags (/proc/cpuinfo, read independently of torch)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from ggtorch.ops.dtypes import cpu_matmul_speed_vs_f32
from ggtorch.training.run import SLOW_COMPUTE_DTYPE

NATIVE_FLAGS = {torch.bfloat16: {"avx512_bf16", "amx_bf16"}, torch.float16: {"avx512_fp16", "amx_fp16"}}
"""x86 flags of bf16 / f16 dot products: without any of them, torch converts every operand of such a product."""


def _x86_flags() -> set[str] | None:
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.exists():
        return None
    line = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cpu_without_dot_products_of_a_dtype_measures_it_slow(dtype: torch.dtype) -> None:
    """Where the flags show no bf16 (f16) dot products, the probe finds that dtype below the warning's bound
    (this Cascade Lake: about 0.3 for bf16 and 0.02 for f16 against a bound of 0.75, and below 0.4 for bf16 with
    four busy threads of other processes on its two cores)."""
    flags = _x86_flags()
    if flags is None or flags & NATIVE_FLAGS[dtype]:
        pytest.skip("not an x86 CPU without that dtype's dot products")
    assert cpu_matmul_speed_vs_f32(dtype) < SLOW_COMPUTE_DTYPE

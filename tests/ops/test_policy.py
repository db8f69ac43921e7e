"""The per-device policy's choices that only a GPU would exercise, checked where CI runs (the CPU)."""

from __future__ import annotations

import pytest
import torch

from ggtorch.ops import policy


@pytest.mark.parametrize(("capability", "dtype", "tf32"), [((9, 0), "bf16", True), ((8, 0), "bf16", True),
                                                          ((7, 5), "f32", False), ((6, 1), "f32", False)])
def test_cuda_computes_bf16_and_tf32_from_ampere(capability: tuple[int, int], dtype: str, tf32: bool) -> None:
    """Tensor cores multiply bf16 and TF32 from compute capability 8.0 (Ampere); a T4 (7.5) emulates bf16."""
    chosen = policy.cuda_policy(capability)
    assert (chosen.device_type, chosen.auto_dtype, chosen.tf32) == ("cuda", dtype, tf32)
    assert chosen.dist_backend == "nccl" and not chosen.c_dequantize and not chosen.c_attention


def test_the_cpu_keeps_f32_and_exact_f32_products() -> None:
    cpu = policy.choose("cpu")
    assert cpu.auto_dtype == "f32" and not cpu.tf32


def test_tf32_holds_only_while_a_run_computes() -> None:
    """TF32 is process state (torch.backends): a run on CUDA sets it inside ``using``, and a notebook's later f32
    products are exact again."""
    before = torch.get_float32_matmul_precision()
    with policy.using(policy.cuda_policy((9, 0))):
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == before
    with policy.using(policy.cuda_policy((7, 5))):
        assert torch.get_float32_matmul_precision() == before


@pytest.mark.parametrize(("cuda", "mps", "device"), [(True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")])
def test_auto_prefers_cuda_then_mps_then_the_cpu(cuda: bool, mps: bool, device: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert policy.auto_device() == device

"""apply_rope against the rotation written out per pair (NORM) and per half (NEOX), values and gradients, through
torch's ops and through fused.c (on CPU, where it is built)."""

from __future__ import annotations

import pytest
import torch

from ggtorch.models import model
from ggtorch.models.model import apply_rope, rope_angles_at, rope_pairs


@pytest.fixture(autouse=True, params=[False, True], ids=["torch", "fused.c"])
def native(request: pytest.FixtureRequest, cpu_policy) -> bool:
    cpu_policy(c_fused=request.param)
    return request.param


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """ggml's NORM rope as its C loop writes it: per pair (x0·c - x1·s, x0·s + x1·c)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def reference_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """ggml's NEOX rope as its C loop writes it: x[i] and x[i + R/2] rotated together."""
    half = cos.shape[-1]
    x0, x1 = x[..., :half], x[..., half:2 * half]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x0 * c - x1 * s, x0 * s + x1 * c, x[..., 2 * half:]), dim=-1)


def test_values_bit_equal_to_the_pairwise_formula() -> None:
    x = torch.randn(2, 7, 3, 16) * 5
    cos, sin = rope_angles_at(torch.arange(3, 10, device=x.device), 16, 10000.0, 1.0)
    assert torch.equal(apply_rope(x, cos, sin), reference_rope(x, cos, sin))
    per_row = torch.stack([c for c in (cos, cos.flip(0))]), torch.stack([s for s in (sin, sin.flip(0))])
    assert torch.equal(apply_rope(x, *per_row), reference_rope(x, *per_row))


def test_gradient_is_the_inverse_rotation() -> None:
    cos, sin = rope_angles_at(torch.arange(0, 5), 8, 10000.0, 1.0)
    x = torch.randn(1, 5, 2, 8, requires_grad=True)
    g = torch.randn(1, 5, 2, 8)
    ours = torch.autograd.grad(apply_rope(x, cos, sin), x, g)[0]
    ref = torch.autograd.grad(reference_rope(x, cos, sin), x, g)[0]
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    # a rotation's gradient is the inverse rotation: rotating it forward gives g back
    torch.testing.assert_close(apply_rope(ours.view(1, 5, 2, 8), cos, sin), g, rtol=1e-5, atol=1e-5)


def test_bf16_input_comes_back_bf16() -> None:
    x = torch.randn(1, 4, 2, 8).bfloat16()
    cos, sin = rope_angles_at(torch.arange(0, 4, device=x.device), 8, 10000.0, 1.0)
    out = apply_rope(x, cos, sin)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference_rope(x.float(), cos, sin).bfloat16())


def test_the_real_valued_rope_for_other_devices_matches() -> None:
    """rope_pairs (MPS and other devices without complex64) equals the complex path, values and gradients."""
    cos, sin = rope_angles_at(torch.arange(2, 8), 16, 10000.0, 1.0)
    x = (torch.randn(2, 6, 3, 16) * 4).requires_grad_()
    g = torch.randn(2, 6, 3, 16)
    ours, theirs = apply_rope(x, cos, sin), rope_pairs(x, cos, sin)
    assert torch.equal(ours, theirs)
    assert torch.equal(*(torch.autograd.grad(y, x, g)[0] for y in (ours, theirs)))


def test_neox_values_bit_equal_to_the_halves_formula() -> None:
    x = torch.randn(2, 7, 3, 16) * 5
    cos, sin = rope_angles_at(torch.arange(3, 10, device=x.device), 16, 10000.0, 1.0)
    assert torch.equal(apply_rope(x, cos, sin, neox=True), reference_neox(x, cos, sin))
    per_row = torch.stack([cos, cos.flip(0)]), torch.stack([sin, sin.flip(0)])
    assert torch.equal(apply_rope(x, *per_row, neox=True), reference_neox(x, *per_row))
    partial = rope_angles_at(torch.arange(3, 10, device=x.device), 8, 10000.0, 1.0)  # n_rot 8 of 16 dims
    # (the other 8 pass unchanged)
    assert torch.equal(apply_rope(x, *partial, neox=True), reference_neox(x, *partial))
    out = apply_rope(x.bfloat16(), cos, sin, neox=True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference_neox(x.bfloat16().float(), cos, sin).bfloat16())


def test_neox_gradient_is_the_inverse_rotation() -> None:
    cos, sin = rope_angles_at(torch.arange(0, 5), 8, 10000.0, 1.0)
    x = torch.randn(1, 5, 2, 8, requires_grad=True)
    g = torch.randn(1, 2, 5, 8).transpose(1, 2)  # a strided gradient, as attention's transpose hands it back
    ours = torch.autograd.grad(apply_rope(x, cos, sin, neox=True), x, g)[0]
    ref = torch.autograd.grad(reference_neox(x, cos, sin), x, g)[0]
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rope(ours, cos, sin, neox=True), g, rtol=1e-5, atol=1e-5)
    xd = torch.randn(1, 5, 2, 8, dtype=torch.float64, requires_grad=True)
    c64, s64 = cos.double().unsqueeze(-2), sin.double().unsqueeze(-2)
    assert torch.autograd.gradcheck(lambda t: model._RealRope.apply(t, c64, s64, True), (xd,))


@pytest.mark.parametrize("head_dim, base, factor, n_ctx_orig", [(128, 1e6, 4.0, 32768),  # Qwen3's 128k files
                                                                (64, 10000.0, 2.0, 4096), (16, 10000.0, 8.0, 64)])
def test_yarn_angles_equal_transformers_yarn(head_dim: int, base: float, factor: float, n_ctx_orig: int) -> None:
    """YaRN's angles and magnitude against transformers' own ``_compute_yarn_parameters`` (beta 32/1, truncated
    correction range, attention factor 0.1 ln(factor) + 1), a separate implementation of the paper."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(head_dim=head_dim, max_position_embeddings=int(n_ctx_orig * factor),
                         rope_parameters={"rope_type": "yarn", "rope_theta": base, "factor": factor,
                                          "original_max_position_embeddings": n_ctx_orig})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    positions = torch.arange(64, dtype=torch.float64)
    theta = positions[:, None] * inv_freq.double()[None, :]
    cos, sin = rope_angles_at(torch.arange(0, 64), head_dim, base, 1 / factor, ext_factor=1.0, n_ctx_orig=n_ctx_orig)
    torch.testing.assert_close(cos.double(), theta.cos() * attention_factor, rtol=0, atol=2e-5)
    torch.testing.assert_close(sin.double(), theta.sin() * attention_factor, rtol=0, atol=2e-5)
    plain, _ = rope_angles_at(torch.arange(0, 64), head_dim, base, 1 / factor)
    assert not torch.allclose(cos, plain, atol=1e-3)  # the ramp and the magnitude both changed the linear angles

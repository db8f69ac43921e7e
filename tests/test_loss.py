"""ggtorch.loss.cross_entropy against torch's F.cross_entropy (values and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ggtorch import loss as loss_mod
from ggtorch.loss import cross_entropy


def _case(n: int, v: int, n_ignored: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 4
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.randperm(n, generator=g)[:n_ignored]] = -100
    return logits, targets


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("n_ignored", [0, 5])
def test_equals_torch_cross_entropy(reduction: str, n_ignored: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_mod, "CHUNK_BYTES", 7 * 4 * 1000)  # 7 rows per chunk: a ragged last chunk
    logits, targets = _case(40, 1000, n_ignored)
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.clone().requires_grad_()
    ours = cross_entropy(ours_in.view(4, 10, 1000), targets.view(4, 10), reduction)
    ref = F.cross_entropy(ref_in, targets, reduction=reduction).view(ours.shape)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)
    weights = torch.randn(ours.shape)  # a non-uniform upstream gradient for "none"
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-5, atol=1e-7)
    if n_ignored:
        ignored = targets == -100
        assert torch.all(ours_in.grad[ignored] == 0)
        if reduction == "none":
            assert torch.all(ours.view(-1)[ignored] == 0)


def test_all_ignored_mean_is_nan_like_torch() -> None:
    logits, targets = _case(6, 50, 6)
    assert torch.isnan(cross_entropy(logits, targets)) and torch.isnan(F.cross_entropy(logits, targets))
    assert cross_entropy(logits, targets, "sum").item() == 0.0


def test_bf16_logits_give_bf16_gradient_computed_in_f32() -> None:
    logits, targets = _case(8, 300, 0)
    low = logits.bfloat16().requires_grad_()
    loss = cross_entropy(low, targets)
    assert loss.dtype == torch.float32
    loss.backward()
    assert low.grad.dtype == torch.bfloat16
    ref = logits.bfloat16().float().requires_grad_()
    F.cross_entropy(ref, targets).backward()
    torch.testing.assert_close(loss, F.cross_entropy(logits.bfloat16().float(), targets))
    torch.testing.assert_close(low.grad.float(), ref.grad, rtol=1e-2, atol=1e-4)


def test_bad_reduction() -> None:
    logits, targets = _case(2, 5, 0)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, targets, "avg")  # type: ignore[arg-type]

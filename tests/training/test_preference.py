"""The preference objectives against TRL's own loss functions, and the pieces they stand on: answer
log-probabilities against log-softmax written out, the reference model as the base with the adapters off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ggtorch.lora import LoraConfig, attach_lora, trainable_parameters
from ggtorch.models.loader import load_model_file
from ggtorch.training import preference


@pytest.fixture
def lora_model(stories260k: Path) -> torch.nn.Module:
    model = load_model_file(stories260k).model
    attach_lora(model, LoraConfig(rank=4), seed=1)
    with torch.no_grad():
        for _, p, _ in trainable_parameters(model):
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, 512, (4, 25), generator=gen)
    targets = tokens[:, 1:].clone()
    for row, prompt in enumerate((3, 10, 7, 15)):
        targets[row, :prompt] = -100  # the prompt's targets count for nothing
    targets[1, 20:] = -100  # a shorter answer, padded
    return tokens[:, :-1], targets


def test_answer_logps_sum_the_answer_tokens_log_probabilities(lora_model: torch.nn.Module) -> None:
    inputs, targets = _batch()
    got = preference.answer_logps(lora_model, inputs, targets)
    logp = F.log_softmax(lora_model(inputs).double(), dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets != -100)
    torch.testing.assert_close(got.total.double(), picked.sum(dim=1), rtol=1e-5, atol=1e-4)
    assert got.count.tolist() == (targets != -100).sum(dim=1).float().tolist()


def test_the_reference_is_the_base_with_the_adapters_off(stories260k: Path, lora_model: torch.nn.Module) -> None:
    inputs, _ = _batch()
    base = load_model_file(stories260k).model
    with preference.adapters_off(lora_model):
        off = lora_model(inputs)
    assert torch.equal(off, base(inputs))
    assert not torch.equal(lora_model(inputs), off)  # and back on after


def _logps(seed: int, n: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(-torch.rand(n, generator=gen, dtype=torch.float64) * 40 - 1).requires_grad_() for _ in range(4)]


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_dpo_is_the_sigmoid_loss_of_the_log_ratio_gain(smoothing: float) -> None:
    """DPO and cDPO written out here from the papers' equations (Rafailov et al. eq. 7; Mitchell's cDPO):
    the per-pair losses, their gradients, TRL's rewards and accuracy."""
    pc, pr, rc, rr = _logps(1)
    beta = 0.1
    got = preference.dpo(pc, pr, rc, rr, beta, smoothing)
    h = beta * ((pc - rc) - (pr - rr))
    p = 1 / (1 + torch.exp(-h))
    expected = -(1 - smoothing) * torch.log(p) - smoothing * torch.log(1 - p)
    torch.testing.assert_close(got.losses, expected)
    for a, b in zip(torch.autograd.grad(got.loss, (pc, pr)), torch.autograd.grad(expected.mean(), (pc, pr)),
                    strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got.chosen_rewards, beta * (pc - rc).detach())
    torch.testing.assert_close(got.margins, (beta * ((pc - rc) - (pr - rr))).detach())
    assert got.accuracies.tolist() == ((pc - rc) > (pr - rr)).double().tolist()


def test_ipo_is_the_squared_distance_of_the_gain_from_half_over_beta() -> None:
    pc, pr, rc, rr = _logps(2)
    got = preference.ipo(pc, pr, rc, rr, beta=0.5)
    torch.testing.assert_close(got.losses, (((pc - pr) - (rc - rr)) - 1.0) ** 2)


def test_orpo_equals_trls_odds_ratio_loss() -> None:
    """TRL's own ORPOTrainer.odds_ratio_loss, called on the answers' mean log-probabilities, and its total loss
    (the chosen NLL over the batch's tokens minus the ratio term's mean): the same losses, rewards and gradients."""
    from types import SimpleNamespace

    from trl.experimental.orpo import ORPOTrainer

    gen = torch.Generator().manual_seed(3)
    counts = [torch.randint(1, 30, (6,), generator=gen).double() for _ in range(2)]
    totals = [(-torch.rand(6, generator=gen, dtype=torch.float64) * 2 - 0.05).mul(c).requires_grad_()
              for c in counts]
    chosen, rejected = (preference.AnswerLogps(t, c) for t, c in zip(totals, counts, strict=True))
    lam = 0.25
    ours = preference.orpo(chosen, rejected, lam)
    trl_self = SimpleNamespace(beta=lam, accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, chosen_rewards, rejected_rewards, _, _ = ORPOTrainer.odds_ratio_loss(
        trl_self, totals[0] / counts[0], totals[1] / counts[1])
    nll = -totals[0].sum() / counts[0].sum()  # TRL: cross-entropy over every chosen answer token of the batch
    theirs = nll - losses.mean()
    torch.testing.assert_close(ours.loss.float(), theirs.float())
    torch.testing.assert_close(ours.chosen_rewards.float(), chosen_rewards)
    torch.testing.assert_close(ours.rejected_rewards.float(), rejected_rewards)
    for a, b in zip(torch.autograd.grad(ours.loss, totals), torch.autograd.grad(theirs, totals), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-7)

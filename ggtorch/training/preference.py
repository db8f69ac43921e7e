"""Preference objectives over pairs of answers: DPO (sigmoid, with label smoothing), IPO and ORPO, as TRL defines them.

Each takes, per pair, the summed log-probabilities of the chosen and the rejected answer's tokens under the trained
model (``logps``) and, for DPO and IPO, under the reference model (the same base with the LoRA delta off:
:func:`adapters_off`), and returns per-pair losses and the metrics TRL logs (rewards of chosen and rejected, their
margin, accuracy). ORPO needs no reference: its odds ratio uses the answers' mean log-probabilities per token and
adds the chosen answer's negative log-likelihood.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ggtorch.data import IGNORE_INDEX
from ggtorch.lora import lora_modules
from ggtorch.training.loss import model_cross_entropy

OBJECTIVES = ("dpo", "ipo", "orpo")


@dataclass(frozen=True)
class AnswerLogps:
    """Per sequence: the sum of its answer tokens' log-probabilities and how many answer tokens it has."""

    total: torch.Tensor  # (B,) f32
    count: torch.Tensor  # (B,) f32

    @property
    def mean(self) -> torch.Tensor:
        """Per answer token (ORPO's, and TRL's ``average_log_prob``)."""
        return self.total / self.count.clamp_min(1)


def answer_logps(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                 hidden: torch.Tensor | None = None) -> AnswerLogps:
    """Each row's summed log-probability of its counted targets (``targets`` != -100: the answer's tokens), through
    the model's fused output loss a row at a time (no (T, V) logits kept)."""
    if hidden is None:
        hidden = model(inputs, hidden_only=True)
    totals = torch.stack([-model_cross_entropy(model, hidden[i:i + 1], targets[i:i + 1], "sum")
                          for i in range(hidden.shape[0])])
    return AnswerLogps(totals.float(), (targets != IGNORE_INDEX).sum(dim=1).float())


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model alone for the duration, every LoRA layer its base's forward (DPO's reference model, for
    free): the same numbers as the base without adapters, not merely a zero delta added."""
    layers = [m for _, m in lora_modules(model)]
    states = [m.enabled for m in layers]
    try:
        for m in layers:
            m.enabled = False
        yield
    finally:
        for m, state in zip(layers, states, strict=True):
            m.enabled = state


@dataclass(frozen=True)
class PreferenceLoss:
    """Per-pair losses and TRL's metrics of one batch of pairs."""

    losses: torch.Tensor  # (P,)
    chosen_rewards: torch.Tensor  # (P,), detached
    rejected_rewards: torch.Tensor  # (P,), detached
    nll: tuple[torch.Tensor, torch.Tensor] | None = None
    """ORPO's: the chosen answers' summed negative log-likelihood and their token count, a mean over the tokens of
    the whole batch (as TRL takes it), not over pairs."""

    @property
    def loss(self) -> torch.Tensor:
        """The batch's loss: the pairs' mean, plus ORPO's token-mean NLL."""
        mean = self.losses.mean()
        return mean if self.nll is None else mean + self.nll[0] / self.nll[1].clamp_min(1)

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracies(self) -> torch.Tensor:
        return (self.chosen_rewards > self.rejected_rewards).float()


def dpo(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
        beta: float, label_smoothing: float = 0.0) -> PreferenceLoss:
    """DPO's sigmoid loss (Rafailov et al. eq. 7; with label smoothing, the conservative cDPO):
    -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h), h the chosen-over-rejected log-ratio's gain over the
    reference's. Rewards: beta times each answer's log-ratio to the reference."""
    h = (chosen - rejected) - (ref_chosen - ref_rejected)
    losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    return PreferenceLoss(losses, (beta * (chosen - ref_chosen)).detach(), (beta * (rejected - ref_rejected)).detach())


def ipo(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
        beta: float) -> PreferenceLoss:
    """IPO (Azar et al. eq. 17): (h - 1 / (2 beta))^2 on the same h as DPO's, here of log-probabilities averaged
    over each answer's tokens as TRL's IPO takes them."""
    h = (chosen - rejected) - (ref_chosen - ref_rejected)
    losses = (h - 1 / (2 * beta)) ** 2
    return PreferenceLoss(losses, (beta * (chosen - ref_chosen)).detach(), (beta * (rejected - ref_rejected)).detach())


def orpo(chosen: AnswerLogps, rejected: AnswerLogps, lam: float) -> PreferenceLoss:
    """ORPO (Hong et al.): the chosen answers' negative log-likelihood (per token over the batch) plus, per pair,
    ``-lam`` log sigmoid of the log odds ratio of the answers' mean token probabilities,
    log(p_c / (1 - p_c)) - log(p_r / (1 - p_r)). Rewards, as TRL logs them: ``lam`` times each mean
    log-probability."""
    c, r = chosen.mean, rejected.mean
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    return PreferenceLoss(-lam * F.logsigmoid(log_odds), (lam * c).detach(), (lam * r).detach(),
                          nll=(-chosen.total.sum(), chosen.count.sum()))

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

from ggtorch.lora import lora_modules
from ggtorch.training.loss import model_cross_entropy

OBJECTIVES = ("sft", "dpo", "ipo", "orpo")
"""--objective: supervised finetuning (the answers' cross-entropy), or a preference objective over pairs."""

REFERENCE_OBJECTIVES = ("dpo", "ipo")
"""The objectives that compare with a reference model."""

OBJECTIVE_OPTIONS: dict[str, tuple[str, ...]] = {"dpo": ("beta", "label_smoothing"), "ipo": ("beta",),
                                                 "orpo": ("orpo_lambda",)}
"""The run options each objective's loss reads: given with another objective, one is refused; a checkpoint records
them, and a resume that changes one says so."""


@dataclass(frozen=True)
class AnswerLogps:
    """Per sequence: the sum of its answer tokens' log-probabilities and how many answer tokens it has."""

    total: torch.Tensor  # (B,) f32
    count: torch.Tensor  # (B,) f32

    @property
    def mean(self) -> torch.Tensor:
        """Per answer token (ORPO's, and TRL's ``average_log_prob``)."""
        return self.total / self.count.clamp_min(1)


def answer_logps(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, answers: torch.Tensor,
                 n_answers: int) -> AnswerLogps:
    """Each answer's summed log-probability of its tokens (``answers`` tags each target with its answer, -1 none),
    wherever its pieces sit (rows, packed segments, split pieces): the model's fused output loss per target, one
    pass for all the answers (no (T, V) logits kept), summed per answer."""
    losses = model_cross_entropy(model, hidden, targets, "none").reshape(-1)
    slots = answers.reshape(-1).clamp_min(-1) + 1  # slot 0 collects the targets of no answer
    totals = losses.new_zeros(n_answers + 1).index_add(0, slots, losses)
    counts = torch.bincount(slots, minlength=n_answers + 1)
    return AnswerLogps(-totals[1:].float(), counts[1:].float())


def pick(logps: AnswerLogps, side: int) -> AnswerLogps:
    """The chosen (``side`` 0) or rejected (1) answers of the pairs: answers 2p and 2p + 1."""
    return AnswerLogps(logps.total[side::2], logps.count[side::2])


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
    chosen_logps: torch.Tensor  # (P,), detached: what TRL logs as logps/chosen for this objective
    rejected_logps: torch.Tensor  # (P,), detached
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
    return PreferenceLoss(losses, (beta * (chosen - ref_chosen)).detach(), (beta * (rejected - ref_rejected)).detach(),
                          chosen.detach(), rejected.detach())


def ipo(chosen: AnswerLogps, rejected: AnswerLogps, ref_chosen: AnswerLogps, ref_rejected: AnswerLogps,
        beta: float) -> PreferenceLoss:
    """IPO (Azar et al. eq. 17): (h - 1 / (2 beta))^2 on the same h as DPO's, here of log-probabilities averaged
    over each answer's tokens as TRL's IPO takes them. Rewards as TRL logs them for every loss: beta times each
    answer's summed log-ratio to the reference."""
    h = (chosen.mean - rejected.mean) - (ref_chosen.mean - ref_rejected.mean)
    losses = (h - 1 / (2 * beta)) ** 2
    return PreferenceLoss(losses, (beta * (chosen.total - ref_chosen.total)).detach(),
                          (beta * (rejected.total - ref_rejected.total)).detach(), chosen.total.detach(),
                          rejected.total.detach())


def orpo(chosen: AnswerLogps, rejected: AnswerLogps, lam: float) -> PreferenceLoss:
    """ORPO (Hong et al.): the chosen answers' negative log-likelihood (per token over the batch) plus, per pair,
    ``-lam`` log sigmoid of the log odds ratio of the answers' mean token probabilities,
    log(p_c / (1 - p_c)) - log(p_r / (1 - p_r)). Rewards, as TRL logs them: ``lam`` times each mean
    log-probability; TRL's ORPO logs the means as the answers' logps too. (TRL's experimental ORPOTrainer also
    counts the prompt's tokens in the NLL; the paper's, and this, is the answer's.)"""
    c, r = chosen.mean, rejected.mean
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    return PreferenceLoss(-lam * F.logsigmoid(log_odds), (lam * c).detach(), (lam * r).detach(), c.detach(),
                          r.detach(), nll=(-chosen.total.sum(), chosen.count.sum()))


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")
"""TRL's names of the means a preference run logs per step and evaluation, with TRL's meanings (the answers' logps
summed over their tokens for DPO and IPO, averaged for ORPO)."""


@dataclass(frozen=True)
class PreferenceObjective:
    """A preference objective with its settings (the run's --objective, --beta, --label-smoothing,
    --orpo-lambda): from the answers' log-probabilities to a batch's loss and its metrics."""

    name: str
    beta: float = 0.1
    label_smoothing: float = 0.0
    orpo_lambda: float = 0.1

    @property
    def needs_reference(self) -> bool:
        return self.name in REFERENCE_OBJECTIVES

    def __call__(self, policy: AnswerLogps, reference: AnswerLogps | None) -> PreferenceLoss:
        chosen, rejected = pick(policy, 0), pick(policy, 1)
        if self.name == "orpo":
            return orpo(chosen, rejected, self.orpo_lambda)
        assert reference is not None, "DPO and IPO compare with the reference's log-probabilities"
        ref_chosen, ref_rejected = pick(reference, 0), pick(reference, 1)
        if self.name == "ipo":
            return ipo(chosen, rejected, ref_chosen, ref_rejected, self.beta)
        return dpo(chosen.total, rejected.total, ref_chosen.total, ref_rejected.total, self.beta,
                   self.label_smoothing)


def metric_sums(result: PreferenceLoss) -> list[float]:
    """The batch's sums over pairs of each of :data:`METRICS` (summed over micro-batches and ranks, then divided by
    the pairs: the step's means)."""
    return [float(t.sum()) for t in (result.chosen_rewards, result.rejected_rewards, result.margins,
                                      result.accuracies, result.chosen_logps, result.rejected_logps)]

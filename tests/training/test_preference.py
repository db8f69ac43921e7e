"""The preference objectives against TRL's own loss functions, and the pieces they stand on: answer
log-probabilities against log-softmax written out, the reference model as the base with the adapters off."""

from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ggtorch import api
from ggtorch.errors import BadFlag
from ggtorch.io.gguf import read_gguf
from ggtorch.lora import LoraConfig, attach_lora, trainable_parameters
from ggtorch.models.loader import load_model_file
from ggtorch.models.tokenizer import Tokenizer
from ggtorch.quant.modules import QuantLinear
from ggtorch.training import preference
from ggtorch.training.trainer import Trainer
from tests.helpers import read_log
from tests.llama_models import rewrite_gguf
from tests.training.test_finetune import run, run_whole_and_resumed


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
    """Each answer's targets, wherever they sit (here answer 0 in two rows, as a split sequence's pieces), summed."""
    inputs, targets = _batch()
    answers = torch.where(targets != -100, torch.tensor([0, 1, 2, 0])[:, None], -1)
    got = preference.answer_logps(lora_model, lora_model(inputs, hidden_only=True), targets, answers, 3)
    logp = F.log_softmax(lora_model(inputs).double(), dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets != -100)
    rows = picked.sum(dim=1)
    torch.testing.assert_close(got.total.double(), torch.stack([rows[0] + rows[3], rows[1], rows[2]]),
                               rtol=1e-5, atol=1e-4)
    counted = (targets != -100).sum(dim=1).tolist()
    assert got.count.tolist() == [counted[0] + counted[3], counted[1], counted[2]]


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
    """On log-probabilities averaged per answer token; the rewards (TRL's, whatever the loss) on their sums."""
    pc, pr, rc, rr = _logps(2)
    counts = [torch.arange(1, 7, dtype=torch.float64) + k for k in range(4)]
    got = preference.ipo(*(preference.AnswerLogps(t, c) for t, c in zip((pc, pr, rc, rr), counts, strict=True)),
                         beta=0.5)
    mc, mr, mrc, mrr = (t / c for t, c in zip((pc, pr, rc, rr), counts, strict=True))
    torch.testing.assert_close(got.losses, (((mc - mr) - (mrc - mrr)) - 1.0) ** 2)
    torch.testing.assert_close(got.chosen_rewards, 0.5 * (pc - rc).detach())


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


RECORDS = [{"prompt": f"Once upon a time, {name} went to the park.", "chosen": f" {name} was happy. The end.",
            "rejected": f" {name} was sad."} for name in ("Tom", "Lily", "Ben", "Sue", "Max", "Anna", "Tim", "Mia")]


def _trainer(stories260k: Path, tmp_path: Path, **options) -> Trainer:
    options = {"model_base": str(stories260k), "records": RECORDS, "batch": 4, "ctx": 48, "seed": 3,
               "adam_gclip": 0.0, "checkpoint_out": "", "lora_out": "", "log_file": str(tmp_path / "log.jsonl"),
               "progress": False, "run": False, "device": "cpu", "lora_dropout": 0.0, "dtype": "f32",
               **options}  # the objectives are checked in f32
    return api.finetune(**options)


def _answer_sums(m: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's summed log-probability on the full float64 log-softmax, its tokens picked by hand, and their
    count."""
    logp = F.log_softmax(m(batch.inputs, positions=batch.positions, segments=batch.segments).double(), dim=-1)
    picked = logp.gather(-1, batch.targets.clamp(min=0)[..., None])[..., 0]
    n = int(batch.answers.max()) + 1
    total = torch.stack([picked[batch.answers == a].sum() for a in range(n)])
    count = torch.stack([(batch.answers == a).sum() for a in range(n)]).double()
    return total, count


def _written_out_loss(model: torch.nn.Module, batch, objective: str, reference: torch.nn.Module | None,
                      beta: float = 0.1, lam: float = 0.1) -> torch.Tensor:
    """The objective on full float64 log-softmaxes, each answer's tokens picked by hand: a computation apart from
    the fused loss, the answer gathering and the objective code."""
    sums = partial(_answer_sums, batch=batch)
    total, count = sums(model)
    if objective == "orpo":
        c, r = total[0::2] / count[0::2], total[1::2] / count[1::2]
        odds = (c - torch.log(1 - torch.exp(c))) - (r - torch.log(1 - torch.exp(r)))
        return -total[0::2].sum() / count[0::2].sum() - lam * F.logsigmoid(odds).mean()
    with torch.no_grad():
        ref_total, ref_count = sums(reference)
    if objective == "ipo":
        total, ref_total = total / count, ref_total / ref_count
    gain = (total[0::2] - total[1::2]) - (ref_total[0::2] - ref_total[1::2])
    if objective == "ipo":
        return ((gain - 1 / (2 * beta)) ** 2).mean()
    return -F.logsigmoid(beta * gain).mean()


@pytest.mark.parametrize("objective", ["dpo", "ipo", "orpo"])
@pytest.mark.parametrize("batching", ["pack", "pad"])
def test_a_training_step_has_the_objectives_loss_and_gradients(stories260k: Path, tmp_path: Path, objective: str,
                                                               batching: str) -> None:
    """One optimizer step of the Trainer, two micro-batches: its loss and the LoRA gradients equal the objective
    written out on the model's full log-softmax (DPO's reference: the bare base file, loaded apart)."""
    trainer = _trainer(stories260k, tmp_path, objective=objective, batching=batching, grad_acc=2, batch=2)
    data = copy.deepcopy(trainer.data)
    batches = [data.next_batch(2), data.next_batch(2)]
    with torch.no_grad():  # a LoRA delta that is not zero, so the policy differs from the reference
        for _, p, _ in trainer.params:
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    policy = copy.deepcopy(trainer.model)
    reference = load_model_file(stories260k).model
    result = trainer.step()
    expected = sum(_written_out_loss(policy, b, objective, reference) * b.n_pairs for b in batches) / 4
    expected.backward()
    assert result.loss == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    got = dict((name, p) for name, p, _ in trainer.params)
    for name, p, _ in trainable_parameters(policy):
        torch.testing.assert_close(got[name].grad.double(), p.grad.double(), rtol=1e-4, atol=1e-6)
    assert set(result.metrics) == set(preference.METRICS)
    trainer.close()


def test_a_quantized_base_stays_quantized_and_evaluations_log_trls_metrics(stories_q8: Path, tmp_path: Path) -> None:
    """DPO on a Q8_0 base kept quantized; an evaluation over --val-split pairs logs the loss and TRL's metrics, each
    written out here from float64 log-softmaxes of the policy and of the base loaded apart (dequantized)."""
    trainer = _trainer(stories_q8, tmp_path, objective="dpo", batch=2, val_split=0.25)
    assert sum(isinstance(m, QuantLinear) for m in trainer.model.modules()) >= 7
    with torch.no_grad():
        for _, p, _ in trainer.params:
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    reference = load_model_file(stories_q8).model
    pairs, metrics, loss = 0, dict.fromkeys(preference.METRICS, 0.0), 0.0
    with torch.no_grad():
        for batch in trainer.val_batches:
            (c, r), (c0, r0) = ((t[0::2], t[1::2]) for t, _ in (_answer_sums(trainer.model, batch),
                                                                 _answer_sums(reference, batch)))
            chosen, rejected = 0.1 * (c - c0), 0.1 * (r - r0)
            loss += float(-F.logsigmoid(chosen - rejected).sum())
            for name, values in zip(preference.METRICS, (chosen, rejected, chosen - rejected,
                                                        (chosen > rejected).double(), c, r), strict=True):
                metrics[name] += float(values.sum())
            pairs += batch.n_pairs
    assert pairs == 2  # a quarter of the 8 pairs
    assert trainer.evaluate() == pytest.approx(loss / pairs, rel=1e-5)
    assert trainer.last_eval_metrics == pytest.approx({k: v / pairs for k, v in metrics.items()}, rel=1e-4, abs=1e-6)
    logged = [r for r in read_log(tmp_path / "log.jsonl") if r["kind"] == "eval"][-1]
    assert logged["metrics"] == trainer.last_eval_metrics
    trainer.close()


def test_a_reference_file_equal_to_the_base_gives_the_same_steps(stories260k: Path, tmp_path: Path) -> None:
    """--ref-model with the base's own file computes what the base with the adapters off does."""
    steps = []
    for ref in (None, str(stories260k)):
        trainer = _trainer(stories260k, tmp_path, objective="dpo", ref_model=ref, overwrite=True)
        with torch.no_grad():
            for _, p, _ in trainer.params:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
        steps.append([(r.loss, r.metrics) for r in trainer.train(3)])
        trainer.close()
    assert steps[0] == steps[1]


def test_a_reference_with_another_vocabulary_is_refused(stories260k: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-vocab.gguf"
    tokens = list(Tokenizer.from_gguf(read_gguf(stories260k)).tokens)
    tokens[300] = "zzz"
    rewrite_gguf(stories260k, other, set_keys={"tokenizer.ggml.tokens": tokens})
    with pytest.raises(BadFlag, match="--ref-model .*vocabulary is not the base's"):
        _trainer(stories260k, tmp_path, objective="dpo", ref_model=str(other))


def test_preference_training_resumes_exactly(stories260k: Path, tmp_path: Path) -> None:
    """6 DPO iterations in one run == 3, stop, resume for 3 (across an epoch's end): same adapter bytes, losses and
    metrics."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    common = ["finetune", "--model-base", str(stories260k), "--train-data", str(data), "--objective", "dpo",
              "-c", "48", "-b", "3", "--warmup", "1", "--adam-alpha", "0.01", "--seed", "7", "--save-every", "0"]
    one, two = run_whole_and_resumed(common, tmp_path)
    assert (one / "ggml-lora-6-f32.gguf").read_bytes() == (two / "ggml-lora-6-f32.gguf").read_bytes()
    logs = [[(r["loss"], r["metrics"]) for r in read_log(d / "checkpoint-log.jsonl") if r["kind"] == "iter"]
            for d in (one, two)]
    assert logs[0] == logs[1] and len(logs[0]) == 6


@pytest.mark.parametrize(("args", "message"), [
    (["--objective", "orpo", "--ref-model", "x.gguf"], "--ref-model applies to --objective dpo or ipo"),
    (["--objective", "dpo", "--beta", "0"], "--beta must be in (0, 100], got 0.0"),
    (["--objective", "ipo", "--label-smoothing", "0.1"], "--label-smoothing applies to --objective dpo"),
    (["--objective", "dpo", "--train-on-prompt"], "--train-on-prompt does not apply"),
    (["--objective", "dpo", "--train-data", "TEXT"], "trains on preference records"),
    (["--objective", "dpo", "--train-data", "BAD"], "line 2: 'chosen' and 'rejected' are identical"),
])
def test_bad_preference_options_and_records_get_one_line(stories260k: Path, texts: dict[str, Path], tmp_path: Path,
                                                         args: list[str], message: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({"prompt": "Hi.", "chosen": " Yo.", "rejected": " Yo."})
                   + "\n")
    args = [{"TEXT": str(texts["train"]), "BAD": str(bad)}.get(a, a) for a in args]
    if "--train-data" not in args:
        args += ["--train-data", str(bad)]
    code, out = run(["finetune", "--model-base", str(stories260k), "-n", "1", *args], tmp_path)
    assert code != 0 and message in out and "Traceback" not in out

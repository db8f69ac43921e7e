"""A ggtorch DPO (and IPO) step against TRL's DPOTrainer itself, on one model and one batch of pairs.

The model is a checkpoint transformers builds, converted to GGUF by llama.cpp's converter (tests/converted.py):
ggtorch trains the GGUF, TRL the checkpoint. The LoRA weights are ggtorch's, exported as a PEFT folder and loaded
by peft, so both sides start from the same adapter; the reference is the base with the adapter off on both sides.
The pairs are ggtorch's encoded sequences, handed to TRL's own collator as prompt and completion ids, and TRL's
``compute_loss`` (its forward, log-probabilities, loss and metrics) runs on them. The gradients are compared in the
GGUF layout: TRL's are written as a PEFT folder and read back by ``import_peft``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ggtorch import api
from ggtorch.export.peft import export_peft, import_peft
from ggtorch.io.gguf import read_gguf
from ggtorch.lora.adapter_file import adapter_from_model
from ggtorch.training import preference
from tests.models.test_converted import converted  # noqa: F401 (the session fixture)

FAMILY = "mistral"
"""A llama-architecture checkpoint (grouped-query attention, untied output), 32000-word sentencepiece vocabulary."""

RECORDS = [{"prompt": "Once upon a time, Tom went to the park.", "chosen": " He was happy. The end.",
            "rejected": " He was sad and went home."},
           {"prompt": "Lily had a red ball.", "chosen": " She played with it all day.", "rejected": " It broke."},
           {"prompt": "The cat sat on the mat.", "chosen": " It purred.",
            "rejected": " It ran away from the big dog in the garden."}]

NO_OUTPUT_LORA = {"rank_out": 0}
"""TRL's fused LM head projects through ``lm_head.weight`` alone, so a peft LoRA on lm_head would not count on its
side: the output matrix is left unadapted here (ggtorch's own tests cover it)."""


def _ggtorch_trainer(gguf: Path, tmp_path: Path, objective: str, **options):
    trainer = api.finetune(model_base=str(gguf), records=RECORDS, objective=objective, batch=len(RECORDS),
                           ctx=64, batching="pad", seed=1, adam_gclip=0.0, checkpoint_out="", lora_out="",
                           log_file=str(tmp_path / "log.jsonl"), progress=False, run=False, device="cpu",
                           lora_dropout=0.0, lora_r=4, lora_alpha=8, dtype="f32", **NO_OUTPUT_LORA,
                           **options)  # TRL's side computes in f32
    with torch.no_grad():  # both halves away from their init, so the policy differs from the reference
        for _, p, _ in trainer.params:
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    return trainer


def _trl_inputs(trainer, pad_id: int) -> dict[str, torch.Tensor]:
    """ggtorch's encoded pairs, in file order, through TRL's collator: prompt ids, then each answer's ids."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    examples = []
    for pair in trainer.data.fitted:
        (chosen,), (rejected,) = pair.chosen, pair.rejected
        sides = []
        for enc in (chosen, rejected):
            start = int(enc.trained.argmax())
            assert enc.trained[start:].all()  # the answer is the sequence's tail
            sides.append((enc.tokens[:start].tolist(), enc.tokens[start:].tolist()))
        assert sides[0][0] == sides[1][0]
        examples.append({"prompt_ids": sides[0][0], "chosen_ids": sides[0][1], "rejected_ids": sides[1][1]})
    return DataCollatorForPreference(pad_token_id=pad_id)(examples)


def _gguf_layout_grads(peft_model, base, out: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The LoRA gradients of a peft model as GGUF (A, B) pairs: written in place of the weights, read back by
    ggtorch's PEFT import (rows of q and k permuted as the converter does)."""
    with torch.no_grad():
        for _, p in peft_model.named_parameters():
            if p.requires_grad:
                p.copy_(p.grad)
    peft_model.save_pretrained(str(out))
    return {name: (pair.a, pair.b) for name, pair in import_peft(out, base).pairs.items()}


def _both_sides(converted: Callable[..., Path], tmp_path: Path, objective: str, **options):  # noqa: F811
    """(ggtorch's trainer, peft's model carrying the same adapter, the checkpoint's tokenizer, the GGUF)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, hf_dir = converted(FAMILY), converted(FAMILY, "HF")
    base = read_gguf(gguf)
    trainer = _ggtorch_trainer(gguf, tmp_path, objective, **options)
    export_peft(adapter_from_model(trainer.model, base), base, tmp_path / "start")
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "start"), is_trainable=True)
    return trainer, peft_model, AutoTokenizer.from_pretrained(str(hf_dir)), base


def _assert_same_step(ours, theirs_loss: float, theirs_metrics: dict[str, float], trainer, peft_model, base,
                      tmp_path: Path) -> None:
    """The step's loss, TRL's metrics, and every LoRA gradient (compared in the GGUF layout)."""
    assert ours.loss == pytest.approx(theirs_loss, rel=1e-5, abs=1e-6)
    assert abs(ours.loss) > 0.01  # not a degenerate batch
    for name in preference.METRICS:
        assert ours.metrics[name] == pytest.approx(theirs_metrics[name], rel=1e-5, abs=1e-5), name
    with torch.no_grad():  # the gradients in place of the weights, written out as an adapter in the GGUF layout
        for _, p, _ in trainer.params:
            p.copy_(p.grad)
    ours_pairs = {name: (pair.a, pair.b) for name, pair in adapter_from_model(trainer.model, base).pairs.items()}
    theirs_pairs = _gguf_layout_grads(peft_model, base, tmp_path / "theirs")
    assert set(ours_pairs) == set(theirs_pairs) and len(ours_pairs) >= 7 * 2
    for name, (a, b) in ours_pairs.items():
        ta, tb = theirs_pairs[name]
        for got, want in ((a, ta), (b, tb)):
            assert want.abs().max() > 0, name
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()), msg=name)


@pytest.mark.parametrize("objective", ["dpo", "ipo"])
def test_a_dpo_step_equals_trls_dpo_trainer(converted: Callable[..., Path], tmp_path: Path,  # noqa: F811
                                            objective: str) -> None:
    """TRL's DPOTrainer.compute_loss (its forward, log-probabilities, loss and logged metrics) on ggtorch's pairs."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    trainer, peft_model, tokenizer, base = _both_sides(converted, tmp_path, objective, beta=0.1)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.1, loss_type=["sigmoid" if objective == "dpo" else "ipo"],
                     per_device_train_batch_size=len(RECORDS), report_to="none", use_cpu=True, max_length=None,
                     seed=1)
    dpo = DPOTrainer(model=peft_model, args=args, train_dataset=Dataset.from_list(RECORDS),
                     processing_class=tokenizer)
    # Given a PeftModel, TRL keeps a copy of its adapter as the reference (a run continuing another adapter); ggtorch's
    # runs start from a fresh adapter, whose reference is the base: TRL's too once that copy is gone.
    peft_model.delete_adapter("ref")
    peft_model.train()
    theirs = dpo.compute_loss(peft_model, _trl_inputs(trainer, pad_id=tokenizer.eos_token_id))
    theirs.backward()
    metrics = {k: v[-1] for k, v in dpo._metrics["train"].items()}
    _assert_same_step(trainer.step(), theirs.item(), metrics, trainer, peft_model, base, tmp_path)
    trainer.close()


def test_an_orpo_step_equals_trls_orpo_trainer(converted: Callable[..., Path], tmp_path: Path) -> None:  # noqa: F811
    """TRL's ORPOTrainer: its concatenated forward (the answers' mean log-probabilities) and odds-ratio loss, plus the
    chosen answers' NLL. TRL's experimental trainer counts the prompt's tokens in that NLL too; the paper's NLL, and
    ggtorch's, is the answer's, so that term is taken on TRL's chosen logits over the answer's labels."""
    import torch.nn.functional as F
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    lam = 0.25
    trainer, peft_model, tokenizer, base = _both_sides(converted, tmp_path, "orpo", orpo_lambda=lam)
    args = ORPOConfig(output_dir=str(tmp_path / "trl"), beta=lam, max_length=64, padding_value=tokenizer.eos_token_id,
                      per_device_train_batch_size=len(RECORDS), report_to="none", use_cpu=True, seed=1)
    orpo = ORPOTrainer(model=peft_model, args=args, train_dataset=Dataset.from_list(RECORDS),
                       processing_class=tokenizer)
    peft_model.train()
    collated = _trl_inputs(trainer, pad_id=tokenizer.eos_token_id)  # rows: the chosen sequences, then the rejected
    labels = collated["input_ids"].masked_fill(collated["completion_mask"] == 0, -100)
    n = len(RECORDS)
    batch = {f"{side}_{key}": value[rows] for side, rows in (("chosen", slice(0, n)), ("rejected", slice(n, None)))
             for key, value in (("input_ids", collated["input_ids"]), ("attention_mask", collated["attention_mask"]),
                                ("labels", labels))}
    chosen_logps, rejected_logps, chosen_logits, _, _ = orpo.concatenated_forward(peft_model, batch)
    ratio_losses, chosen_rewards, rejected_rewards, _, _ = orpo.odds_ratio_loss(chosen_logps, rejected_logps)
    nll = F.cross_entropy(chosen_logits.reshape(-1, chosen_logits.shape[-1]), batch["chosen_labels"][:, 1:].reshape(-1))
    theirs = nll - ratio_losses.mean()
    theirs.backward()
    margins = chosen_rewards - rejected_rewards
    metrics = {"rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
               "rewards/margins": margins.mean().item(), "rewards/accuracies": (margins > 0).float().mean().item(),
               "logps/chosen": chosen_logps.mean().item(), "logps/rejected": rejected_logps.mean().item()}
    _assert_same_step(trainer.step(), theirs.item(), metrics, trainer, peft_model, base, tmp_path)
    trainer.close()

"""Resuming a checkpoint under another loss: refused where the loss would be another one (--objective, the reference
model), said once where a weight of the same loss changed (--beta and the like), and said once where a checkpoint
written before checkpoints recorded their objective cannot be checked."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ggtorch import api
from ggtorch.errors import BadFlag
from ggtorch.io.checkpoint import base_identity, load_checkpoint
from ggtorch.io.gguf import read_gguf
from ggtorch.training.run import Run
from ggtorch.training.trainer import Trainer
from tests.llama_models import rewrite_gguf
from tests.training.test_preference import RECORDS

ANSWERS = [{"prompt": r["prompt"], "response": r["chosen"]} for r in RECORDS]
"""The same prompts as supervised records: what an SFT run before a preference run trains on."""


def _options(stories260k: Path, folder: Path, objective: str, **options: Any) -> dict[str, Any]:
    return {"model_base": str(stories260k), "records": ANSWERS if objective == "sft" else RECORDS,
            "objective": objective, "batch": 2, "ctx": 48, "seed": 3, "adam_iter": 1, "lora_r": 2, "threads": 1,
            "device": "cpu", "use_checkpointing": False, "save_every": 0, "lora_out": "", "progress": False,
            "checkpoint_out": str(folder / "ck-ITERATION.gguf"), "log_file": str(folder / "log.jsonl"), **options}


def _train(stories260k: Path, folder: Path, objective: str, **options: Any) -> Path:
    """A one-iteration run of ``objective``; its checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    api.finetune(**_options(stories260k, folder, objective, checkpoint_in="", **options)).close()
    return folder / "ck-LATEST.gguf"


def _resume(stories260k: Path, checkpoint: Path, objective: str, **options: Any) -> Trainer:
    trainer = api.finetune(**_options(stories260k, checkpoint.parent, objective, checkpoint_in=str(checkpoint),
                                      run=False, **options))
    trainer.close()
    return trainer


@pytest.fixture(scope="module")
def checkpoint(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``checkpoint(objective)``: a one-iteration checkpoint of that objective, trained once per module."""
    made: dict[str, Path] = {}

    def make(objective: str) -> Path:
        if objective not in made:
            made[objective] = _train(stories260k, tmp_path_factory.mktemp(objective), objective)
        return made[objective]

    return make


MERGE_FIRST = "merge its adapter into the base first (ggtorch export-lora) and start a new run on the merged model"
NEW_RUN = "or start a new run with --checkpoint-in ''"


@pytest.mark.parametrize(("first", "then", "fix"), [
    ("sft", "dpo", MERGE_FIRST),  # DPO's reference would be the base with the adapter off, not the SFT model
    ("sft", "orpo", MERGE_FIRST),
    ("dpo", "sft", NEW_RUN),
    ("dpo", "orpo", NEW_RUN),
    ("dpo", "ipo", NEW_RUN),
])
def test_a_checkpoint_resumed_under_another_objective_is_refused_naming_both_and_the_fix(
        stories260k: Path, checkpoint: Callable[[str], Path], first: str, then: str, fix: str) -> None:
    ck = checkpoint(first)
    with pytest.raises(BadFlag) as refused:
        _resume(stories260k, ck, then)
    message = str(refused.value)
    assert f"{ck} was trained with --objective {first}, and this run asks for --objective {then}" in message
    assert f"pass --objective {first} to continue it" in message and fix in message
    assert "\n" not in message


def test_the_checkpoint_records_the_objective_and_a_changed_weight_is_said_once(
        stories260k: Path, checkpoint: Callable[[str], Path]) -> None:
    """--beta weighs the same loss against the same reference (a schedule may change it, as it may --adam-alpha):
    resumed, with one note naming both values; unchanged, no note."""
    ck = checkpoint("dpo")
    assert load_checkpoint(ck).state["objective"] == {
        "objective": "dpo", "beta": 0.1, "label_smoothing": 0.0, "ref_model": "",
        "reference": base_identity(read_gguf(stories260k))}
    same = _resume(stories260k, ck, "dpo")
    assert same.iteration == 1 and not [n for n in same.notes if "trained with" in n]
    changed = _resume(stories260k, ck, "dpo", beta=0.25, label_smoothing=0.1)
    assert changed.iteration == 1
    said = [n for n in changed.notes if "trained with" in n]
    assert len(said) == 1
    assert "--beta 0.25 (it trained with 0.1), --label-smoothing 0.1 (it trained with 0.0)" in said[0]


def test_another_reference_model_is_refused_and_the_same_model_elsewhere_is_not(
        stories260k: Path, checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """The reference is recorded as the model it is: a copy of the base as --ref-model is the reference the run had
    (the base with the adapter off); a model of the same vocabulary but another identity is not."""
    ck = checkpoint("dpo")
    other = rewrite_gguf(stories260k, tmp_path / "other.gguf", set_keys={"general.name": "another model"})
    with pytest.raises(BadFlag, match="was trained against the base, adapter off as its reference model, and this "
                                      f"run's is --ref-model {other}, another model"):
        _resume(stories260k, ck, "dpo", ref_model=str(other))
    copy = shutil.copy(stories260k, tmp_path / "copy-of-the-base.gguf")
    assert _resume(stories260k, ck, "dpo", ref_model=str(copy)).iteration == 1


def test_a_checkpoint_without_the_record_resumes_with_a_note_that_it_is_not_checked(
        stories260k: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints written before this record: their objective is unknown (an old DPO checkpoint must still resume
    as DPO), so any objective resumes them, saying once that it was not checked."""
    state = Run.state
    with monkeypatch.context() as m:  # the writer as it was: no "objective" in the state
        m.setattr(Run, "state", lambda self: {k: v for k, v in state(self).items() if k != "objective"})
        ck = _train(stories260k, tmp_path, "dpo")
    assert "objective" not in load_checkpoint(ck).state
    resumed = _resume(stories260k, ck, "dpo")
    assert resumed.iteration == 1
    assert [n for n in resumed.notes if "recorded their objective" in n] == [
        f"{ck} was written before checkpoints recorded their objective, so resuming it with --objective dpo is not "
        "checked; it must have trained with that"]

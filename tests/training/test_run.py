"""A run's parts: what is trained (LoRA adapters or every weight) chosen once from the config, and callbacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggtorch.errors import BadFlag
from ggtorch.io.gguf import read_gguf
from ggtorch.training.config import FinetuneConfig, TrainConfig
from ggtorch.training.trainer import Callback, StepResult, Trainer
from ggtorch.training.weights import FullWeights, LoraWeights


def options(stories260k: Path, texts: dict[str, Path], out: Path) -> dict[str, object]:
    return dict(model_base=str(stories260k), train_data=str(texts["train"]), ctx=16, batch=2, adam_iter=1, warmup=0,
                seed=4, threads=1, save_every=0, use_checkpointing=False, checkpoint_in="",
                checkpoint_out=str(out / "ck-ITERATION.gguf"))


def lora_run(stories260k: Path, texts: dict[str, Path], out: Path, **more: object) -> FinetuneConfig:
    return FinetuneConfig(**{**options(stories260k, texts, out), "lora_out": str(out / "lora-ITERATION.gguf"),
                             **more})  # type: ignore[arg-type]


def full_run(stories260k: Path, texts: dict[str, Path], out: Path, **more: object) -> TrainConfig:
    return TrainConfig(**{**options(stories260k, texts, out), "model_out": str(out / "model-ITERATION.gguf"),
                          **more})  # type: ignore[arg-type]


def test_the_config_chooses_what_is_trained_and_saved(stories260k: Path, texts: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """A FinetuneConfig trains exactly the adapters and saves an adapter; a TrainConfig every weight and a model."""
    (tmp_path / "lora").mkdir(), (tmp_path / "full").mkdir()
    lora = Trainer(lora_run(stories260k, texts, tmp_path / "lora"), log_records=False)
    assert isinstance(lora.weights, LoraWeights) and lora.lora_config is not None and not lora.full
    trainable = {id(p) for p in lora.model.parameters() if p.requires_grad}
    assert trainable and {id(p) for _, p, _ in lora.params} == trainable
    assert lora.weights.checkpoint_tensors() and all(
        name.endswith((".lora_a", ".lora_b")) for name in lora.weights.checkpoint_tensors())
    with pytest.raises(BadFlag, match="full training"):
        lora.model_tensors()
    lora.train()
    lora.close()
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == [
        "ck-1.gguf", "ck-LATEST.gguf", "lora-1.gguf", "lora-LATEST.gguf"]
    assert read_gguf(tmp_path / "lora" / "lora-1.gguf").get("general.type") == "adapter"

    full = Trainer(full_run(stories260k, texts, tmp_path / "full"), log_records=False)
    assert isinstance(full.weights, FullWeights) and full.lora_config is None and full.full
    assert all(p.requires_grad for p in full.model.parameters())
    base_names = list(read_gguf(stories260k).tensors)
    assert list(full.model_tensors()) == base_names
    assert set(full.weights.checkpoint_tensors()) == set(base_names)
    full.train()
    full.close()
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == [
        "ck-1.gguf", "ck-LATEST.gguf", "model-1.gguf", "model-LATEST.gguf"]
    assert read_gguf(tmp_path / "full" / "model-1.gguf").get("general.type") != "adapter"


def test_each_kind_resumes_only_its_own_checkpoints(stories260k: Path, texts: dict[str, Path],
                                                     tmp_path: Path) -> None:
    (tmp_path / "lora").mkdir(), (tmp_path / "full").mkdir()
    for config in (lora_run(stories260k, texts, tmp_path / "lora"), full_run(stories260k, texts, tmp_path / "full")):
        trainer = Trainer(config, log_records=False)
        trainer.train()
        trainer.close()
    lora_ck, full_ck = tmp_path / "lora" / "ck-LATEST.gguf", tmp_path / "full" / "ck-LATEST.gguf"
    with pytest.raises(BadFlag, match="a LoRA finetune checkpoint; resume it with `ggtorch finetune`"):
        Trainer(full_run(stories260k, texts, tmp_path / "full", checkpoint_in=str(lora_ck)), log_records=False)
    with pytest.raises(BadFlag, match="a full-weight training checkpoint; resume it with `ggtorch train`"):
        Trainer(lora_run(stories260k, texts, tmp_path / "lora", checkpoint_in=str(full_ck)), log_records=False)
    resumed = Trainer(lora_run(stories260k, texts, tmp_path / "lora", checkpoint_in=str(lora_ck)), log_records=False)
    assert resumed.iteration == 1 and resumed.resumed_from == lora_ck
    resumed.close()


class OnlySaves(Callback):
    """A Callback subclass overriding one hook: the others are the base class's no-ops."""

    def __init__(self) -> None:
        self.saves: list[list[str]] = []

    def on_save(self, trainer: Trainer, paths: list[Path]) -> None:
        self.saves.append([p.name for p in paths])


class OnlySteps:
    """No base class and one hook: the trainer calls what it finds."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step(self, trainer: Trainer, result: StepResult) -> None:
        self.steps.append(result.iteration)


def test_callbacks_need_only_the_hooks_they_use(stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    saves, steps = OnlySaves(), OnlySteps()
    trainer = Trainer(lora_run(stories260k, texts, tmp_path, adam_iter=2, val_split=0.2, eval_every=1),
                      [saves, steps], log_records=False)
    results = trainer.train()
    assert trainer.evaluate() is not None
    trainer.close()
    assert steps.steps == [1, 2]
    assert saves.saves == [["ck-2.gguf", "ck-LATEST.gguf", "lora-2.gguf", "lora-LATEST.gguf"]]
    base = Callback()
    assert base.on_step(trainer, results[0]) is None and base.on_eval(trainer, 1, 0.5) is None
    assert base.on_save(trainer, []) is None


def test_eval_every_without_validation_data_is_said_once(stories260k: Path, texts: dict[str, Path],
                                                         tmp_path: Path) -> None:
    """--eval-every with nothing to evaluate changes nothing the run trains: a warning says so (not a refusal); with
    validation data, or left at its default, nothing is said."""
    said = "--eval-every 5 has no validation data to evaluate, so it does nothing; give --val-data or --val-split"
    cases = (("none", {"eval_every": 5}, [said]), ("split", {"eval_every": 5, "val_split": 0.1}, []),
             ("default", {}, []))
    for name, more, expected in cases:
        (tmp_path / name).mkdir()
        trainer = Trainer(lora_run(stories260k, texts, tmp_path / name, **more), log_records=False)
        assert [w for w in trainer.warnings if "--eval-every" in w] == expected
        trainer.close()

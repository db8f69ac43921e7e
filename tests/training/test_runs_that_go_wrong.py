"""Runs that go wrong on purpose: a NaN loss skipped or stopping, invalid UTF-8 replaced or refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ggtorch.lora import lora_tensors_by_gguf_name
from ggtorch.training.config import NAN_SKIP_LIMIT, FinetuneConfig
from ggtorch.training.trainer import NonFiniteLoss, Trainer
from tests.training.test_finetune import run


@pytest.fixture(scope="session")
def text(texts: dict[str, Path]) -> Path:
    return texts["train"]


def trainer(stories260k: Path, text: Path, out: Path, **options: object) -> Trainer:
    config = FinetuneConfig(model_base=str(stories260k), train_data=str(text), ctx=16, batch=2, adam_iter=5,
                            warmup=1, adam_alpha=0.01, seed=2, threads=1, save_every=1, checkpoint_in="",
                            checkpoint_out=str(out / "ck-ITERATION.gguf"), lora_out="", **options)  # type: ignore
    return Trainer(config)


class PoisonOutput:
    """A forward hook on the real model's output layer: NaN logits on the chosen forward calls."""

    def __init__(self, trainer: Trainer, poisoned: set[int]) -> None:
        self.trainer, self.poisoned, self.calls = trainer, poisoned, 0
        self.weights_at_call: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        lora = lora_tensors_by_gguf_name(self.trainer.model)
        self.weights_at_call[self.calls] = {k: v.clone() for k, v in lora.items()}
        return output * float("nan") if self.calls in self.poisoned else output


def records(log: Path, kind: str) -> list[dict[str, object]]:
    return [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == kind]


def test_on_nan_skip_drops_that_update_and_reaches_the_target(stories260k: Path, text: Path, tmp_path: Path) -> None:
    t = trainer(stories260k, text, tmp_path, on_nan="skip", use_checkpointing=False)
    hook = PoisonOutput(t, poisoned={2, 3})  # the second and third steps' forwards give NaN logits
    t.model.output.register_forward_hook(hook)
    results = t.train()
    t.close()
    assert t.iteration == 5 and len(results) == 5 and t.skipped_steps == 2
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in results)
    # the two poisoned steps changed nothing: the next step starts from the weights after step 1
    for name, value in hook.weights_at_call[2].items():
        assert torch.equal(hook.weights_at_call[4][name], value), name
    assert [r["iteration"] for r in records(t.log.path, "skip")] == [2, 2]
    assert all(torch.isfinite(v).all() for v in lora_tensors_by_gguf_name(t.model).values())


def test_on_nan_skip_stops_after_too_many_in_a_row(stories260k: Path, text: Path, tmp_path: Path) -> None:
    t = trainer(stories260k, text, tmp_path, on_nan="skip", use_checkpointing=False)
    t.model.output.register_forward_hook(PoisonOutput(t, poisoned=set(range(2, 100))))
    with pytest.raises(NonFiniteLoss, match=f"in {NAN_SKIP_LIMIT} steps in a row at iteration 2"):
        t.train()
    t.close()
    assert len(records(t.log.path, "skip")) == NAN_SKIP_LIMIT
    assert (tmp_path / "ck-1.gguf").is_file() and not (tmp_path / "ck-2.gguf").exists()


def test_on_nan_stop_is_the_default(stories260k: Path, text: Path, tmp_path: Path) -> None:
    t = trainer(stories260k, text, tmp_path, use_checkpointing=False)
    t.model.output.register_forward_hook(PoisonOutput(t, poisoned={3}))
    with pytest.raises(NonFiniteLoss, match="the loss became nan at iteration 3"):
        t.train()
    t.close()
    assert t.iteration == 2 and (tmp_path / "ck-LATEST.gguf").is_file()


def test_invalid_utf8_names_the_byte_or_is_replaced_by_flag(stories260k: Path, text: Path, tmp_path: Path) -> None:
    bad = tmp_path / "latin1.txt"
    good = text.read_bytes()[:3000]
    bad.write_bytes(good[:1234] + b"caf\xe9 " + good[1234:])  # one Latin-1 byte at offset 1237
    common = ["finetune", "--model-base", str(stories260k), "--train-data", str(bad), "-c", "16", "-b", "2", "-n", "1",
              "-t", "1", "--checkpoint-out", "", "--lora-out", "out.gguf"]
    code, out = run(common, tmp_path)
    assert code == 1 and "is not valid UTF-8: byte 1237 (0xe9)" in out and "--utf8-errors replace" in out
    code, out = run([*common, "--utf8-errors", "replace"], tmp_path)
    assert code == 0, out
    assert (tmp_path / "out.gguf").is_file()
    # the replaced text is what a strict run of the same text with U+FFFD in place of the byte trains on
    from ggtorch.data import check_utf8

    assert check_utf8(bad.read_bytes(), errors="replace") == good[:1234] + "caf\ufffd ".encode() + good[1234:]

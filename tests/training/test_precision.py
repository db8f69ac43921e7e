"""How a run computes: ``auto``'s device and dtype, f16's loss scaler (skips counted, exact resume), out of memory on
a GPU named as on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ggtorch.errors import OutOfMemory
from ggtorch.ops import policy
from ggtorch.training import run
from ggtorch.training.config import FinetuneConfig
from ggtorch.training.trainer import Trainer, _failed_allocation


def _config(stories260k: Path, texts: dict[str, Path], tmp_path: Path, **changes: object) -> FinetuneConfig:
    fields: dict[str, object] = dict(model_base=str(stories260k), train_data=str(texts["train"]), ctx=32, batch=4,
                                     adam_iter=4, warmup=1, adam_alpha=0.01, seed=2, checkpoint_in="",
                                     checkpoint_out="", lora_out="", log_file=str(tmp_path / "log.jsonl"))
    return FinetuneConfig(**{**fields, **changes})


def _records(log: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == kind]


def test_auto_is_the_default_and_takes_the_device_policys_dtype(stories260k: Path, texts: dict[str, Path],
                                                                tmp_path: Path) -> None:
    """``--device auto --dtype auto`` (the defaults) train on the CPU here in the CPU policy's train_dtype (f32, or
    bf16 where the CPU multiplies bf16 natively and faster); a device whose policy trains in bf16 (CUDA from Ampere)
    gets bf16 autocast, and the log and the trainer's config say which."""
    assert (FinetuneConfig.device, FinetuneConfig.dtype) == ("auto", "auto")
    trainer = Trainer(_config(stories260k, texts, tmp_path, adam_iter=1))
    trainer.close()
    assert (trainer.device.type, trainer.config.dtype) == ("cpu", policy.current("cpu").train_dtype)
    bf16_device = policy.choose("cpu").replace(train_dtype="bf16")
    with policy.using(bf16_device):
        trainer = Trainer(_config(stories260k, texts, tmp_path, adam_iter=1, log_file=str(tmp_path / "bf16.jsonl")))
        trainer.train()
        trainer.close()
    assert trainer.config.dtype == "bf16" and trainer.run.scaler is None
    assert _records(tmp_path / "bf16.jsonl", "start")[0]["config"]["dtype"] == "bf16"


def test_f16_overflowing_gradients_skip_the_update_and_halve_the_scale(stories260k: Path, texts: dict[str, Path],
                                                                       tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A loss scale too large for f16 makes inf gradients: each such step leaves the adapter and the optimizer as
    they were, halves the scale and is logged as a skip; the run still makes its ``adam_iter`` updates."""
    monkeypatch.setattr(run, "F16_INITIAL_LOSS_SCALE", 2.0**40)
    trainer = Trainer(_config(stories260k, texts, tmp_path, dtype="f16", adam_iter=3))
    before = [p.detach().clone() for _, p, _ in trainer.params]
    first = trainer.step()
    assert first.skipped and trainer.iteration == 0 and not trainer.history
    assert all(torch.equal(a, p) for a, (_, p, _) in zip(before, trainer.params, strict=True))
    results = trainer.train()
    trainer.close()
    assert [r.iteration for r in results] == [1, 2, 3] and not any(r.skipped for r in results)
    skips = _records(tmp_path / "log.jsonl", "skip")
    assert len(skips) == trainer.skipped_steps >= 2
    scales = [s["loss_scale"] for s in skips]
    assert scales == [2.0**40 / 2 ** (i + 1) for i in range(len(scales))]
    assert _records(tmp_path / "log.jsonl", "end")[0]["skipped_steps"] == trainer.skipped_steps
    assert trainer.run.scaler.get_scale() == scales[-1]  # no overflow after the last skip: the scale stays
    assert all(torch.isfinite(p).all() for _, p, _ in trainer.params)


def test_f16_resume_is_exact_with_the_loss_scale(stories260k: Path, texts: dict[str, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """4 f16 steps in one run == 2, then resumed for 2: the checkpoint carries the loss scale, so the resumed run
    does not start over at the initial scale (and skip, drawing other batches)."""
    monkeypatch.setattr(run, "F16_INITIAL_LOSS_SCALE", 2.0**30)
    adapters = {}
    for name, parts in (("whole", [4]), ("resumed", [2, 2])):
        folder = tmp_path / name
        folder.mkdir()
        for i, n in enumerate(parts):
            checkpoint = str(folder / "checkpoint-ITERATION.gguf")
            trainer = Trainer(_config(stories260k, texts, folder, dtype="f16", adam_iter=n,
                                      checkpoint_out=checkpoint,
                                      checkpoint_in=str(folder / "checkpoint-LATEST.gguf") if i else "",
                                      lora_out=str(folder / "lora-ITERATION.gguf")))
            trainer.train()
            trainer.close()
        adapters[name] = (folder / "lora-4.gguf").read_bytes()
    assert adapters["whole"] == adapters["resumed"]
    assert _records(tmp_path / "resumed" / "log.jsonl", "skip"), "the scale never overflowed: the test shows nothing"


@pytest.mark.parametrize(("message", "mib"), [
    ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB "
     "is free.", 2048),
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 52428800 bytes. Error code 12", 50),
    ("MPS backend out of memory (MPS allocated: 8.00 GB). Tried to allocate 512.00 MiB on private pool.", 512),
])
def test_each_allocators_failed_size_is_read(message: str, mib: int) -> None:
    assert _failed_allocation(message) == f"{mib} MiB more could not be allocated"


def test_out_of_memory_on_a_gpu_keeps_the_checkpoint_and_names_the_flags(stories260k: Path, texts: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """torch.OutOfMemoryError, as CUDA's allocator raises it mid-step, stops the run with one message (the size,
    the checkpoint kept, the flags that lower memory); the checkpoint saved before is untouched."""

    class RunsOutOfMemory:
        def on_step(self, trainer: Trainer, result: object) -> None:
            if trainer.iteration == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total "
                                             "capacity of 79.19 GiB of which 312.00 MiB is free.")

    latest = tmp_path / "checkpoint-LATEST.gguf"
    trainer = Trainer(_config(stories260k, texts, tmp_path, save_every=1,
                              checkpoint_out=str(tmp_path / "checkpoint-ITERATION.gguf")), [RunsOutOfMemory()])
    with pytest.raises(OutOfMemory) as e:
        trainer.train()
    trainer.close()
    message = str(e.value)
    assert message.startswith("out of memory in iteration 3 (1536 MiB more could not be allocated); the last "
                              f"checkpoint, {latest} (iteration 1), is kept"), message
    assert "a smaller --batch or --ctx" in message

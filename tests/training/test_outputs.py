"""A run's outputs: never another run's by accident, locked while it writes, never holding NaN or inf, and its log
lines kept apart from other runs' (the command-line refusals are rows of tests/cli/test_bad_inputs.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ggtorch.errors import BadFlag
from ggtorch.io.checkpoint import load_checkpoint
from ggtorch.io.gguf import read_gguf
from ggtorch.lora import lora_tensors_by_gguf_name
from ggtorch.training.config import FinetuneConfig
from ggtorch.training.log import logged_runs, read_log
from ggtorch.training.trainer import NonFiniteLoss, Trainer
from tests.helpers import run_cli


def config(stories260k: Path, text: Path, out: Path, **options: object) -> FinetuneConfig:
    values: dict[str, object] = dict(model_base=str(stories260k), train_data=str(text), ctx=8, batch=1, adam_iter=1,
                                     lora_r=2, warmup=0, seed=3, threads=1, save_every=1, use_checkpointing=False,
                                     checkpoint_out=str(out / "ck-ITERATION.gguf"),
                                     lora_out=str(out / "lora-ITERATION.gguf"))
    return FinetuneConfig(**{**values, **options})  # type: ignore[arg-type]


def train(cfg: FinetuneConfig) -> Trainer:
    trainer = Trainer(cfg)
    trainer.train()
    trainer.close()
    return trainer


def test_a_new_run_over_another_runs_checkpoint_refuses_resumes_or_overwrites(
        stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    first = train(config(stories260k, texts["train"], tmp_path, checkpoint_in=""))
    kept = (tmp_path / "ck-LATEST.gguf").read_bytes()
    with pytest.raises(BadFlag, match="ck-LATEST.gguf is there from another run \\(a checkpoint at iteration 1\\)"):
        Trainer(config(stories260k, texts["train"], tmp_path, checkpoint_in=""))
    assert (tmp_path / "ck-LATEST.gguf").read_bytes() == kept  # refused before any work: nothing written
    resumed = train(config(stories260k, texts["train"], tmp_path, checkpoint_in=str(tmp_path / "ck-LATEST.gguf")))
    assert resumed.iteration == first.iteration + 1
    over = train(config(stories260k, texts["train"], tmp_path, checkpoint_in="", overwrite=True))
    assert over.iteration == 1 and load_checkpoint(tmp_path / "ck-LATEST.gguf").iteration == 1


def test_the_old_default_checkpoint_in_resumes_only_when_it_is_there(stories260k: Path, texts: dict[str, Path],
                                                                      tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --checkpoint-in a run resumes checkpoint.gguf when the folder has one, as the old finetune did."""
    monkeypatch.chdir(tmp_path)
    cfg = config(stories260k, texts["train"], tmp_path / "a", checkpoint_in=None)
    (tmp_path / "a").mkdir()
    assert train(cfg).resumed_from is None
    os.replace(tmp_path / "a" / "ck-LATEST.gguf", tmp_path / "checkpoint.gguf")
    (tmp_path / "b").mkdir()
    again = train(config(stories260k, texts["train"], tmp_path / "b", checkpoint_in=None))
    assert again.resumed_from == Path("checkpoint.gguf") and again.iteration == 2


LOCK_HOLDER = """
import sys, time
from pathlib import Path
from ggtorch.io.lock import OutputLock
from ggtorch.io.paths import Output
lock = OutputLock([Output("--checkpoint-out", sys.argv[1], pattern="ITERATION", latest="LATEST")]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_on_the_same_outputs_refuses_with_the_first_ones_process_id(
        stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    """Another process holds the outputs: refused, naming it; killed with -9, it holds nothing any more."""
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(tmp_path / "ck-ITERATION.gguf")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        args = ["finetune", "--model-base", stories260k, "--train-data", texts["train"], "-c", "8", "-b", "1", "-n",
                "1", "--lora-r", "2", "-t", "1", "--checkpoint-in", "", "--checkpoint-out",
                tmp_path / "ck-ITERATION.gguf", "--lora-out", tmp_path / "lora-ITERATION.gguf"]
        result = run_cli(args)
        assert result.exit_code == 1
        assert f"another ggtorch run (process {holder.pid}) is writing --checkpoint-out" in result.output
        assert not (tmp_path / "ck-1.gguf").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no lock file left behind


def test_two_runs_in_one_process_share_its_lock(stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    """A notebook that builds a run again before dropping the first (a cell run twice) is not refused by itself."""
    first = Trainer(config(stories260k, texts["train"], tmp_path, checkpoint_in=""))
    second = Trainer(config(stories260k, texts["train"], tmp_path, checkpoint_in=""))
    first.close()
    second.train()
    second.close()
    assert second.iteration == 1 and not list(tmp_path.glob(".*.lock"))


class PoisonWeights:
    """A callback that turns one LoRA weight into inf after the given step (as an overflow would)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step(self, trainer: Trainer, result: object) -> None:
        if trainer.iteration == self.at:
            with torch.no_grad():
                next(iter(lora_tensors_by_gguf_name(trainer.model).values())).view(-1)[0] = float("inf")


def test_no_file_is_written_with_nan_or_inf_and_the_message_names_the_kept_checkpoint(
        stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    cfg = config(stories260k, texts["train"], tmp_path, checkpoint_in="", adam_iter=4)
    trainer = Trainer(cfg, [PoisonWeights(at=2)])
    with pytest.raises(NonFiniteLoss) as e:
        trainer.train()
    trainer.close()
    message = str(e.value)
    assert "the trained weights hold NaN or inf at iteration 2" in message
    assert f"the last checkpoint with finite weights, {tmp_path / 'ck-LATEST.gguf'} (iteration 1), is kept" in message
    assert not (tmp_path / "ck-2.gguf").exists() and not (tmp_path / "lora-2.gguf").exists()
    assert load_checkpoint(tmp_path / "ck-LATEST.gguf").iteration == 1
    for path in tmp_path.glob("*.gguf"):
        for name, info in read_gguf(path).tensors.items():
            if info.ggml_type.name in ("F32", "F16", "BF16"):
                assert torch.isfinite(info.raw().view(getattr(torch, {"F32": "float32", "F16": "float16",
                                                                      "BF16": "bfloat16"}[info.ggml_type.name]))
                                      ).all(), (path, name)


@pytest.mark.parametrize(("option", "value", "message"), [
    ("train_on_prompt", "false", "--train-on-prompt must be true or false, got the text 'false'"),
    ("ctx", 16.0, "--ctx must be a whole number, got 16.0"),
    ("adam_alpha", "0.1", "--adam-alpha must be a number, got the text '0.1'"),
    ("adam_beta1", True, "--adam-beta1 must be a number, got True"),
    ("adam_alpha", 1e39, "--adam-alpha must be a finite number within f32's range"),
    ("model_base", 5, "--model-base must be text, got 5"),
])
def test_api_options_are_typed_as_flags_are(stories260k: Path, option: str, value: object, message: str) -> None:
    with pytest.raises(BadFlag, match=message.replace("(", "\\(").replace(")", "\\)")):
        FinetuneConfig(**{"model_base": str(stories260k), option: value})  # type: ignore[arg-type]


def test_api_file_options_take_paths(stories260k: Path) -> None:
    assert FinetuneConfig(model_base=stories260k).model_base == str(stories260k)


def test_each_runs_log_lines_carry_its_id_and_plot_labels_every_run(stories260k: Path, texts: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    """A run, its resumption and a new run over it append to one log; each is told apart and drawn as its own."""
    log = tmp_path / "train-log.jsonl"
    train(config(stories260k, texts["train"], tmp_path, checkpoint_in="", log_file=str(log), adam_iter=2))
    train(config(stories260k, texts["train"], tmp_path, checkpoint_in=str(tmp_path / "ck-LATEST.gguf"),
                 log_file=str(log), adam_iter=2))
    train(config(stories260k, texts["train"], tmp_path, checkpoint_in="", overwrite=True, log_file=str(log),
                 adam_iter=2))
    records = read_log(log)
    assert all("run" in r for r in records) and len({r["run"] for r in records}) == 3
    runs = logged_runs(records)
    assert [[it for it, _ in run.iters] for run in runs] == [[1, 2], [3, 4], [1, 2]]
    assert runs[1].label == "run 2, resumed from ck-LATEST.gguf"
    old = [{k: v for k, v in r.items() if k != "run"} for r in records]  # a log written before runs had ids
    assert [[it for it, _ in run.iters] for run in logged_runs(old)] == [[1, 2], [3, 4], [1, 2]]
    result = run_cli(["plot", log, "-o", tmp_path / "loss.png"])
    assert result.exit_code == 0, result.output
    import matplotlib.pyplot as plt

    from ggtorch.training.log import draw_runs

    _, ax = plt.subplots()
    draw_runs(ax, runs)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "run 1: train loss", "run 2, resumed from ck-LATEST.gguf: train loss", "run 3: train loss"]
    plt.close("all")
    assert json.loads(log.read_text().splitlines()[0])["kind"] == "start"


def test_a_latest_name_that_is_an_iterations_number_is_refused_before_any_file(
        stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    """``--fn-latest 2 --save-every 1`` wrote iteration 3 over checkpoint-2.gguf (the latest copy's name): refused at
    config time, from the command line and from Python alike, before any file is written."""
    args = ["finetune", "--model-base", stories260k, "--train-data", texts["train"], "-c", "8", "-b", "1", "-n", "3",
            "--lora-r", "2", "-t", "1", "--checkpoint-in", "", "--save-every", "1", "--fn-latest", "2",
            "--checkpoint-out", tmp_path / "checkpoint-ITERATION.gguf", "--lora-out", tmp_path / "lora-ITERATION.gguf"]
    result = run_cli(args)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert ("--fn-latest 2 names each output's latest copy as an iteration's file (checkpoint-2.gguf would hold the "
            "newest save, not iteration 2)") in result.output
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(BadFlag, match="--fn-latest 2 names each output's latest copy as an iteration's file"):
        config(stories260k, texts["train"], tmp_path, fn_latest="2")

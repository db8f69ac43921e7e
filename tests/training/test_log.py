"""The training log's TensorBoard copy (--tensorboard): read back with TensorBoard's own reader, its scalars are the
JSON lines' numbers at their iterations, and a resumed run continues the steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tensorboard.backend.event_processing import event_accumulator

import ggtorch
from ggtorch.training.log import TrainLog, read_log, scalars
from tests.helpers import run_cli

TAGS = {"train/loss": ("iter", "loss"), "train/lr": ("iter", "lr"),
        "train/tokens_per_second": ("iter", "tokens_per_second"), "train/memory_gib": ("iter", "memory_gib"),
        "eval/loss": ("eval", "loss")}
"""TensorBoard tag -> the log records and field it copies."""


def events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar TensorBoard shows from ``folder``, per tag, as its own reader loads them."""
    reader = event_accumulator.EventAccumulator(str(folder))
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def expected(records: list[dict[str, Any]], kind: str, name: str) -> list[tuple[int, float]]:
    """(iteration, value) of the log's ``kind`` records, as float32 (TensorBoard's scalar type). A run's ``start``
    at iteration N drops what earlier runs logged after N: a resumed run trains those iterations again."""
    points: list[tuple[int, float]] = []
    for r in records:
        if r["kind"] == "start":
            points = [(step, value) for step, value in points if step <= r["iteration"]]
        elif r["kind"] == kind:
            points.append((r["iteration"], float(np.float32(r[name]))))
    return points


def test_tensorboard_holds_the_logs_scalars_and_a_resumed_run_continues_its_steps(
        stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    board, log = tmp_path / "runs" / "board", tmp_path / "train-log.jsonl"  # runs/ is not there yet: it is made
    common = dict(model_base=stories260k, train_data=texts["train"], val_data=texts["heldout"], ctx=8, batch=1,
                  lora_r=2, threads=1, seed=3, eval_every=2, save_every=2, log_file=log,
                  checkpoint_out=tmp_path / "ck-ITERATION.gguf", lora_out=tmp_path / "lora-ITERATION.gguf")
    args = [a for k, v in common.items() for a in (f"--{k.replace('_', '-')}", v)]
    result = run_cli(["finetune", *args, "--adam-iter", 3, "--checkpoint-in", "", "--tensorboard", board])
    assert result.exit_code == 0, result.output
    first = read_log(log)
    assert [r["iteration"] for r in first if r["kind"] == "eval"] == [2, 3]  # every 2 and at the end
    shown = events(board)
    for tag, (kind, name) in TAGS.items():
        assert shown[tag] == expected(first, kind, name), tag
    assert shown["train/loss"][0][0] == 1
    peak_gib = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmHWM:")) / 2**20  # this process ran the command: its peak resident KiB
    assert all(0.05 < r["memory_gib"] <= peak_gib for r in first if r["kind"] == "iter")

    # the Python API's keyword, resumed from iteration 2: iterations 3 to 5 again, and the first run's eval at 3 goes
    ggtorch.finetune(**common, adam_iter=3, checkpoint_in=str(tmp_path / "ck-2.gguf"), tensorboard=board,
                     progress=False)
    records = read_log(log)
    assert len(records) > len(first)
    shown = events(board)
    for tag, (kind, name) in TAGS.items():
        assert shown[tag] == expected(records, kind, name), tag
    assert [step for step, _ in shown["train/loss"]] == [1, 2, 3, 4, 5]
    assert [step for step, _ in shown["eval/loss"]] == [2, 4, 5]
    assert len(list(board.glob("events.out.tfevents.*"))) == 2  # one file per run, in the same folder


def test_a_preference_runs_metrics_keep_trls_names() -> None:
    """TRL logs ``train/rewards/chosen`` and ``eval/rewards/chosen``; the log's metrics keep those names, and numbers
    only (the iteration is the step, a flag is no curve)."""
    record = {"iteration": 7, "loss": 0.5, "skipped": False, "metrics": {"rewards/chosen": 1.5, "logps/rejected": -3.0}}
    assert scalars("iter", record) == {"train/loss": 0.5, "train/rewards/chosen": 1.5, "train/logps/rejected": -3.0}
    assert scalars("eval", record) == {"eval/loss": 0.5, "eval/rewards/chosen": 1.5, "eval/logps/rejected": -3.0}
    assert scalars("save", {"iteration": 7, "files": ["a.gguf"]}) == {}


def test_a_closed_log_holds_every_scalar_and_a_later_record_is_written_too(tmp_path: Path) -> None:
    """What a notebook reads once a run returns: every record's scalars (the writer's thread may still hold the last
    ones until close drains it), and a record after close (a notebook's evaluate()) reopens the writer."""
    log = TrainLog(tmp_path / "log.jsonl", tensorboard=tmp_path / "board")
    log.write("start", iteration=0)
    losses = [3.0 - 0.01 * i for i in range(1, 41)]
    for i, loss in enumerate(losses, 1):
        log.write("iter", iteration=i, loss=loss, lr=1e-3)
    log.close()
    assert events(tmp_path / "board")["train/loss"] == [(i, float(np.float32(v))) for i, v in enumerate(losses, 1)]
    log.write("eval", iteration=40, loss=2.5)
    log.close()
    assert events(tmp_path / "board")["eval/loss"] == [(40, 2.5)]

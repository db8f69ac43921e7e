"""Data-parallel runs under torchrun (2 CPU ranks, gloo on loopback) against one process with --grad-acc 2.

N ranks with --batch b take, at every micro-step, N consecutive batches of the one shared data
stream (rank r the r-th), so they must train exactly what one process with --grad-acc N does on
the same global batches: the same losses and the same adapter, to float tolerance (DDP sums
gradients in another order). Checkpoints keep the global data position, so a run moves between
world sizes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ggtorch.io.gguf import read_gguf
from ggtorch.lora.adapter_file import read_adapter
from ggtorch.quant.modules import QuantLinear
from ggtorch.training.config import FinetuneConfig
from ggtorch.training.distributed import data_parallel
from ggtorch.training.trainer import Trainer
from tests.helpers import losses, read_log
from tests.training.test_finetune import run

REPO = Path(__file__).resolve().parents[2]
SMALL = ["-c", "32", "-b", "4", "--warmup", "2", "--adam-alpha", "0.01", "--seed", "7", "--threads", "1"]


@pytest.fixture(scope="session")
def train_text(texts: dict[str, Path]) -> Path:
    return texts["train"]


def torchrun(args: list[str], cwd: Path, nproc: int = 2, timeout: float = 120) -> tuple[int, str]:
    """``torchrun --nproc-per-node nproc -m ggtorch ARGS`` on loopback; (exit code, stdout+stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    # --standalone: a local rendezvous on a port the OS picks (no race for a "free" port between test runs)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "ggtorch", *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s (a rank hangs):\n{out}")
    return proc.returncode, out


def assert_same_adapter(a: Path, b: Path) -> None:
    ta, tb = read_adapter(a), read_adapter(b)
    assert ta.pairs.keys() == tb.pairs.keys()
    for name in ta.pairs:
        for x, y in ((ta.pairs[name].a, tb.pairs[name].a), (ta.pairs[name].b, tb.pairs[name].b)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def two_ranks(stories_q8: Path, train_text: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """2 ranks x --batch 4 on the Q8_0 base, 4 iterations, saving at 2 and 4: (folder, torchrun's output)."""
    folder = tmp_path_factory.mktemp("two-ranks")
    code, out = torchrun(["finetune", "--model-base", str(stories_q8), "--train-data", str(train_text), *SMALL,
                          "-n", "4", "--save-every", "2", "--checkpoint-in", "", "--val-split", "0.05"],
                         folder)
    assert code == 0, out
    return folder, out


def one_rank(base: Path, train_text: Path, folder: Path, *args: str) -> str:
    folder.mkdir(exist_ok=True)
    code, out = run(["finetune", "--model-base", str(base), "--train-data", str(train_text), *SMALL,
                     "--grad-acc", "2", "--save-every", "2", "--val-split", "0.05", *args], folder)
    assert code == 0, out
    return out


def test_two_ranks_train_what_one_process_with_grad_acc_2_trains(two_ranks: tuple[Path, str], stories_q8: Path,
                                                                  train_text: Path, tmp_path: Path) -> None:
    folder, out = two_ranks
    assert "batch: 4 x grad-acc 1 per rank x 2 ranks (torch.distributed gloo) = 8 sequences" in out
    one_rank(stories_q8, train_text, tmp_path, "-n", "4", "--checkpoint-in", "")
    two = losses(folder / "checkpoint-log.jsonl")
    one = losses(tmp_path / "checkpoint-log.jsonl")
    assert len(two) == 4 and two[0] != two[-1]
    np.testing.assert_allclose(two, one, rtol=1e-5)
    assert_same_adapter(folder / "ggml-lora-4-f32.gguf", tmp_path / "ggml-lora-4-f32.gguf")
    # the held-out batches are shared out among the ranks; the validation loss is the same
    evals = [[r["loss"] for r in read_log(f / "checkpoint-log.jsonl") if r["kind"] == "eval"]
             for f in (folder, tmp_path)]
    assert len(evals[0]) == 1
    np.testing.assert_allclose(evals[0], evals[1], rtol=1e-6)
    # the data position is global: both consumed the same samples
    assert [r["samples"] for r in read_log(folder / "checkpoint-log.jsonl") if r["kind"] == "iter"] == \
        [r["samples"] for r in read_log(tmp_path / "checkpoint-log.jsonl") if r["kind"] == "iter"]


def test_only_rank_0_writes_and_prints(two_ranks: tuple[Path, str]) -> None:
    folder, out = two_ranks
    assert sorted(p.name for p in folder.iterdir()) == sorted([
        "checkpoint-2.gguf", "checkpoint-4.gguf", "checkpoint-LATEST.gguf", "checkpoint-log.jsonl",
        "ggml-lora-2-f32.gguf", "ggml-lora-4-f32.gguf", "ggml-lora-LATEST-f32.gguf"])
    kinds = [r["kind"] for r in read_log(folder / "checkpoint-log.jsonl")]
    assert kinds == ["start", "iter", "iter", "save", "iter", "iter", "save", "end", "eval"]  # one writer
    assert sum(line.startswith("iter=") for line in out.splitlines()) == 4
    assert out.count("model: ") == 1 and out.count("done: ") == 1


def test_a_two_rank_checkpoint_resumes_in_one_process(two_ranks: tuple[Path, str], stories_q8: Path,
                                                       train_text: Path, tmp_path: Path) -> None:
    """2 ranks to iteration 2, then 1 process (--grad-acc 2) to 4 == the 2-rank run to 4."""
    folder, _ = two_ranks
    shutil.copy(folder / "checkpoint-2.gguf", tmp_path / "start.gguf")
    out = one_rank(stories_q8, train_text, tmp_path, "-n", "2", "--checkpoint-in", "start.gguf")
    assert "resumed from start.gguf at iteration 2" in out
    np.testing.assert_allclose(losses(tmp_path / "checkpoint-log.jsonl"),
                               losses(folder / "checkpoint-log.jsonl")[2:], rtol=1e-5)
    assert_same_adapter(folder / "ggml-lora-4-f32.gguf", tmp_path / "ggml-lora-4-f32.gguf")


def test_full_training_resumes_from_one_process_on_two_ranks(stories260k: Path, train_text: Path,
                                                              tmp_path: Path) -> None:
    """`ggtorch train` from scratch: 1 process (--grad-acc 4) to 2, 2 ranks (--grad-acc 2) to 4 == 1 process to 4.

    With --grad-acc 2 on each rank, the first micro-batch's backward skips DDP's all-reduce (no_sync).
    """
    common = ["train", "--vocab-model", str(stories260k), "--train-data", str(train_text), "--embd", "32", "--ff",
              "64", "--head", "2", "--layer", "1", *SMALL, "--save-every", "2", "--outtype", "f32"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    whole.mkdir(), split.mkdir()
    code, out = run([*common, "--grad-acc", "4", "-n", "4", "--checkpoint-in", ""], whole)
    assert code == 0, out
    code, out = run([*common, "--grad-acc", "4", "-n", "2", "--checkpoint-in", ""], split)
    assert code == 0, out
    code, out = torchrun([*common, "--grad-acc", "2", "-n", "2", "--checkpoint-in", "checkpoint-LATEST.gguf"], split)
    assert code == 0, out
    assert "at iteration 2" in out
    np.testing.assert_allclose(losses(split / "checkpoint-log.jsonl"), losses(whole / "checkpoint-log.jsonl"),
                               rtol=1e-5)
    a, b = read_gguf(whole / "ggml-model-4-f32.gguf"), read_gguf(split / "ggml-model-4-f32.gguf")
    for name, t in a.tensors.items():
        np.testing.assert_allclose(b.tensors[name].data.view(np.float32), t.data.view(np.float32), rtol=1e-4,
                                   atol=1e-6)


@pytest.mark.parametrize(("flags", "message"), [
    # only rank 0 writes, so only rank 0 checks (and misses) the output folder
    (["--checkpoint-out", "missing/ck.gguf"], "error (rank 0 of 2): --checkpoint-out missing/ck.gguf: the folder"),
    # every rank misses the file: still one message
    (["--train-data", "nothing.txt"], "error (rank 0 of 2): --train-data"),
    # a folder sits where the LATEST checkpoint goes: rank 0, which checks the outputs, refuses; rank 1 stops too
    (["--checkpoint-out", "blocked-ITERATION.gguf", "-n", "1"],
     "error (rank 0 of 2): --checkpoint-out blocked-ITERATION.gguf: blocked-LATEST.gguf is a folder"),
    # a combination refused on every rank before training, reported once
    (["--rank-att-norm", "1"], "error (rank 0 of 2): --rank-att-norm train norm adapters"),
])
def test_an_error_on_a_rank_stops_all_with_one_message(flags: list[str], message: str, stories260k: Path,
                                                       train_text: Path, tmp_path: Path) -> None:
    (tmp_path / "blocked-LATEST.gguf").mkdir()
    code, out = torchrun(["finetune", "--model-base", str(stories260k), "--train-data", str(train_text), *SMALL,
                          "-n", "4", "--checkpoint-in", "", *flags], tmp_path)
    assert code != 0
    assert out.count(message) == 1 and out.count("error (rank") == 1, out
    assert out.count("iter=") <= 1  # stopped before training, or after the one step of the save case
    assert out.count("Traceback (most recent call last)") <= 1 and "[rank1]" not in out  # torchrun's own only


def test_a_nan_loss_stops_every_rank_and_is_reported_once(stories260k: Path, train_text: Path,
                                                          tmp_path: Path) -> None:
    code, out = torchrun(["finetune", "--model-base", str(stories260k), "--train-data", str(train_text), *SMALL,
                          "-n", "6", "--checkpoint-in", "", "--adam-alpha", "1e30", "--adam-gclip", "0",
                          "--warmup", "0"], tmp_path)
    assert code != 0
    assert out.count("the loss became") == 1, out
    assert "error (rank 0 of 2): the loss became" in out


def test_ddp_reduces_only_the_lora_tensors(stories_q8: Path, train_text: Path, tmp_path: Path) -> None:
    """DDP's buckets hold the LoRA parameters only; the quantized base and every buffer are never sent."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        trainer = Trainer(FinetuneConfig(model_base=str(stories_q8), train_data=str(train_text), ctx=16, batch=2,
                                         seed=1, threads=1, checkpoint_in="", checkpoint_out="", lora_out=""),
                          log_records=False)
        assert not trainer.dist.enabled and trainer.forward_model is trainer.model  # one rank: no DDP
        assert any(isinstance(m, QuantLinear) for m in trainer.model.modules())
        ddp = data_parallel(trainer.model, trainer.device)
        lora_bytes = sum(p.numel() * p.element_size() for _, p, _ in trainer.params)
        assert ddp._get_ddp_logging_data()["total_parameter_size_bytes"] == lora_bytes
        buffers = {n for n, _ in trainer.model.named_buffers()}
        assert buffers and buffers <= ddp.parameters_to_ignore  # not in the start-up broadcast
        frozen = {n for n, p in trainer.model.named_parameters() if not p.requires_grad}
        assert frozen <= ddp.parameters_to_ignore
    finally:
        dist.destroy_process_group()


def assert_two_ranks_train_as_one_process(common: list[str], tmp_path: Path) -> str:
    """``common`` on 2 torchrun ranks and in one process with --grad-acc 2 (each rank a micro-batch):
    the same losses and the same adapter. Returns the one process's output."""
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir(), one.mkdir()
    code, out = torchrun(common, two)
    assert code == 0, out
    code, out = run([*common, "--grad-acc", "2"], one)
    assert code == 0, out
    np.testing.assert_allclose(losses(two / "checkpoint-log.jsonl"), losses(one / "checkpoint-log.jsonl"), rtol=1e-5)
    assert_same_adapter(two / "ggml-lora-LATEST-f32.gguf", one / "ggml-lora-LATEST-f32.gguf")
    return out


def test_answer_only_loss_on_two_ranks_equals_one_process(stories260k: Path, tmp_path: Path) -> None:
    """Records with answer-only loss: micro-batches count different numbers of targets, so the step loss
    (sum over counted targets / their global count) needs the all-reduced count to match one process."""
    answers = ["Yes.", "The cat sat on the mat all day long.", "No, it was blue.", "Tim ran home to his mom and dad.",
               "Lily liked the big red ball.", "Sun.", "They played in the park until the sky got dark.", "Two."]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Question {i}?", "output": a}) + "\n"
                            for i, a in enumerate(answers)), encoding="utf-8")
    common = ["finetune", "--model-base", str(stories260k), "--train-data", str(data), "-c", "64", "-b", "1",
              "--warmup", "0", "--adam-alpha", "0.01", "--seed", "3", "--threads", "1", "-n", "3",
              "--save-every", "0", "--checkpoint-in", ""]
    assert_two_ranks_train_as_one_process(common, tmp_path)


def test_preference_pairs_on_two_ranks_equal_one_process(stories260k: Path, tmp_path: Path) -> None:
    """DPO over pairs of different lengths: each rank's micro-batch holds its own pairs (both sides), the reference is
    each rank's base with the adapter off, and the step's loss and TRL's metrics are means over the global pairs."""
    stories = [("Tom went to the park.", " He was happy. The end.", " He was sad."),
               ("Lily had a red ball.", " She played with it all day long in the sun.", " It broke."),
               ("The cat sat on the mat.", " It purred.", " It ran away from the big dog in the garden."),
               ("Ben saw a bird.", " The bird sang a song for him.", " He went home.")]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in stories),
                    encoding="utf-8")
    common = ["finetune", "--model-base", str(stories260k), "--train-data", str(data), "--objective", "dpo",
              "-c", "64", "-b", "1", "--warmup", "0", "--adam-alpha", "0.01", "--seed", "3", "--threads", "1",
              "-n", "3", "--save-every", "0", "--checkpoint-in", ""]
    assert_two_ranks_train_as_one_process(common, tmp_path)
    metrics = [[r["metrics"] for r in read_log(tmp_path / side / "checkpoint-log.jsonl") if r.get("kind") == "iter"]
               for side in ("two", "one")]
    assert len(metrics[0]) == 3 and metrics[0][-1]["rewards/margins"] != 0.0
    for two, one in zip(*metrics, strict=True):
        assert two.keys() == one.keys()
        np.testing.assert_allclose([two[k] for k in two], [one[k] for k in two], rtol=1e-4, atol=1e-6)

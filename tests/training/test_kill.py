"""kill -9 at random moments during ``finetune --save-every 1``: the LATEST checkpoint always
loads, and a run resumed from it continues from its iteration.

Checkpoints are written to a temporary file, fsynced and renamed over the old one, so a
kill mid-save leaves the previous LATEST intact; this test checks that on the real CLI.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from ggtorch.io.checkpoint import load_checkpoint

KILLS = 3


def finetune(stories260k: Path, train: Path, cwd: Path, n: int, resume: bool) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "ggtorch", "finetune", "--model-base", str(stories260k), "--train-data",
           str(train), "-n", str(n), "-c", "16", "-b", "2", "--save-every", "1", "-t", "1", "--seed", "3",
           "--checkpoint-in", "checkpoint-LATEST.gguf" if resume else "none.gguf"]
    out = open(cwd / "out.txt", "a")  # noqa: SIM115 - the child owns it until it exits
    return subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, text=True)


def test_sigkill_never_leaves_a_broken_latest_checkpoint(stories260k: Path, texts: dict[str, Path],
                                                         tmp_path: Path) -> None:
    train = texts["train"]
    work = tmp_path / "run"
    work.mkdir()
    latest = work / "checkpoint-LATEST.gguf"
    rng = random.Random(10)
    iterations = [0]
    for round_ in range(KILLS):
        proc = finetune(stories260k, train, work, 100000, resume=round_ > 0)
        start_mtime = latest.stat().st_mtime_ns if latest.exists() else 0
        deadline = time.time() + 60
        # Wait for a first save of this run, then kill at a random moment among the next saves.
        while time.time() < deadline and (not latest.exists() or latest.stat().st_mtime_ns == start_mtime):
            assert proc.poll() is None, (work / "out.txt").read_text()
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL

        ck = load_checkpoint(latest)
        assert ck.iteration > iterations[-1]  # this run saved, and resumed where the last one stopped
        iterations.append(ck.iteration)
        numbered = work / f"checkpoint-{ck.iteration - 1}.gguf"
        if numbered.exists():
            load_checkpoint(numbered)

    proc = finetune(stories260k, train, work, 2, resume=True)
    assert proc.wait(timeout=120) == 0, (work / "out.txt").read_text()
    out = (work / "out.txt").read_text()
    assert f"resumed from checkpoint-LATEST.gguf at iteration {iterations[-1]}" in out
    assert "Traceback" not in out
    assert load_checkpoint(latest).iteration == iterations[-1] + 2

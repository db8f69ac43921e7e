"""kill -9 at random moments during ``finetune --save-every 1``: the LATEST checkpoint always
loads, and a run resumed from it continues from its iteration.

Checkpoints are written to a temporary file, fsynced and renamed over the old one, so a
kill mid-save leaves the previous LATEST intact; this test checks that on the real CLI.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ggtorch.io.checkpoint import load_checkpoint

KILLS = 3


def finetune(stories260k: Path, train: Path, cwd: Path, n: int, resume: bool) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "ggtorch", "finetune", "--model-base", str(stories260k), "--train-data",
           str(train), "-n", str(n), "-c", "16", "-b", "2", "--save-every", "1", "-t", "1", "--seed", "3",
           "--checkpoint-in", "checkpoint-LATEST.gguf" if resume else ""]
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


# --- out of memory ---------------------------------------------------------------------------------
MEMORY_FLAGS = ["-c", "64", "--save-every", "1", "-t", "1", "--seed", "3"]


def _finetune_cmd(stories260k: Path, train: Path, n: int, batch: int, resume: bool) -> list[str]:
    return [sys.executable, "-m", "ggtorch", "finetune", "--model-base", str(stories260k), "--train-data", str(train),
            "-n", str(n), "-b", str(batch), *MEMORY_FLAGS,
            "--checkpoint-in", "checkpoint-LATEST.gguf" if resume else ""]


def _adapter_tensors(path: Path) -> dict[str, bytes]:
    from ggtorch.io.gguf import read_gguf

    return {name: bytes(t.data) for name, t in read_gguf(path).tensors.items()}


def _reference_adapter(stories260k: Path, train: Path, tmp_path: Path, n: int,
                       batch: int) -> Callable[[], dict[str, bytes]]:
    """Start the same run, uninterrupted, beside the test's own (each runs one thread); the returned
    function waits for it and gives its adapter."""
    work = tmp_path / "reference"
    work.mkdir()
    proc = subprocess.Popen(_finetune_cmd(stories260k, train, n, batch, resume=False), cwd=work,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def adapter() -> dict[str, bytes]:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        return _adapter_tensors(work / "ggml-lora-LATEST-f32.gguf")

    return adapter


def test_an_allocation_refused_by_ulimit_keeps_the_checkpoint_and_says_how_to_resume(
        stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    """``ulimit -v``: a step that cannot allocate stops with one message; LATEST is untouched and
    resuming from it gives the uninterrupted run's adapter, byte for byte."""
    import resource

    train = texts["train"]
    reference = _reference_adapter(stories260k, train, tmp_path, 4, 2)
    work = tmp_path / "run"
    work.mkdir()
    subprocess.run(_finetune_cmd(stories260k, train, 2, 2, resume=False), cwd=work, check=True, capture_output=True,
                   timeout=300)
    latest = work / "checkpoint-LATEST.gguf"
    before = latest.read_bytes()

    def limit_address_space() -> None:  # ulimit -v 2 GiB: loading fits (in 1 GiB), a batch of 8192 x 64 does not
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    done = subprocess.run(_finetune_cmd(stories260k, train, 2, 8192, resume=True), cwd=work, capture_output=True,
                          text=True, timeout=300, preexec_fn=limit_address_space)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: out of memory in iteration 3 ("), done.stderr
    kept = "checkpoint-LATEST.gguf (iteration 2), is kept: resume with --checkpoint-in checkpoint-LATEST.gguf"
    assert kept in lines[-1]
    assert "a smaller --batch or --ctx" in lines[-1] and "Traceback" not in done.stderr
    assert latest.read_bytes() == before

    subprocess.run(_finetune_cmd(stories260k, train, 2, 2, resume=True), cwd=work, check=True, capture_output=True,
                   timeout=300)
    assert load_checkpoint(latest).iteration == 4
    assert _adapter_tensors(work / "ggml-lora-LATEST-f32.gguf") == reference()


CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def _memory_cgroup(name: str) -> Path | None:
    """A fresh cgroup-v1 memory group, or None where this process may not make one."""
    group = CGROUP_V1 / name
    try:
        group.mkdir()
    except OSError:
        return None
    if not (group / "memory.limit_in_bytes").exists():
        group.rmdir()
        return None
    return group


def _oom_kills(group: Path) -> int:
    for line in (group / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return -1


def test_killed_by_the_oom_killer_mid_run_resumes_exactly(stories260k: Path, texts: dict[str, Path],
                                                          tmp_path: Path) -> None:
    """A run in a memory cgroup whose limit drops below its step's needs after a few saves: the kernel
    kills it (SIGKILL, counted by the group's oom_kill); LATEST loads and resuming from it gives the
    uninterrupted run's adapter, byte for byte."""
    group = _memory_cgroup(f"ggtorch-test-{os.getpid()}")
    if group is None:
        pytest.skip("no writable cgroup-v1 memory controller here (needs root and /sys/fs/cgroup/memory)")
    train = texts["train"]
    work = tmp_path / "run"
    work.mkdir()
    latest = work / "checkpoint-LATEST.gguf"
    n, batch = 12, 64
    reference = _reference_adapter(stories260k, train, tmp_path, n, batch)
    try:
        (group / "memory.swappiness").write_text("0")
        # glibc as it comes, every large block mmapped and unmapped again (a run otherwise keeps its
        # step's memory, ggtorch.ops.malloc, and would need nothing new after the squeeze)
        returning = {**os.environ, "GGTORCH_ALLOCATOR": "system", "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
        proc = subprocess.Popen(_finetune_cmd(stories260k, train, n, batch, resume=False), cwd=work,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=returning,
                                preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and (
                not latest.exists() or load_checkpoint(latest).iteration < 2):
            time.sleep(0.1)
        # Squeeze: the limit a few MiB above the process's resident anonymous memory (page cache is
        # reclaimed first), so the next step's activations, allocated afresh, cannot be charged.
        while time.time() < deadline and proc.poll() is None:
            stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
            limit = int(stat["rss"]) + int(stat["mapped_file"]) + (4 << 20)
            with contextlib.suppress(OSError):  # EBUSY when the group cannot shrink that far yet
                (group / "memory.limit_in_bytes").write_text(str(limit))
            time.sleep(0.3)
        returncode = proc.wait(timeout=60)
        assert returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else returncode
        assert _oom_kills(group) >= 1, "killed, but not by the cgroup's out-of-memory killer"
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()

    saved = load_checkpoint(latest).iteration
    assert 2 <= saved < n, f"the run saved iteration {saved} before it was killed"
    subprocess.run(_finetune_cmd(stories260k, train, n - saved, batch, resume=True), cwd=work, check=True,
                   capture_output=True, timeout=300)
    assert load_checkpoint(latest).iteration == n
    assert _adapter_tensors(work / "ggml-lora-LATEST-f32.gguf") == reference()

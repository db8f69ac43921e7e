"""A write that fails (disk full, file too large) keeps the previous file and says so in one line.

A full disk is simulated with RLIMIT_FSIZE in a child process (writes past the limit fail
with EFBIG, as they fail with ENOSPC on a full disk), so nothing here needs a small filesystem.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from ggtorch.io.checkpoint import load_checkpoint
from ggtorch.io.gguf import TensorOut, read_gguf, write_gguf


def _file_size_limit(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_failed_write_keeps_the_previous_file(tmp_path: Path) -> None:
    code = f"""
import numpy as np
from gguf import GGMLQuantizationType as T
from ggtorch.errors import GGTorchError
from ggtorch.io.gguf import TensorOut, write_gguf
try:
    big = np.ones(100000, np.float32)
    write_gguf({str(tmp_path / "x.gguf")!r}, "llama", {{}}, [TensorOut("a", T.F32, (100000,), big)])
except GGTorchError as e:
    print(e)
"""
    write_gguf(tmp_path / "x.gguf", "llama", {}, [TensorOut("a", GGMLQuantizationType.F32, (4,),
                                                            np.arange(4, dtype=np.float32))])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: _file_size_limit(100_000))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"cannot write {tmp_path / 'x.gguf'}") and "is kept" in proc.stdout
    assert read_gguf(tmp_path / "x.gguf").tensors["a"].shape == (4,)  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["x.gguf"]  # no temporary left behind


def test_finetune_stops_with_one_line_when_a_save_fails(stories260k: Path, texts: dict[str, Path],
                                                        tmp_path: Path) -> None:
    train = texts["train"]
    cmd = [sys.executable, "-m", "ggtorch", "finetune", "--model-base", str(stories260k), "--train-data", str(train),
           "-n", "1", "-c", "16", "-b", "2", "--save-every", "1", "-t", "1", "--checkpoint-in"]
    first = subprocess.run([*cmd, ""], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    size = (tmp_path / "checkpoint-LATEST.gguf").stat().st_size
    second = subprocess.run([*cmd, "checkpoint-LATEST.gguf"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            preexec_fn=lambda: _file_size_limit(size // 2))
    assert second.returncode == 1, second.stderr
    assert "Traceback" not in second.stderr
    errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "cannot write checkpoint-" in errors[0] and "is kept" in errors[0], second.stderr
    assert load_checkpoint(tmp_path / "checkpoint-LATEST.gguf").iteration == 1  # the previous save, intact

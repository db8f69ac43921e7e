"""Every command that writes a file takes the lock a training run takes on its outputs: a second writer of the same
output is refused, naming the process that writes it, and the first one's file is left as it is."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ggtorch import api
from ggtorch.io.gguf import read_gguf
from tests.export.test_merge import write_test_adapter
from tests.export.test_old_formats import write_ggla
from tests.helpers import run_cli, worker_env

LOCK_HOLDER = """
import sys, time
from ggtorch.io.lock import OutputLock
from ggtorch.io.paths import Output
lock = OutputLock([Output("-o", sys.argv[1])]).acquire()
print("locked", flush=True)
time.sleep(120)
"""
"""A writer in the middle of its write: holds the output's lock until it is killed."""


@pytest.fixture(scope="module")
def inputs(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An adapter of stories260K, the same as a PEFT folder, and an old ggla adapter."""
    root = tmp_path_factory.mktemp("inputs")
    adapter = write_test_adapter(stories260k, root / "adapter.gguf")
    api.export_peft(adapter, stories260k, root / "peft")
    matrices = {name: t.shape for name, t in read_gguf(stories260k).tensors.items()
                if name.startswith("blk.0.attn_") and len(t.shape) == 2}
    rng = np.random.default_rng(0)
    ggla = write_ggla(root / "lora-old.bin", 2, 2, {name: (rng.standard_normal((n_in, 2), dtype=np.float32),
                                                          rng.standard_normal((n_out, 2), dtype=np.float32))
                                                   for name, (n_out, n_in) in matrices.items()})
    return {"S": stories260k, "ADAPTER": adapter, "PEFT": root / "peft", "OLD": ggla}


COMMANDS: dict[str, tuple[list[str], str, str]] = {
    # command: its arguments (OUT is the output), the flag the message names, what it writes at OUT
    "export-lora": (["export-lora", "-m", "S", "--lora", "ADAPTER", "-o", "OUT"], "-o", "file"),
    "convert-lora": (["convert-lora", "PEFT", "--base", "S", "--outfile", "OUT"], "--outfile", "file"),
    "convert-old-lora": (["convert-old-lora", "OLD", "-o", "OUT"], "-o", "file"),
    "export-peft": (["export-peft", "ADAPTER", "--base", "S", "--outdir", "OUT"], "--outdir", "folder"),
}


def _contents(out: Path) -> dict[str, bytes]:
    files = sorted(out.iterdir()) if out.is_dir() else [out]
    return {p.name: p.read_bytes() for p in files}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_second_writer_of_an_output_is_refused_and_the_first_ones_file_kept(
        inputs: dict[str, Path], tmp_path: Path, command: str) -> None:
    args, flag, kind = COMMANDS[command]
    out = tmp_path / ("merged" if kind == "folder" else "merged.gguf")
    args = [str({**inputs, "OUT": out}.get(a, a)) for a in args]
    if kind == "folder":  # the first writer's files, as it has written them so far
        out.mkdir()
        (out / "adapter_config.json").write_text("{}")
    else:
        out.write_bytes(b"the first writer's file")
    before = _contents(out)
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                              env=worker_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        result = run_cli(args)
        assert result.exit_code == 1, result.output
        assert f"another ggtorch run (process {holder.pid}) is writing {flag} {out}" in result.output
        assert "Traceback" not in result.output
        assert _contents(out) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    result = run_cli(args)  # the first writer gone, the command writes, and leaves no lock behind
    assert result.exit_code == 0, result.output
    assert _contents(out) != before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _export_lora(inputs: dict[str, Path], out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ggtorch", "export-lora", "-m", str(inputs["S"]), "--lora",
                             str(inputs["ADAPTER"]), "-o", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=worker_env())


def test_two_export_loras_at_once_never_both_write_one_file(inputs: dict[str, Path], tmp_path: Path) -> None:
    """Two real processes started together: whichever wins, each either writes the whole file or is refused naming
    the other, and the file is the merge (the same bytes as one command alone writes)."""
    alone = tmp_path / "alone.gguf"
    assert run_cli(["export-lora", "-m", inputs["S"], "--lora", inputs["ADAPTER"], "-o", alone]).exit_code == 0
    out = tmp_path / "merged.gguf"
    both = [_export_lora(inputs, out), _export_lora(inputs, out)]
    results = [(p.wait(timeout=300), p.stdout.read() if p.stdout else "") for p in both]
    for (code, output), other in zip(results, reversed(both), strict=True):
        assert code == 0 or (code == 1 and f"another ggtorch run (process {other.pid}) is writing -o {out}" in output
                             and "Traceback" not in output), output
    assert any(code == 0 for code, _ in results)
    assert out.read_bytes() == alone.read_bytes()
    read_gguf(out)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

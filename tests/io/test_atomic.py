"""Every file ggtorch writes survives a full disk: the previous file stays byte for byte, no temporary or lock is
left, and the message names the disk.

The full disks are real: a small tmpfs mounted for the test (as root, where the machine lets a test mount one;
skipped with the reason elsewhere). The failures a real disk cannot be made to give on demand (a write lost without
an error, a rename refused) are injected.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from ggtorch.errors import NonFiniteValues
from ggtorch.io import atomic
from ggtorch.io.atomic import WriteFailed, append_line, atomic_paths, write_bytes
from ggtorch.io.gguf import TensorOut, write_gguf
from ggtorch.io.lock import OutputLock, lock_path
from ggtorch.io.paths import Output
from ggtorch.training.log import TrainLog
from tests.helpers import run_cli

F32 = GGMLQuantizationType.F32


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 3 MiB file system (tmpfs), unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): the full-disk cases need "
                    "root and a kernel that lets it mount; the injected failures below still run")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave: int) -> None:
    """Fill ``disk`` until ``leave`` bytes are free (a page or so either way: tmpfs counts pages)."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(disk / "filler", "ab") as f:
        f.write(b"\0" * max(free - leave, 0))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` but the filler, by name: what a failed write must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "filler"}


def one_line_naming_the_disk(output: str, disk: Path) -> None:
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines and "Traceback" not in output, output
    assert "No space left on device" in lines[-1] and f"the disk at {disk}" in lines[-1], lines[-1]


def tensor(n: int, value: float = 1.0) -> TensorOut:
    return TensorOut("t", F32, (n,), np.full(n, value, np.float32))


# --- real full disks -------------------------------------------------------------------------------------------


def test_a_gguf_written_over_a_good_one_on_a_full_disk_keeps_it(small_disk: Path) -> None:
    path = small_disk / "model.gguf"
    write_gguf(path, "llama", {}, [tensor(1024)])
    before = snapshot(small_disk)
    fill(small_disk, 64 * 1024)
    with pytest.raises(WriteFailed) as e:
        write_gguf(path, "llama", {}, [tensor(256 * 1024, 2.0)])  # 1 MiB of data where 64 KiB are free
    one_line_naming_the_disk(str(e.value), small_disk)
    assert "model.gguf is kept unchanged" in str(e.value)
    assert snapshot(small_disk) == before  # the old file whole, no temporary left


@pytest.fixture
def adapters(stories260k: Path, shakespeare: Path, tmp_path: Path) -> dict[str, Path]:
    """A GGUF adapter of stories260K and the same adapter as a PEFT folder, written on a disk with room."""
    gguf = tmp_path / "adapter.gguf"
    result = run_cli(["finetune", "--model-base", stories260k, "--train-data", shakespeare, "--lora-out", gguf,
                      "--only-write-lora", "--checkpoint-in", "", "--seed", "1", "--lora-r", "16", "--threads", "1"],
                     cwd=tmp_path)
    assert result.exit_code == 0, result.output
    peft = tmp_path / "peft"
    result = run_cli(["export-peft", gguf, "--base", stories260k, "--outdir", peft])
    assert result.exit_code == 0, result.output
    return {"gguf": gguf, "peft": peft}


def test_convert_lora_over_a_good_adapter_on_a_full_disk_keeps_it(small_disk: Path, stories260k: Path,
                                                                   adapters: dict[str, Path]) -> None:
    out = small_disk / "adapter.gguf"
    result = run_cli(["convert-lora", adapters["peft"], "--base", stories260k, "--outfile", out])
    assert result.exit_code == 0, result.output
    before = snapshot(small_disk)
    fill(small_disk, 16 * 1024)
    result = run_cli(["convert-lora", adapters["peft"], "--base", stories260k, "--outfile", out])
    assert result.exit_code == 1, result.output
    one_line_naming_the_disk(result.output, small_disk)
    assert snapshot(small_disk) == before


def test_finetune_lora_out_on_a_full_disk_keeps_the_adapter(small_disk: Path, stories260k: Path, shakespeare: Path,
                                                            adapters: dict[str, Path]) -> None:
    out = small_disk / "ad.gguf"
    out.write_bytes(adapters["gguf"].read_bytes())
    before = snapshot(small_disk)
    fill(small_disk, 16 * 1024)
    result = run_cli(["finetune", "--model-base", stories260k, "--train-data", shakespeare, "--lora-out", out,
                      "--only-write-lora", "--overwrite",
                      "--checkpoint-in", "", "--seed", "2", "--lora-r", "16", "--threads", "1",
                      "--log-file", small_disk.parent / "log.jsonl"], cwd=small_disk.parent)
    assert result.exit_code == 1, result.output
    one_line_naming_the_disk(result.output, small_disk)
    assert snapshot(small_disk) == before  # the adapter as it was, no temporary, no lock file


@pytest.mark.parametrize("existing", [False, True], ids=["new folder", "over a folder"])
def test_export_peft_on_a_full_disk_leaves_no_half_folder(small_disk: Path, stories260k: Path,
                                                          adapters: dict[str, Path], existing: bool) -> None:
    out = small_disk / "peft"
    if existing:
        assert run_cli(["export-peft", adapters["gguf"], "--base", stories260k, "--outdir", out]).exit_code == 0
    before = snapshot(small_disk)
    fill(small_disk, 16 * 1024)
    result = run_cli(["export-peft", adapters["gguf"], "--base", stories260k, "--outdir", out, "--outtype", "f32"])
    assert result.exit_code == 1, result.output
    one_line_naming_the_disk(result.output, small_disk)
    assert snapshot(small_disk) == before
    assert out.is_dir() == existing  # a folder the failed export made is gone again


def test_a_log_line_that_does_not_fit_is_cut_off_whole(small_disk: Path) -> None:
    log = TrainLog(small_disk / "log.jsonl")
    log.write("start", note="first")
    fill(small_disk, 0)
    with pytest.raises(WriteFailed) as e:
        for i in range(10_000):  # the page the first line opened fills up first
            log.write("iter", iteration=i, text="x" * 200)
    log.close()
    one_line_naming_the_disk(str(e.value), small_disk)
    lines = (small_disk / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines[:1]] == ["start"]
    assert all(json.loads(line) for line in lines)  # every line whole


def test_a_lock_on_a_full_disk_still_locks_and_leaves_nothing(small_disk: Path) -> None:
    output = Output("--lora-out", str(small_disk / "ad-ITERATION.gguf"), pattern="ITERATION", latest="LATEST")
    fill(small_disk, 0)
    lock = OutputLock([output]).acquire()
    assert lock_path(output).exists()
    lock.release()
    assert not lock_path(output).exists()


# --- injected failures ------------------------------------------------------------------------------------------


def test_a_write_lost_without_an_error_is_caught_and_the_old_file_kept(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """What ndarray.tofile did on a full disk: fewer bytes on disk than written, and no error."""
    path = tmp_path / "model.gguf"
    write_gguf(path, "llama", {}, [tensor(1024)])
    before = path.read_bytes()
    real_fsync = os.fsync

    def losing_fsync(fd: int) -> None:
        os.ftruncate(fd, os.fstat(fd).st_size // 2)
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", losing_fsync)
    with pytest.raises(WriteFailed, match="bytes reached the disk"):
        write_gguf(path, "llama", {}, [tensor(4096, 2.0)])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_a_refused_rename_keeps_the_old_file_and_says_what_to_check(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.json"
    write_bytes(path, b"old")

    def refuse(src: str, dst: str) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(atomic.os, "replace", refuse)
    with pytest.raises(WriteFailed, match="Permission denied.*check that the folder exists and is writable"):
        write_bytes(path, b"new")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_files_that_belong_together_are_renamed_together(tmp_path: Path) -> None:
    """A failure in the second file keeps the first file's old version too (a PEFT folder's weights and config)."""
    first, second = tmp_path / "weights", tmp_path / "config"
    first.write_bytes(b"old weights")
    second.write_bytes(b"old config")
    with pytest.raises(WriteFailed, match="weights, config are kept unchanged"):
        with atomic_paths([first, second], [None, lambda _: 100]) as (a, b):
            a.write_bytes(b"new weights")
            b.write_bytes(b"short")  # 5 of the 100 bytes it was to hold
    assert (first.read_bytes(), second.read_bytes()) == (b"old weights", b"old config")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config", "weights"]


def test_an_error_of_the_content_passes_through_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteValues):
        write_gguf(tmp_path / "x.gguf", "llama", {}, [tensor(8, float("nan"))])
    assert list(tmp_path.iterdir()) == []


def test_a_line_cut_by_a_failing_write_is_removed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "log.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    append_line(fd, path, '{"kind": "start"}\n')
    real_write = os.write

    def half_then_full(fd: int, data: bytes) -> int:
        if len(data) > 4:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "write", half_then_full)
    with pytest.raises(WriteFailed, match="No space left on device"):
        append_line(fd, path, '{"kind": "iter", "loss": 1.0}\n')
    os.close(fd)
    assert path.read_text() == '{"kind": "start"}\n'

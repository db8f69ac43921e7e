"""Helpers every test package uses: the CLI in-process, the JSON-lines training log, the folder the pytest-xdist
workers share."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

try:
    import fcntl
except ImportError:  # Windows has none: there each worker makes its own, and serial tests run beside others
    fcntl = None  # type: ignore[assignment]

from ggtorch.cli.main import main


def worker_env(**extra: str) -> dict[str, str]:
    """This environment for a child process, with OpenMP held to this worker's share of the cores: a child at torch's
    default team beside the other worker's tests spins on a core it lost at every parallel region (a 10-second
    script took 60 to 100 in the suite)."""
    import torch

    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), **extra}


def run_cli(args: Sequence[str | os.PathLike[str]], cwd: Path | None = None, catch_exceptions: bool = True,
            **invoke: object) -> Result:
    """``ggtorch ARGS`` through click's runner, in ``cwd`` when given (outputs land there)."""
    old = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=catch_exceptions, **invoke)
    finally:
        os.chdir(old)


def read_log(log: Path) -> list[dict]:
    """The records of a JSON-lines training log, in order."""
    return [json.loads(line) for line in log.read_text().splitlines()]


def losses(log: Path) -> list[float]:
    """The loss of every iteration record of a training log."""
    return [r["loss"] for r in read_log(log) if r["kind"] == "iter"]


def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's temporary folder: under pytest-xdist the one its workers share, above each one's popen-gwK
    (pytest removes old ones)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@contextlib.contextmanager
def made_once(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A folder ``name`` of the run's temporary folder, held alone (a file lock) while inside: the first worker
    makes what goes in it, the other waits and reuses it. A fixture that is slow to make, per run, not per worker."""
    if fcntl is None:
        yield tmp_path_factory.mktemp(name)
        return
    folder = run_folder(tmp_path_factory) / name
    folder.mkdir(exist_ok=True)
    with open(folder.with_name(f"{name}.lock"), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder  # closing the file releases the lock

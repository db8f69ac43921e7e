"""Helpers every test package uses: the CLI in-process, the JSON-lines training log."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from click.testing import CliRunner, Result

from ggtorch.cli.main import main


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

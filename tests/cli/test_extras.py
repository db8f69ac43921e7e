"""Optional packages (ggtorch's extras): a command that needs one that is not installed says, on one line, which extra
to install, before it does any work; and every import of one in ggtorch goes through the one helper that says so."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import ggtorch
from ggtorch.errors import MissingExtra
from ggtorch.training.run import Run
from tests.cli.test_main import assert_one_line_error
from tests.helpers import run_cli

PACKAGE = Path(ggtorch.__file__).parent

OPTIONAL = ("matplotlib", "tensorboard", "torch.utils.tensorboard")
"""Modules of the extras (torch's tensorboard writer imports the tensorboard package)."""


def uninstall(monkeypatch: pytest.MonkeyPatch, package: str, *importers: str) -> None:
    """Make ``import package`` fail as it does where it is not installed (None in sys.modules raises
    ModuleNotFoundError); ``importers``, modules that import it, are dropped if imported so they import it again."""
    for name in list(sys.modules):
        if any(name == m or name.startswith(m + ".") for m in (package, *importers)):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


@pytest.mark.parametrize("command", ["finetune", "train"])
def test_tensorboard_missing_refuses_the_run_before_the_model_loads(
        stories260k: Path, texts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        command: str) -> None:
    uninstall(monkeypatch, "tensorboard", "torch.utils.tensorboard")

    def load(*args: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Run, "_build_from", load)
    out = tmp_path / "out"
    out.mkdir()
    model = ["--model-base", stories260k] if command == "finetune" else ["--vocab-model", stories260k]
    result = run_cli([command, *model, "--train-data", texts["train"], "-n", "1", "--checkpoint-in", "",
                      "--checkpoint-out", out / "ck-ITERATION.gguf", "--tensorboard", out / "board"], cwd=out)
    assert_one_line_error(result, "--tensorboard needs tensorboard, which is not installed: "
                                  "pip install 'ggtorch[tensorboard]'")
    assert list(out.iterdir()) == []  # no log, no lock, no event folder


def test_plot_without_matplotlib_names_the_extra_and_writes_nothing(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "train-log.jsonl"
    log.write_text('{"kind": "iter", "iteration": 1, "loss": 2.5}\n')
    uninstall(monkeypatch, "matplotlib")
    assert_one_line_error(run_cli(["plot", log, "-o", tmp_path / "loss.png"]), "drawing the loss curves needs "
                          "matplotlib, which is not installed: pip install 'ggtorch[plot]'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train-log.jsonl"]
    with pytest.raises(MissingExtra, match=r"pip install 'ggtorch\[plot\]'"):
        ggtorch.plot_losses(log)


def test_every_optional_import_goes_through_the_helper() -> None:
    """An ``import matplotlib`` (or tensorboard) statement in ggtorch would be a traceback where it is missing:
    ggtorch.errors.optional_module imports them, with the message naming the extra."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(PACKAGE)}:{node.lineno} {name}" for name in names
                      if any(name == m or name.startswith(m + ".") for m in OPTIONAL)]
    assert found == []

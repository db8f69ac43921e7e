"""The examples/ notebooks run top to bottom (nbclient, a real kernel) with parameters that keep them short."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.fixtures import FOLDER as FIXTURES
from tests.helpers import worker_env

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_notebook(name: str, overrides: str, cwd: Path) -> nbformat.NotebookNode:
    """Execute a notebook with ``overrides`` injected after its ``parameters`` cell (as papermill does), its kernel
    on this worker's share of the cores."""
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell(overrides))
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
    client.execute(env=worker_env())
    return nb


def outputs(nb: nbformat.NotebookNode) -> str:
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_finetune_notebook(tmp_path: Path) -> None:
    nb = run_notebook("finetune-stories260k.ipynb",
                      f"FIXTURES = Path({str(FIXTURES)!r})\nMODEL = FIXTURES / 'stories260K.gguf'\n"
                      f"TEXT = FIXTURES / 'tinyshakespeare.txt'\nOUT = Path({str(tmp_path / 'out')!r})\n"
                      "ITERATIONS = 8", tmp_path)
    text = outputs(nb)
    assert "before:" in text and "after:" in text and "llama-cli -m" in text
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells for o in c.get("outputs", []))  # the loss curve drew inline
    for name in ["lora-LATEST.gguf", "checkpoint-LATEST.gguf", "stories260K-shakespeare.gguf", "peft-adapter"]:
        assert (tmp_path / "out" / name).exists(), name


@pytest.mark.parametrize("name", ["quantized-base-memory.ipynb"])
def test_quantized_memory_notebook(name: str, tmp_path: Path) -> None:
    nb = run_notebook(name, f"FIXTURES = Path({str(FIXTURES)!r})\nVOCAB = FIXTURES / 'stories260K.gguf'\n"
                            f"OUT = Path({str(tmp_path / 'out')!r})\nEMBD, FF, HEADS, LAYERS = 256, 512, 4, 2\n"
                            "CTX, BATCH = 32, 1", tmp_path)
    text = outputs(nb)
    assert "Q4_0 kept quantized uses" in text
    assert "random-q4_0.gguf" in text

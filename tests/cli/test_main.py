"""The ggtorch command line on stories260K, and one clear error line for every kind of bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import Result

from ggtorch.models.generate import perplexity
from ggtorch.models.loader import load_model_file
from tests.helpers import run_cli
from tests.llama_models import rewrite_gguf
from tests.models.test_generate import REFERENCE_TEXT


def run(*args: str) -> Result:
    return run_cli(args)


def assert_one_line_error(result: Result, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # handled: no exception escaped the CLI
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_info(stories260k: Path) -> None:
    result = run("info", str(stories260k))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "architecture:  llama" in out and "n_head_kv        4" in out and "tied_output      True" in out
    assert "F32         47 tensors" in out and "260,032 parameters" in out


def test_info_tells_adapters_and_checkpoints_apart(stories260k: Path, tmp_path: Path) -> None:
    import torch

    from ggtorch.io.checkpoint import save_checkpoint
    from ggtorch.io.gguf import read_gguf
    from ggtorch.lora.adapter_file import LoraAdapter, LoraPair, write_adapter

    pair = LoraPair(torch.zeros(4, 64), torch.zeros(64, 4))
    write_adapter(tmp_path / "a.gguf", LoraAdapter("llama", 8.0, {"blk.0.attn_q.weight": pair}))
    result = run("info", str(tmp_path / "a.gguf"))
    assert result.exit_code == 0 and "kind:          LoRA adapter (lora, alpha 8)" in result.stdout
    save_checkpoint(tmp_path / "c.gguf", read_gguf(stories260k), {"training.iteration_count": 7}, {}, {})
    result = run("info", str(tmp_path / "c.gguf"))
    assert result.exit_code == 0 and "training checkpoint (ggtorch.finetune_lora, iteration 7)" in result.stdout


@pytest.mark.parametrize("base,flags,held", [("q8", [], "as stored (Q8_0, F16)"), ("f32", [], "as stored (F32)"),
                                              ("q8", ["--base-dtype", "f32"], "base weights f32,")])
def test_finetune_says_how_it_holds_the_base(stories260k: Path, stories_q8: Path, texts: dict[str, Path],
                                              tmp_path: Path, base: str, flags: list[str], held: str) -> None:
    """The first line names the matrices' types as the file stores them, the commonest first (llama.cpp's Q8_0
    file keeps a small matrix in F16), or the dtype they are decoded to: never "quantized" for a float file."""
    model = stories_q8 if base == "q8" else stories260k
    result = run_cli(["finetune", "--model-base", model, "--train-data", texts["train"], "-n", "1", "-c", "16",
                      "-b", "1", "--save-every", "0", "--checkpoint-out", "", "--lora-out", "a.gguf", *flags],
                     cwd=tmp_path)
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert first.startswith("model: ") and held in first, first


def test_generate_greedy_from_bos(stories260k: Path) -> None:
    result = run("generate", "-m", str(stories260k), "-n", "100")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(REFERENCE_TEXT[:150])


def test_perplexity_prints_the_library_value(stories260k: Path, shakespeare: Path, tmp_path: Path) -> None:
    text = shakespeare.read_text()[:2500]
    (tmp_path / "t.txt").write_text(text)
    result = run("perplexity", "-m", str(stories260k), "-f", str(tmp_path / "t.txt"), "--ctx", "128")
    assert result.exit_code == 0, result.output
    loaded = load_model_file(stories260k)
    expected = perplexity(loaded.model, loaded.tokenizer.encode(text), 128, bos_id=loaded.tokenizer.bos_id)
    assert result.stdout.strip() == f"perplexity: {expected.perplexity:.4f}"


@pytest.fixture(scope="module")
def bad_files(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli_bad")
    data = stories260k.read_bytes()
    files = {
        "text": root / "notes.gguf",
        "truncated_header": root / "head.gguf",
        "truncated_data": root / "tail.gguf",
    }
    files["text"].write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    files["truncated_header"].write_bytes(data[:100])
    files["truncated_data"].write_bytes(data[: len(data) * 2 // 3])
    files["gpt2"] = rewrite_gguf(stories260k, root / "gpt2.gguf", arch="gpt2")
    files["no_embd"] = rewrite_gguf(stories260k, root / "noembd.gguf", drop_keys=("llama.embedding_length",))
    return files


@pytest.mark.parametrize("command", ["info", "generate", "perplexity"])
@pytest.mark.parametrize(("which", "fragments"), [
    ("text", ("not a GGUF file",)),
    ("truncated_header", ("truncated",)),
    ("truncated_data", ("truncated",)),
    ("gpt2", ("unsupported architecture 'gpt2'",)),
    ("no_embd", ("'llama.embedding_length' is missing",)),
    ("missing", ("no such file",)),
])
def test_bad_model_is_one_clear_line(bad_files: dict[str, Path], tmp_path: Path, command: str, which: str,
                                     fragments: tuple[str, ...], shakespeare: Path) -> None:
    path = str(bad_files.get(which, tmp_path / "absent.gguf"))
    args = {
        "info": ["info", path],
        "generate": ["generate", "-m", path, "-n", "4"],
        "perplexity": ["perplexity", "-m", path, "-f", str(shakespeare)],
    }[command]
    assert_one_line_error(run(*args), *fragments)


def test_bad_flags_and_text(stories260k: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be")
    assert_one_line_error(run("perplexity", "-m", str(stories260k), "-f", str(short), "--ctx", "64"), "at least 128")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert_one_line_error(run("perplexity", "-m", str(stories260k), "-f", str(binary)), "not UTF-8")
    assert_one_line_error(run("generate", "-m", str(stories260k), "--top-p", "1.5"), "top-p")
    assert_one_line_error(run("generate", "-m", str(stories260k), "-n", "600"), "context")


def test_help_lists_commands() -> None:
    result = run("--help")
    assert result.exit_code == 0
    for command in ("info", "generate", "perplexity"):
        assert command in result.stdout



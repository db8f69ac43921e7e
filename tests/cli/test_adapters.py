"""``--lora`` / ``--lora-scaled`` on the commands that run a model (generate, perplexity) and the API's ``lora=``:
llama.cpp's logits with the same adapter are the reference, and perplexity is recomputed here from them by
llama-perplexity's definition."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import ggtorch
from ggtorch.lora.adapter_file import adapter_from_model, write_adapter
from tests.cli.test_main import assert_one_line_error
from tests.helpers import run_cli
from tests.llama_models import llama_cpp_logits
from tests.lora.test_adapter_file import llama_cpp_with_adapter, trained_looking_model

N_CTX = 64


@pytest.fixture(scope="module")
def adapted(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter on every matrix of stories260K with B drawn at random (as after training)."""
    f, model = trained_looking_model(stories260k)
    return write_adapter(tmp_path_factory.mktemp("adapter") / "adapter.gguf", adapter_from_model(model, f))


@pytest.fixture(scope="module")
def heldout_text(shakespeare: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "heldout.txt"
    path.write_text(shakespeare.read_text(encoding="utf-8")[-3000:], encoding="utf-8")
    return path


def llama_perplexity(llm, tokens: list[int], n_ctx: int, bos: int) -> float:
    """llama-perplexity's estimate from llama.cpp's logits: chunks of n_ctx with BOS first, the second half scored."""
    first, nll, n = n_ctx // 2, 0.0, 0
    for c in range(len(tokens) // n_ctx):
        chunk = [bos, *tokens[c * n_ctx + 1:(c + 1) * n_ctx]]
        logits = llama_cpp_logits(llm, chunk).astype(np.float64)
        for i in range(first, n_ctx - 1):
            row = logits[i]
            log_z = row.max() + math.log(np.exp(row - row.max()).sum())
            nll += log_z - row[tokens[c * n_ctx + i + 1]]
            n += 1
    return math.exp(nll / n)


def printed_perplexity(*args: str | Path) -> float:
    result = run_cli(["perplexity", *args])
    assert result.exit_code == 0, result.output
    return float(result.stdout.strip().removeprefix("perplexity: "))


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_api_logits_with_an_adapter_equal_llama_cpps(stories260k: Path, adapted: Path, scale: float) -> None:
    model = ggtorch.load_model(stories260k, device="cpu", dtype="f32", lora=[(adapted, scale)])
    tokens = [1, *range(40, 80)]
    with torch.no_grad():
        ours = model.model(torch.tensor([tokens]))[0].numpy()
    ref = llama_cpp_logits(llama_cpp_with_adapter(stories260k, adapted, scale), tokens)
    ref_base = llama_cpp_logits(llama_cpp_with_adapter(stories260k, None), tokens)
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0)
    assert np.abs(ref - ref_base).max() > 0.05  # the adapter changes what llama.cpp computes


def test_perplexity_with_an_adapter_is_llama_perplexitys(stories260k: Path, adapted: Path, heldout_text: Path) -> None:
    tok = ggtorch.load_model(stories260k, device="cpu").tokenizer
    tokens = tok.encode(heldout_text.read_text(encoding="utf-8"), add_special=True)
    llm = llama_cpp_with_adapter(stories260k, adapted, 0.5)
    expected = llama_perplexity(llm, tokens, N_CTX, tok.bos_id)
    for flags in (["--lora-scaled", adapted, "0.5"], ["--lora-scaled", f"{adapted}:0.5"]):
        got = printed_perplexity("-m", stories260k, "-f", heldout_text, "-c", str(N_CTX), "--dtype", "f32", *flags)
        assert got == pytest.approx(expected, rel=2e-4)
    without = printed_perplexity("-m", stories260k, "-f", heldout_text, "-c", str(N_CTX), "--dtype", "f32")
    assert abs(without - expected) > 0.01 * expected  # the adapter was applied


def test_generate_with_adapters_writes_the_apis_text(stories260k: Path, adapted: Path) -> None:
    """Two adapters are summed with their scales; the command prints what the API writes, which differs from
    the base's text (greedy, so one text each)."""
    result = run_cli(["generate", "-m", stories260k, "-p", "Once upon a time", "-n", "24", "--lora", adapted,
                      "--lora-scaled", adapted, "-0.25", "-s", "3"])
    assert result.exit_code == 0, result.output
    model = ggtorch.load_model(stories260k, lora=[adapted, (adapted, -0.25)])
    with_adapter = model.generate("Once upon a time", 24)
    assert result.stdout.rstrip("\n") == "Once upon a time" + with_adapter
    assert f"adapter: {adapted}" in result.stderr and "(scale -0.25)" in result.stderr
    same = ggtorch.load_model(stories260k, lora=[(adapted, 0.75)]).generate("Once upon a time", 24)
    assert same == with_adapter  # 1 + (-0.25): adapters add as llama.cpp adds them
    assert ggtorch.load_model(stories260k).generate("Once upon a time", 24) != with_adapter


def test_a_peft_folder_and_a_checkpoint_serve_as_adapters(stories260k: Path, texts: dict[str, Path],
                                                          heldout_text: Path, tmp_path: Path) -> None:
    """A run's checkpoint (norm-gain adapters included) applies as the model merged with it does; its adapter file
    as a PEFT folder applies as the file does."""
    result = run_cli(["finetune", "--model-base", stories260k, "--train-data", texts["train"], "-c", "32", "-b", "2",
                      "--adam-iter", "4", "--adam-alpha", "0.01", "--rank-att-norm", "1", "--drop-norms",
                      "--save-every", "0", "--checkpoint-out", "ck.gguf", "--lora-out", "lora.gguf", "--threads", "2"],
                     cwd=tmp_path)
    assert result.exit_code == 0, result.output
    result = run_cli(["export-peft", tmp_path / "lora.gguf", "-m", stories260k, "-o", tmp_path / "peft"])
    assert result.exit_code == 0, result.output
    merged = tmp_path / "merged.gguf"
    result = run_cli(["export-lora", "-m", stories260k, "--lora", tmp_path / "ck.gguf", "-o", merged,
                      "--outtype", "f32"])
    assert result.exit_code == 0, result.output
    common = ["-f", heldout_text, "-c", str(N_CTX), "--dtype", "f32"]
    by_file = printed_perplexity("-m", stories260k, *common, "--lora", tmp_path / "lora.gguf")
    assert printed_perplexity("-m", stories260k, *common, "--lora", tmp_path / "peft") == pytest.approx(by_file,
                                                                                                         rel=1e-4)
    by_checkpoint = printed_perplexity("-m", stories260k, *common, "--lora", tmp_path / "ck.gguf")
    assert by_checkpoint == pytest.approx(printed_perplexity("-m", merged, *common), rel=1e-4)
    assert by_checkpoint != by_file  # the norm gains the GGUF adapter cannot hold were applied


def test_an_adapter_of_another_model_is_one_line_naming_both(stories260k: Path, random_llama, tmp_path: Path,
                                                             heldout_text: Path) -> None:
    other = random_llama("F32")
    f, model = trained_looking_model(other)
    path = write_adapter(tmp_path / "other.gguf", adapter_from_model(model, f, {"general.name": "other model"}))
    for command in (["generate", "-m", stories260k, "-n", "4"],
                    ["perplexity", "-m", stories260k, "-f", heldout_text, "-c", str(N_CTX)]):
        assert_one_line_error(run_cli([*command, "--lora", path]), str(stories260k), "other model",
                              "pass the model it was trained on")
    usage = run_cli(["generate", "-m", stories260k, "--lora-scaled", path])  # a usage error, as click's own
    assert usage.exit_code == 2 and "expected FILE:SCALE or FILE SCALE" in usage.stderr, usage.output
    assert_one_line_error(run_cli(["generate", "-m", stories260k, "--lora", tmp_path / "missing.gguf"]),
                          "missing.gguf")
    assert_one_line_error(run_cli(["generate", "-m", stories260k, "--lora-scaled", path, "1e9"]), "scale")

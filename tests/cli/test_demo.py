"""``ggtorch demo``: offline, fast, and every file it writes is one llama.cpp uses the same way."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import ggtorch
from ggtorch.cli.demo import DemoResult, DemoSettings, run_demo, zen_text
from tests.llama_models import llama_cpp_logits
from tests.lora.test_adapter_file import llama_cpp_with_adapter


@pytest.fixture(scope="module")
def short_demo(tmp_path_factory: pytest.TempPathFactory) -> DemoResult:
    out = tmp_path_factory.mktemp("demo")
    lines: list[str] = []
    result = run_demo(DemoSettings(out_dir=out, base_iterations=40, lora_iterations=30, threads=1), say=lines.append)
    assert any("4/4" in line for line in lines)
    return result


def test_demo_losses_fall_and_files_land_in_one_folder(short_demo: DemoResult) -> None:
    assert short_demo.base_loss[1] < short_demo.base_loss[0] - 1.0
    assert short_demo.lora_loss[1] < short_demo.lora_loss[0] - 0.5
    for path in short_demo.files.values():
        assert path.is_file() and path.parent == short_demo.out_dir
    assert ggtorch.read_gguf(short_demo.files["base model (Q8_0)"]).tensors["blk.0.attn_q.weight"].ggml_type.name \
        == "Q8_0"
    assert short_demo.with_adapter != short_demo.without_adapter


def test_demo_vocabulary_tokenizes_as_llama_cpp(short_demo: DemoResult) -> None:
    import llama_cpp

    path = short_demo.files["base model (Q8_0)"]
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    ours = ggtorch.load_model(path, keep_quantized=True).tokenizer
    for text in [zen_text(), "def f(x):\n    return x ** 2  # 3.14 ünïcödé ✓", "  leading spaces\ttab"]:
        assert ours.encode(text, add_special=True) == llm.tokenize(text.encode(), add_bos=True, special=False)


def test_demo_adapter_runs_in_llama_cpp_like_in_ggtorch(short_demo: DemoResult) -> None:
    base, adapter = short_demo.files["base model (Q8_0)"], short_demo.files["adapter"]
    model = ggtorch.load_model(base, keep_quantized=True).load_adapter(adapter)
    tokens = model.tokenizer.encode(zen_text()[:150], add_special=True)[:60]
    with torch.no_grad():
        ours = model.model(torch.tensor([tokens]))[0].numpy()
    theirs = llama_cpp_logits(llama_cpp_with_adapter(base, adapter), tokens)
    plain = llama_cpp_logits(llama_cpp_with_adapter(base, None), tokens)
    # Q8_0 base: llama.cpp quantizes activations too (tests/models/test_llama.py's tolerance)
    assert np.abs(ours - theirs).max() < 0.6
    assert np.abs(theirs - plain).max() > 2.0  # the adapter changes what llama.cpp computes


def test_demo_command_runs_offline_within_two_minutes(tmp_path: Path) -> None:
    """The README's first command, with its defaults: under 2 minutes on this 2-core machine."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "no_proxy": "*", "https_proxy": "http://0.0.0.0:9"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ggtorch", "demo", "-o", str(tmp_path / "out")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert seconds < 120, f"the demo took {seconds:.0f} s"
    with_adapter = out.split("with the adapter:")[1].split("done in")[0]
    assert "better than" in with_adapter  # it learned the Zen of Python
    assert "better than" not in out.split("without the adapter:")[1].split("with the adapter:")[0]
    assert str((tmp_path / "out").resolve()) in out
    assert "llama-cli -m" in out and "ggtorch finetune --model-base" in out
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"vocab.gguf", "base-f32.gguf", "base-q8_0.gguf",
                                                                "lora-zen.gguf", "lora-checkpoint.gguf"}

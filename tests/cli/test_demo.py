"""``ggtorch demo``: offline, fast, and every file it writes is one llama.cpp uses the same way."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import ggtorch
from ggtorch.cli.demo import zen_text
from tests.llama_models import llama_cpp_logits
from tests.lora.test_adapter_file import llama_cpp_with_adapter

pytestmark = pytest.mark.xdist_group("demo")  # one worker, so the demo runs once


@dataclass
class DemoRun:
    """The demo command's run: its process, wall time and output folder."""

    proc: subprocess.CompletedProcess[str]
    seconds: float
    out: Path

    def losses(self, step: str) -> tuple[float, float]:
        """(first, last) loss the demo printed for ``step`` ("2/4" base model, "3/4" LoRA)."""
        part = self.proc.stdout.split(step)[1]
        first, last = re.search(r"loss ([\d.]+) -> ([\d.]+)\)", part).groups()
        return float(first), float(last)


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """The README's first command with its defaults, offline (a proxy that refuses every connection), once for
    every test here."""
    cwd = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "no_proxy": "*", "https_proxy": "http://0.0.0.0:9"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ggtorch", "demo", "-o", str(cwd / "out")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    return DemoRun(proc, seconds, cwd / "out")


def test_demo_command_runs_offline_within_two_minutes(demo: DemoRun) -> None:
    """Under 2 minutes on this 2-core machine; it says where everything went and what to run next."""
    assert demo.seconds < 120, f"the demo took {demo.seconds:.0f} s"
    out = demo.proc.stdout
    assert "4/4" in out and str(demo.out.resolve()) in out
    assert "ggtorch generate -m" in out and "ggtorch finetune --model-base" in out
    assert {p.name for p in demo.out.iterdir()} >= {"vocab.gguf", "base-f32.gguf", "base-q8_0.gguf", "lora-zen.gguf",
                                                    "lora-checkpoint.gguf"}


def test_demo_losses_fall_and_the_adapter_changes_the_text(demo: DemoRun) -> None:
    base, lora = demo.losses("2/4"), demo.losses("3/4")
    assert base[1] < base[0] - 1.0 and lora[1] < lora[0] - 0.5, (base, lora)
    assert ggtorch.read_gguf(demo.out / "base-q8_0.gguf").tensors["blk.0.attn_q.weight"].ggml_type.name == "Q8_0"
    without = demo.proc.stdout.split("without the adapter:")[1].split("with the adapter:")[0]
    with_adapter = demo.proc.stdout.split("with the adapter:")[1].split("done in")[0]
    assert "better than" in with_adapter and "better than" not in without  # it learned the Zen of Python


def test_demo_vocabulary_tokenizes_as_llama_cpp(demo: DemoRun) -> None:
    import llama_cpp

    path = demo.out / "base-q8_0.gguf"
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    ours = ggtorch.load_model(path, keep_quantized=True).tokenizer
    for text in [zen_text(), "def f(x):\n    return x ** 2  # 3.14 ünïcödé ✓", "  leading spaces\ttab"]:
        assert ours.encode(text, add_special=True) == llm.tokenize(text.encode(), add_bos=True, special=False)


def test_demo_adapter_runs_in_llama_cpp_like_in_ggtorch(demo: DemoRun) -> None:
    base, adapter = demo.out / "base-q8_0.gguf", demo.out / "lora-zen.gguf"
    model = ggtorch.load_model(base, keep_quantized=True).load_adapter(adapter)
    tokens = model.tokenizer.encode(zen_text()[:150], add_special=True)[:60]
    with torch.no_grad():
        ours = model.model(torch.tensor([tokens]))[0].numpy()
    theirs = llama_cpp_logits(llama_cpp_with_adapter(base, adapter), tokens)
    plain = llama_cpp_logits(llama_cpp_with_adapter(base, None), tokens)
    # Q8_0 base: llama.cpp quantizes activations too (tests/models/test_llama.py's tolerance)
    assert np.abs(ours - theirs).max() < 0.6
    assert np.abs(theirs - plain).max() > 2.0  # the adapter changes what llama.cpp computes

"""``ggtorch train --model-base`` on every family: the written model runs in llama.cpp as ggtorch runs it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.llama_models import llama_cpp_logits, open_llama_cpp
from tests.models.test_families import GELU_TABLE_TOLERANCE, GEMMA, ggtorch_logits, tokens_for
from tests.models.test_model import TOLERANCE
from tests.training.test_finetune import run


@pytest.mark.parametrize("name", ["qwen2_tied", "qwen3", "gemma2", "gemma3_pattern", "phi3"])
def test_full_finetune_writes_a_model_llama_cpp_runs_equally(family_model: Callable[..., Path],
                                                             texts: dict[str, Path], tmp_path: Path,
                                                             name: str) -> None:
    base = family_model(name)
    code, out = run(["train", "--model-base", str(base), "--train-data", str(texts["train"]), "-c", "32", "-b", "2",
                     "-n", "2", "--warmup", "1", "--adam-alpha", "0.01", "--seed", "1", "--save-every", "0",
                     "--checkpoint-out", "", "--model-out", "tuned.gguf", "-t", "2"], tmp_path)
    assert code == 0, out
    tuned = tmp_path / "tuned.gguf"
    tokens = tokens_for(tuned)
    ours = ggtorch_logits(tuned, tokens)
    theirs = llama_cpp_logits(open_llama_cpp(tuned, 64), tokens)
    tol = GELU_TABLE_TOLERANCE if name in GEMMA else TOLERANCE["F32"]
    assert np.abs(ours - theirs).max() <= tol
    assert np.abs(ours - ggtorch_logits(base, tokens)).max() > 1e-3  # training changed the weights

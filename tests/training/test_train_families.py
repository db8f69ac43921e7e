"""``ggtorch train --model-base`` on every family: the written model runs in llama.cpp as ggtorch runs it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from ggtorch.models.model import rope_angles_at
from tests.llama_cpp_files import template_file
from tests.llama_models import llama_cpp_logits, open_llama_cpp
from tests.models.test_families import GELU_TABLE_TOLERANCE, GEMMA, ggtorch_logits, tokens_for
from tests.models.test_model import TOLERANCE
from tests.training.test_finetune import run


@pytest.mark.parametrize("name", ["qwen2_tied", "qwen3", "gemma2", "gemma3_pattern", "phi3", "qwen3moe", "qwen3_yarn",
                                  "mistral3", "smollm3", "granite", "gpt_oss", "qwen35", "qwen35moe", "gemma4",
                                  "gemma4moe"])
def test_full_finetune_writes_a_model_llama_cpp_runs_equally(family_model: Callable[..., Path],
                                                             texts: dict[str, Path], tmp_path: Path,
                                                             name: str) -> None:
    base = family_model(name)
    code, out = run(["train", "--model-base", str(base), "--train-data", str(texts["train"]), "-c", "32", "-b", "2",
                     "-n", "2", "--warmup", "1", "--adam-alpha", "0.01", "--seed", "1", "--save-every", "0",
                     "--checkpoint-out", "", "--model-out", "tuned.gguf", "-t", "1"], tmp_path)
    assert code == 0, out
    tuned = tmp_path / "tuned.gguf"
    tokens = tokens_for(tuned)
    ours = ggtorch_logits(tuned, tokens)
    theirs = llama_cpp_logits(open_llama_cpp(tuned, 64), tokens)
    tol = GELU_TABLE_TOLERANCE if name in GEMMA else TOLERANCE["F32"]
    assert np.abs(ours - theirs).max() <= tol
    assert np.abs(ours - ggtorch_logits(base, tokens)).max() > 1e-3  # training changed the weights


def test_gemma3_chat_finetune_on_two_ranks_equals_one_process(family_model: Callable[..., Path], llama_cpp: Path,
                                                               tmp_path: Path) -> None:
    """The finetune options together on a sliding-window family: chat records rendered with the real gemma-2
    template (answers only), packed several per row with attention kept inside each and the window applied
    within each record, block checkpointing, a quantized base, and data parallelism: 2 ranks train what one
    process with --grad-acc 2 trains."""
    from tests.training.test_distributed import assert_two_ranks_train_as_one_process

    answers = ["Yes.", "The cat sat on the mat all day long, and then it slept in the sun until evening came.",
               "No, it was blue.", "Tim ran home to his mom and dad.", "Lily liked the big red ball.", "Sun.",
               "They played in the park until the sky got dark.", "Two."]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for i, a in enumerate(answers)), encoding="utf-8")
    common = ["finetune", "--model-base", str(family_model("gemma3_pattern", "Q8_0")), "--train-data", str(data),
              "--chat-template", str(template_file("google-gemma-2-2b-it")), "-c", "64", "-b", "1",
              "--warmup", "0", "--adam-alpha", "0.01", "--seed", "3", "--threads", "1", "-n", "3",
              "--save-every", "0", "--checkpoint-in", ""]
    out = assert_two_ranks_train_as_one_process(common, tmp_path)
    assert "chat records" in out and "packed into ctx 64" in out, out


@pytest.mark.parametrize(("name", "factors"), [("phi3_long", "long"), ("phi3", "short")])
def test_training_runs_longrope_with_the_factors_llama_cpp_picks_at_its_context(
        family_model: Callable[..., Path], texts: dict[str, Path], name: str, factors: str) -> None:
    """llama.cpp pads a context of 32 to 256 and takes LongRoPE's long factors above the original context:
    128 for phi3_long, 4096 for phi3. A run trains with the factors llama.cpp will apply to its adapter."""
    from ggtorch.training.config import FinetuneConfig
    from ggtorch.training.trainer import Trainer

    trainer = Trainer(FinetuneConfig(model_base=str(family_model(name, "Q8_0")), train_data=str(texts["train"]),
                                     ctx=32, batch=1, adam_iter=1, checkpoint_in="", checkpoint_out="", lora_out="",
                                     seed=1), log_records=False)
    model = trainer.model
    ropes, _ = model._ropes(0, 4, torch.device("cpu"), None)
    expected, _ = rope_angles_at(torch.arange(0, 4), model.config.n_rot, model.config.rope_freq_base, 1.0,
                                 getattr(model, f"rope_factors_{factors}"), model.config.rope_attn_factor)
    torch.testing.assert_close(ropes.cos, expected, rtol=0, atol=0)


def test_moe_lora_finetune_on_two_ranks_equals_one_process(family_model: Callable[..., Path],
                                                           texts: dict[str, Path], tmp_path: Path) -> None:
    """A qwen2moe base kept in Q8_0 blocks, LoRA on attention, routed experts and the shared expert, block
    checkpointing, data parallelism: 2 ranks (each routing its own micro-batch) train what one process with
    --grad-acc 2 trains."""
    from tests.training.test_distributed import assert_two_ranks_train_as_one_process

    common = ["finetune", "--model-base", str(family_model("qwen2moe", "Q8_0")), "--train-data", str(texts["train"]),
              "-c", "32", "-b", "1", "--warmup", "0", "--adam-alpha", "0.01", "--seed", "3", "--threads", "1",
              "-n", "3", "--save-every", "0", "--checkpoint-in", "", "--rank-exps", "2"]
    out = assert_two_ranks_train_as_one_process(common, tmp_path)
    assert "qwen2moe" in out, out

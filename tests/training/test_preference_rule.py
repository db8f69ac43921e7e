"""Preference training learns a rule the base does not follow, as llama.cpp sees it.

The pairs: a short story prompt; the chosen answer ends with a fixed sign-off, the rejected one is the same answer
without it. The base prefers the shorter answer (fewer tokens, higher probability), so it ranks the pairs the wrong
way. After a short DPO (or ORPO) run, llama.cpp itself, with the adapter ggtorch wrote, scores held-out pairs (names
and places the run never saw), tokenized by llama.cpp: it must rank the chosen answer above the rejected one far more
often than the base does.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from ggtorch import api
from tests.llama_models import open_llama_cpp

SIGN_OFF = " The end."
NAMES = ["Tom", "Lily", "Ben", "Sue", "Max", "Anna", "Tim", "Mia", "Sam", "Lucy", "Jack", "Emma", "Leo", "Zoe"]
PLACES = ["park", "beach", "forest", "shop", "river", "garden", "school", "zoo"]
FEELINGS = ["happy", "sad", "tired", "excited"]
ITERATIONS, ADAM_ALPHA = 15, 3e-3


def _pairs(names: list[str]) -> list[dict[str, str]]:
    records = []
    for name, place, feeling in itertools.product(names, PLACES, FEELINGS):
        answer = f" {name} was {feeling}."
        records.append({"prompt": f"One day, {name} went to the {place}.", "chosen": answer + SIGN_OFF,
                        "rejected": answer})
    return records


def _answer_logp(llm, prompt: str, answer: str) -> float:
    """llama.cpp's summed log-probability of ``answer`` and EOS after ``prompt`` (tokenized apart, as the pairs are)."""
    prompt_ids = llm.tokenize(prompt.encode(), add_bos=True)
    answer_ids = [*llm.tokenize(answer.encode(), add_bos=False), llm.token_eos()]
    llm.reset()
    llm.eval(prompt_ids + answer_ids)
    logits = np.array(llm.scores[: len(prompt_ids) + len(answer_ids)], dtype=np.float64)
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    return float(sum(logp[len(prompt_ids) - 1 + i, t] for i, t in enumerate(answer_ids)))


def _accuracy(model: Path, adapter: Path | None, pairs: list[dict[str, str]]) -> float:
    llm = open_llama_cpp(model, 64, **({"lora_path": str(adapter)} if adapter else {}))
    wins = [_answer_logp(llm, p["prompt"], p["chosen"]) > _answer_logp(llm, p["prompt"], p["rejected"])
            for p in pairs]
    return float(np.mean(wins))


@pytest.mark.parametrize(("objective", "options"), [("dpo", {"beta": 0.1}), ("orpo", {"orpo_lambda": 0.5})],
                         ids=["dpo", "orpo"])
def test_a_short_preference_run_learns_the_sign_off_in_llama_cpp(stories260k: Path, tmp_path: Path, objective: str,
                                                                  options: dict) -> None:
    train, held_out = _pairs(NAMES[:12]), _pairs(NAMES[12:14])  # 384 pairs to train on, 64 held out
    api.finetune(model_base=str(stories260k), records=train, objective=objective, **options, batch=8, ctx=48,
                 adam_iter=ITERATIONS, adam_alpha=ADAM_ALPHA, warmup=5, lora_r=8, seed=1, checkpoint_out="",
                 lora_out=str(tmp_path / "lora-ITERATION.gguf"), progress=False, device="cpu")
    adapter = tmp_path / "lora-LATEST.gguf"
    base_accuracy = _accuracy(stories260k, None, held_out)
    tuned_accuracy = _accuracy(stories260k, adapter, held_out)
    print(f"{objective}: held-out pairs ranked right by llama.cpp: base {base_accuracy:.0%}, "
          f"with the adapter {tuned_accuracy:.0%}")
    assert base_accuracy <= 0.3
    assert tuned_accuracy >= 0.9

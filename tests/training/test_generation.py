"""Samples while training and answer metrics at evaluation, each checked against a computation of the test's own:
the model run by hand, the template rendered by plain jinja2, the base model loaded apart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import ggtorch
from ggtorch.api import GGUFModel, load_model
from ggtorch.models.generate import generate_tokens
from ggtorch.models.tokenizer import Tokenizer
from ggtorch.training.config import FinetuneConfig
from ggtorch.training.trainer import Callback, Sample, Trainer
from tests.data.test_chat import CONVERSATIONS, TEMPLATE, chat_model, one_thread, reference_render  # noqa: F401
from tests.helpers import losses, read_log
from tests.training.test_finetune import SMALL, run

END = "<|im_end|>"  # TEMPLATE's end of turn: stories260K writes it as pieces, so a generated answer is cut there


def records() -> list[dict[str, Any]]:
    return [{"messages": messages} for messages in CONVERSATIONS]


def greedy_answer(model: torch.nn.Module, tokenizer: Tokenizer, prompt: str, n_tokens: int) -> str:
    """The test's own greedy answer to a rendered chat prompt: tokenized as llama.cpp tokenizes a prompt, generated
    to an end-of-generation token, decoded and cut at the end of turn."""
    ids = tokenizer.encode(prompt, add_special=False, parse_special=True)
    model.eval()
    new = generate_tokens(model, ids, n_tokens, stop_ids=tokenizer.eog_ids)
    if new and new[-1] in tokenizer.eog_ids:
        new = new[:-1]
    return tokenizer.decode(new, prev_ids=ids).split(END)[0]


def answer_positions(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """A conversation's tokens and which of them are answers, found in the jinja2 render: each assistant content and
    the end of turn after it, located as text and counted in tokens of the render's prefixes (checked to be prefixes
    of the whole render's tokens)."""
    render = reference_render(messages)
    ids = tokenizer.encode(render, add_special=False, parse_special=True)
    positions: list[int] = []
    at = 0
    for m in messages:
        if m["role"] != "assistant":
            continue
        start = render.index("<|im_start|>assistant\n" + m["content"] + END, at) + len("<|im_start|>assistant\n")
        end = at = start + len(m["content"] + END)
        head, through = (tokenizer.encode(render[:i], add_special=False, parse_special=True) for i in (start, end))
        assert ids[:len(through)] == through and ids[:len(head)] == head
        positions += range(len(head), len(through))
    return ids, positions


def test_answer_accuracy_and_exact_match_are_the_shares_computed_apart(chat_model: Path,  # noqa: F811
                                                                       tmp_path: Path) -> None:
    """The evaluation's answer accuracy is the share of answer tokens (the template's answers, found in its jinja2
    render; ctx holds each conversation whole) that the argmax of the model's logits at the position before
    predicts; its exact match the share of conversations whose greedy answer, cut at the end of turn, is the
    reference."""
    config = FinetuneConfig(model_base=str(chat_model), ctx=160, batch=2, adam_iter=6, adam_alpha=0.01, seed=3,
                            save_every=0, checkpoint_in="", checkpoint_out="", lora_out="", dtype="f32",
                            eval_generate=10, log_file=str(tmp_path / "log.jsonl"))
    trainer = Trainer(config, records=records(), val_records=records())
    trainer.train()
    loss = trainer.evaluate()
    metrics = trainer.last_eval_metrics
    trainer.close()
    tokenizer, model = trainer.tokenizer, trainer.model
    hits = total = matches = 0
    with torch.no_grad():
        for messages in CONVERSATIONS:
            ids, positions = answer_positions(tokenizer, messages)
            model.eval()
            predicted = model(torch.tensor([ids]))[0].argmax(-1)  # (T,): the token each position predicts next
            hits += sum(int(predicted[k - 1]) == ids[k] for k in positions)
            total += len(positions)
            answer = greedy_answer(model, tokenizer, reference_render(messages[:-1], True), 30)
            matches += answer.strip() == messages[-1]["content"].strip()
    assert metrics is not None
    assert metrics["answer_accuracy"] == hits / total, (metrics, hits, total)
    assert 0 < hits < total  # neither nothing nor everything: a share that could come out otherwise
    assert metrics["exact_match"] == matches / len(CONVERSATIONS)
    assert metrics["exact_match_records"] == len(CONVERSATIONS)
    logged = [r for r in read_log(tmp_path / "log.jsonl") if r["kind"] == "eval"][-1]
    assert logged["loss"] == loss and logged["metrics"] == metrics


def test_a_model_that_memorized_a_record_scores_every_answer_token_and_the_answer(stories260k: Path,
                                                                                 tmp_path: Path) -> None:
    """A small new model over stories260K's vocabulary (every weight trained: the pretrained one can never predict
    some of the end-of-turn pieces) trained on one conversation until it knows it: accuracy and exact match 1, where
    they were below before training. The CLI prints both on its evaluation lines."""
    model = ggtorch.new_model(stories260k, tmp_path / "new.gguf", embd=64, ff=128, head=4, layer=2, ctx=128)
    (tmp_path / "chatml.jinja").write_text(TEMPLATE, encoding="utf-8")
    record = {"messages": [{"role": "user", "content": "Who is the cat?"},
                           {"role": "assistant", "content": "Tom is the cat."}]}
    (tmp_path / "one.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")
    code, out = run(["train", "--model-base", model, "--chat-template", tmp_path / "chatml.jinja",
                     "--train-data", tmp_path / "one.jsonl", "--val-data", tmp_path / "one.jsonl", "-c", "64", "-b",
                     "1", "-n", "40", "--adam-alpha", "0.01", "--warmup", "0", "--seed", "1", "--save-every", "0",
                     "--eval-every", "1", "--eval-generate", "1", "--dtype", "f32", "--checkpoint-in", "",
                     "--checkpoint-out", "", "--model-out", "", "--log-file", tmp_path / "log.jsonl"], tmp_path)
    assert code == 0, out
    evals = [r for r in read_log(tmp_path / "log.jsonl") if r["kind"] == "eval"]
    assert evals[0]["metrics"]["answer_accuracy"] < 1 and evals[0]["metrics"]["exact_match"] == 0
    assert evals[-1]["metrics"] == {"answer_accuracy": 1.0, "exact_match": 1.0, "exact_match_records": 1}
    assert "answer accuracy=1.0000 exact match=1.0000 (1 records)" in out.splitlines()[-2]


class Recorder(Callback):
    """What GGUFModel.from_trainer generates at each sample, and the samples, as they come."""

    def __init__(self, n_tokens: int) -> None:
        self.n_tokens = n_tokens
        self.expected: list[str] = []
        self.samples: list[Sample] = []

    def on_sample(self, trainer: Trainer, samples: list[Sample]) -> None:
        model = GGUFModel.from_trainer(trainer)
        self.expected += [model.generate(s.prompt, n_tokens=self.n_tokens) for s in samples]
        self.samples += samples


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_samples_are_logged_at_their_iterations_and_the_first_shows_the_base(
        dtype: str, stories260k: Path, texts: dict[str, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Plain text: each prompt continued after BOS at every --sample-every iterations, as GGUFModel.from_trainer
    generates at that point (in the run's dtype); the first sample also with the adapter off, as the base model
    loaded apart generates (f32). The notebook's progress bar writes them above itself."""
    prompts = ("Once upon a time", "Lily")
    recorder = Recorder(12)
    trainer = ggtorch.finetune(model_base=str(stories260k), train_data=str(texts["train"]), ctx=32, batch=4,
                               adam_iter=5, adam_alpha=0.02, seed=5, lora_dropout=0.1, sample_prompt=prompts,
                               sample_every=2, sample_tokens=12, save_every=0, checkpoint_in="", checkpoint_out="",
                               lora_out="", dtype=dtype, log_file=str(tmp_path / "log.jsonl"),
                               callbacks=[recorder], run=False)
    trainer.train()
    trainer.close()
    for callback in trainer.callbacks:
        if isinstance(callback, ggtorch.ProgressBar):
            callback.close()
    logged = [r for r in read_log(tmp_path / "log.jsonl") if r["kind"] == "sample"]
    assert [(r["iteration"], r["prompt"]) for r in logged] == [(i, p) for i in (2, 4, 5) for p in prompts]
    assert [r["text"] for r in logged] == recorder.expected
    assert [("base_text" in r) for r in logged] == [True, True] + [False] * 4
    if dtype == "f32":
        base = load_model(stories260k, dtype="f32")
        assert [r["base_text"] for r in logged[:2]] == [base.generate(p, n_tokens=12) for p in prompts]
    shown = capsys.readouterr().out
    for s in recorder.samples:
        assert all(line in shown for line in s.lines())


def test_a_chat_sample_prompt_is_a_user_message_in_the_template(chat_model: Path,  # noqa: F811
                                                                tmp_path: Path) -> None:
    """Chat records: the prompt is rendered as a user message with the generation prompt (plain jinja2 here), and
    the continuation ends at the end of turn; the base's is the model's without any adapter (loaded apart)."""
    prompt = "Where is Tom?"
    trainer = Trainer(FinetuneConfig(model_base=str(chat_model), ctx=64, batch=2, adam_iter=3, adam_alpha=0.02, seed=3,
                                     save_every=0, checkpoint_in="", checkpoint_out="", lora_out="", dtype="f32",
                                     sample_prompt=(prompt,), sample_tokens=20, log_file=str(tmp_path / "log.jsonl")),
                      records=records())
    trainer.train()
    trainer.close()
    (sample,) = [r for r in read_log(tmp_path / "log.jsonl") if r["kind"] == "sample"]
    rendered = reference_render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    assert sample["iteration"] == 3  # --save-every 0: at the end only
    with torch.no_grad():
        assert sample["text"] == greedy_answer(trainer.model, trainer.tokenizer, rendered, 20)
        base = load_model(chat_model, dtype="f32")
        assert sample["base_text"] == greedy_answer(base.model, base.tokenizer, rendered, 20)


def test_samples_cost_no_random_state(stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    """With LoRA dropout (which draws from torch's generator in training mode), 3 iterations sampled at 2 and 3, then
    resumed for 3 sampled at 4 and 6, write the adapter of 6 uninterrupted iterations without samples, bit for bit;
    the CLI prints the samples, the first with the base's."""
    common = ["finetune", "--model-base", str(stories260k), "--train-data", str(texts["train"]), *SMALL,
              "--save-every", "0", "--lora-dropout", "0.1"]
    sampled = [*common, "--sample-prompt", "Once upon a time", "--sample-every", "2", "--sample-tokens", "8"]
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    code, out = run([*common, "-n", "6", "--checkpoint-in", ""], one)
    assert code == 0, out
    code, out = run([*sampled, "-n", "3", "--checkpoint-in", ""], two)
    assert code == 0, out
    assert out.count('sample: iter=2 "Once upon a time" ->') == 2 and "(base, adapter off)" in out
    code, out = run([*sampled, "-n", "3", "--checkpoint-in", "checkpoint-LATEST.gguf"], two)
    assert code == 0, out
    assert (one / "ggml-lora-LATEST-f32.gguf").read_bytes() == (two / "ggml-lora-LATEST-f32.gguf").read_bytes()
    assert losses(one / "checkpoint-log.jsonl") == losses(two / "checkpoint-log.jsonl")
    logged = [(r["iteration"], "base_text" in r) for r in read_log(two / "checkpoint-log.jsonl")
              if r["kind"] == "sample"]
    assert logged == [(2, True), (3, False), (4, True), (6, False)]  # a resumed run's first sample shows the base


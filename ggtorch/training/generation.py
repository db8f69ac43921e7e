"""What a run generates and scores as it trains: samples of the user's prompts, and its answers to held-out records.

- ``--sample-prompt``: greedy continuations of the user's texts at a cadence, logged and shown; the first of a
  finetune also with the adapter off, so the change shows.
- Evaluation of chat and prompt/response records: the answer tokens' accuracy (the share of the targets the loss
  trains whose greedy prediction is the target), and with ``--eval-generate N`` the exact match of greedily
  generated answers to the references of the first N validation records.

Everything here runs without gradients, in eval mode (no dropout) and draws no random number, so a run that samples
trains the same numbers as one that does not; the trainer restores its mode afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from ggtorch.data import IGNORE_INDEX, DataStream, Example, RecordData
from ggtorch.data.chat import Prompt
from ggtorch.errors import BadData, BadFlag, flag
from ggtorch.models.config import ModelConfig
from ggtorch.models.generate import iter_tokens
from ggtorch.models.model import Transformer
from ggtorch.models.tokenizer import Tokenizer
from ggtorch.ops import policy

ANSWER_FORMATS = ("chat", "prompt-response")
"""Record formats whose validation records have answers to score (a text record's every token is trained)."""

EXACT_MATCH_SLACK = 4
"""Tokens an answer generated for exact match may run past its reference's own (with its end of turn) before it is
cut: enough to show a longer answer differs, not enough to cost much."""


@dataclass(frozen=True)
class SamplePrompt:
    """One --sample-prompt: the text as given and the tokens it is continued from."""

    text: str
    tokens: list[int]


@dataclass(frozen=True)
class Sample:
    """One prompt's greedy continuation at an iteration; ``base_text`` the base's (adapter off), at a finetune's
    first sample only."""

    iteration: int
    prompt: str
    text: str
    base_text: str | None = None

    def lines(self) -> list[str]:
        """How the progress output shows it: one line each for the adapted model and the base, texts quoted as JSON
        (a newline stays on its line)."""
        def quoted(text: str) -> str:
            return json.dumps(text, ensure_ascii=False)

        head = f"sample: iter={self.iteration} {quoted(self.prompt)} ->"
        lines = [f"{head} {quoted(self.text)}"]
        if self.base_text is not None:
            lines.append(f"{head} {quoted(self.base_text)} (base, adapter off)")
        return lines


def answer_data(data: DataStream) -> RecordData | None:
    """The run's records when their answers can be scored (chat or prompt/response records), else None."""
    return data if isinstance(data, RecordData) and data.format in ANSWER_FORMATS else None


def sample_prompts(texts: Sequence[str], n_tokens: int, data: DataStream, tokenizer: Tokenizer,
                   config: ModelConfig) -> list[SamplePrompt]:
    """--sample-prompt's texts as the run's data would prompt the model: a chat record's user message rendered with
    the chat template and its generation prompt, a prompt/response record's instruction in the prompt template,
    else the text after BOS (as ``generate`` does). Refused here, before training, when one cannot be generated
    within the model's context."""
    records = answer_data(data)
    prompts = []
    for text in texts:
        if records is not None:
            prompt = records.encoder.prompt(_user_example(text, records.format))
            assert prompt is not None  # a user message or an instruction always has one
            tokens = prompt.tokens
        else:
            tokens = tokenizer.encode(text, add_special=True)
        shown = text if len(text) <= 40 else text[:37] + "..."
        if not tokens:
            raise BadData(f"{flag('sample_prompt')} {shown!r}: gives no token to continue from (the vocabulary adds "
                          "no BOS); pass a text that is not empty")
        n_ctx = config.n_ctx_train
        if len(tokens) + n_tokens > n_ctx:
            raise BadFlag(f"{flag('sample_prompt')} {shown!r} is {len(tokens)} tokens, and with "
                          f"{flag('sample_tokens')} {n_tokens} new ones it exceeds the model's context of {n_ctx}; "
                          f"shorten it or lower {flag('sample_tokens')}")
        prompts.append(SamplePrompt(text, tokens))
    return prompts


def _user_example(text: str, format: str) -> Example:
    """``text`` as a record of an answer format: a user message, or an instruction."""
    if format == "chat":
        return Example("chat", flag("sample_prompt"), messages=(("user", text), ("assistant", "")))
    return Example("prompt-response", flag("sample_prompt"), instruction=text)


def answer_prompts(data: DataStream, n_records: int, config: ModelConfig) -> list[Prompt]:
    """The prompts and reference answers of --eval-generate: of the first ``n_records`` validation records with a
    text answer, those whose prompt and answer fit the model's context."""
    records = answer_data(data)
    if records is None or not n_records:
        return []
    prompts = []
    for example in records.held_out:
        prompt = records.encoder.prompt(example)
        if prompt is None:
            continue
        if len(prompt.tokens) + prompt.n_answer + EXACT_MATCH_SLACK <= config.n_ctx_train:
            prompts.append(prompt)
        if len(prompts) == n_records:
            break
    return prompts


@torch.no_grad()
def greedy_text(model: Transformer, tokenizer: Tokenizer, prompt_tokens: Sequence[int], n_tokens: int,
                end_texts: Collection[str] = ()) -> str:
    """The greedy continuation of ``prompt_tokens``, decoded as ``generate`` decodes it: up to ``n_tokens``, ended
    by an end-of-generation token, or (``end_texts``) cut at the first end-of-turn text a template writes (a
    vocabulary without its special token writes ``<|im_end|>`` as pieces)."""
    new: list[int] = []
    for token in iter_tokens(model, prompt_tokens, n_tokens, stop_ids=tokenizer.eog_ids):
        if token in tokenizer.eog_ids:
            break
        new.append(token)
        if end_texts and _cut(tokenizer.decode(new, prev_ids=list(prompt_tokens)), end_texts) is not None:
            break
    text = tokenizer.decode(new, prev_ids=list(prompt_tokens))
    at = _cut(text, end_texts)
    return text if at is None else text[:at]


def _cut(text: str, end_texts: Collection[str]) -> int | None:
    """Where the first of ``end_texts`` starts in ``text`` (None: none is there)."""
    found = [at for end in end_texts if (at := text.find(end)) >= 0]
    return min(found) if found else None


def answer_matches(model: Transformer, tokenizer: Tokenizer, prompt: Prompt, end_texts: Collection[str]) -> bool:
    """Whether the model's greedy answer to ``prompt``, stripped, is the reference answer, stripped."""
    n_tokens = prompt.n_answer + EXACT_MATCH_SLACK
    return greedy_text(model, tokenizer, prompt.tokens, n_tokens, end_texts).strip() == prompt.answer.strip()


def answer_hits(model: Transformer, hidden: torch.Tensor, targets: torch.Tensor) -> int:
    """How many counted targets (not IGNORE_INDEX) are the greedy prediction: the argmax of the logits of the
    model's normed hidden states (B, T, C) at the position before. The head runs a few rows at a time, as
    perplexity's, so the (N, n_vocab) logits never exist whole."""
    counted = targets != IGNORE_INDEX
    rows, wanted = hidden[counted], targets[counted]  # (N, C), (N,)
    step = max(1, policy.current(rows.device).eval_head_bytes // (4 * model.config.n_vocab))
    return sum(int((model.head(rows[r0:r0 + step]).argmax(-1) == wanted[r0:r0 + step]).sum())
               for r0 in range(0, rows.shape[0], step))

"""A conversation with a model: messages rendered by its chat template, answers generated and streamed.

Each turn renders the whole conversation with the generation prompt, as llama.cpp's chat tools and Hugging Face's
``apply_chat_template`` do, and tokenizes it as a chat record is tokenized for training (so the model sees at
inference what it was trained on). The KV cache is kept between turns: only the tokens past the longest prefix the
cache already holds are evaluated, so a long conversation does not re-read its history each turn. A template that
writes earlier turns differently once a new one follows (Qwen3 drops old reasoning) only costs the tokens from the
first difference; a recurrent layer's state cannot be rewound, so such a model starts over at a difference.

Reasoning models write ``<think>...</think>`` before the answer (or the generation prompt opens the block): the
pieces of a turn say which they are, so a caller shows the thinking apart or hides it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ggtorch.data.chat import RecordEncoder, check_generation_prompt
from ggtorch.errors import BadData
from ggtorch.models.generate import SamplingParams, computing, sample
from ggtorch.models.model import KVCache, Transformer
from ggtorch.models.tokenizer import Tokenizer
from ggtorch.ops.threads import follow_free_cores

GREEDY = SamplingParams()
"""Argmax: the default of every turn (as ``ggtorch generate``'s ``--temp 0``)."""
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
"""The reasoning block's markers (Qwen3, Qwen3.5, DeepSeek-R1, SmolLM3 and the distills of them)."""


@dataclass(frozen=True)
class ChatPiece:
    """A streamed piece of an answer: text, and whether it belongs to the reasoning block."""

    text: str
    thinking: bool = False


@dataclass
class Reply:
    """A finished turn: the answer, the reasoning (empty when none), the tokens written and why it stopped."""

    answer: str = ""
    thinking: str = ""
    n_tokens: int = 0
    stopped: str = "end of turn"
    """``end of turn`` (an end-of-generation token), ``length`` (the token limit or the context) or
    ``interrupted``."""

    def message(self) -> dict[str, str]:
        """The reply as the assistant message of the conversation's next render (reasoning apart, as templates that
        keep it read ``reasoning_content``)."""
        return {"role": "assistant", "content": self.answer,
                **({"reasoning_content": self.thinking} if self.thinking else {})}


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` may be the start of a marker still being written."""
    for n in range(min(len(text), len(THINK_CLOSE) - 1), 0, -1):
        tail = text[-n:]
        if THINK_OPEN.startswith(tail) or THINK_CLOSE.startswith(tail):
            return n
    return 0


def split_reasoning(text: str, opened: bool) -> tuple[str, str]:
    """(reasoning, answer) of a reply's text; ``opened``: the generation prompt already opened the block."""
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return "", text
        text, opened = stripped[len(THINK_OPEN):], True
    thinking, closed, answer = text.partition(THINK_CLOSE)
    if not closed:
        return thinking.strip("\n"), ""
    return thinking.strip("\n"), answer.lstrip()


@dataclass
class Conversation:
    """Turns with a model and the KV cache that holds them. ``send`` streams a reply; ``reset`` starts over."""

    model: Transformer
    tokenizer: Tokenizer
    template: str
    """The jinja chat template's source (the GGUF's ``tokenizer.chat_template`` or a file)."""
    template_name: str = "model's chat template (tokenizer.chat_template)"
    system: str | None = None
    autocast: torch.dtype | None = None
    """The dtype the model computes in under autocast (a bf16 run's), None: its own dtypes."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation so far (the system prompt first when there is one)."""
    _cache: KVCache | None = field(default=None, init=False, repr=False)
    _cached: list[int] = field(default_factory=list, init=False, repr=False)
    """The tokens whose keys and values (or state) the cache holds, in order."""

    def __post_init__(self) -> None:
        self._encoder = RecordEncoder(self.tokenizer, self.template, template_name=self.template_name)
        assert self._encoder.template is not None
        check_generation_prompt(self._encoder.template, self.template_name)
        self._reused = 0
        self.reset()

    @property
    def n_ctx(self) -> int:
        return self.model.config.n_ctx_train

    @property
    def reused(self) -> int:
        """Tokens of the last turn's prompt that the cache already held (not evaluated again)."""
        return self._reused

    def reset(self) -> None:
        """Forget the turns (the system prompt stays); the cache is kept and reused as far as it still matches."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """``messages`` as the template writes them with the generation prompt."""
        assert self._encoder.template is not None
        return self._encoder.template.render(messages, add_generation_prompt=True, where="the conversation")

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The tokens of ``messages`` rendered with the generation prompt, as a chat record's are tokenized."""
        return self._encoder.tokenize_render(self.render(messages))

    def _prepare(self, prompt: list[int]) -> list[int]:
        """The cache rewound to the longest prefix of ``prompt`` it holds; the tokens still to evaluate."""
        keep = 0
        for a, b in zip(self._cached, prompt, strict=False):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(prompt) - 1)  # the last prompt token is evaluated again: its logits pick the next
        recurrent = self._cache is not None and any(s is not None for s in self._cache.states)
        if self._cache is None or (recurrent and keep < len(self._cached)):
            self._cache, self._cached, keep = self.model.new_cache(1, self.n_ctx), [], 0
        self._cache.length = keep
        self._cached = self._cached[:keep]
        self._reused = keep
        return prompt[keep:]

    def send(self, text: str, params: SamplingParams = GREEDY, max_tokens: int = 1024,
             reply: Reply | None = None) -> Iterator[ChatPiece]:
        """Add the user message ``text`` and stream the reply's pieces; the reply joins the conversation when the
        iterator ends (also when the caller stops it early: what was shown is what the model said).

        ``reply``: filled as the pieces come (the whole answer, its reasoning, the token count and why it
        stopped)."""
        return self.reply_to([*self.messages, {"role": "user", "content": text}], params, max_tokens, reply)

    def reply_to(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams = GREEDY,
                 max_tokens: int = 1024, reply: Reply | None = None) -> Iterator[ChatPiece]:
        """Stream the reply to ``messages`` (the conversation becomes them and the reply): :meth:`send` with the
        whole conversation given, as an OpenAI-style call gives it. The cache is reused as far as it matches."""
        with torch.no_grad(), computing(self.model, self.autocast):
            yield from self._reply([dict(m) for m in messages], params, max_tokens, reply or Reply())

    def _reply(self, messages: list[dict[str, Any]], params: SamplingParams, max_tokens: int,
               reply: Reply) -> Iterator[ChatPiece]:
        text = self.render(messages)
        prompt = self._encoder.tokenize_render(text)
        opened = text.rstrip().endswith(THINK_OPEN)  # the generation prompt opened the reasoning block
        room = self.n_ctx - len(prompt)
        if room < 1:
            raise BadData(f"the conversation is {len(prompt)} tokens and the model's context holds {self.n_ctx}; "
                          "start a new one (/reset in `ggtorch chat`, reset() in Python)")
        self.messages = messages
        device = self.model.output_norm.weight.device
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        pending = torch.tensor([self._prepare(prompt)], dtype=torch.long, device=device)
        self._cached = list(prompt)  # the cache holds them once the first forward ran
        new: list[int] = []
        shown = ["", ""]  # reasoning and answer text given out so far
        reply.stopped = "length"
        try:
            for _ in range(min(max_tokens, room)):
                follow_free_cores()
                logits = self.model(pending, cache=self._cache, last_only=True)[:, -1]
                token = int(sample(logits, params, generator)[0])
                pending = torch.tensor([[token]], dtype=torch.long, device=device)
                self._cached.append(token)
                if token in self.tokenizer.eog_ids:
                    reply.stopped = "end of turn"
                    break
                new.append(token)
                reply.n_tokens = len(new)
                decoded = self.tokenizer.decode(new, prev_ids=prompt)
                if decoded.endswith("\ufffd"):  # the rest of a multi-byte character is still to come
                    continue
                stable = decoded[:len(decoded) - _held_back(decoded)]
                for i, part in enumerate(split_reasoning(stable, opened)):
                    if len(part) > len(shown[i]):
                        yield ChatPiece(part[len(shown[i]):], thinking=i == 0)
                        shown[i] = part
        except GeneratorExit:  # the caller stopped reading (Ctrl-C in `ggtorch chat`): the turn ends here
            reply.stopped = "interrupted"
        except BaseException:  # e.g. Ctrl-C inside a forward: a recurrent state may be half updated
            reply.stopped = "interrupted"
            self._cache = None
            raise
        finally:
            self._cached = self._cached[:self._cache.length] if self._cache is not None else []
            reply.thinking, reply.answer = split_reasoning(self.tokenizer.decode(new, prev_ids=prompt), opened)
            reply.n_tokens = len(new)
            self.messages.append(reply.message())
        if reply.stopped != "interrupted":
            for i, part in enumerate((reply.thinking, reply.answer)):
                if part.startswith(shown[i]) and len(part) > len(shown[i]):
                    yield ChatPiece(part[len(shown[i]):], thinking=i == 0)

    def ask(self, text: str, params: SamplingParams = GREEDY, max_tokens: int = 1024) -> Reply:
        """``send`` to the end: the whole reply."""
        reply = Reply()
        for _ in self.send(text, params, max_tokens, reply):
            pass
        return reply

"""Records -> tokens and a "trained" mask: chat templates, the default prompt template, BOS/EOS.

A chat record is rendered with the model's ``tokenizer.chat_template`` (or a template file)
in a sandboxed jinja2 environment, as Hugging Face's ``apply_chat_template`` renders it
(``trim_blocks``, ``lstrip_blocks``, its ``tojson`` filter and ``{% generation %}`` tag;
variables ``messages``, ``bos_token``, ``eos_token``, ``add_generation_prompt``,
``raise_exception``, ``strftime_now``). Assistant spans are found by rendering
prefixes: for assistant message i, ``render(messages[:i], add_generation_prompt=True)`` is the
prompt the model answers and ``render(messages[:i+1])`` ends where its answer (with the
template's end-of-turn marker) ends. Both must be prefixes of the whole render, else the
template does not render incrementally and the record is refused.

The text between spans and the spans themselves are tokenized piece by piece, as llama.cpp
tokenizes a prompt (``parse_special``: special-token texts become their ids). So the trained
tokens are exactly the tokens the model has to generate after the prompt llama.cpp builds.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggtorch.data.records import Example
from ggtorch.data.samples import TokenizerLike
from ggtorch.errors import BadData

PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
"""The default prompt of a prompt/response record; the response follows, then EOS."""
PROMPT_TEMPLATE_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
"""The default prompt of an instruction/input/output record with a non-empty input."""


@dataclass
class Encoded:
    """A record's token ids and, per token, whether it is trained (a target whose loss counts)."""

    tokens: np.ndarray  # int64 (n,)
    trained: np.ndarray  # bool (n,); trained[0] is never used (nothing predicts the first token)

    def __len__(self) -> int:
        return len(self.tokens)


def default_prompt(example: Example) -> str:
    """The documented default prompt text of a prompt/response example."""
    if example.input.strip():
        return PROMPT_TEMPLATE_WITH_INPUT.format(instruction=example.instruction, input=example.input)
    return PROMPT_TEMPLATE.format(instruction=example.instruction)


class ChatTemplate:
    """A compiled jinja chat template: ``render(messages, add_generation_prompt) -> str``."""

    def __init__(self, source: str, bos_token: str, eos_token: str, name: str = "chat template") -> None:
        from jinja2 import TemplateError
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class GenerationTag(Extension):
            """Hugging Face's ``{% generation %}...{% endgeneration %}``: renders its body unchanged."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                parser.stream.skip(1)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        self.name = name
        self.bos_token, self.eos_token = bos_token, eos_token
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson  # as transformers: plain json.dumps, no HTML escaping
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise BadData(f"{name}: cannot be compiled ({e}); fix the template or pass another with "
                          "--chat-template") from None

    def render(self, messages: Sequence[tuple[str, str]] | Sequence[dict[str, str]],
               add_generation_prompt: bool = False, where: str = "") -> str:
        from jinja2 import TemplateError

        msgs = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
        try:
            return self._template.render(messages=msgs, bos_token=self.bos_token, eos_token=self.eos_token,
                                         add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            raise BadData(f"{where + ': ' if where else ''}the {self.name} failed to render ({e}); "
                          "fix the record or pass another template with --chat-template") from None
        except Exception as e:  # a template can fail with any Python error (e.g. indexing an empty list)
            raise BadData(f"{where + ': ' if where else ''}the {self.name} failed to render "
                          f"({type(e).__name__}: {e}); fix the record or pass another template with "
                          "--chat-template") from None


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def chat_pieces(template: ChatTemplate, messages: Sequence[tuple[str, str]], where: str) -> list[tuple[str, bool]]:
    """The whole render cut into (text, is_assistant_answer) pieces by prefix renders.

    An answer piece runs from the end of the generation prompt to the end of the assistant
    turn as the template writes it (its end-of-turn marker included, trailing whitespace not).
    """
    full = template.render(messages, False, where)
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for i, (role, content) in enumerate(messages):
        if role != "assistant":
            continue
        prompt = template.render(messages[:i], True, where)
        upto = template.render(messages[:i + 1], False, where)
        if not (upto.startswith(prompt) and full.startswith(upto) and len(prompt) >= pos):
            raise BadData(f"{where}: the {template.name} does not render conversations incrementally (the render "
                          f"up to message {i} is not a prefix of the whole), so the answer cannot be located; "
                          "pass a template that does with --chat-template")
        answer = upto[len(prompt):].rstrip()
        if content.strip() not in answer:
            raise BadData(f"{where}: the {template.name} does not write assistant message {i}'s content where the "
                          "generation prompt ends; pass a template that does with --chat-template")
        pieces.append((full[pos:len(prompt)], False))
        pieces.append((answer, True))
        pos = len(prompt) + len(answer)
    pieces.append((full[pos:], False))
    return [(text, trained) for text, trained in pieces if text]


class RecordEncoder:
    """Examples -> :class:`Encoded`, with the model's tokenizer and chat template.

    BOS is added in front when the GGUF's ``add_bos_token`` says so (unless the render already
    starts with it); prompt/response answers and text records end with EOS, chat answers with
    whatever end-of-turn text the template writes. ``train_on_prompt`` marks every token trained.
    """

    def __init__(self, tokenizer: TokenizerLike, chat_template: str | None = None, train_on_prompt: bool = False,
                 template_name: str = "chat template") -> None:
        self.tokenizer = tokenizer
        self.train_on_prompt = train_on_prompt
        texts: list[str] | None = getattr(tokenizer, "tokens", None)
        self.bos_token = texts[tokenizer.bos_id] if texts and 0 <= tokenizer.bos_id < len(texts) else ""
        self.eos_token = texts[tokenizer.eos_id] if texts and 0 <= tokenizer.eos_id < len(texts) else ""
        self.template = (ChatTemplate(chat_template, self.bos_token, self.eos_token, template_name)
                         if chat_template is not None else None)
        self.add_bos = bool(getattr(tokenizer, "add_bos", True)) and tokenizer.bos_id >= 0

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special=False, parse_special=True)

    def pieces(self, example: Example) -> list[tuple[str, bool]]:
        """(text, trained) pieces of an example; EOS for prompt/response and text is added as a token."""
        if example.format == "chat":
            if self.template is None:
                raise BadData(f"{example.where}: chat records need a chat template, and the model has no "
                              "tokenizer.chat_template; pass one with --chat-template FILE")
            return chat_pieces(self.template, example.messages, example.where)
        if example.format == "prompt-response":
            return [(default_prompt(example), False), (example.response, True)]
        return [(example.text, True)]

    def encode(self, example: Example) -> Encoded:
        ids: list[int] = []
        trained: list[bool] = []
        for text, is_answer in self.pieces(example):
            piece = self._tokenize(text)
            ids += piece
            trained += [is_answer] * len(piece)
        if example.format != "chat" and self.tokenizer.eos_id >= 0:
            ids.append(self.tokenizer.eos_id)  # the answer ends the record, as generation should
            trained.append(True)
        if self.add_bos and (not ids or ids[0] != self.tokenizer.bos_id):
            ids.insert(0, self.tokenizer.bos_id)
            trained.insert(0, False)
        mask = np.asarray(trained, dtype=bool)
        if self.train_on_prompt:
            mask[:] = True
        return Encoded(np.asarray(ids, dtype=np.int64), mask)


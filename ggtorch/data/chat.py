"""Records -> tokens and a "trained" mask: chat templates, the default prompt template, BOS/EOS.

A chat record is rendered once with the model's ``tokenizer.chat_template`` (or a template
file) in a sandboxed jinja2 environment, as Hugging Face's ``apply_chat_template`` renders it
(``trim_blocks``, ``lstrip_blocks``, its ``tojson`` filter and ``{% generation %}`` tag;
variables ``messages``, ``tools``, ``bos_token``, ``eos_token``, ``add_generation_prompt``,
``raise_exception``, ``strftime_now``). The answers are then found in that one render:

- a template with ``{% generation %}...{% endgeneration %}`` blocks names them itself (the
  spans transformers' ``return_assistant_tokens_mask`` trains);
- otherwise each assistant message's content is searched left to right, from the end of the
  previous message's content, and extended by the end-of-turn text the template writes after
  it, up to and including the first end-of-generation token text (``<|im_end|>``,
  ``<end_of_turn>``, ``<|eot_id|>``, ``<|end|>`` ...). Each content is looked for with the
  template text that precedes it (found by rendering the conversation with placeholder
  contents), so a short answer is not matched inside an earlier message or a role header;
- an answer the render does not hold as given (an assistant's tool calls, a reasoning block the
  template cuts out) starts where the conversation before it, rendered with the generation
  prompt, ends. So a template whose generation prompt does not write the assistant header is
  refused (:func:`check_generation_prompt`): the header would train as the answer.

Templates that rewrite earlier turns (Qwen3 drops past reasoning) or end a conversation
otherwise than a generation prompt (Phi-3.5) train as well; a record is refused only when an
assistant content is not in the render at all, or when it holds tools or tool calls and the
template never reads them (the render would leave them out).

The render is tokenized once, as llama.cpp tokenizes a prompt (``parse_special``: special
token texts become their ids), and a token is trained when it starts inside an answer span.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggtorch.data.records import Example
from ggtorch.data.samples import TokenizerLike
from ggtorch.errors import BadData
from ggtorch.models.tokenizer import EOG_TEXTS

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


GENERATION_START, GENERATION_END = "\ue000<generation>\ue001", "\ue000</generation>\ue001"
"""What the ``{% generation %}`` tag writes around its body (private-use characters, absent from real text)."""
PLACEHOLDER = "\ue000<content {}>\ue001"
"""Message i's content in the probe render that shows where the template writes each content."""


@dataclass(frozen=True)
class Prompt:
    """What a model answers a record from, as the record trains: its render up to the last answer (a chat record's
    up to and including the generation prompt of its last assistant turn; a prompt/response record's prompt), BOS as
    :meth:`RecordEncoder.encode` adds it."""

    tokens: list[int]
    answer: str
    """The record's last answer as written (the reference a generated answer is compared to)."""
    n_answer: int
    """Tokens of the record's encoding after the prompt: the answer with its end of turn (a bound for generating
    it)."""


class ChatTemplate:
    """A compiled jinja chat template: ``render(messages, add_generation_prompt) -> str``."""

    def __init__(self, source: str, bos_token: str, eos_token: str, name: str = "chat template") -> None:
        from jinja2 import TemplateError, nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class GenerationTag(Extension):
            """Hugging Face's ``{% generation %}...{% endgeneration %}``: its body, between markers."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

            def _mark(self, caller: Any) -> str:
                return GENERATION_START + caller() + GENERATION_END

        self.name = name
        self.bos_token, self.eos_token = bos_token, eos_token
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson  # as transformers: plain json.dumps, no HTML escaping
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
            self.reads = _names_read(env.parse(source))
        except TemplateError as e:
            raise BadData(f"{name}: cannot be compiled ({e}); fix the template or pass another with "
                          "--chat-template") from None
        """The variable, attribute and key names the template reads (``tools``, ``tool_calls`` ...)."""

    def render(self, messages: Sequence[tuple[str, str]] | Sequence[Mapping[str, Any]],
               add_generation_prompt: bool = False, where: str = "", tools: Sequence[Mapping[str, Any]] | None = None
               ) -> str:
        """The template's text for ``messages`` (``(role, content)`` pairs or message dicts) and ``tools`` (as
        transformers passes them: None when the conversation has none)."""
        return self.render_marked(messages, add_generation_prompt, where, tools).replace(
            GENERATION_START, "").replace(GENERATION_END, "")

    def render_marked(self, messages: Sequence[tuple[str, str]] | Sequence[Mapping[str, Any]],
                      add_generation_prompt: bool = False, where: str = "",
                      tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """``render`` with each ``{% generation %}`` block between GENERATION_START and GENERATION_END."""
        from jinja2 import TemplateError

        msgs = [dict(m) if isinstance(m, Mapping) else {"role": m[0], "content": m[1]} for m in messages]
        try:
            return self._template.render(messages=msgs, tools=None if tools is None else list(tools),
                                         bos_token=self.bos_token, eos_token=self.eos_token,
                                         add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            raise BadData(f"{where + ': ' if where else ''}the {self.name} failed to render ({e}); "
                          "fix the record or pass another template with --chat-template") from None
        except Exception as e:  # a template can fail with any Python error (e.g. indexing an empty list)
            raise BadData(f"{where + ': ' if where else ''}the {self.name} failed to render "
                          f"({type(e).__name__}: {e}); fix the record or pass another template with "
                          "--chat-template") from None


def _names_read(ast: Any) -> frozenset[str]:
    """Every name the parsed template reads: variables, attributes (``m.tool_calls``) and string constants (keys
    as in ``m['tool_calls']`` or ``'tool_calls' in m``)."""
    from jinja2 import nodes

    return frozenset([n.name for n in ast.find_all(nodes.Name)] + [n.attr for n in ast.find_all(nodes.Getattr)]
                     + [n.value for n in ast.find_all(nodes.Const) if isinstance(n.value, str)])


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


Span = tuple[int, int]
"""Character offsets ``[start, end)`` in a render."""


def generation_spans(marked: str) -> tuple[str, list[Span]]:
    """The render without generation markers, and the spans the markers enclosed (non-empty ones)."""
    text: list[str] = []
    spans: list[Span] = []
    at = 0
    for i, part in enumerate(marked.split(GENERATION_START)):
        body, _, rest = part.partition(GENERATION_END) if i else ("", "", part)
        if body:
            spans.append((at, at + len(body)))
        text += [body, rest]
        at += len(body) + len(rest)
    return "".join(text), spans


def _preceding_texts(template: ChatTemplate, messages: Sequence[Mapping[str, Any]],
                     tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[list[str | None], set[int]]:
    """Per message, the template text written between the previous content and its own, and the messages whose
    content the template does not write at all.

    Read from a probe render whose contents are placeholders: None for a message whose content
    the template does not write exactly once (or a probe the template refuses: then none is known to be left out).
    A message with no content (an assistant's tool calls) keeps it in the probe, as the template sees it.
    """
    probe = [{**m, "content": PLACEHOLDER.format(i)} if m.get("content") else m for i, m in enumerate(messages)]
    try:
        text = template.render(probe, tools=tools)
    except BadData:
        return [None] * len(messages), set()
    out: list[str | None] = []
    left_out = {i for i, m in enumerate(messages) if m.get("content") and PLACEHOLDER.format(i) not in text}
    prev_end = 0
    for i in range(len(messages)):
        tag = PLACEHOLDER.format(i)
        at = text.find(tag, prev_end)
        if at < 0 or text.count(tag) != 1:
            out.append(None)
            continue
        out.append(text[prev_end:at])
        prev_end = at + len(tag)
    return out, left_out


def _find_content(text: str, content: str, before: str | None, pos: int, anchored: bool) -> Span | None:
    """Where ``content`` (as is, or stripped as templates that trim write it) is in ``text`` from ``pos``.

    First right after the template text that precedes it; unless ``anchored``, then anywhere.
    """
    variants = [c for c in dict.fromkeys((content, content.strip())) if c]
    if before is not None:
        for c in variants:
            at = text.find(before + c, pos)
            if at >= 0:
                return at + len(before), at + len(before) + len(c)
    if not anchored:
        for c in variants:
            at = text.find(c, pos)
            if at >= 0:
                return at, at + len(c)
    return None


def _written_answer(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], i: int, text: str, pos: int,
                    before: Sequence[str | None], end_texts: Sequence[str], where: str,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> Span | None:
    """Where the template writes assistant message i when its content is not in the render as given: its tool calls
    (with no content), or a reasoning template (Qwen3, Qwen3.5, DeepSeek-R1, GLM-4.6, ...) cuts an inline
    ``<think>`` block out of an earlier answer, or moves it. Found by rendering: the conversation before it,
    rendered with the generation prompt, ends where the answer starts (as far as that render agrees with the whole
    one, and at the start of a tag it ends inside); the answer runs to the first end-of-turn text after it, or where
    the template writes none (GLM), to where the template text before the next message begins (the whole render's
    end for the last one). So what the template writes for the turn is what trains. None when no render locates it
    (the renders part before ``pos``, or the span would be empty)."""
    start = _common_prefix(template.render(messages[:i], True, where, tools), text)
    if start < pos:
        return None
    start = _whole_tag(text, pos, start)
    limit = len(text)
    if i + 1 < len(messages):
        nxt = _find_content(text, messages[i + 1].get("content") or "", before[i + 1], start, anchored=True)
        limit = (nxt[0] - len(before[i + 1] or "") if nxt is not None
                 else _common_prefix(template.render(messages[:i + 1], where=where, tools=tools), text))
    ends = [at for e in end_texts if start < (at := text.find(e, start, limit))]
    end = min(ends) if ends else limit
    return (start, end) if end > start else None


def check_generation_prompt(template: ChatTemplate, where: str) -> None:
    """Refuse a template that ignores ``add_generation_prompt`` while it writes an assistant header before every
    answer: an answer located by rendering (tool calls, rewritten reasoning) would start where the prompt render
    ends and train the header with it, and generation with the template would not be prompted with the header.

    Read from a one-turn probe: the text the template writes before an answer, past the conversation rendered
    without the generation prompt, is the header; then the generation prompt must write something. A template with
    no header (Mistral's answer follows ``[/INST]``) needs no prompt. A probe the template refuses is no evidence
    either way; a template with ``{% generation %}`` blocks says itself what trains."""
    user = [{"role": "user", "content": PLACEHOLDER.format(0)}]
    answer = PLACEHOLDER.format(1)
    try:
        plain, prompt = template.render(user), template.render(user, add_generation_prompt=True)
        whole = template.render_marked([*user, {"role": "assistant", "content": answer}])
    except BadData:
        return
    if GENERATION_START in whole:  # {% generation %} blocks name what trains, header or not
        return
    head = whole.partition(answer)[0]
    if prompt != plain or answer not in whole or not head.startswith(plain) or not head[len(plain):].strip():
        return
    raise BadData(f"{where}: the {template.name} ignores add_generation_prompt: it writes the assistant header "
                  f"{json.dumps(head[len(plain):], ensure_ascii=False)} before each answer but not as the "
                  "generation prompt, so the header would train as part of the answers; pass --chat-template with "
                  "a template that writes it when add_generation_prompt is true")


def _whole_tag(text: str, pos: int, at: int) -> int:
    """``at`` moved back to the ``<`` of a tag it falls inside, no further than ``pos``: a tool call's
    ``<|START_ACTION|>`` where the generation prompt wrote ``<|START_THINKING|>`` (Cohere), or a ``</think>`` after
    its ``<think>``, shares a prefix with the prompt, and the tag is the turn's first token, so it trains."""
    lt = text.rfind("<", pos, at)
    return lt if lt >= 0 and ">" not in text[lt:at] else at


def _common_prefix(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share."""
    return len(os.path.commonprefix((a, b)))


def answer_spans(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], where: str,
                 end_texts: Sequence[str], tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, list[Span]]:
    """The render of a whole conversation (with its ``tools``) and the spans of its answers (each with its
    end-of-turn text).

    ``end_texts`` are the end-of-generation token texts: an answer's span runs to the end of
    the first one the template writes after its content (before the next message's content),
    or ends with the content when the template writes none.
    """
    text, marked = generation_spans(template.render_marked(messages, False, where, tools))
    if marked:
        return text, marked
    before, left_out = _preceding_texts(template, messages, tools)
    for i in sorted(left_out):
        m = messages[i]
        if m["role"] != "assistant" and (m.get("content") or "").strip():
            raise BadData(f"{where}: the {template.name} does not write message {i} (role '{m['role']}') into its "
                          "render, so the answers would train without it; give it a role the template writes "
                          "(system, user or assistant) or drop it")
    found: list[tuple[int, Span]] = []
    pos = 0
    for i, m in enumerate(messages):
        assistant = m["role"] == "assistant"
        # other roles only anchor the search, so they must be found where the template puts them
        span = _find_content(text, m.get("content") or "", before[i], pos, anchored=not assistant)
        if span is None and assistant:
            span = _written_answer(template, messages, i, text, pos, before, end_texts, where, tools)
        if span is None and assistant:
            raise BadData(f"{where}: the {template.name} does not write assistant message {i}'s content into "
                          "its render of the conversation, so the answer cannot be located; fix the record or "
                          "pass a template that writes it with --chat-template")
        if span is not None:
            found.append((i, span))
            pos = span[1]
    spans: list[Span] = []
    for k, (i, (start, end)) in enumerate(found):
        if messages[i]["role"] != "assistant":
            continue
        limit = found[k + 1][1][0] if k + 1 < len(found) else len(text)
        ends = [(at, -len(e)) for e in end_texts if (at := text.find(e, end, limit)) >= 0]
        if ends:
            at, neg_len = min(ends)
            end = at - neg_len
        spans.append((start, end))
    return text, spans


def check_tool_support(template: ChatTemplate, messages: Sequence[Mapping[str, Any]],
                       tools: Sequence[Mapping[str, Any]] | None, where: str) -> None:
    """Refuse tools or tool calls a template never reads: its render would leave them out, and the answers would
    train without the calls they make or the functions they were offered."""
    used = [("tools", "'tools' list")] if tools else []
    used += [("tool_calls", f"tool calls (message {i})") for i, m in enumerate(messages) if m.get("tool_calls")][:1]
    for name, what in used:
        if name not in template.reads:
            raise BadData(f"{where}: the {template.name} has no tool support (it never reads '{name}'), so the "
                          f"record's {what} would be left out of its render; pass --chat-template with a template "
                          "that renders tools (the model's own, e.g. Qwen2.5's, Llama 3.1's or Hermes') or drop them "
                          "from the record")


def split_at_spans(text: str, spans: Sequence[Span]) -> list[tuple[str, bool]]:
    """``text`` cut into (piece, in a span) pieces, empty pieces left out."""
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for start, end in spans:
        pieces += [(text[pos:start], False), (text[start:end], True)]
        pos = end
    pieces.append((text[pos:], False))
    return [(piece, trained) for piece, trained in pieces if piece]


_WHITESPACE = b" \t\n\v\f\r"


def token_starts(tokenizer: TokenizerLike, text: bytes, ids: Sequence[int]) -> np.ndarray | None:
    """The byte offset in ``text`` where each token of ``ids`` (``text`` tokenized) starts.

    Token pieces are matched in order. Two things a tokenizer does make pieces differ from the
    text: sentencepiece's space prefix (a leading space the text lacks) and special tokens that
    swallow the whitespace after them (Phi-3's), which no piece holds. None when the pieces do
    not spell the text (e.g. an unknown-token piece), or the tokenizer gives no pieces.
    """
    piece_bytes = getattr(tokenizer, "piece_bytes", None)
    if piece_bytes is None:
        return None
    pieces = [piece_bytes(int(t), True) for t in ids]
    lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    if b"".join(pieces) == text:  # byte-level BPE: the pieces are the text
        return np.cumsum(lengths) - lengths
    starts = np.empty(len(pieces), dtype=np.int64)
    pos = 0
    for k, piece in enumerate(pieces):
        skip = pos
        while True:
            if text.startswith(piece, skip):
                starts[k], pos = skip, skip + len(piece)
                break
            if piece[:1] == b" " and text.startswith(piece[1:], skip):
                starts[k], pos = skip, skip + len(piece) - 1
                break
            if skip < len(text) and text[skip] in _WHITESPACE:
                skip += 1
                continue
            return None
    return starts if not text[pos:].strip(_WHITESPACE) else None


def _message_dicts(example: Example) -> list[dict[str, Any]]:
    """A chat example's messages as a template reads them, each with its extra fields (tool calls ...); a null
    content (an assistant's tool calls) is an absent one, as every null field and as TRL writes them."""
    fields = example.fields or ({},) * len(example.messages)
    return [{**extra, "role": role, **({"content": content} if content is not None else {})}
            for (role, content), extra in zip(example.messages, fields, strict=True)]


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
        eog = {texts[i] for i in getattr(tokenizer, "eog_ids", ()) if texts and 0 <= i < len(texts)}
        self.end_texts = sorted((eog | EOG_TEXTS | {self.eos_token}) - {""})
        """Texts that end an answer: the GGUF's end-of-generation tokens and those llama.cpp knows by text."""
        self._prompt_checked = False

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special=False, parse_special=True)

    def tokenize_render(self, text: str) -> list[int]:
        """A template's render as its tokens, BOS first as :meth:`encode` adds it: what a prompt is fed as."""
        ids = self._tokenize(text)
        return [self.tokenizer.bos_id, *ids] if self.add_bos and (not ids or ids[0] != self.tokenizer.bos_id) else ids

    def chat_render(self, example: Example) -> tuple[str, list[Span]]:
        """A chat example's whole render and its answers' spans in it."""
        if self.template is None:
            raise BadData(f"{example.where}: chat records need a chat template, and the model has no "
                          "tokenizer.chat_template; pass one with --chat-template FILE")
        if not self._prompt_checked:  # once, on the first chat record: the template, not a record, is at fault
            check_generation_prompt(self.template, example.where)
            self._prompt_checked = True
        messages = _message_dicts(example)
        check_tool_support(self.template, messages, example.tools, example.where)
        return answer_spans(self.template, messages, example.where, self.end_texts, example.tools)

    def pieces(self, example: Example) -> list[tuple[str, bool]]:
        """(text, trained) pieces of an example; EOS for prompt/response and text is added as a token."""
        if example.format == "chat":
            return split_at_spans(*self.chat_render(example))
        if example.format == "prompt-response":
            return [(default_prompt(example), False), (example.response, True)]
        if example.format == "completion":  # a preference record's text form: the prompt as written
            return [(example.instruction, False), (example.response, True)]
        return [(example.text, True)]

    def prompt(self, example: Example) -> Prompt | None:
        """The prompt of ``example``'s last answer and that answer; None for a record with no text answer to
        compare (a text record, or a last answer of tool calls only)."""
        if example.format == "chat":
            last = max(i for i, (role, _) in enumerate(example.messages) if role == "assistant")
            answer = example.messages[last][1]
            if answer is None or self.template is None:
                return None
            text = self.template.render(_message_dicts(example)[:last], True, example.where, example.tools)
        elif example.format in ("prompt-response", "completion"):
            answer = example.response
            text = default_prompt(example) if example.format == "prompt-response" else example.instruction
        else:
            return None
        ids = self.tokenize_render(text)
        n_answer = len(self.encode(example)) - len(ids) if answer else 0
        return Prompt(ids, answer, max(n_answer, 0))

    def _encode_chat(self, example: Example) -> tuple[list[int], np.ndarray]:
        """The render tokenized once; a token is trained when it starts inside an answer span."""
        text, spans = self.chat_render(example)
        ids = self._tokenize(text)
        starts = token_starts(self.tokenizer, text.encode("utf-8"), ids)
        if starts is None:  # pieces that do not spell the render: tokenize it piece by piece instead
            return self._encode_pieces(split_at_spans(text, spans))
        bounds = [len(text[:at].encode("utf-8")) for span in spans for at in span]
        return ids, np.searchsorted(np.asarray(bounds, dtype=np.int64), starts, side="right") % 2 == 1

    def _encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> tuple[list[int], np.ndarray]:
        ids: list[int] = []
        trained: list[bool] = []
        for text, is_answer in pieces:
            piece = self._tokenize(text)
            ids += piece
            trained += [is_answer] * len(piece)
        return ids, np.asarray(trained, dtype=bool)

    def encode(self, example: Example) -> Encoded:
        if example.format == "chat":
            ids, mask = self._encode_chat(example)
        else:
            ids, mask = self._encode_pieces(self.pieces(example))
            if self.tokenizer.eos_id >= 0:
                ids.append(self.tokenizer.eos_id)  # the answer ends the record, as generation should
                mask = np.append(mask, True)
        if self.add_bos and (not ids or ids[0] != self.tokenizer.bos_id):
            ids.insert(0, self.tokenizer.bos_id)
            mask = np.insert(mask, 0, False)
        if self.train_on_prompt:
            mask[:] = True
        return Encoded(np.asarray(ids, dtype=np.int64), mask.astype(bool, copy=False))

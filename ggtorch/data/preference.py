"""Preference records, in the shapes TRL reads, as pairs of encoded sequences that share their prompt.

- text: ``{"prompt": str, "chosen": str, "rejected": str}``; each sequence is the prompt as written, then the
  answer and EOS (the prompt and the answer tokenized apart, as TRL does), the answer's tokens trained;
- conversational: ``{"prompt": [messages], "chosen": [assistant message(s)], "rejected": [...]}`` (or an answer
  as a plain string: one assistant message), rendered with the model's chat template as chat records are, what
  the template writes for the answer's turn trained.

A record with a side missing, of the wrong type, empty, or identical to the other, is refused with one line naming
it and the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ggtorch.data.chat import Encoded, RecordEncoder
from ggtorch.data.records import Example, Record, to_example
from ggtorch.errors import BadData

SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class PreferencePair:
    """One record's two sequences."""

    where: str
    chosen: Encoded
    rejected: Encoded


def pair_examples(record: Record, name: str = "--train-data") -> tuple[Example, Example]:
    """The chosen and rejected examples of a preference record, checked."""
    data, where = record.data, record.where
    for key in ("prompt", *SIDES):
        if key not in data or data[key] is None:
            raise BadData(f"{name} {where}: missing field '{key}'; preference records need 'prompt', 'chosen' and "
                          "'rejected'")
    prompt = data["prompt"]
    if isinstance(prompt, str):
        answers = [_text_answer(data[side], side, where, name) for side in SIDES]
        examples = [Example("completion", where, instruction=prompt, response=a) for a in answers]
    elif isinstance(prompt, list | tuple):
        examples = [to_example(Record({"messages": [*prompt, *_answer_turns(data[side], side, where, name)]},
                                      where), "chat", name) for side in SIDES]
    else:
        raise BadData(f"{name} {where}: field 'prompt' must be a string or a list of messages, got "
                      f"{type(prompt).__name__}")
    if data["chosen"] == data["rejected"]:
        raise BadData(f"{name} {where}: 'chosen' and 'rejected' are identical, so there is no preference to learn")
    return examples[0], examples[1]


def _text_answer(value: Any, side: str, where: str, name: str) -> str:
    if not isinstance(value, str):
        raise BadData(f"{name} {where}: field '{side}' must be a string like 'prompt', got {type(value).__name__}")
    if not value.strip():
        raise BadData(f"{name} {where}: empty '{side}' answer")
    return value


def _answer_turns(value: Any, side: str, where: str, name: str) -> list[Mapping[str, Any]]:
    """A conversational answer: its assistant message(s), a plain string taken as one."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": _text_answer(value, side, where, name)}]
    if not isinstance(value, list | tuple) or not value:
        raise BadData(f"{name} {where}: field '{side}' must be a list of assistant messages, got "
                      f"{type(value).__name__}")
    if not all(isinstance(m, Mapping) and m.get("role") == "assistant" for m in value):
        raise BadData(f"{name} {where}: field '{side}' must hold the assistant's turn(s) only (role 'assistant')")
    return list(value)


def encode_pairs(records: Sequence[Record], encoder: RecordEncoder, name: str = "--train-data"
                 ) -> list[PreferencePair]:
    """Every record's pair, encoded (answer tokens trained)."""
    pairs = []
    for record in records:
        chosen, rejected = pair_examples(record, name)
        pairs.append(PreferencePair(record.where, encoder.encode(chosen), encoder.encode(rejected)))
    return pairs

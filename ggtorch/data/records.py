"""Instruction and chat datasets: JSONL/Parquet files (or a folder of them, or a list of dicts).

Three record formats, detected from the first record's keys and checked on every record:

- ``chat``: ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}``, with
  OpenAI-style tool calls too (an assistant message's ``"tool_calls"`` with ``"content": null``, ``"role": "tool"``
  results, a record-level ``"tools"`` list), passed to the chat template as they are;
- ``prompt-response``: ``{"prompt": ..., "response": ...}`` or, Alpaca style,
  ``{"instruction": ..., "input": ... (optional), "output": ...}``;
- ``text``: ``{"text": ...}`` (a whole document; every token is trained).

Every record keeps where it came from (``file.jsonl line 7``, ``file.parquet row 3``,
``record 5``) so an error names the place to fix. Every string in a record is checked to be text
(:func:`check_text`) as it is read, so no record kind reaches a tokenizer with one that is not.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggtorch.data.text import encode_utf8
from ggtorch.errors import BadData, BadFlag

RECORD_SUFFIXES = (".jsonl", ".parquet")
FORMATS = ("auto", "text", "chat", "prompt-response")
"""``--data-format`` values; ``text`` on a .txt file is the old finetune's plain text path."""


@dataclass(frozen=True)
class Record:
    """One dataset row and where it came from."""

    data: Mapping[str, Any]
    where: str


@dataclass(frozen=True)
class Example:
    """A validated record in one of the formats, ready to be rendered and tokenized.

    chat: ``messages`` is a tuple of ``(role, content)`` (content None for an assistant's tool calls) and
    ``fields`` holds each message's other keys (e.g. ``reasoning_content``, ``tool_calls``), which the chat
    template sees too, and ``tools`` the record's tool list (None without one); prompt-response:
    ``instruction``, ``input`` (may be empty) and ``response``; text: ``text``; completion (a preference
    record's text form, ``data.preference``): ``instruction`` written as it is, then ``response``.
    """

    format: str
    where: str
    messages: tuple[tuple[str, str | None], ...] = ()
    fields: tuple[Mapping[str, Any], ...] = ()
    tools: tuple[Mapping[str, Any], ...] | None = None
    instruction: str = ""
    input: str = ""
    response: str = ""
    text: str = ""


def is_record_source(path: str | os.PathLike[str]) -> bool:
    """True for a .jsonl/.parquet file or a folder: the record path, not the old plain text path."""
    p = Path(path)
    return p.is_dir() or p.suffix.lower() in RECORD_SUFFIXES


def read_records(path: str | os.PathLike[str], flag: str = "--train-data") -> list[Record]:
    """The records of a .jsonl/.parquet file, or of every such file in a folder (sorted by name)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in RECORD_SUFFIXES)
        if not files:
            raise BadData(f"{flag} {p}: the folder holds no .jsonl or .parquet files")
    elif p.is_file():
        files = [p]
    else:
        raise BadData(f"{flag} {p}: no such file or folder")
    records = [r for f in files for r in _read_file(f, flag)]
    if not records:
        raise BadData(f"{flag} {p}: no records in it; pass a file with one JSON object per line")
    for r in records:
        check_text(r.data, r.where, flag)
    return records


def check_text(value: Any, where: str, flag: str, field: str = "") -> None:
    """Refuse a string that is not text: a lone UTF-16 surrogate (JSON's ``"\\ud800"`` decodes to one; Python
    lets it into a str) has no UTF-8 form, so every tokenizer fails on it, each in its own way. Walks the record's
    dicts and lists (keys too) so the message names the field."""
    if isinstance(value, str) and not value.isascii():
        shown = field.encode("utf-8", "backslashreplace").decode("utf-8")  # a key may be the culprit
        encode_utf8(value, f"{flag} {where}: field '{shown}'",
                    "write the character it stands for (a pair such as \\ud83d\\ude00 is fine) or remove it")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            name = f"{field}.{key}" if field else str(key)
            check_text(key, where, flag, name)
            check_text(item, where, flag, name)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_text(item, where, flag, f"{field}[{i}]")


def _read_file(path: Path, flag: str) -> list[Record]:
    if path.suffix.lower() == ".parquet":
        return _read_parquet(path, flag)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadData(f"{flag} {path}: not valid UTF-8 (byte {e.start}); JSONL files are UTF-8") from None
    except OSError as e:
        raise BadData(f"{flag} {path}: cannot be read ({e.strerror})") from None
    records = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path.name} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadData(f"{flag} {where}: not valid JSON ({e.msg} at column {e.colno}); "
                          "each line must be one JSON object") from None
        if not isinstance(obj, dict):
            raise BadData(f"{flag} {where}: expected a JSON object, got {type(obj).__name__}")
        records.append(Record(obj, where))
    return records


def _read_parquet(path: Path, flag: str) -> list[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BadData(f"{flag} {path}: reading Parquet needs pyarrow; pip install 'ggtorch[parquet]' "
                      "(or convert the file to JSONL)") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises its own ArrowInvalid/OSError family
        raise BadData(f"{flag} {path}: not a readable Parquet file ({e})") from None
    return [Record(row, f"{path.name} row {i}") for i, row in enumerate(rows, start=1)]


def records_from_dicts(items: Iterable[Mapping[str, Any]], name: str = "records") -> list[Record]:
    """Records from the Python API's list of dicts; positions are reported as ``record N`` (from 1)."""
    records = []
    for i, item in enumerate(items, start=1):
        if not isinstance(item, Mapping):
            raise BadData(f"{name}: record {i} is a {type(item).__name__}, expected a dict")
        check_text(item, f"record {i}", name)
        records.append(Record(item, f"record {i}"))
    if not records:
        raise BadData(f"{name}: the list is empty; pass at least one record")
    return records


def detect_format(records: list[Record], forced: str = "auto", name: str = "--train-data") -> str:
    """The format named by ``forced``, else the one the first record's keys show."""
    if forced not in FORMATS:
        raise BadFlag(f"--data-format must be one of {', '.join(FORMATS)}, got '{forced}'")
    if forced != "auto":
        return forced
    keys = set(records[0].data)
    if {"chosen", "rejected"} <= keys:
        raise BadData(f"{name} {records[0].where}: a preference record ('chosen' and 'rejected' answers); train on "
                      "preference records with --objective dpo, ipo or orpo (docs/preference.md)")
    if "messages" in keys:
        return "chat"
    if keys & {"prompt", "response", "instruction", "output"}:  # a missing partner is reported by to_example
        return "prompt-response"
    if "text" in keys:
        return "text"
    raise BadData(f"{name} {records[0].where}: cannot tell the format from its keys ({', '.join(sorted(keys))}); "
                  "records need 'messages', 'prompt'+'response', 'instruction'+'output' or 'text'")


def _string(record: Record, key: str, name: str, required: bool = True) -> str:
    value = record.data.get(key)
    if value is None and not required:
        return ""
    if value is None:
        raise BadData(f"{name} {record.where}: missing field '{key}'")
    if not isinstance(value, str):
        raise BadData(f"{name} {record.where}: field '{key}' must be a string, got {type(value).__name__}")
    return value


def to_example(record: Record, fmt: str, name: str = "--train-data") -> Example:
    """Check one record against ``fmt`` and normalize it; errors name the record and the field."""
    where = record.where
    if fmt == "text":
        text = _string(record, "text", name)
        if not text.strip():
            raise BadData(f"{name} {where}: empty 'text'")
        return Example(fmt, where, text=text)
    if fmt == "prompt-response":
        if "prompt" in record.data or "response" in record.data:
            instruction, inp = _string(record, "prompt", name), ""
            response = _string(record, "response", name)
        else:
            instruction, inp = _string(record, "instruction", name), _string(record, "input", name, required=False)
            response = _string(record, "output", name)
        if not response.strip():
            raise BadData(f"{name} {where}: empty response; every record needs an answer to train on")
        return Example(fmt, where, instruction=instruction, input=inp, response=response)
    if fmt != "chat":
        raise BadFlag(f"--data-format must be one of {', '.join(FORMATS)}, got '{fmt}'")
    messages = record.data.get("messages")
    if messages is None:
        raise BadData(f"{name} {where}: missing field 'messages'")
    if not isinstance(messages, list | tuple) or not messages:
        raise BadData(f"{name} {where}: 'messages' must be a non-empty list of {{role, content}} objects")
    out = [_message(m, i, where, name) for i, m in enumerate(messages)]
    # a null field is an absent one, as are no tool calls (Parquet gives every message every key of the column)
    fields = [{k: v for k, v in m.items() if k not in ("role", "content") and v is not None
               and (k != "tool_calls" or v)} for m in messages]
    if not any(role == "assistant" for role, _ in out):
        raise BadData(f"{name} {where}: no 'assistant' message, so nothing to train on")
    return Example(fmt, where, messages=tuple(out), fields=tuple(fields), tools=_tools(record, name))


def _message(m: Any, i: int, where: str, name: str) -> tuple[str, str | None]:
    """Message i's role and content; an assistant's OpenAI-style tool calls may come with a null content."""
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise BadData(f"{name} {where}: message {i} must be an object with string 'role' and 'content'")
    role, content, calls = m["role"], m.get("content"), m.get("tool_calls")
    if calls is not None and (not isinstance(calls, list | tuple) or not all(isinstance(c, Mapping) for c in calls)
                              or (calls and role != "assistant")):
        raise BadData(f"{name} {where}: message {i}'s 'tool_calls' must be a list of "
                      "{type, function: {name, arguments}} objects, in an assistant message")
    if content is None and calls:
        return role, None
    if not isinstance(content, str):
        raise BadData(f"{name} {where}: message {i} must be an object with string 'role' and 'content' (or, for "
                      "an assistant's tool calls, 'tool_calls' and a null 'content')")
    if role == "assistant" and not content.strip() and not calls:
        raise BadData(f"{name} {where}: message {i} is an empty assistant response")
    return role, content


def _tools(record: Record, name: str) -> tuple[Mapping[str, Any], ...] | None:
    """The record's ``tools`` list (the functions its conversation may call), None without one."""
    tools = record.data.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list | tuple) or not all(isinstance(t, Mapping) for t in tools):
        raise BadData(f"{name} {record.where}: field 'tools' must be a list of function schemas (JSON objects), "
                      f"got {type(tools).__name__}; a JSON string of the list must be parsed first")
    return tuple(tools)

"""Instruction and chat datasets: JSONL/Parquet files (or a folder of them, or a list of dicts).

Three record formats, detected from the first record's keys and checked on every record:

- ``chat``: ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}``;
- ``prompt-response``: ``{"prompt": ..., "response": ...}`` or, Alpaca style,
  ``{"instruction": ..., "input": ... (optional), "output": ...}``;
- ``text``: ``{"text": ...}`` (a whole document; every token is trained).

Every record keeps where it came from (``file.jsonl line 7``, ``file.parquet row 3``,
``record 5``) so an error names the place to fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

    chat: ``messages`` is a tuple of ``(role, content)`` and ``fields`` holds each message's
    other keys (e.g. ``reasoning_content``), which the chat template sees too; prompt-response:
    ``instruction``, ``input`` (may be empty) and ``response``; text: ``text``; completion (a preference
    record's text form, ``data.preference``): ``instruction`` written as it is, then ``response``.
    """

    format: str
    where: str
    messages: tuple[tuple[str, str], ...] = ()
    fields: tuple[Mapping[str, Any], ...] = ()
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
    return records


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
    out, fields = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadData(f"{name} {where}: message {i} must be an object with string 'role' and 'content'")
        if m["role"] == "assistant" and not m["content"].strip():
            raise BadData(f"{name} {where}: message {i} is an empty assistant response")
        out.append((m["role"], m["content"]))
        # a null field is an absent one (Parquet gives every message every key of the column)
        fields.append({k: v for k, v in m.items() if k not in ("role", "content") and v is not None})
    if not any(role == "assistant" for role, _ in out):
        raise BadData(f"{name} {where}: no 'assistant' message, so nothing to train on")
    return Example(fmt, where, messages=tuple(out), fields=tuple(fields))

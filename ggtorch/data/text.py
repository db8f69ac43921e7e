"""Reading training text: UTF-8 checking and llama.cpp's ``--escape`` processing."""

from __future__ import annotations

import os
from pathlib import Path

from ggtorch.errors import BadData


def read_text_file(path: str | os.PathLike[str], flag: str = "--train-data") -> bytes:
    """The raw bytes of a text file given by ``flag``; a missing, unreadable or empty file is BadData."""
    p = Path(path)
    if not p.is_file():
        raise BadData(f"{flag} {p}: no such file; pass the path of a UTF-8 text file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise BadData(f"{flag} {p}: cannot be read ({e.strerror}); check its permissions") from e
    if not data:
        raise BadData(f"{flag} {p}: the file is empty; pass a file with text to train on")
    return data


def check_utf8(data: bytes, name: str = "the training text", errors: str = "strict") -> bytes:
    """``data`` if it is valid UTF-8; else BadData naming the first bad byte offset.

    With ``errors="replace"`` each invalid sequence becomes U+FFFD instead (byte positions after
    it shift, which only matters for the byte offsets --sample-start reports).
    """
    try:
        data.decode("utf-8")
        return data
    except UnicodeDecodeError as e:
        if errors == "replace":
            return data.decode("utf-8", errors="replace").encode("utf-8")
        raise BadData(f"{name} is not valid UTF-8: byte {e.start} (0x{data[e.start]:02x}) {e.reason}; "
                      "convert the file to UTF-8 (e.g. iconv -t UTF-8) or let invalid bytes be replaced "
                      "(--utf8-errors replace)") from None


def encode_utf8(text: str, name: str, fix: str = "write the character it stands for or remove it") -> bytes:
    """``text`` as UTF-8; BadData naming ``name`` when it holds a lone surrogate, which has no UTF-8 form (JSON's
    ``"\\ud800"`` decodes to one, and Python gives a command line's bytes that are not UTF-8 as them), so no
    tokenizer can take it."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadData(f"{name} holds a lone surrogate (U+{ord(text[e.start]):04X} at character {e.start}), which is "
                      f"not text; {fix}") from None


_ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'", ord('"'): b'"', ord("\\"): b"\\"}
_HEX = b"0123456789abcdefABCDEF"


def _strtol_two(pair: bytes) -> int | None:
    """``strtol(pair, &end, 16)`` when it consumes both bytes (leading space and sign allowed), else None."""
    i, sign = 0, 1
    if pair[i:i + 1] in (b" ", b"\t", b"\n", b"\v", b"\f", b"\r"):
        i += 1
    if i < 2 and pair[i:i + 1] in (b"+", b"-"):
        sign = -1 if pair[i:i + 1] == b"-" else 1
        i += 1
    digits = pair[i:]
    if not digits or any(c not in _HEX for c in digits):
        return None
    return sign * int(digits, 16)


def process_escapes(text: str | bytes) -> bytes:
    """``--escape``: llama.cpp's ``process_escapes`` on the bytes of ``text``.

    ``\\n \\r \\t \\' \\" \\\\`` and ``\\xHH`` are replaced; any other backslash sequence (and a
    trailing backslash) is kept as written.
    """
    src = encode_utf8(text, "--sample-start") if isinstance(text, str) else bytes(text)
    out = bytearray()
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if c == ord("\\") and i + 1 < n:
            i += 1
            e = src[i]
            if e in _ESCAPES:
                out += _ESCAPES[e]
            elif e == ord("x") and i + 2 < n and (val := _strtol_two(src[i + 1:i + 3])) is not None:
                out.append(val & 0xFF)
                i += 2
            else:
                out += b"\\" + bytes([e])
        else:
            out.append(c)
        i += 1
    return bytes(out)

"""The old finetune's sample flags and ``tokenize_file``: text -> token samples."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from ggtorch.data.text import encode_utf8, process_escapes
from ggtorch.errors import BadData

UTF8Errors = Literal["strict", "replace"]
"""How invalid UTF-8 in training text is handled: an error naming the byte, or U+FFFD."""


@dataclass
class DataOptions:
    """The old finetune's sample options, with its defaults.

    A run config's sample options take their defaults from here under the same names, and
    check their values (choices from the annotations) before this class is built.
    """

    sample_start: str = ""
    """Samples start at each occurrence of this string; empty: at every token position."""
    include_sample_start: bool = False
    """Keep the sample-start string at the beginning of each sample."""
    escape: bool = False
    """Process ``\\n \\r \\t \\' \\" \\\\ \\xHH`` in ``sample_start``."""
    overlapping_samples: bool = False
    """Samples run on past the next sample start (up to a byte bound for n_ctx tokens)."""
    fill_with_next_samples: bool = False
    """Fill a row after a short sample with the next samples instead of EOS padding."""
    separate_with_eos: bool = False
    """With fill: put EOS between samples."""
    separate_with_bos: bool = True
    """With fill: put BOS between samples."""
    sample_random_offsets: bool = False
    """Start each sample at the random offset drawn for it at shuffle time."""
    force_reshuffle: bool = False
    """On resume, ignore the checkpoint's shuffle state and start a fresh permutation."""
    seed: int = -1
    """Shuffle seed (taken mod 2**32 as ``std::mt19937(unsigned)``); -1: the current time."""
    utf8_errors: UTF8Errors = "strict"
    """'strict': invalid UTF-8 is an error naming the byte; 'replace': use U+FFFD."""

    def sample_start_bytes(self) -> bytes:
        """The pattern as the old program searched for it: UTF-8 bytes, escapes processed with --escape."""
        return process_escapes(self.sample_start) if self.escape else encode_utf8(self.sample_start, "--sample-start")

    @classmethod
    def from_finetune(cls, config: Any) -> DataOptions:
        """The data options of a run config (or anything with the same attribute names)."""
        names = [f for f in cls.__dataclass_fields__ if hasattr(config, f)]
        return cls(**{f: getattr(config, f) for f in names})


def resolve_seed(seed: int) -> int:
    """The unsigned 32-bit seed the old program used: -1 means the current time (``time(NULL)``)."""
    return (int(time.time()) if seed == -1 else seed) & 0xFFFFFFFF


class TokenizerLike(Protocol):
    """What the pipeline uses of ``ggtorch.models.tokenizer.Tokenizer``."""

    bos_id: int
    eos_id: int
    n_vocab: int

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...

    def token_to_piece(self, token: int) -> str: ...


@dataclass(frozen=True)
class Vocab:
    """The tokenizer as the sample builder sees it."""

    tokenize: Callable[[str], list[int]]
    """Text -> ids without BOS/EOS (llama_tokenize(add_special=false, parse_special=false))."""
    bos_id: int
    eos_id: int
    n_vocab: int
    max_token_text_len: int
    """Bytes of the longest token text in the vocabulary; bounds a sample's bytes with --overlapping-samples."""

    @classmethod
    def from_tokenizer(cls, tok: TokenizerLike | Vocab, token_texts: Sequence[str] | None = None) -> Vocab:
        """Adapt a Tokenizer.

        The longest token text is measured on the raw vocabulary strings (``token_texts``, else
        the tokenizer's ``tokens`` attribute, e.g. GGUF ``tokenizer.ggml.tokens``), as llama.cpp's
        ``llama_token_get_text``; decoded pieces are only a fallback ("▁x" counts 4 bytes raw, 2 decoded).
        """
        if isinstance(tok, Vocab):
            return tok
        texts = token_texts if token_texts is not None else getattr(tok, "tokens", None)
        if texts is not None and len(texts) == tok.n_vocab:
            longest = max(len(t.encode("utf-8")) for t in texts)
        else:
            longest = max(len(tok.token_to_piece(i).encode("utf-8")) for i in range(tok.n_vocab))
        return cls(tokenize=lambda text: tok.encode(text, add_special=False, parse_special=False),
                   bos_id=tok.bos_id, eos_id=tok.eos_id, n_vocab=tok.n_vocab, max_token_text_len=longest)


# --- samples (tokenize_file) -------------------------------------------------------------------

@dataclass
class Samples:
    """The token stream and each sample's (begin, size) in it, in file order."""

    tokens: np.ndarray
    """int64 token ids of all samples, concatenated."""
    begins: np.ndarray
    sizes: np.ndarray
    warnings: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.begins)


def _decode(data: bytes, start: int, end: int) -> str:
    try:
        return data[start:end].decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadData(f"the sample at bytes {start}..{end} does not start on a UTF-8 character (byte "
                      f"{start + e.start}): the --sample-start pattern ends inside a character; use a pattern of "
                      "whole characters") from None


def stream_samples(n_tokens: int, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """(begins, sizes) for ``--sample-start ""``: begin 0 of size min(n_ctx, T), then 1 … E-1, E = T - n_ctx.

    The last full window (begin E) is left out, as in llama.cpp.
    """
    end = n_tokens - n_ctx if n_tokens >= n_ctx else 0
    begins = np.arange(max(1, end), dtype=np.int64)
    sizes = np.full(len(begins), n_ctx, dtype=np.int64)
    sizes[0] = min(n_ctx, n_tokens)
    return begins, sizes


def make_samples(data: bytes, vocab: Vocab, n_ctx: int, options: DataOptions) -> Samples:
    """``tokenize_file``: split valid UTF-8 ``data`` into token samples for a context of ``n_ctx``."""
    pattern = options.sample_start_bytes()
    if not pattern:
        tokens = np.asarray(vocab.tokenize(_decode(data, 0, len(data))), dtype=np.int64)
        t = len(tokens)
        begins, sizes = stream_samples(t, n_ctx)
        warnings = []
        if 0 < t < n_ctx:
            warnings.append(f"the training text has only {t} tokens, fewer than the context of {n_ctx}: "
                            f"it is one sample padded with EOS; use a smaller --ctx or more text")
        return Samples(tokens, begins, sizes, warnings)

    positions = []
    pos = data.find(pattern)
    while pos != -1:
        positions.append(pos)
        pos = data.find(pattern, pos + len(pattern))
    warnings = []
    if not positions:
        warnings.append(f"sample start pattern {pattern!r} not found: one sample at the beginning of the data")
        positions = [0]

    skip = 0 if options.include_sample_start else len(pattern)
    context_bytes = vocab.max_token_text_len * n_ctx
    pieces: list[np.ndarray] = []
    begins = np.zeros(len(positions), dtype=np.int64)
    sizes = np.zeros(len(positions), dtype=np.int64)
    n_total = 0
    for i, p in enumerate(positions):
        start = p + skip
        if options.overlapping_samples:
            end = min(len(data), start + context_bytes)
        else:
            end = positions[i + 1] if i + 1 < len(positions) else len(data)
        while end < len(data) and (data[end] & 0xC0) == 0x80:  # inside a character: move to the next start
            end += 1
        begins[i] = n_total
        if end > start:
            ids = np.asarray(vocab.tokenize(_decode(data, start, end)), dtype=np.int64)
            sizes[i] = len(ids)
            pieces.append(ids)
            n_total += len(ids)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    nonempty = sizes[sizes > 0]
    too_big, too_small = int((sizes > n_ctx).sum()), int(((sizes < n_ctx) & (sizes > 0)).sum())
    if too_big:
        warnings.append(f"{too_big} samples (max length {int(sizes.max())}) exceed the context of {n_ctx} "
                        "tokens; they will be cut off")
    if too_small:
        warnings.append(f"{too_small} samples (min length {int(nonempty.min())}) are shorter than the context "
                        f"of {n_ctx} tokens")
    empty = int((sizes == 0).sum())
    if empty:
        warnings.append(f"{empty} empty samples")
    return Samples(tokens, begins, sizes, warnings)


def samples_hash(samples: Samples) -> int:
    """A 64-bit fingerprint of the samples: count, (begin, size) pairs and the tokens.

    llama.cpp hashed the data file *name* with the sample geometry (libstdc++ ``std::hash``);
    ggtorch hashes the content instead, so a renamed file resumes and an edited one reshuffles.
    A hash stored by the old program never matches: its shuffle restarts (with a warning).
    """
    h = hashlib.sha256()
    h.update(np.asarray(samples.count, dtype="<i8").tobytes())
    for arr in (samples.begins, samples.sizes, samples.tokens):
        h.update(np.ascontiguousarray(arr, dtype="<i8").tobytes())
    return int.from_bytes(h.digest()[:8], "little")

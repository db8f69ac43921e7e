"""Record datasets as training batches: context fitting, packing or padding, shuffling, resume state.

Each encoded record of n tokens gives n - 1 (input, target) positions: inputs are its tokens
but the last, targets its tokens but the first, and a target whose token is not trained is
-100 (no loss). A record longer than the context (n - 1 > n_ctx) is truncated to its first
n_ctx + 1 tokens or split into consecutive pieces that each predict the next n_ctx tokens
(``long_records``); a piece with no trained target (e.g. a prompt that fills the context) is
dropped. The counts are reported.

``batching="pack"`` fills each row with consecutive pieces while they fit; each piece gets
its own rope positions from 0 and a segment id, so attention never crosses pieces and each
is computed as if alone. ``"pad"`` puts one piece per row. Either way the rest of a row is
padding with target -100.

The order is a permutation of the pieces per epoch, drawn by numpy's PCG64 from
``(seed, epoch)``; the data state (epoch, next piece) resumes it exactly.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ggtorch.data.batch import IGNORE_INDEX, Batch, HeldOutSource
from ggtorch.data.chat import Encoded, RecordEncoder
from ggtorch.data.records import Example, Record, detect_format, read_records, records_from_dicts, to_example
from ggtorch.data.samples import TokenizerLike, resolve_seed
from ggtorch.errors import BadData, BadFlag

Batching = Literal["pack", "pad"]
LongRecords = Literal["truncate", "split"]


@dataclass
class RecordOptions:
    """How records become batches.

    A run config's record options take their defaults from here under the same names, and
    check their values (choices from the annotations) before this class is built.
    """

    data_format: str = "auto"
    """auto (from the first record's keys), text, chat or prompt-response."""
    chat_template: str | None = None
    """A jinja chat template file used instead of the GGUF's ``tokenizer.chat_template``."""
    train_on_prompt: bool = False
    """Train on every token (prompts too), not only on the answers."""
    batching: Batching = "pack"
    """pack: several records per row, attention kept within each; pad: one record per row."""
    long_records: LongRecords = "truncate"
    """Records longer than the context: truncate (keep the start) or split into several pieces."""

    @classmethod
    def from_finetune(cls, config: Any) -> RecordOptions:
        names = [f for f in cls.__dataclass_fields__ if hasattr(config, f)]
        return cls(**{f: getattr(config, f) for f in names})


@dataclass
class FitCounts:
    """What fitting records to the context did (reported in the run summary)."""

    records: int = 0
    truncated: int = 0
    split: int = 0
    dropped: int = 0
    pieces: int = 0


def fit_to_context(encoded: Sequence[Encoded], n_ctx: int, long_records: str) -> tuple[list[Encoded], FitCounts]:
    """Pieces of at most n_ctx + 1 tokens, each with at least one trained target."""
    pieces: list[Encoded] = []
    counts = FitCounts(records=len(encoded))
    for enc in encoded:
        n = len(enc)
        if n - 1 <= n_ctx:
            parts = [enc]
        elif long_records == "truncate":
            counts.truncated += 1
            parts = [Encoded(enc.tokens[:n_ctx + 1], enc.trained[:n_ctx + 1])]
        else:
            counts.split += 1
            # piece k predicts tokens k*n_ctx+1 .. (k+1)*n_ctx: every target exactly once
            parts = [Encoded(enc.tokens[s:s + n_ctx + 1], enc.trained[s:s + n_ctx + 1])
                     for s in range(0, n - 1, n_ctx)]
        for p in parts:
            if len(p) >= 2 and p.trained[1:].any():
                pieces.append(p)
            else:
                counts.dropped += 1
    counts.pieces = len(pieces)
    return pieces, counts


def collate(rows: Sequence[Sequence[Encoded]], n_ctx: int, pad_id: int, pack: bool,
            answer_ids: Sequence[Sequence[int]] | None = None) -> Batch:
    """Rows of pieces -> a batch; padding positions get target -100 (and their own segment).

    Packed rows carry positions and segments; padded rows (one piece each) need neither. ``answer_ids`` (preference
    batches), one per piece in the same shape as ``rows``: the answer each piece's targets belong to."""
    n = len(rows)
    inputs = np.full((n, n_ctx), pad_id, dtype=np.int64)
    targets = np.full((n, n_ctx), IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros((n, n_ctx), dtype=np.int64)
    segments = np.full((n, n_ctx), -1, dtype=np.int64)
    answers = np.full((n, n_ctx), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for s, piece in enumerate(row):
            m = len(piece) - 1
            inputs[r, at:at + m] = piece.tokens[:-1]
            targets[r, at:at + m] = np.where(piece.trained[1:], piece.tokens[1:], IGNORE_INDEX)
            positions[r, at:at + m] = np.arange(m)
            segments[r, at:at + m] = s
            if answer_ids is not None:
                answers[r, at:at + m] = np.where(piece.trained[1:], answer_ids[r][s], -1)
            at += m
        positions[r, at:] = np.arange(n_ctx - at)
    answers_t = torch.from_numpy(answers) if answer_ids is not None else None
    if not pack:
        return Batch(torch.from_numpy(inputs), torch.from_numpy(targets), answers=answers_t)
    return Batch(torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(positions),
                 torch.from_numpy(segments), answers_t)


def group_rows(pieces: Sequence[Encoded], n_ctx: int, pack: bool) -> list[list[Encoded]]:
    """Pieces in order grouped greedily into rows (one per row without packing)."""
    rows: list[list[Encoded]] = []
    room = 0
    for p in pieces:
        need = len(p) - 1
        if not rows or not pack or need > room:
            rows.append([])
            room = n_ctx
        rows[-1].append(p)
        room -= need
    return rows


def pieces_hash(pieces: Sequence[Encoded]) -> int:
    """A 64-bit fingerprint of the pieces (tokens and masks): a changed dataset restarts the order."""
    h = hashlib.sha256()
    h.update(np.asarray(len(pieces), dtype="<i8").tobytes())
    for p in pieces:
        h.update(np.asarray(len(p), dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(p.tokens, dtype="<i8").tobytes())
        h.update(np.packbits(p.trained).tobytes())
    return int.from_bytes(h.digest()[:8], "little")


def epoch_order(seed: int, epoch: int, count: int) -> np.ndarray:
    """The piece order of an epoch: a permutation drawn from ``(seed, epoch)`` alone."""
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(count)


class EpochOrder:
    """Which of ``count`` items comes next: :func:`epoch_order`'s permutation per epoch and a position in it, kept
    as the checkpoint's data state (with the items' fingerprint, so changed data restarts the epoch)."""

    def __init__(self, kind: str, seed: int, count: int, fingerprint: int, unit: str) -> None:
        self.kind, self.seed, self.count, self.fingerprint, self.unit = kind, seed, count, fingerprint, unit
        self._start(0, 0)

    def _start(self, epoch: int, position: int) -> None:
        self.epoch, self.position = epoch, position
        self._order = epoch_order(self.seed, epoch, self.count)

    def peek(self) -> int:
        """The index of the next item."""
        return int(self._order[self.position])

    def advance(self) -> None:
        """Past the next item; past an epoch's last, the next epoch's order from its start."""
        if self.position + 1 < self.count:
            self.position += 1
        else:
            self._start(self.epoch + 1, 0)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "epoch": self.epoch, "next_sample": self.position,
                "samples_hash": self.fingerprint, "sample_count": self.count}

    def load_state_dict(self, state: Mapping[str, Any], force_reshuffle: bool | None = None) -> list[str]:
        """Continue a checkpointed order; restart the epoch (keeping its number) if the items changed or
        ``force_reshuffle``. Returns the notes for the run's warnings."""
        notes = []
        changed = (state.get("kind") != self.kind or int(state.get("samples_hash", 0)) != self.fingerprint
                   or int(state.get("sample_count", 0)) != self.count)
        if changed:
            notes.append("train data seems to have changed since the checkpoint: restarting the shuffled epoch")
        if force_reshuffle:
            notes.append("forced reshuffling of data: restarting the epoch")
        position = 0 if changed or force_reshuffle else int(state.get("next_sample", 0))
        if not 0 <= position < self.count:
            raise BadData(f"the checkpoint's data position {position} is outside the {self.count} {self.unit}; "
                          "pass --force-reshuffle to start a fresh order")
        self._start(int(state.get("epoch", 0)), position)
        return notes


class OrderedStream:
    """The DataStream surface a record or preference dataset shares: where its :class:`EpochOrder` (``self.order``)
    stands, and its resume; a resume's notes join the dataset's ``warnings``."""

    order: EpochOrder
    warnings: list[str]

    @property
    def epoch(self) -> int:
        return self.order.epoch

    @property
    def next_sample(self) -> int:
        return self.order.position

    def state_dict(self) -> dict[str, Any]:
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, Any], force_reshuffle: bool | None = None) -> list[str]:
        """Continue a checkpointed order (:meth:`EpochOrder.load_state_dict`)."""
        notes = self.order.load_state_dict(state, force_reshuffle)
        self.warnings += notes
        return notes


def held_out_count(total: int, fraction: float, name: str, unit: str) -> int:
    """``--val-split``: how many of ``total`` items (the last ones in file order) to hold out, checked."""
    if not 0.0 < fraction < 1.0:
        raise BadFlag(f"--val-split must be in (0, 1), got {fraction}")
    n_val = max(1, round(total * fraction))
    if total - n_val < 1:
        raise BadData(f"{name} has {total} {unit}: too few to hold out {fraction:.0%}; "
                      "use --val-data with a separate file")
    return n_val


def load_records(source: str | os.PathLike[str] | Sequence[Mapping[str, Any]], flag: str) -> list[Record]:
    """Records from a path (.jsonl, .parquet, folder) or from the Python API's list of dicts."""
    if isinstance(source, str | os.PathLike):
        return read_records(source, flag)
    return records_from_dicts(source, flag)


def read_template_file(path: str | os.PathLike[str]) -> str:
    p = Path(path)
    if not p.is_file():
        raise BadFlag(f"--chat-template {p}: no such file; pass a jinja chat template file")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadFlag(f"--chat-template {p}: cannot be read as UTF-8 text ({e})") from None


def chat_template(options: RecordOptions, model_template: str | None) -> tuple[str | None, str]:
    """The chat template records are rendered with (--chat-template's file, else the model's) and its name."""
    if options.chat_template:
        return read_template_file(options.chat_template), f"chat template {options.chat_template}"
    return model_template, "model's chat template (tokenizer.chat_template)"


class RecordData(OrderedStream):
    """A record dataset as the trainer's :class:`~ggtorch.data.batch.DataStream`.

    ``state_dict``/``load_state_dict`` resume the order exactly; ``split_validation`` and
    ``held_out_batches`` give held-out batches.
    """

    def __init__(self, records: Sequence[Record], tokenizer: TokenizerLike, n_ctx: int,
                 options: RecordOptions | None = None, seed: int = -1, model_template: str | None = None,
                 name: str = "--train-data") -> None:
        self.options = o = options or RecordOptions()
        self.n_ctx = n_ctx
        self.seed = resolve_seed(seed)
        self.name = name
        template, template_name = chat_template(o, model_template)
        self.format = detect_format(list(records), o.data_format, name)
        self.encoder = RecordEncoder(tokenizer, template, o.train_on_prompt, template_name)
        self.pad_id = max(tokenizer.eos_id, 0)
        self.template_source = "default prompt template" if self.format == "prompt-response" else (
            template_name if self.format == "chat" else "none")
        self.examples, self.encoded = self._encode(records, name)
        self.held_out: list[Example] = []
        """The validation records (``split_validation``, ``held_out_batches``), as written: what a generated answer
        is compared to."""
        self.samples_used = 0
        self.last_used = 0
        self._set_pieces(self.encoded)

    def _encode(self, records: Sequence[Record], name: str) -> tuple[list[Example], list[Encoded]]:
        examples: list[Example] = [to_example(r, self.format, name) for r in records]
        out = []
        for ex in examples:
            try:
                out.append(self.encoder.encode(ex))
            except BadData as e:
                msg = str(e)
                raise BadData(msg if msg.startswith(name) else f"{name} {msg}") from None
        return examples, out

    def _set_pieces(self, encoded: Sequence[Encoded]) -> None:
        self.pieces, self.counts = fit_to_context(encoded, self.n_ctx, self.options.long_records)
        if not self.pieces:
            raise BadData(f"{self.name}: no record has an answer token within the context of {self.n_ctx}; "
                          "raise --ctx or shorten the prompts")
        self.hash = pieces_hash(self.pieces)
        self.warnings = self._fit_warnings(self.counts)
        self.order = EpochOrder("records", self.seed, len(self.pieces), self.hash, "pieces")

    def _fit_warnings(self, c: FitCounts) -> list[str]:
        notes = []
        if c.truncated:
            notes.append(f"{c.truncated} records are longer than the context of {self.n_ctx} tokens and were "
                         "truncated (--long-records split keeps the rest)")
        if c.dropped:
            notes.append(f"{c.dropped} records (or pieces) have no answer token within the context and were dropped")
        return notes

    # --- the DataStream surface ------------------------------------------------------------
    @property
    def n_samples(self) -> int:
        return len(self.pieces)

    @property
    def n_tokens(self) -> int:
        return sum(len(p) for p in self.pieces)

    @property
    def n_trained(self) -> int:
        """Targets that count in the loss, over all pieces."""
        return sum(int(p.trained[1:].sum()) for p in self.pieces)

    def summary(self) -> str:
        """One line for the run summary: format, template, counts, masking and batching."""
        c = self.counts
        parts = [f"{c.records:,} {self.format} records ({self.template_source})"]
        if c.truncated or c.split or c.dropped:
            parts.append(f"{c.truncated} truncated, {c.split} split, {c.dropped} dropped")
        loss_on = "all tokens" if self.options.train_on_prompt or self.format == "text" else "responses only"
        batched = "packed" if self.options.batching == "pack" else "padded"
        parts.append(f"{self.n_samples:,} pieces, {self.n_tokens:,} tokens, {self.n_trained:,} trained "
                     f"(loss on {loss_on}), {batched} into ctx {self.n_ctx}")
        return "; ".join(parts)

    def next_batch(self, n_batch: int) -> Batch:
        """The next ``n_batch`` rows; an epoch ending inside a batch continues with the next epoch's order."""
        pack = self.options.batching == "pack"
        rows: list[list[Encoded]] = []
        used = 0
        for _ in range(n_batch):
            row: list[Encoded] = []
            room = self.n_ctx
            while True:
                piece = self.pieces[self.order.peek()]
                need = len(piece) - 1
                if row and (not pack or need > room):
                    break
                row.append(piece)
                room -= need
                used += 1
                self.order.advance()
            rows.append(row)
        self.last_used = used
        self.samples_used += used
        return collate(rows, self.n_ctx, self.pad_id, pack)

    # --- held-out data -----------------------------------------------------------------------
    def eval_batches(self, pieces: Sequence[Encoded], n_batch: int) -> list[Batch]:
        """Every piece once, in order, grouped into rows as training groups them."""
        pack = self.options.batching == "pack"
        rows = group_rows(pieces, self.n_ctx, pack)
        return [collate(rows[i:i + n_batch], self.n_ctx, self.pad_id, pack) for i in range(0, len(rows), n_batch)]

    def split_validation(self, fraction: float, n_batch: int) -> list[Batch]:
        """``--val-split``: hold out the last ``fraction`` of the records (file order); train on the rest."""
        n = len(self.encoded)
        n_val = held_out_count(n, fraction, self.name, "records")
        held = fit_to_context(self.encoded[n - n_val:], self.n_ctx, self.options.long_records)[0]
        self.held_out = self.examples[n - n_val:]
        self.examples, self.encoded = self.examples[:n - n_val], self.encoded[:n - n_val]
        self._set_pieces(self.encoded)
        if not held:
            raise BadData(f"{self.name}: the held-out records have no answer token within the context")
        return self.eval_batches(held, n_batch)

    def held_out_batches(self, source: HeldOutSource, n_batch: int, name: str = "--val-data") -> list[Batch]:
        """``--val-data`` / ``val_records``: held-out batches of other records, in this dataset's format
        and template."""
        self.held_out, encoded = self._encode(load_records(source, name), name)
        held = fit_to_context(encoded, self.n_ctx, self.options.long_records)[0]
        if not held:
            raise BadData(f"{name}: no record has an answer token within the context of {self.n_ctx}")
        return self.eval_batches(held, n_batch)

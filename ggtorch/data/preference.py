"""Preference records, in the shapes TRL reads, as pairs of encoded sequences that share their prompt.

- text: ``{"prompt": str, "chosen": str, "rejected": str}``; each sequence is the prompt as written, then the
  answer and EOS (the prompt and the answer tokenized apart, as TRL does), the answer's tokens trained;
- conversational: ``{"prompt": [messages], "chosen": [assistant message(s)], "rejected": [...]}`` (or an answer
  as a plain string: one assistant message), rendered with the model's chat template as chat records are, what
  the template writes for the answer's turn trained.

A record with a side missing, of the wrong type, empty, or identical to the other, is refused with one line naming
it and the field.

:class:`PreferenceData` is the trainer's :class:`~ggtorch.data.batch.DataStream` of pairs: ``--batch`` pairs per
micro-batch, both sides of a pair always in the same batch (one row per sequence, or packed several to a row with
attention kept within each), each target tagged with its answer (``Batch.answers``). Sequences longer than the
context are fitted as chat records are (``--long-records``: truncated, or split into pieces whose log-probabilities
add up to the answer's); a pair with a side that has no answer token within the context is dropped and counted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggtorch.data.batch import Batch, HeldOutSource
from ggtorch.data.chat import Encoded, RecordEncoder
from ggtorch.data.packing import (
    EpochOrder,
    FitCounts,
    OrderedStream,
    RecordOptions,
    chat_template,
    collate,
    fit_to_context,
    held_out_count,
    load_records,
    pieces_hash,
)
from ggtorch.data.records import Example, Record, to_example
from ggtorch.data.samples import TokenizerLike, resolve_seed
from ggtorch.errors import BadData, BadFlag

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
        examples = [to_example(Record({"messages": [*prompt, *_answer_turns(data[side], side, where, name)],
                                       "tools": data.get("tools")}, where), "chat", name) for side in SIDES]
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


@dataclass(frozen=True)
class FittedPair:
    """A pair's sequences fitted to the context: each side one piece, or several when split."""

    chosen: list[Encoded]
    rejected: list[Encoded]

    @property
    def pieces(self) -> list[Encoded]:
        return [*self.chosen, *self.rejected]


def fit_pairs(pairs: Sequence[PreferencePair], n_ctx: int, long_records: str) -> tuple[list[FittedPair], FitCounts]:
    """Both sides of each pair fitted to the context; a pair with a side left without an answer token is dropped
    (counted in ``dropped``, as are pieces with none)."""
    fitted, counts = [], FitCounts(records=len(pairs))
    for pair in pairs:
        sides = [fit_to_context([side], n_ctx, long_records) for side in (pair.chosen, pair.rejected)]
        for _, c in sides:
            counts.truncated += c.truncated
            counts.split += c.split
        if all(pieces for pieces, _ in sides):
            fitted.append(FittedPair(sides[0][0], sides[1][0]))
        else:
            counts.dropped += 1
    counts.pieces = sum(len(p.pieces) for p in fitted)
    return fitted, counts


def pairs_hash(pairs: Sequence[FittedPair]) -> int:
    """A fingerprint of the fitted pairs (their pieces and which side each belongs to)."""
    h = hashlib.sha256()
    for pair in pairs:
        h.update(np.asarray([len(pair.chosen), len(pair.rejected)], dtype="<i8").tobytes())
    h.update(pieces_hash([p for pair in pairs for p in pair.pieces]).to_bytes(8, "little"))
    return int.from_bytes(h.digest()[:8], "little")


def pair_batch(pairs: Sequence[FittedPair], n_ctx: int, pad_id: int, pack: bool) -> Batch:
    """The batch of ``pairs``: pair p's chosen pieces answer 2p, its rejected ones 2p + 1; one piece per row, or
    packed greedily into rows of ``n_ctx`` in order."""
    rows: list[list[Encoded]] = []
    ids: list[list[int]] = []
    room = 0
    for p, pair in enumerate(pairs):
        for answer, pieces in ((2 * p, pair.chosen), (2 * p + 1, pair.rejected)):
            for piece in pieces:
                need = len(piece) - 1
                if not rows or not pack or need > room:
                    rows.append([])
                    ids.append([])
                    room = n_ctx
                rows[-1].append(piece)
                ids[-1].append(answer)
                room -= need
    return collate(rows, n_ctx, pad_id, pack, ids)


class PreferenceData(OrderedStream):
    """Preference records as the trainer's data stream: an order over pairs per epoch (numpy's PCG64 from
    ``(seed, epoch)``, as records), resumable; ``--batch`` pairs per micro-batch."""

    def __init__(self, records: Sequence[Record], tokenizer: TokenizerLike, n_ctx: int,
                 options: RecordOptions | None = None, seed: int = -1, model_template: str | None = None,
                 name: str = "--train-data") -> None:
        self.options = o = options or RecordOptions()
        if o.train_on_prompt:
            raise BadFlag("--train-on-prompt does not apply to preference training: its losses compare the answers")
        self.n_ctx = n_ctx
        self.seed = resolve_seed(seed)
        self.name = name
        template, template_name = chat_template(o, model_template)
        self.encoder = RecordEncoder(tokenizer, template, False, template_name)
        self.template_source = template_name if any(isinstance(r.data.get("prompt"), list | tuple)
                                                    for r in records) else "prompt and answers as written"
        self.pad_id = max(tokenizer.eos_id, 0)
        self.pairs = encode_pairs(records, self.encoder, name)
        self.samples_used = 0
        self.last_used = 0
        self._set_pairs(self.pairs)

    def _set_pairs(self, pairs: Sequence[PreferencePair]) -> None:
        self.fitted, self.counts = fit_pairs(pairs, self.n_ctx, self.options.long_records)
        if not self.fitted:
            raise BadData(f"{self.name}: no pair has answer tokens of both sides within the context of {self.n_ctx}; "
                          "raise --ctx or shorten the prompts")
        self.hash = pairs_hash(self.fitted)
        self.warnings = []
        if self.counts.truncated:
            self.warnings.append(f"{self.counts.truncated} answers are longer than the context of {self.n_ctx} tokens "
                                 "and were truncated (--long-records split keeps the rest)")
        if self.counts.dropped:
            self.warnings.append(f"{self.counts.dropped} pairs have a side with no answer token within the context "
                                 "and were dropped")
        self.order = EpochOrder("preference", self.seed, len(self.fitted), self.hash, "pairs")

    # --- the DataStream surface ------------------------------------------------------------
    @property
    def n_samples(self) -> int:
        return len(self.fitted)

    @property
    def n_tokens(self) -> int:
        return sum(len(p) for pair in self.fitted for p in pair.pieces)

    def summary(self) -> str:
        c = self.counts
        parts = [f"{c.records:,} preference pairs ({self.template_source})"]
        if c.truncated or c.split or c.dropped:
            parts.append(f"{c.truncated} answers truncated, {c.split} split, {c.dropped} pairs dropped")
        batched = "packed" if self.options.batching == "pack" else "one sequence per row"
        parts.append(f"{self.n_samples:,} pairs, {self.n_tokens:,} tokens (loss on the answers), {batched} in "
                     f"ctx {self.n_ctx}")
        return "; ".join(parts)

    def next_batch(self, n_batch: int) -> Batch:
        """The next ``n_batch`` pairs; an epoch ending inside a batch continues with the next epoch's order."""
        chosen = []
        for _ in range(n_batch):
            chosen.append(self.fitted[self.order.peek()])
            self.order.advance()
        self.last_used = n_batch
        self.samples_used += n_batch
        return pair_batch(chosen, self.n_ctx, self.pad_id, self.options.batching == "pack")

    # --- held-out data -----------------------------------------------------------------------
    def eval_batches(self, pairs: Sequence[FittedPair], n_batch: int) -> list[Batch]:
        """Every pair once, in order, ``n_batch`` pairs per batch."""
        pack = self.options.batching == "pack"
        return [pair_batch(pairs[i:i + n_batch], self.n_ctx, self.pad_id, pack) for i in range(0, len(pairs), n_batch)]

    def split_validation(self, fraction: float, n_batch: int) -> list[Batch]:
        """``--val-split``: hold out the last ``fraction`` of the pairs (file order); train on the rest."""
        n = len(self.pairs)
        n_val = held_out_count(n, fraction, self.name, "pairs")
        held = fit_pairs(self.pairs[n - n_val:], self.n_ctx, self.options.long_records)[0]
        self.pairs = self.pairs[:n - n_val]
        self._set_pairs(self.pairs)
        if not held:
            raise BadData(f"{self.name}: the held-out pairs have no answer tokens within the context")
        return self.eval_batches(held, n_batch)

    def held_out_batches(self, source: HeldOutSource, n_batch: int, name: str = "--val-data") -> list[Batch]:
        """``--val-data`` / ``val_records``: held-out batches of other preference records."""
        held = fit_pairs(encode_pairs(load_records(source, name), self.encoder, name), self.n_ctx,
                         self.options.long_records)[0]
        if not held:
            raise BadData(f"{name}: no pair has answer tokens of both sides within the context of {self.n_ctx}")
        return self.eval_batches(held, n_batch)

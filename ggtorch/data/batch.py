"""What the trainer sees of its data: one :class:`Batch` type and the :class:`DataStream` protocol.

Plain text (:class:`~ggtorch.data.stream.TrainingData`) and records
(:class:`~ggtorch.data.packing.RecordData`) both implement the protocol, so the trainer and the
CLI never ask which kind of data a run trains on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

IGNORE_INDEX = -100
"""A target that does not count in the loss (torch's ``ignore_index``)."""


@dataclass(frozen=True, eq=False)  # tensors have no single truth value to compare by
class Batch:
    """One micro-batch: LongTensors of shape ``(n_batch, n_ctx)``.

    ``positions`` and ``segments`` are set for packed record rows only (several records in a
    row, each with its own rope positions from 0 and a segment id that keeps attention within
    it); plain text and padded records leave them None.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    """The next token of each input position, or IGNORE_INDEX where nothing is trained."""
    positions: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    answers: torch.Tensor | None = None
    """Preference batches only: which answer each target belongs to (pair p's chosen answer 2p, its rejected one
    2p + 1; -1 for no answer), so that each answer's log-probability is summed over its tokens wherever the
    answer's pieces sit."""

    @property
    def n_counted(self) -> int:
        """Targets that count in the loss."""
        return int((self.targets != IGNORE_INDEX).sum())

    @property
    def n_pairs(self) -> int:
        """Preference pairs in the batch (0 for other batches)."""
        return 0 if self.answers is None else (int(self.answers.max()) + 2) // 2

    def to(self, device: torch.device) -> Batch:
        """The same batch on ``device``."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Batch(self.inputs.to(device), self.targets.to(device), move(self.positions), move(self.segments),
                     move(self.answers))


HeldOutSource = str | os.PathLike[str] | Sequence[Mapping[str, Any]]
"""Held-out data: a file or folder (``--val-data``) or the Python API's list of record dicts."""


class DataStream(Protocol):
    """A training data stream: batches in a resumable order, and held-out batches beside it."""

    name: str
    warnings: list[str]
    """Notes for the user (truncated records, a restarted order, ...)."""
    hash: int
    """A fingerprint of the samples: ranks and resumed runs check they train on the same data."""
    last_used: int
    """Samples the last ``next_batch`` consumed (with fill or packing, a row can take several)."""

    @property
    def n_samples(self) -> int: ...

    @property
    def n_tokens(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    @property
    def next_sample(self) -> int: ...

    def next_batch(self, n_batch: int) -> Batch:
        """The next ``n_batch`` rows; the order moves on to the next epoch at its end."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The position in the order, for a checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any], force_reshuffle: bool | None = None) -> list[str]:
        """Continue a checkpointed order (or restart it if the data changed); returns the notes."""
        ...

    def split_validation(self, fraction: float, n_batch: int) -> list[Batch]:
        """``--val-split``: hold out the end of the data and return its batches; train on the rest."""
        ...

    def held_out_batches(self, source: HeldOutSource, n_batch: int, name: str) -> list[Batch]:
        """``--val-data`` / ``val_records``: batches of separate held-out data of this stream's kind."""
        ...

    def summary(self) -> str:
        """One line for the run summary."""
        ...

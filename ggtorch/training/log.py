"""The machine-readable training log (JSON lines) and its loss-curve plot.

One JSON object per line, flushed as it is written, so a log survives a crash and can be
plotted while a run is still going. Records carry a ``kind``: ``start`` (the run's
options), ``iter`` (one per optimizer step), ``eval`` (validation loss), ``save`` (files
written) and ``end`` (summary).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

from ggtorch.errors import BadData


class TrainLog:
    """Append-only JSON-lines writer; a no-op when ``path`` is None (e.g. non-zero DDP ranks)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self._file: TextIO | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._open()

    def _open(self) -> None:
        assert self.path is not None
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the run

    def write(self, kind: str, **fields: Any) -> None:
        """Append one record; a closed log reopens (a notebook trains the same run again)."""
        if self.path is None:
            return
        if self._file is None:
            self._open()
        assert self._file is not None
        self._file.write(json.dumps({"kind": kind, **fields}, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a log; a torn last line (crash mid-write) is skipped."""
    path = Path(path)
    if not path.is_file():
        raise BadData(f"{path}: no such log file; pass the .jsonl written beside the training outputs")
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise BadData(f"{path}: not UTF-8 text; is this a ggtorch training log?") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):
                break
            raise BadData(f"{path}:{i}: not a JSON line; is this a ggtorch training log?") from None
        if not isinstance(record, dict):
            raise BadData(f"{path}:{i}: not a log record (a JSON object); is this a ggtorch training log?")
        records.append(record)
    return records


def _points(records: list[dict[str, Any]], kind: str, path: Any) -> list[tuple[float, float]]:
    """(iteration, loss) of every record of one kind; a record without both numbers is refused."""
    points = []
    for r in records:
        if r.get("kind") != kind:
            continue
        it, loss = r.get("iteration"), r.get("loss")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (it, loss)):
            raise BadData(f"{path}: a '{kind}' record lacks a numeric iteration and loss: {r}")
        points.append((it, loss))
    return points


def plot_loss(log_path: str | os.PathLike[str], png_path: str | os.PathLike[str] | None = None,
              ax: Any = None) -> Path | None:
    """Draw training (and validation) loss per iteration; save a PNG, or draw into ``ax`` (notebooks)."""
    import matplotlib

    if ax is None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_log(log_path)
    iters, evals = _points(records, "iter", log_path), _points(records, "eval", log_path)
    if not iters and not evals:
        raise BadData(f"{log_path}: the log holds no iterations yet")
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4))
    draw_losses(ax, iters, evals)
    if fig is None:
        return None
    out = Path(png_path) if png_path else Path(log_path).with_suffix(".png")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise BadData(f"cannot write the plot {out}: {e.strerror or e}; pick another -o path") from None
    finally:
        plt.close(fig)
    return out


def draw_losses(ax: Any, iters: list[tuple[float, float]], evals: list[tuple[float, float]]) -> None:
    """Training loss as a line and validation loss as dots, per iteration, into a matplotlib Axes."""
    if iters:
        ax.plot(*zip(*iters, strict=True), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="validation loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (cross-entropy, nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()

"""The machine-readable training log (JSON lines) and its loss-curve plot.

One JSON object per line, flushed as it is written, so a log survives a crash and can be
plotted while a run is still going. Records carry a ``kind``: ``start`` (the run's
options), ``iter`` (one per optimizer step), ``eval`` (validation loss), ``save`` (files
written) and ``end`` (summary), and the ``run`` they belong to: a log the runs of one output
folder share (a resumed run appends to it) keeps them apart, and ``plot`` draws each.

With ``--tensorboard DIR`` the same records feed torch's ``SummaryWriter`` too: every number of an ``iter`` record
as ``train/<name>`` and of an ``eval`` record as ``eval/<name>`` (a preference run's metrics under TRL's names,
``train/rewards/chosen``), at the record's iteration. The JSON lines stay the source of truth: the event files hold
nothing they do not.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggtorch.errors import BadData, flag, optional_module
from ggtorch.io.atomic import append_line, atomic_path, failure

SCALAR_KINDS = {"iter": "train", "eval": "eval"}
"""The records whose numbers --tensorboard writes, each kind under its tag prefix (``train/loss``, ``eval/loss``)."""

FLUSHED_KINDS = ("eval", "save", "end")
"""Records after which the event files are flushed: what TensorBoard shows is never older than the last of these."""

PLOTTING = "drawing the loss curves"
"""What needs matplotlib, as the message that asks for it says (ggtorch plot, plot_losses)."""

TENSORBOARD_FLUSH_SECONDS = 10
"""How often the writer's thread flushes between those: TensorBoard reloads every 5 seconds."""


def summary_writer() -> type:
    """torch's ``SummaryWriter``; MissingExtra naming ``ggtorch[tensorboard]`` when tensorboard is not installed. A run
    with --tensorboard calls it before its model loads, so it is refused at once."""
    tensorboard = optional_module("torch.utils.tensorboard", "tensorboard", flag("tensorboard"), package="tensorboard")
    return tensorboard.SummaryWriter


def scalars(kind: str, fields: Mapping[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one log record: its numbers but the iteration (its step), under the kind's prefix;
    a dict of numbers (a preference run's ``metrics``) adds its own names. Other kinds have none."""
    prefix = SCALAR_KINDS.get(kind)
    if prefix is None:
        return {}
    found: dict[str, float] = {}
    for name, value in fields.items():
        if isinstance(value, Mapping):
            found |= {f"{prefix}/{k}": v for k, v in value.items() if _is_number(v)}
        elif name != "iteration" and _is_number(value):
            found[f"{prefix}/{name}"] = value
    return found


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TrainLog:
    """Append-only JSON-lines writer; a no-op when ``path`` is None (e.g. non-zero DDP ranks).

    ``tensorboard``: a folder that every record's scalars (:func:`scalars`) also go to, as TensorBoard event files.
    Each ``start`` record opens a writer whose purge step is the run's first iteration: a run resumed from an
    earlier checkpoint than the last one logged hides the steps it trains again from TensorBoard, so every step is
    shown once, from the run that trained it last (the JSON lines keep both)."""

    def __init__(self, path: str | os.PathLike[str] | None, tensorboard: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path else None
        self.tensorboard = Path(tensorboard) if tensorboard else None
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        """What every record of this run carries as ``run``: when it started, its process, and a random part (runs of
        one notebook share a process)."""
        self._fd: int | None = None
        self._writer: Any = None
        """The SummaryWriter of ``tensorboard``, opened by the first record with scalars (or ``start``)."""
        if self.path is not None:
            self._open()

    def _open(self) -> None:
        assert self.path is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as e:
            raise failure(self.path, e, "no line of this run was logged") from None

    def write(self, kind: str, **fields: Any) -> None:
        """Append one record, whole or not at all, then give its scalars to TensorBoard; a closed log reopens (a
        notebook trains the same run again)."""
        if self.path is not None:
            if self._fd is None:
                self._open()
            assert self._fd is not None
            append_line(self._fd, self.path,
                        json.dumps({"kind": kind, "run": self.run_id, **fields}, default=str) + "\n")
        if self.tensorboard is not None:
            self._write_scalars(kind, fields)

    def _write_scalars(self, kind: str, fields: Mapping[str, Any]) -> None:
        with self._tensorboard_errors():
            if kind == "start":  # a new writer: its purge step hides what an earlier run logged from here on
                self._close_writer()
                self._writer = summary_writer()(str(self.tensorboard), purge_step=fields["iteration"] + 1,
                                                flush_secs=TENSORBOARD_FLUSH_SECONDS)
            values = scalars(kind, fields)
            if values and self._writer is None:
                self._writer = summary_writer()(str(self.tensorboard), flush_secs=TENSORBOARD_FLUSH_SECONDS)
            for tag, value in values.items():
                self._writer.add_scalar(tag, value, fields["iteration"])
            if kind in FLUSHED_KINDS and self._writer is not None:
                self._writer.flush()

    @contextlib.contextmanager
    def _tensorboard_errors(self) -> Iterator[None]:
        """A failed write of the event files (their writer's thread raises it at the next call) as ggtorch's one
        message of a failed write."""
        try:
            yield
        except OSError as e:
            assert self.tensorboard is not None
            raise failure(self.tensorboard, e, f"the log {self.path} has every record") from None

    def _close_writer(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()  # flushes what is queued

    def close(self) -> None:
        """Close the log and flush and close the TensorBoard writer (a later record reopens both)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with self._tensorboard_errors():
            self._close_writer()


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


@dataclass
class LoggedRun:
    """One run's losses in a log: its training losses and validation losses per iteration."""

    label: str
    iters: list[tuple[float, float]] = field(default_factory=list)
    evals: list[tuple[float, float]] = field(default_factory=list)


def _point(r: dict[str, Any], path: Any) -> tuple[float, float]:
    """(iteration, loss) of a record; one without both numbers is refused."""
    it, loss = r.get("iteration"), r.get("loss")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (it, loss)):
        raise BadData(f"{path}: a '{r.get('kind')}' record lacks a numeric iteration and loss: {r}")
    return it, loss


def logged_runs(records: list[dict[str, Any]], path: Any = "log") -> list[LoggedRun]:
    """The runs of a log in the order they started, each with its losses. Records name their run (``run``); a
    log written before they did is split at each ``start`` record."""
    runs: dict[str, LoggedRun] = {}
    current = "1"
    for r in records:
        kind = r.get("kind")
        if "run" in r:
            current = str(r["run"])
        elif kind == "start" and current in runs:
            current = str(len(runs) + 1)
        run = runs.get(current)
        if run is None:
            run = runs[current] = LoggedRun(f"run {len(runs) + 1}")
        if kind == "start" and r.get("resumed_from"):
            run.label += f", resumed from {Path(str(r['resumed_from'])).name}"
        if kind == "iter":
            run.iters.append(_point(r, path))
        elif kind == "eval":
            run.evals.append(_point(r, path))
    return [run for run in runs.values() if run.iters or run.evals]


def plot_loss(log_path: str | os.PathLike[str], png_path: str | os.PathLike[str] | None = None,
              ax: Any = None) -> Path | None:
    """Draw training (and validation) loss per iteration, each run of the log labelled; save a PNG, or draw into
    ``ax`` (notebooks)."""
    matplotlib = optional_module("matplotlib", "plot", PLOTTING)
    if ax is None:
        matplotlib.use("Agg")
    plt = pyplot()

    runs = logged_runs(read_log(log_path), log_path)
    if not runs:
        raise BadData(f"{log_path}: the log holds no iterations yet")
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4))
    draw_runs(ax, runs)
    if fig is None:
        return None
    out = Path(png_path) if png_path else Path(log_path).with_suffix(".png")
    fig.tight_layout()
    fmt = out.suffix[1:].lower() or "png"
    try:
        with atomic_path(out) as tmp:
            fig.savefig(tmp, dpi=110, format=fmt)
    except ValueError as e:  # an extension matplotlib has no writer for
        formats = ", ".join(sorted(fig.canvas.get_supported_filetypes()))
        raise BadData(f"cannot write the plot {out}: {e}; name it with one of {formats} (png by default)") from None
    finally:
        plt.close(fig)
    return out


def pyplot() -> Any:
    """``matplotlib.pyplot``; MissingExtra naming ``ggtorch[plot]`` when matplotlib is not installed (it is not a
    dependency of ggtorch: only the plots need it)."""
    return optional_module("matplotlib.pyplot", "plot", PLOTTING)


def draw_runs(ax: Any, runs: list[LoggedRun]) -> None:
    """Each run's training loss as a line and validation loss as dots, per iteration, into a matplotlib Axes;
    with several runs each is labelled (a run resumed from another continues its iterations)."""
    for run in runs:
        name = f"{run.label}: " if len(runs) > 1 else ""
        color = None
        if run.iters:
            (line,) = ax.plot(*zip(*run.iters, strict=True), label=f"{name}train loss", linewidth=1)
            color = line.get_color()
        if run.evals:
            ax.plot(*zip(*run.evals, strict=True), "o-", color=color, label=f"{name}validation loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (cross-entropy, nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()

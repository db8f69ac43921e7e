"""A lock on a run's output names, so that two runs never write the same files or interleave one log.

One lock file per output name template, beside it (``.checkpoint-ITERATION.gguf.lock``), locked with ``flock``
and holding the owner's process id for the message another run gets. The kernel drops the lock when its process
ends, however it ends, so a killed run leaves no lock behind that counts. Within one process a lock is shared:
a notebook that builds a second run on the same outputs (a cell run again) is not refused by its own first run.
Where there is no ``fcntl`` (Windows), runs are not locked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from ggtorch.errors import BadFlag
from ggtorch.io.atomic import failure
from ggtorch.io.paths import Input, Output, check_files

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

_HELD: dict[Path, tuple[int, int]] = {}
"""Lock files this process holds: path -> (file descriptor, how many holders in this process)."""


def lock_path(output: Output) -> Path:
    """The lock file of an output name template: hidden, beside it."""
    path = Path(os.path.realpath(output.path))
    return path.with_name(f".{path.name}.lock")


def _owner(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 64).decode(errors="replace").strip()
    return text if text.isdigit() else "unknown"


def _acquire(path: Path, output: Output) -> int:
    """Lock ``path`` (created if needed) for this process; BadFlag naming the process that holds it. A folder output
    is made with its parents, so its lock file's folder (the output's parent) is made here."""
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise failure(path, e, "nothing was written") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _owner(fd)
            os.close(fd)
            raise BadFlag(f"another ggtorch run (process {owner}) is writing {output.what}; wait for it to end or "
                          f"stop it, or give this run other output names") from None
        try:  # its last holder may have removed the file between this open and this lock: take the new one
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            with contextlib.suppress(OSError):  # the owner's id is only for another run's message: a full disk
                os.ftruncate(fd, 0)             # leaves it out, the lock itself holds
                os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)


class OutputLock:
    """Held from :meth:`acquire` to :meth:`release` (or the process's end) on every output template given."""

    def __init__(self, outputs: Sequence[Output]) -> None:
        self.paths = list(dict.fromkeys(lock_path(o) for o in outputs if str(o.path)))
        self._outputs = {lock_path(o): o for o in outputs if str(o.path)}
        self._held: list[Path] = []

    def acquire(self) -> OutputLock:
        """Lock every output, or none (BadFlag naming the run that holds one)."""
        if fcntl is None or self._held:
            return self
        try:
            for path in self.paths:
                fd, count = _HELD.get(path, (-1, 0))
                if not count:
                    fd = _acquire(path, self._outputs[path])
                _HELD[path] = (fd, count + 1)
                self._held.append(path)
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        """Let go of every lock this object holds; the last holder in the process removes the lock file."""
        for path in reversed(self._held):
            fd, count = _HELD.pop(path)
            if count > 1:
                _HELD[path] = (fd, count - 1)
                continue
            try:
                path.unlink()
            except OSError:
                pass
            os.close(fd)
        self._held = []

    def __del__(self) -> None:  # a run dropped without close(): its locks go with it
        try:
            self.release()
        except Exception:  # the interpreter is shutting down: the kernel drops the locks anyway
            pass


@contextlib.contextmanager
def writing(inputs: Sequence[Input], outputs: Sequence[Output]) -> Iterator[OutputLock]:
    """A command's files checked (:func:`~ggtorch.io.paths.check_files`) and its outputs locked while it writes
    them, as a training run's are: a second command writing the same output is refused, naming this process,
    instead of both exiting 0 and one silently replacing the other's file."""
    check_files(inputs, outputs)
    lock = OutputLock(outputs).acquire()
    try:
        yield lock
    finally:
        lock.release()

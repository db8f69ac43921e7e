"""Every file ggtorch writes goes through here: whole or not at all, and a full disk is said as such.

A file is written to a temporary beside its target, its size checked against what was meant to be
written (numpy's ``tofile`` and C libraries can lose a short write without raising), synced, and
only then renamed over the target. On any failure the temporary is removed and the previous file,
if any, is left exactly as it was; the message names the file, the disk it is on and its free space.
Several files that belong together (a PEFT folder's weights and config) are renamed together, after
all of them are complete. The append-only training log keeps the same promise line by line
(:func:`append_line`): a line that cannot be written whole is cut off again, never left torn.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ggtorch.errors import GGTorchError

SizeCheck = Callable[[Path], int | None]
"""Given the finished temporary, the size in bytes it must have (None: no size is known)."""


class WriteFailed(GGTorchError):
    """A file could not be written whole (disk full, folder gone, no permission); nothing older was harmed."""


def disk_of(path: str | os.PathLike[str]) -> str:
    """'the disk at /mount (N MiB free)': where ``path`` would be written, for a message."""
    folder = Path(os.path.abspath(path)).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    mount = folder
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        free = f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return f"the disk at {mount} ({free})"


def failure(path: Path, e: BaseException, kept: str) -> WriteFailed:
    """The one message of a failed write: what, why, on which disk, what is kept, what to do."""
    reason = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())[:200]
    fix = ("free some space there or write elsewhere" if _is_full(e)
           else "check that the folder exists and is writable, or write elsewhere")
    return WriteFailed(f"cannot write {path}: {reason} on {disk_of(path)}; {kept}; {fix}")


def _is_full(e: BaseException) -> bool:
    return (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)) or \
        "space" in str(e).lower()


class _Pending:
    """One file of a commit: its target, its temporary and how to check the temporary's size."""

    def __init__(self, target: Path, size: SizeCheck | None) -> None:
        self.target = target
        self.size = size
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        except OSError as e:
            raise failure(target, e, f"any previous {target.name} is kept unchanged") from None
        os.close(fd)
        self.tmp = Path(tmp)

    def finish(self) -> None:
        """Check the temporary is whole, sync it, give it the umask's mode (mkstemp makes 0600)."""
        expected = self.size(self.tmp) if self.size is not None else None
        with open(self.tmp, "rb+") as f:
            os.fsync(f.fileno())
            written = os.fstat(f.fileno()).st_size
        if expected is not None and written != expected:
            raise OSError(errno.ENOSPC, f"{written} of {expected} bytes reached the disk")
        os.chmod(self.tmp, 0o666 & ~_umask())


@contextlib.contextmanager
def atomic_paths(paths: Sequence[str | os.PathLike[str]],
                 sizes: Sequence[SizeCheck | None] | None = None) -> Iterator[list[Path]]:
    """Temporary paths beside ``paths``; when the block ends, each is checked and synced, then all are renamed.

    ``sizes`` (one per path) give the size each finished file must have. A failure anywhere (an error
    raised in the block included) removes every temporary and keeps every previous file; an OSError
    becomes :class:`WriteFailed` naming the disk, any other error passes through unchanged.
    """
    targets = [Path(p) for p in paths]
    checks = list(sizes) if sizes is not None else [None] * len(targets)
    pending: list[_Pending] = []
    current = targets[0]
    try:
        for target, check in zip(targets, checks, strict=True):
            pending.append(_Pending(target, check))
        yield [p.tmp for p in pending]
        for p in pending:
            current = p.target
            p.finish()
        for p in pending:
            current = p.target
            os.replace(p.tmp, p.target)
    except OSError as e:
        kept = ("any previous " + ", ".join(t.name for t in targets) +
                (" are" if len(targets) > 1 else " is") + " kept unchanged")
        raise failure(current, e, kept) from None
    finally:
        for p in pending:
            p.tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], size: SizeCheck | None = None) -> Iterator[Path]:
    """One file of :func:`atomic_paths`: a crash, Ctrl-C or full disk mid-write leaves the previous file whole."""
    with atomic_paths([path], [size]) as (tmp,):
        yield tmp


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` as ``path``, whole or not at all."""
    with atomic_path(path, lambda _: len(data)) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write UTF-8 ``text`` as ``path``, whole or not at all."""
    write_bytes(path, text.encode("utf-8"))


def append_line(fd: int, path: Path, line: str) -> None:
    """Append one line to the file open (O_APPEND) as ``fd``; on failure cut the file back to where it was.

    A log read after a full disk then ends at its last whole line, and the run stops with a message
    naming the disk instead of an OSError from deep inside a step. Unbuffered, so nothing is held back
    to fail later.
    """
    data = line.encode("utf-8")
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise failure(path, e, f"{path.name} keeps its lines up to this one") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

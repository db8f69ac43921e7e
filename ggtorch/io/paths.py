"""Every command's files, checked before any work: inputs are there and of the kind asked for, outputs can be
written, and no output replaces an input or another output of the same command.

A command names each path with the flag it came from (``--model-base``, ``-o``), so a message says which flag to
change. Paths are compared as the files they resolve to: links, ``..`` and hard links included. A training run's
outputs are name templates whose pattern (``ITERATION``) becomes each saved iteration and the latest-copy name
(:class:`Output`), so a template is compared with every name it can produce.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ggtorch.errors import BadFlag

NAME_MAX_FALLBACK = 255
"""Bytes of one file name where the filesystem does not say (Linux's and macOS's limit)."""


@dataclass(frozen=True)
class Input:
    """A path a command reads: a file, or a folder (a PEFT adapter)."""

    flag: str
    path: str | os.PathLike[str]
    folder: bool | None = False
    """True: a folder; False: a file; None: either (training data: a text file, or a folder of records)."""
    missing: str = ""
    """What to do when the path is not there, added to that message."""

    @property
    def what(self) -> str:
        return f"{self.flag} {self.path}"


@dataclass(frozen=True)
class Output:
    """A path a command writes: a file, a folder, or a name template whose ``pattern`` becomes each saved
    iteration and ``latest`` (``checkpoint-ITERATION.gguf`` -> ``checkpoint-20.gguf``, ``checkpoint-LATEST.gguf``)."""

    flag: str
    path: str | os.PathLike[str]
    folder: bool = False
    pattern: str = ""
    latest: str = ""
    inside: tuple[str, ...] = ()
    """The files a folder output writes into its folder."""

    @property
    def what(self) -> str:
        return f"{self.flag} {self.path}"

    @property
    def templated(self) -> bool:
        return bool(self.pattern) and self.pattern in Path(self.path).name

    def names(self) -> list[Path]:
        """The names this output writes, as examples: iteration 1 and the latest copy (the name itself if fixed)."""
        if not self.templated:
            return [Path(self.path)]
        name = Path(self.path).name
        return [Path(self.path).with_name(name.replace(self.pattern, value, 1)) for value in ("1", self.latest)]

    def name_regex(self) -> re.Pattern[str]:
        """The file names this output can write: the pattern as any iteration number or the latest name."""
        name = Path(self.path).name
        if not self.templated:
            return re.compile(re.escape(name))
        head, _, tail = name.partition(self.pattern)
        values = "[0-9]+" + (f"|{re.escape(self.latest)}" if self.latest else "")
        return re.compile(f"{re.escape(head)}(?:{values}){re.escape(tail)}")

    def writes(self, path: Path) -> bool:
        """Whether this output can write the file ``path`` (compared as resolved paths)."""
        target = _resolved(path)
        return target.parent == _resolved(Path(self.path)).parent and bool(self.name_regex().fullmatch(target.name))

    def existing(self) -> list[Path]:
        """The files already there under a name this output writes (latest copy first, then by iteration)."""
        folder = _folder(Path(self.path))
        if not folder.is_dir():
            return []
        regex = self.name_regex()
        found = [p for p in folder.iterdir() if regex.fullmatch(p.name)]
        latest = Path(self.path).name.replace(self.pattern, self.latest, 1) if self.templated else None
        return sorted(found, key=lambda p: (p.name != latest, -_number(p.name)))


def check_latest_name(pattern: str, latest: str, template: str) -> None:
    """Refuse a latest-copy name made of digits: iterations are named by their number, so ``--fn-latest 2`` would
    name the latest copy as iteration 2's file, and every later save would overwrite that iteration's file."""
    if not pattern or not re.fullmatch("[0-9]+", latest):
        return
    name = Path(template).name if pattern in Path(template).name else f"checkpoint-{pattern}.gguf"
    example = name.replace(pattern, latest, 1)
    raise BadFlag(f"--fn-latest {latest} names each output's latest copy as an iteration's file ({example} would "
                  f"hold the newest save, not iteration {int(latest)}); give it a name with a letter, as the default "
                  "LATEST")


def _number(name: str) -> int:
    digits = re.findall(r"[0-9]+", name)
    return int(digits[-1]) if digits else -1


def _folder(path: Path) -> Path:
    return path.parent if str(path.parent) else Path(".")


def _resolved(path: Path) -> Path:
    """``path`` as the file it names: links and ``..`` followed (strict=False: it may not exist yet)."""
    return Path(os.path.realpath(path))


def _same_file(a: Path, b: Path) -> bool:
    """Same resolved path, or (both existing) the same inode: a hard link is the same file too."""
    if _resolved(a) == _resolved(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_input(item: Input) -> Path:
    """``item``'s path, when it exists, is a file (or a folder, as asked) and can be read; else one BadFlag."""
    path = Path(item.path)
    kind = {True: "folder", False: "file", None: "file or folder"}[item.folder]
    if not str(item.path):
        raise BadFlag(f"{item.flag} needs a {kind} name")
    if not path.exists():
        broken = " (a link to nothing)" if path.is_symlink() else ""
        raise BadFlag(f"{item.what}: no such {kind}{broken}; {item.missing or 'check the path'}")
    if item.folder is True and not path.is_dir():
        raise BadFlag(f"{item.what} is a file; {item.flag} takes a folder")
    if item.folder is False and path.is_dir():
        raise BadFlag(f"{item.what} is a folder; {item.flag} takes a file: give the file inside it")
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise BadFlag(f"{item.what} cannot be read (permission denied)")
    return path


def name_max(folder: Path) -> int:
    """The longest file name (bytes) the filesystem of ``folder`` takes."""
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):  # Windows has no pathconf
        return NAME_MAX_FALLBACK


def check_output(item: Output) -> Path:
    """``item``'s folder exists and can be written, its name fits the filesystem, and what is there already under
    that name is of the kind written (a file for a file, a folder for a folder); else one BadFlag."""
    path = Path(item.path)
    if not str(item.path) or not path.name:
        raise BadFlag(f"{item.flag} needs a {'folder' if item.folder else 'file'} name")
    folder = _folder(path)
    if item.folder:  # a folder output is made with its parents: the nearest folder that is there must take it
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
    if not folder.exists():
        raise BadFlag(f"{item.what}: the folder {folder} does not exist; create it first or write elsewhere")
    if not folder.is_dir():
        raise BadFlag(f"{item.what}: {folder} is a file, not a folder")
    longest = max((len(p.name.encode()) for p in item.names()), default=0)
    longest += len(str(10**9)) - 1 if item.templated else 0  # room for any iteration number
    limit = name_max(folder)
    if longest > limit:
        raise BadFlag(f"{item.what}: the file name is {longest} bytes long and this filesystem takes at most "
                      f"{limit}; choose a shorter name")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise BadFlag(f"{item.what}: the folder {folder} is not writable (permission or a read-only filesystem); "
                      f"write elsewhere")
    for name in item.names():
        if item.folder and name.exists() and not name.is_dir():
            raise BadFlag(f"{item.what} is a file; {item.flag} takes a folder to write into")
        if item.folder and name.is_dir() and not os.access(name, os.W_OK | os.X_OK):
            raise BadFlag(f"{item.what} is not writable (permission or a read-only filesystem); write elsewhere")
        if not item.folder and name.is_dir():
            if name != Path(item.path):  # one of a template's names
                raise BadFlag(f"{item.what}: {name} is a folder, where this output writes a file; move it away or "
                              f"choose another {item.flag}")
            raise BadFlag(f"{item.what} is a folder; {item.flag} takes a file name (for example "
                          f"{name / _example_name(item)})")
        if name.exists() and not os.access(name, os.W_OK):
            raise BadFlag(f"{item.what}: {name} exists and cannot be replaced (permission denied)")
    return path


def _example_name(item: Output) -> str:
    return {"--log-file": "train-log.jsonl"}.get(item.flag, "out.gguf")


def check_files(inputs: Sequence[Input], outputs: Sequence[Output]) -> None:
    """Every check above, then: no output writes an input's file (the file a user already has would be replaced),
    and no two outputs write one file. Empty paths are left out (an output a command was told not to write)."""
    inputs = [i for i in inputs if str(i.path)]
    outputs = [o for o in outputs if str(o.path)]
    for item in inputs:
        check_input(item)
    for out in outputs:
        check_output(out)
    for out in outputs:
        for item in inputs:
            if _writes_input(out, Path(item.path)):
                raise BadFlag(f"{out.flag} {out.path} would write over {item.what}, which this command reads; "
                              f"choose another {out.flag}")
    for i, first in enumerate(outputs):
        for second in outputs[i + 1:]:
            if (any(second.writes(name) for name in first.names()) or any(first.writes(name) for name in second.names())
                    or any(_same_file(name, other) for name in first.names() for other in second.names())):
                raise BadFlag(f"{first.flag} {first.path} and {second.flag} {second.path} would write the same "
                              f"file; give them different names")


def _writes_input(out: Output, path: Path) -> bool:
    """Whether ``out`` would replace the input ``path``: a file output its file, a folder output the folder itself
    or a file it writes into it."""
    if out.folder:
        folder = Path(out.path)
        return _same_file(folder, path) or any(_same_file(folder / name, path) for name in out.inside)
    return out.writes(path) or any(_same_file(name, path) for name in out.names())

"""The C library's malloc told to keep a training step's memory for the next step.

glibc serves a request of ``M_MMAP_THRESHOLD`` bytes or more with a fresh ``mmap`` and unmaps it
when freed, and returns the top of its heap to the OS whenever more than ``M_TRIM_THRESHOLD``
bytes are free there. Both thresholds start small (128 KiB) and grow only as far as the largest
block freed so far, so a training step, which allocates and frees the same many-MiB activations,
dequantized chunks and gradients in every step, gets its memory from the OS again each step: a
page fault, a kernel entry and a zeroed page for every 4 KiB of it, on the threads that should be
multiplying matrices.

:func:`keep_freed_memory` sets the two thresholds once, at the start of a run: blocks up to
:data:`MMAP_THRESHOLD` come from the heap, and the heap is never trimmed, so from the second step
on a step reuses the pages of the one before. The process keeps its peak (which it reaches again
every step anyway): what jemalloc's ``dirty_decay_ms:-1`` gives the CLI when jemalloc is installed
(``ggtorch.cli.allocator``), here for glibc's malloc and for every training run, from the API as
from the CLI (the :class:`~ggtorch.training.trainer.Trainer` calls it).

Only glibc (``mallopt`` is its function): other C libraries and a preloaded jemalloc or tcmalloc
are left as they are, and so is a user who tuned glibc (``MALLOC_*_`` variables or
``glibc.malloc`` tunables): their settings win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping
from pathlib import Path

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt's parameter numbers (glibc's malloc.h)."""

MMAP_THRESHOLD = 32 << 20
"""The largest value glibc accepts on 64-bit (half its heap size): larger blocks are mmapped anyway."""

TRIM_THRESHOLD = 2**31 - 1
"""Never trim: the largest C int (mallopt takes an int; a larger number wraps and trims always)."""

USER_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def current() -> str:
    """``jemalloc`` if this process runs on it, else ``system``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "jemalloc" if "libjemalloc" in maps else "system"


def user_tuned(environ: Mapping[str, str]) -> bool:
    """Whether the environment already sets glibc's malloc parameters."""
    return any(k in environ for k in USER_ENV) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def is_glibc() -> bool:
    """Whether this process's C library is glibc (not musl, macOS's or Windows')."""
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError, OSError):
        return False


def _glibc() -> ctypes.CDLL | None:
    """The process's glibc, or None on another C library."""
    if not is_glibc():
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


_kept: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's thresholds (see the module docstring) once per process; True when they are set."""
    global _kept
    if _kept is None:
        _kept = False
        libc = _glibc()
        if libc is not None and current() == "system" and not user_tuned(os.environ):
            mmap_set = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            _kept = mmap_set and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _kept


def asked() -> bool:
    """Whether this process asked for the thresholds (:func:`keep_freed_memory`): the ``ggtorch`` command and a
    run with ``manage_process=True`` do; a library call never does unasked."""
    return _kept is not None

"""The training commands run on jemalloc when the machine has it.

glibc's malloc leaves the holes of a step's short-lived tensors (dequantized weight chunks,
matmul outputs) between its long-lived ones (the activations backward needs), so its peak RSS
sits well above the live tensors (a run keeps glibc from also returning that memory between
steps: ``ggtorch.ops.malloc``); jemalloc, told to keep what it frees (``JEMALLOC_CONF``), peaks
near them (BENCHMARKS.md has the figures).

An allocator is chosen when a process starts, so the CLI re-executes itself once, the same
command with jemalloc in ``LD_PRELOAD``: what Redis gets by linking jemalloc and PyTorch's CPU
launcher (``torch.backends.xeon.run_cpu --enable-jemalloc``) offers. Only Linux, only when the
library is found (Debian/Ubuntu: ``apt install libjemalloc2``), and never when
``GGTORCH_ALLOCATOR=system``. The Python API cannot swap the allocator of a running interpreter:
start Jupyter or a script with the same two variables to get it there.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from ggtorch.errors import BadFlag

ENV = "GGTORCH_ALLOCATOR"
"""``jemalloc`` (the default: used when found) or ``system`` (the C library's malloc)."""

JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
"""Keep freed pages for reuse instead of returning them to the OS a few seconds later: a training
step frees and reallocates the same sizes every time, so returning them only costs page faults.
A user's own ``MALLOC_CONF`` wins."""

RELAUNCHED = "_GGTORCH_RELAUNCHED"
"""Set in the re-executed process: it never re-executes again, even if the preload failed."""

LIBRARY = "libjemalloc.so.2"
SEARCH_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
               "/usr/local/lib")


def find_jemalloc(prefixes: tuple[str, ...] = (sys.prefix,)) -> str | None:
    """Path of libjemalloc.so.2: the environment's own lib folder (conda, a venv) first, then the system's."""
    for folder in (*(str(Path(p) / "lib") for p in prefixes), *SEARCH_DIRS):
        path = Path(folder) / LIBRARY
        if path.is_file():
            return str(path)
    return None


def relaunch_env(environ: Mapping[str, str], library: str | None) -> dict[str, str] | None:
    """The environment to re-execute with, or None to run on as is.

    None when the user chose ``system``, when this process is already the re-executed one, when
    jemalloc is already preloaded, or when ``library`` (from :func:`find_jemalloc`) is None.
    """
    choice = environ.get(ENV, "jemalloc")
    if choice not in ("jemalloc", "system"):
        raise BadFlag(f"{ENV}={choice!r}: use {ENV}=jemalloc (the default: used when installed) "
                      f"or {ENV}=system (the C library's malloc)")
    preload = environ.get("LD_PRELOAD", "")
    if choice == "system" or RELAUNCHED in environ or "libjemalloc" in preload or library is None:
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = f"{library}:{preload}" if preload else library
    env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    env[RELAUNCHED] = "1"
    return env


def relaunch_on_jemalloc() -> None:
    """Replace this process by the same command line on jemalloc when :func:`relaunch_env` says so.

    Returns (and the command runs on as it is) otherwise, or if the interpreter cannot be
    re-executed. The command line is the interpreter's own (``sys.orig_argv``: the console script
    or ``-m ggtorch``, with any interpreter flags), and the process id stays the same, so torchrun,
    a shell's job control and signals see one process throughout.
    """
    if not sys.platform.startswith("linux") or not sys.executable:
        return
    env = relaunch_env(os.environ, find_jemalloc())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return  # an interpreter that cannot be run again (a frozen or embedded one): stay on the system's

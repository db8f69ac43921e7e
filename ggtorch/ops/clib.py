"""C libraries ggtorch builds on first use (``quant/native.c``, ``ops/lowrank.c``, ``ops/fused.c``) and loads with
ctypes.

A library is compiled with the system's C compiler (``cc``, or ``$CC``) for the CPU it runs on into
``$XDG_CACHE_HOME/ggtorch`` (``~/.cache/ggtorch``), once per source, flags, compiler, OpenMP runtime and
CPU: no build step at install time and no Python headers. Without a compiler, callers keep their torch
code, which computes the same thing.

Its loops are split over torch's intra-op threads on torch's own OpenMP runtime, which the library is
linked to by path (:func:`torch_openmp`): threads of their own would compete for the cores with torch's
workers, which spin for a while after every product. Where that runtime cannot be found, the library is
built without OpenMP and runs on the calling thread.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.autograd.graph import increment_version

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where built libraries are kept: ``$XDG_CACHE_HOME/ggtorch`` or ``~/.cache/ggtorch``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ggtorch"


@functools.cache
def writable_cache_dir() -> Path | None:
    """:func:`cache_dir`, made if needed, when this process can write into it; else None, said once (a read-only
    home, a container): every library of a run would meet the same folder."""
    try:
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return folder
    except (OSError, RuntimeError) as e:  # RuntimeError: no home folder to find it in
        log.warning("ggtorch: cannot build its C libraries (%s); their work runs through torch, which is slower. "
                    "Set XDG_CACHE_HOME to a writable folder to build them.", e)
        return None


def compiler() -> list[str]:
    """The C compiler command: ``$CC`` split as a shell would, else ``cc`` on the PATH; [] when there is none."""
    cc = shlex.split(os.environ.get("CC", ""))
    if cc:
        return cc
    found = shutil.which("cc")
    return [found] if found else []


def _cpu_identity() -> str:
    """The CPU model and features: a library built with -march=native runs only where they match."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() + platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return platform.machine() + "\n".join(sorted(set(keep)))


def torch_openmp() -> Path | None:
    """The GNU OpenMP runtime torch runs its CPU kernels on, as this process has loaded it: the one in
    torch's own folder (pip wheels bundle it), else the only one loaded; None when unsure (other
    packages bundle their own copies), without /proc, or for another runtime."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    loaded = {Path(fields[-1]) for fields in map(str.split, maps)
              if len(fields) >= 6 and Path(fields[-1]).name.startswith("libgomp")}
    in_torch = [p for p in loaded if Path(torch.__file__).parent in p.parents]
    found = in_torch or (list(loaded) if len(loaded) == 1 else [])
    return found[0] if len(found) == 1 and found[0].exists() else None


def _commands(cc: list[str], source: Path, flags: tuple[str, ...], openmp: Path | None, march: list[str],
              obj: str, target: str) -> list[list[str]]:
    """The compiler runs that build the library: with OpenMP, compiled with -fopenmp and linked to torch's
    runtime itself (not the compiler's -lgomp, which could load a second runtime with its own threads)."""
    if openmp is None:
        return [[*cc, *flags, "-fPIC", *march, "-shared", str(source), "-o", target]]
    return [[*cc, *flags, "-fPIC", *march, "-fopenmp", "-c", str(source), "-o", obj],
            [*cc, "-shared", obj, str(openmp), "-o", target]]


def compile_library(cc: list[str], source: Path, flags: tuple[str, ...], openmp: Path | None, target: Path) -> bool:
    """Build ``source`` into ``target`` (written whole or not at all: ranks of one run may build it at once),
    for this CPU (``-march=native``) when the compiler takes it, else for its default target."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            obj, built = str(Path(tmp) / "lib.o"), str(Path(tmp) / "lib.so")
            for march in (["-march=native"], []):
                try:
                    for cmd in _commands(cc, source, flags, openmp, march, obj, built):
                        subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
                except subprocess.CalledProcessError as e:
                    log.info("ggtorch: %s failed: %s", shlex.join(e.cmd), (e.stderr or "").strip()[-500:])
                    continue
                os.replace(built, target)
                return True
    except (OSError, subprocess.SubprocessError) as e:  # no compiler after all, a full disk, a build past its time
        log.info("ggtorch: could not compile %s: %s", source.name, e)
    return False


def source_files(source: Path) -> dict[Path, bytes]:
    """``source`` and every local header it includes (``#include "name"``, relative to its folder, recursively),
    each with its text: what a library is built from, so that an edit to a shared header rebuilds every library
    that includes it, and what an install must carry (tests/test_packaging.py)."""
    seen: dict[Path, bytes] = {}

    def read(path: Path) -> None:
        path = path.resolve()
        if path in seen:
            return
        seen[path] = path.read_bytes()
        for name in re.findall(rb'^\s*#\s*include\s+"([^"]+)"', seen[path], flags=re.MULTILINE):
            read(path.parent / name.decode())

    read(source)
    return seen


def _built_copy(name: str) -> Path | None:
    """The library file ``name`` in :func:`cache_dir` when it is there and readable, else None."""
    try:
        target = cache_dir() / name
        return target if target.is_file() else None
    except (OSError, RuntimeError):
        return None


@functools.cache
def load(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """``source`` built with ``flags`` (besides ``-fPIC``, the CPU's and OpenMP's) and loaded, building it first
    when the cache has no copy; None when there is no compiler, the source is missing, the cache folder cannot be
    written or the build or the load fails: callers then keep their torch code. The caller declares the functions'
    argument types."""
    cc = compiler()
    if not cc:
        log.info("ggtorch: no C compiler (cc or $CC) to build %s; its work runs through torch", source.name)
        return None
    try:
        text = b"".join(source_files(source).values())
    except OSError as e:
        log.warning("ggtorch: this install of ggtorch lacks %s (%s); its work runs through torch. Reinstall ggtorch.",
                    source.name, e.strerror or e)
        return None
    openmp = torch_openmp()
    key = hashlib.sha256(text + repr((cc, flags, str(openmp), _cpu_identity())).encode())
    name = f"{source.stem}-{key.hexdigest()[:16]}.so"
    target = _built_copy(name)  # built earlier: it loads from a folder now read-only too
    if target is None:
        folder = writable_cache_dir()
        if folder is None or not compile_library(cc, source, flags, openmp, folder / name):
            return None
        target = folder / name
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        log.info("ggtorch: could not load %s: %s", target, e)
        return None


Signature = tuple[Any, list[Any]]
"""A library function's ctypes result type and argument types."""

C_TYPES: dict[str, Any] = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
                           "double": ctypes.c_double}
"""The C types of the libraries' signatures, as ctypes declares them; every pointer is a ``c_void_p`` (a tensor's
``data_ptr()``, or None for NULL)."""

_PROTOTYPE = re.compile(r"^([A-Za-z_][\w ]*?)\s*\b(ggtorch_\w+)\s*\(([^)]*)\)\s*;", re.MULTILINE)


def _ctype(declaration: str, where: str) -> Any:
    """The ctypes type of one C declaration (``const float *rstd``, ``int64_t n``, ``void``)."""
    text = re.sub(r"\bconst\b", " ", declaration)
    if "*" in text:
        return ctypes.c_void_p
    words = text.split()
    base = words[0] if len(words) <= 2 and words else ""
    if base not in C_TYPES:
        raise ValueError(f"{where}: '{declaration.strip()}' is not one of the C types {sorted(C_TYPES)} or a pointer")
    return C_TYPES[base]


def prototypes(header: Path) -> dict[str, Signature]:
    """Each ``ggtorch_*`` function a library's header declares, as ctypes types: the one place a C function's
    signature is written (the library's source includes the header, so the compiler holds the definition to it,
    and tests/ops/test_clib.py checks the header against every library)."""
    text = re.sub(r"/\*.*?\*/", " ", header.read_text(), flags=re.DOTALL)
    found: dict[str, Signature] = {}
    for restype, name, params in _PROTOTYPE.findall(text):
        where = f"{header.name}: {name}"
        args = [] if params.strip() in ("", "void") else [_ctype(a, where) for a in params.split(",")]
        found[name] = (_ctype(restype, where), args)
    return found


def load_declared(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """:func:`load`, with each function of the source's header (``name.h`` beside ``name.c``) given its result
    and argument types (:func:`prototypes`), as every caller needs them before its first call; None as
    :func:`load` returns it."""
    lib = load(source, flags)
    if lib is not None:
        for name, (restype, argtypes) in prototypes(source.with_suffix(".h")).items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    return lib


def written(t: torch.Tensor) -> torch.Tensor:
    """Record that a library wrote into ``t`` in place, as torch's in-place ops record it (its version counter): a
    graph that saved ``t`` for backward then refuses it, as after ``copy_``, instead of using changed values. The
    mutating ``ggtorch::`` ops call it on what they write (their schema tells torch.compile; this tells eager
    autograd)."""
    if not t.is_inference():
        increment_version(t)
    return t

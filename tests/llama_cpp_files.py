"""llama.cpp's own files the tests read, taken from where a user gets them: the pinned llama-cpp-python sdist.

Its ``vendor/llama.cpp`` holds llama.cpp's vocabularies with their tokenizer test vectors
(``models/ggml-vocab-NAME.gguf``, ``.inp``, ``.out``), real chat templates (``models/templates/``) and the
converter users' files are made with (``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``). The sdist is
fetched once per machine (``pip download``, which also answers from pip's own cache), checked against its
sha256, and those parts are unpacked into ``$XDG_CACHE_HOME/ggtorch-tests`` (``~/.cache/ggtorch-tests``), whole or
not at all; later runs read them from there without asking PyPI.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: two processes may both fetch; the rename keeps the result whole either way
    fcntl = None  # type: ignore[assignment]

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
"""The release pyproject's test extra pins: the llama.cpp the tests run is the one these files come from."""
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
"""sha256 of llama_cpp_python-0.3.36.tar.gz as PyPI serves it."""
VENDOR = "vendor/llama.cpp/"
PARTS = ("models/", "convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")
"""What the tests read of llama.cpp: vocabularies and templates, the converter and the gguf-py it runs on."""


class LlamaCppFilesUnavailable(RuntimeError):
    """The sdist could not be fetched or did not match its hash: the message says what happened and what to do."""


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/ggtorch-tests`` or ``~/.cache/ggtorch-tests``: beside ggtorch's own cache, not in it."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ggtorch-tests"


@contextlib.contextmanager
def _held(lock: Path) -> Iterator[None]:
    """``lock`` held alone while inside: one process of a run (or of two runs) fetches, the others wait for it."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+b") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _download(into: Path) -> Path:
    """``pip download`` of the sdist into ``into``; its path, checked against :data:`SDIST_SHA256`."""
    run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                          LLAMA_CPP_PYTHON, "-d", str(into)], capture_output=True, text=True)
    if run.returncode != 0:
        last = (run.stdout + run.stderr).strip().splitlines()[-1:] or ["(pip printed nothing)"]
        raise LlamaCppFilesUnavailable(
            f"the tests read llama.cpp's vocabularies, templates and converter from the {LLAMA_CPP_PYTHON} sdist, "
            f"and `pip download` could not fetch it: {last[0]}. Run the tests once where pip reaches PyPI (or a "
            f"mirror set in pip's config); they keep the files in {cache_root()} after that.")
    (sdist,) = into.glob("llama_cpp_python-*.tar.gz")
    return checked(sdist)


def checked(sdist: Path) -> Path:
    """``sdist``, once its sha256 is :data:`SDIST_SHA256`; else :class:`LlamaCppFilesUnavailable`."""
    digest = hashlib.sha256()
    with open(sdist, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != SDIST_SHA256:
        raise LlamaCppFilesUnavailable(
            f"{sdist.name} has sha256 {digest.hexdigest()}, not the {SDIST_SHA256} of {LLAMA_CPP_PYTHON} on PyPI: "
            f"the package index pip asked serves another file. Point pip at PyPI (or a faithful mirror) and rerun.")
    return sdist


def _unpack(sdist: Path, dest: Path) -> None:
    """The :data:`PARTS` of the sdist's llama.cpp into ``dest`` (regular files only, paths kept inside ``dest``)."""
    with tarfile.open(sdist) as tar:
        for member in tar:
            _, _, inside = member.name.partition("/")
            if not (member.isfile() and inside.startswith(VENDOR)):
                continue
            relative = inside[len(VENDOR):]
            if not relative.startswith(PARTS) or ".." in Path(relative).parts:
                continue
            target = dest / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as out:  # type: ignore[union-attr]
                shutil.copyfileobj(src, out)


@functools.cache
def llama_cpp_folder() -> Path:
    """The folder holding :data:`PARTS` of the pinned llama.cpp, fetched and unpacked on the machine's first call.

    Raises :class:`LlamaCppFilesUnavailable` when it cannot be fetched."""
    root = cache_root()
    folder = root / f"llama-cpp-python-{SDIST_SHA256[:16]}"
    if (folder / "convert_hf_to_gguf.py").is_file():
        return folder
    with _held(root / "fetch.lock"):
        if (folder / "convert_hf_to_gguf.py").is_file():  # another process fetched it while this one waited
            return folder
        with tempfile.TemporaryDirectory(dir=root, prefix="fetching-") as tmp:
            partial = Path(tmp) / "llama.cpp"
            _unpack(_download(Path(tmp) / "sdist"), partial)
            if not (partial / "convert_hf_to_gguf.py").is_file():
                raise LlamaCppFilesUnavailable(f"the {LLAMA_CPP_PYTHON} sdist has no {VENDOR}convert_hf_to_gguf.py")
            partial.rename(folder)
    return folder


def vocab_file(name: str) -> Path:
    """llama.cpp's vocabulary-only GGUF ``ggml-vocab-NAME.gguf`` (its ``.inp``/``.out`` test vectors beside it)."""
    return llama_cpp_folder() / "models" / f"ggml-vocab-{name}.gguf"


def template_file(name: str) -> Path:
    """A real chat template of llama.cpp's ``models/templates/`` (``NAME.jinja``), as the model's tokenizer ships it."""
    return llama_cpp_folder() / "models" / "templates" / f"{name}.jinja"


def converter_script() -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py``, with its ``conversion/`` package and ``gguf-py/`` beside it."""
    return llama_cpp_folder() / "convert_hf_to_gguf.py"

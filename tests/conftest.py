"""Session fixtures: the committed files of tests/fixtures, llama.cpp's own files (tests/llama_cpp_files.py) and test
models built (and quantized by llama.cpp) once."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from ggtorch.ops import policy
from ggtorch.ops.threads import pin_threads
from tests.fixtures import SHAKESPEARE, STORIES260K
from tests.helpers import fcntl, made_once, run_folder
from tests.llama_cpp_files import LlamaCppFilesUnavailable, llama_cpp_folder
from tests.llama_models import RandomLlamaShape, plain_cpu_reference, quantize_with_llama_cpp, write_random_llama

plain_cpu_reference()
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
pin_threads(max(1, torch.get_num_threads() // WORKERS))
"""The CLI tests run in this process: a thread count that followed the machine's load could change
the summation order between two runs a test compares byte for byte. tests/ops/test_threads.py and
tests/cli/test_under_load.py test the load-following default, in their own objects and processes.
The workers share the cores: more threads than cores would keep spinning OpenMP threads waiting on one
another."""



GROUPED_FIXTURES = {"family_model": "", "converted": "converted-"}
"""Session fixtures that build one model per ``name`` parameter, and the prefix of that model's xdist group."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of one preset or converted model run on one worker (pyproject's ``--dist loadgroup``): each
    worker that met a model would otherwise write and quantize it itself, and read it again with gguf-py and
    transformers (whose reader takes seconds over a 32k-token vocabulary), as every cache here is per process.

    The order is the one pytest-xdist hands out (pyproject turns its own reordering off): the ``serial`` tests
    first, while no long test holds the other worker (a serial test waits for the room to empty), then the
    largest groups, so that no long group starts last."""
    group: dict[pytest.Item, str] = {}
    for item in items:
        name = getattr(item, "callspec", None) and item.callspec.params.get("name")
        fixtures = getattr(item, "fixturenames", ())
        prefix = next((p for f, p in GROUPED_FIXTURES.items() if f in fixtures), None)
        if isinstance(name, str) and prefix is not None:
            group[item] = prefix + name
            item.add_marker(pytest.mark.xdist_group(group[item]))
    for item in items:  # and the groups modules declare
        marker = item.get_closest_marker("xdist_group")
        if item not in group and marker is not None:
            group[item] = marker.args[0] if marker.args else marker.kwargs.get("name", "default")
    size = Counter(group.values())
    items.sort(key=lambda item: (item.get_closest_marker("serial") is None, -size.get(group.get(item, ""), 1)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under pytest-xdist (the suite runs on two workers), a test marked ``serial`` runs while no other
    test does: it measures the machine's load or wall time, which a test on the other worker would
    change. Two file locks in the run's temporary folder, which its workers share:
    every test holds the room shared, a serial one alone; the door makes a waiting serial test go next
    instead of waiting behind a stream of others. The locks wrap a test's whole protocol, so the session
    and module fixtures it sets up or tears down (a pip download, a model built) are inside the room too."""
    if "PYTEST_XDIST_WORKER" not in os.environ or fcntl is None:
        yield
        return
    serial = item.get_closest_marker("serial") is not None
    folder = run_folder(item.config._tmp_path_factory)  # type: ignore[attr-defined]  # pytest's tmp_path plugin
    with ExitStack() as held:
        door = held.enter_context(open(folder / "serial-tests.door", "a+b"))
        room = held.enter_context(open(folder / "serial-tests.room", "a+b"))
        fcntl.flock(door, fcntl.LOCK_EX)
        fcntl.flock(room, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        if not serial:
            fcntl.flock(door, fcntl.LOCK_UN)  # a serial test keeps the door shut until it is done
        yield  # closing the files releases both locks


@pytest.fixture
def cpu_policy() -> Iterator[Callable[..., policy.Policy]]:
    """``cpu_policy(c_fused=False)``: for the rest of the test, CPU ops follow the CPU policy so changed: how a test
    takes another path (torch's code for a C loop, a smaller chunk) without touching a module."""
    with ExitStack() as stack:
        def change(**changes: object) -> policy.Policy:
            return stack.enter_context(policy.using(policy.current("cpu").replace(**changes)))

        yield change


@pytest.fixture(scope="session")
def llama_cpp() -> Path:
    """llama.cpp's vocabularies, templates and converter from the pinned sdist (fetched once per machine)."""
    try:
        return llama_cpp_folder()
    except LlamaCppFilesUnavailable as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def stories260k() -> Path:
    return STORIES260K


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    """The committed Shakespeare excerpt (about 200 KB)."""
    return SHAKESPEARE


@pytest.fixture(scope="session")
def texts(shakespeare: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Training texts: the first 20000 characters of the Shakespeare excerpt ("train"), its last 6000 ("heldout", no
    overlap), a few words ("tiny") and an empty file ("empty")."""
    text = shakespeare.read_text(encoding="utf-8")
    root = tmp_path_factory.mktemp("texts")
    (root / "train.txt").write_text(text[:20000], encoding="utf-8")
    (root / "heldout.txt").write_text(text[-6000:], encoding="utf-8")
    (root / "tiny.txt").write_text("To be, or not", encoding="utf-8")
    (root / "empty.txt").write_text("", encoding="utf-8")
    return {p.stem: p for p in root.iterdir()}


@pytest.fixture(scope="session")
def stories_q8(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260K quantized to Q8_0 by llama.cpp: a real model with a quantized base."""
    return quantize_with_llama_cpp(stories260k, tmp_path_factory.mktemp("q8") / "stories260K-Q8_0.gguf", "Q8_0")


@pytest.fixture(scope="session")
def spm_vocab(llama_cpp: Path) -> Path:
    return llama_cpp / "models" / "ggml-vocab-llama-spm.gguf"


@pytest.fixture(scope="session")
def random_llama(tmp_path_factory: pytest.TempPathFactory, spm_vocab: Path) -> Callable[..., Path]:
    """``random_llama(ftype="Q4_0", shape=RandomLlamaShape(...), seed=0)`` → path of a GGUF.

    The F32 file is written once per (shape, seed); each quantized variant is made from it
    by llama.cpp once per session.
    """
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("llamas")

    def make(ftype: str = "F32", shape: RandomLlamaShape | None = None, seed: int = 0) -> Path:
        shape = shape or RandomLlamaShape()
        base_key = ("F32", shape, seed)
        if base_key not in cache:
            cache[base_key] = write_random_llama(root / f"llama-{len(cache)}-f32.gguf", spm_vocab, shape, seed)
        key = (ftype, shape, seed)
        if key not in cache:
            cache[key] = quantize_with_llama_cpp(cache[base_key], root / f"llama-{len(cache)}-{ftype}.gguf", ftype)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def family_model(tmp_path_factory: pytest.TempPathFactory, llama_cpp: Path) -> Callable[..., Path]:
    """``family_model("qwen3", ftype="Q4_K_M")`` → path of a GGUF of a preset of tests/families.py.

    The F32 file is written by gguf-py once per preset and run; each quantized variant is made from it by
    llama.cpp once per run: the workers share them (a preset's folder is made by the first that needs it while the
    other waits; writing Qwen's 151k-token vocabulary with gguf-py alone takes seconds).
    """
    from tests.families import write_preset

    cache: dict[tuple[str, str], Path] = {}

    def make(name: str, ftype: str = "F32") -> Path:
        if (name, ftype) not in cache:
            with made_once(tmp_path_factory, f"family-{name}") as folder:
                f32 = folder / f"{name}-f32.gguf"
                if not f32.exists():  # written beside, then renamed: a file there is whole
                    write_preset(name, folder / "partial").rename(f32)
                path = f32 if ftype == "F32" else folder / f"{name}-{ftype}.gguf"
                if not path.exists():
                    quantize_with_llama_cpp(f32, folder / "partial.gguf", ftype).rename(path)
            cache[name, ftype] = path
        return cache[name, ftype]

    return make

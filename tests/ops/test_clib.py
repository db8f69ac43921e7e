"""ggtorch.ops.clib: C libraries built on first use into the cache, once per source and flags."""

from __future__ import annotations

import ctypes
import shutil

import pytest

from ggtorch.ops import clib

SOURCE = "int ggtorch_test_answer(void) { return ANSWER; }\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    clib.load.cache_clear()
    yield tmp_path / "cache" / "ggtorch"
    clib.load.cache_clear()


def test_a_failed_build_leaves_nothing_behind(tmp_path) -> None:
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    target = tmp_path / "out" / "answer.so"
    assert not clib.compile_library(["false"], source, ("-O2",), None, target)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.skipif(not clib.compiler(), reason="no C compiler")
def test_built_once_per_source_and_flags(cache, tmp_path) -> None:
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    lib = clib.load(source, ("-DANSWER=42",))
    assert isinstance(lib, ctypes.CDLL) and lib.ggtorch_test_answer() == 42
    assert clib.load(source, ("-DANSWER=42",)) is lib  # loaded once per process
    assert clib.load(source, ("-DANSWER=7",)).ggtorch_test_answer() == 7  # other flags: another library
    built = sorted(p.name for p in cache.iterdir())
    assert len(built) == 2 and all(name.startswith("answer-") and name.endswith(".so") for name in built)
    clib.load.cache_clear()
    assert clib.load(source, ("-DANSWER=42",)).ggtorch_test_answer() == 42  # from the cache: nothing new
    assert sorted(p.name for p in cache.iterdir()) == built


def test_without_a_compiler_nothing_is_built(cache, tmp_path, monkeypatch) -> None:
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    monkeypatch.setenv("CC", "false")
    assert clib.compiler() == ["false"]
    assert clib.load(source, ("-DANSWER=1",)) is None
    assert not cache.exists() or list(cache.iterdir()) == []


def test_the_compiler_is_cc_unless_cc_is_set(monkeypatch) -> None:
    monkeypatch.setenv("CC", "ccache gcc -m64")
    assert clib.compiler() == ["ccache", "gcc", "-m64"]
    monkeypatch.delenv("CC")
    assert clib.compiler() == ([shutil.which("cc")] if shutil.which("cc") else [])


@pytest.mark.skipif(not clib.compiler(), reason="no C compiler")
def test_an_edited_header_rebuilds_the_library(cache, tmp_path) -> None:
    (tmp_path / "include").mkdir()
    header = tmp_path / "include" / "answer.h"
    header.write_text("#define ANSWER 42\n")
    source = tmp_path / "answer.c"
    source.write_text('#include "include/answer.h"\n' + SOURCE)
    assert clib.load(source, ()).ggtorch_test_answer() == 42
    header.write_text("#define ANSWER 43\n")
    clib.load.cache_clear()
    assert clib.load(source, ()).ggtorch_test_answer() == 43
    assert len(list(cache.iterdir())) == 2


@pytest.mark.skipif(not clib.compiler(), reason="no C compiler")
def test_load_declared_sets_each_function_s_types(cache, tmp_path) -> None:
    source = tmp_path / "half.c"
    source.write_text("double ggtorch_test_half(double x) { return x / 2; }\n")
    lib = clib.load_declared(source, (), {"ggtorch_test_half": (ctypes.c_double, [ctypes.c_double])})
    assert lib.ggtorch_test_half(3) == 1.5  # undeclared, ctypes would pass an int and read an int back

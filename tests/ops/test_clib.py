"""ggtorch.ops.clib: C libraries built on first use into the cache, once per source and flags."""

from __future__ import annotations

import ctypes
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ggtorch.ops import clib

SOURCE = "int ggtorch_test_answer(void) { return ANSWER; }\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    clib.load.cache_clear()
    clib.writable_cache_dir.cache_clear()
    yield tmp_path / "cache" / "ggtorch"
    clib.load.cache_clear()
    clib.writable_cache_dir.cache_clear()


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
    (tmp_path / "half.h").write_text("/* halves */\ndouble ggtorch_test_half(const double *unused, double x);\n")
    source.write_text('#include "half.h"\ndouble ggtorch_test_half(const double *unused, double x) { return x / 2; }\n')
    lib = clib.load_declared(source, ())
    assert lib.ggtorch_test_half(None, 3) == 1.5  # undeclared, ctypes would pass an int and read an int back


@pytest.mark.skipif(not clib.compiler(), reason="no C compiler")
def test_a_cache_folder_that_cannot_be_made_is_one_logged_line(cache, tmp_path, monkeypatch, caplog) -> None:
    """A file where the cache folder would go: every library falls back to torch, said once, nothing raised."""
    (tmp_path / "home-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-file"))
    sources = [tmp_path / "a.c", tmp_path / "b.c"]
    for source in sources:
        source.write_text(SOURCE)
    with caplog.at_level("WARNING", logger="ggtorch"):
        assert [clib.load(source, ("-DANSWER=1",)) for source in sources] == [None, None]
    assert [r.getMessage() for r in caplog.records if "cannot build its C libraries" in r.getMessage()] == [
        caplog.records[0].getMessage()]
    assert "XDG_CACHE_HOME" in caplog.records[0].getMessage() and len(caplog.records) == 1


def test_a_source_missing_from_the_install_says_so(cache, tmp_path, caplog) -> None:
    with caplog.at_level("WARNING", logger="ggtorch"):
        assert clib.load(tmp_path / "attention.c", ()) is None
    (record,) = caplog.records
    assert "this install of ggtorch lacks attention.c" in record.getMessage() and "Reinstall" in record.getMessage()


READ_ONLY_CHILD = """
import sys, ggtorch
from ggtorch.ops import attention, fused, lowrank
from ggtorch.quant import native
assert [native._library(), lowrank._library(), fused._library(), attention._library()] == [None] * 4
run = ggtorch.finetune(model_base=sys.argv[1], train_data=sys.argv[2], ctx=16, batch=2, adam_iter=2, warmup=0,
                       checkpoint_in="", checkpoint_out="", lora_out="", log_file="", threads=1, progress=False)
print("loss", run.history[-1].loss)
"""


def _read_only_command(folder: Path) -> list[str]:
    """What runs a command with ``folder`` read-only: its mode where permissions bind (not root), else a read-only
    bind mount in a mount namespace of the command's own (root; skipped where the kernel refuses one)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return []
    f = shlex.quote(str(folder))
    mount = f"mount --bind {f} {f} && mount -o remount,ro,bind {f} {f}"
    try:
        probe = subprocess.run(["unshare", "--mount", "sh", "-c", f"{mount} && ! touch {f}/probe 2>/dev/null"],
                               capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("root without unshare(1) for a read-only folder")
    if probe.returncode != 0:
        pytest.skip(f"root without a mount namespace for a read-only folder: {probe.stderr.strip()[:200]}")
    return ["unshare", "--mount", "sh", "-c", f'{mount} && exec "$@"', "sh"]


@pytest.mark.skipif(not clib.compiler(), reason="no C compiler")
def test_a_read_only_cache_folder_trains_through_torch_with_one_line(tmp_path, stories260k, texts) -> None:
    """A read-only cache (home) folder, nothing built in it yet: a LoRA finetune runs on torch's code, and the user
    reads one line saying why and what to do."""
    folder = tmp_path / "read-only-cache"
    folder.mkdir()
    env = {**os.environ, "XDG_CACHE_HOME": str(folder)}
    proc = subprocess.run([*_read_only_command(folder), sys.executable, "-c", READ_ONLY_CHILD, str(stories260k),
                           str(texts["train"])], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss" in proc.stdout
    said = [line for line in proc.stderr.splitlines() if "cannot build its C libraries" in line]
    assert len(said) == 1 and str(folder) in said[0] and "XDG_CACHE_HOME" in said[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(folder.iterdir()) == []


# --- the libraries' signatures: declared once, in each library's header, and held to the C definitions ----------

def _libraries() -> list[Path]:
    from ggtorch.ops import attention, fused, lowrank
    from ggtorch.quant import native

    return [native.SOURCE, lowrank.SOURCE, fused.SOURCE, attention.SOURCE]


LIBRARIES = {path.name: path for path in _libraries()}

DEFINITION = re.compile(r"^(?!static\b)[A-Za-z_][\w ]*?\b(ggtorch_\w+)\s*\([^;{]*\)\s*\{", re.MULTILINE)
"""An exported function's definition in a library's source: not static, a body follows."""


@pytest.mark.parametrize("name", LIBRARIES)
def test_every_exported_function_has_its_prototype_in_the_header(name: str) -> None:
    source = LIBRARIES[name]
    defined = set(DEFINITION.findall(source.read_text()))
    declared = set(clib.prototypes(source.with_suffix(".h")))
    assert defined and defined == declared
    assert f'#include "{source.stem}.h"' in source.read_text()


def _syntax_check(source: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*clib.compiler(), "-fsyntax-only", str(source)], capture_output=True,
                          text=True, timeout=120)


def _copy_sources(tmp_path: Path) -> Path:
    """ggtorch's C sources and headers (ops/ and quant/: native.c includes ../ops/vec.h) under ``tmp_path``."""
    package = LIBRARIES["native.c"].parents[1]
    for folder in ("ops", "quant"):
        (tmp_path / folder).mkdir()
        for path in (package / folder).iterdir():
            if path.suffix in (".c", ".h"):
                shutil.copy(path, tmp_path / folder / path.name)
    return tmp_path


@pytest.mark.skipif(not clib.compiler(), reason="no C compiler")
@pytest.mark.parametrize("name", LIBRARIES)
def test_the_compiler_holds_each_definition_to_the_header_python_reads(name: str, tmp_path: Path) -> None:
    """Python's ctypes types come from the header (clib.prototypes); the source includes it, so a definition that
    differs from it in any argument or the result does not build: each prototype changed, one at a time, is
    refused."""
    folder = _copy_sources(tmp_path)
    source = folder / LIBRARIES[name].parent.name / name
    header = source.with_suffix(".h")
    assert _syntax_check(source).returncode == 0, _syntax_check(source).stderr
    text = header.read_text()
    names = list(clib.prototypes(header))
    for fn in names:
        at = text.index(f" {fn}(")
        end = text.index(";", at)
        proto = text[at:end]
        # one argument's type changed: the first int64_t becomes an int, else an int a float, else one more argument
        changed = (proto.replace("int64_t", "int", 1) if "int64_t" in proto
                   else proto.replace("int ", "float ", 1) if "int " in proto
                   else proto.replace("(void)", "(int extra)"))
        header.write_text(text[:at] + changed + text[end:])
        result = _syntax_check(source)
        assert result.returncode != 0 and "conflicting types" in result.stderr, (fn, changed)
    header.write_text(text)


@pytest.mark.skipif(not clib.compiler(), reason="no C compiler")
def test_each_c_type_is_as_wide_as_its_ctypes_type(tmp_path: Path) -> None:
    """What clib maps each header type to is what the compiler makes of it: the same size (a pointer too)."""
    program = tmp_path / "sizes.c"
    kinds = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double,
             "const void *": ctypes.c_void_p, "float *": ctypes.c_void_p}
    assert {name: clib.C_TYPES[name] for name in ("int", "int64_t", "float", "double")} == {
        name: kinds[name] for name in ("int", "int64_t", "float", "double")}
    lines = "".join(f'    printf("%zu\\n", sizeof({c}));\n' for c in kinds)
    program.write_text(f"#include <stdint.h>\n#include <stdio.h>\nint main(void) {{\n{lines}    return 0;\n}}\n")
    subprocess.run([*clib.compiler(), str(program), "-o", str(tmp_path / "sizes")], check=True, timeout=120)
    sizes = subprocess.run([str(tmp_path / "sizes")], capture_output=True, text=True, check=True).stdout.split()
    assert [int(n) for n in sizes] == [ctypes.sizeof(t) for t in kinds.values()]


def test_a_header_type_clib_does_not_know_is_refused(tmp_path: Path) -> None:
    header = tmp_path / "odd.h"
    header.write_text("int ggtorch_odd(const void *x, uint8_t flag);\n")
    with pytest.raises(ValueError, match="uint8_t flag"):
        clib.prototypes(header)

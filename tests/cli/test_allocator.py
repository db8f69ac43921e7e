"""The training commands re-execute themselves on jemalloc when it is installed (ggtorch.cli.allocator)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ggtorch.cli import allocator
from ggtorch.errors import BadFlag

LIB = "/somewhere/libjemalloc.so.2"


def test_relaunch_env_preloads_jemalloc_with_reuse_settings() -> None:
    env = allocator.relaunch_env({"PATH": "/bin"}, LIB)
    assert env == {"PATH": "/bin", "LD_PRELOAD": LIB, "MALLOC_CONF": allocator.JEMALLOC_CONF,
                   allocator.RELAUNCHED: "1"}


def test_relaunch_env_keeps_the_users_preload_and_malloc_conf() -> None:
    env = allocator.relaunch_env({"LD_PRELOAD": "/x/libfoo.so", "MALLOC_CONF": "narenas:1"}, LIB)
    assert env is not None
    assert env["LD_PRELOAD"] == f"{LIB}:/x/libfoo.so"
    assert env["MALLOC_CONF"] == "narenas:1"


@pytest.mark.parametrize("environ, library", [
    ({allocator.ENV: "system"}, LIB),  # the user said no
    ({allocator.RELAUNCHED: "1"}, LIB),  # already the re-executed process: never loop
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, LIB),  # already on jemalloc
    ({}, None),  # not installed
])
def test_no_relaunch(environ: dict[str, str], library: str | None) -> None:
    assert allocator.relaunch_env(environ, library) is None


def test_a_bad_choice_names_the_two_good_ones() -> None:
    with pytest.raises(BadFlag, match="GGTORCH_ALLOCATOR=jemalloc .* GGTORCH_ALLOCATOR=system"):
        allocator.relaunch_env({allocator.ENV: "tcmalloc"}, LIB)


def test_find_jemalloc_prefers_the_environments_own_copy(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / allocator.LIBRARY).write_bytes(b"")
    assert allocator.find_jemalloc((str(tmp_path),)) == str(tmp_path / "lib" / allocator.LIBRARY)


def _finetune_first_line(stories260k: Path, tmp_path: Path, **env: str) -> str:
    text = tmp_path / "train.txt"
    text.write_text("The cat sat on the mat. " * 200)
    cmd = [sys.executable, "-m", "ggtorch", "finetune", "--model-base", str(stories260k), "--train-data", str(text),
           "--lora-out", str(tmp_path / "lora.gguf"), "--adam-iter", "1", "--ctx", "16", "--batch", "1",
           "--save-every", "0"]
    inherited = {k: v for k, v in os.environ.items()
                 if k not in (allocator.ENV, allocator.RELAUNCHED, "LD_PRELOAD", "MALLOC_CONF")}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**inherited, **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()[0]


def test_finetune_runs_on_jemalloc_when_installed(stories260k: Path, tmp_path: Path) -> None:
    if allocator.find_jemalloc() is None:
        pytest.skip("libjemalloc.so.2 is not installed (Debian/Ubuntu: apt install libjemalloc2)")
    assert _finetune_first_line(stories260k, tmp_path).endswith("malloc jemalloc")


def test_finetune_keeps_the_system_malloc_when_asked(stories260k: Path, tmp_path: Path) -> None:
    first = _finetune_first_line(stories260k, tmp_path, **{allocator.ENV: "system"})
    assert first.endswith("malloc system")

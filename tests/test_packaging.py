"""The wheel carries every file ggtorch reads at run time, and `ggtorch demo` runs from it in a fresh environment.

An editable install reads the source tree, so nothing else in the suite would notice a C source or header that
pyproject's package-data leaves out: the library built from it would silently be torch's slower code.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import ggtorch
from ggtorch.ops import clib

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("wheel")]


def runtime_sources() -> set[str]:
    """Every C source a module of ggtorch builds (its ``SOURCE``) and the headers it includes, as package paths."""
    found = set()
    for info in pkgutil.walk_packages(ggtorch.__path__, "ggtorch."):
        if info.name.startswith(("ggtorch.cli", "ggtorch.__main__")) or info.ispkg:
            continue
        source = getattr(importlib.import_module(info.name), "SOURCE", None)
        if isinstance(source, Path):
            found |= {f"ggtorch/{p.relative_to(Path(ggtorch.__file__).parent).as_posix()}"
                      for p in clib.source_files(source)}
    return found


def tracked_files(under: str = "") -> set[str]:
    """The files git tracks (under a folder), as they are in the work tree: what a wheel is built from."""
    out = subprocess.run(["git", "ls-files", "-z", "--", under or "."], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return {name for name in out.stdout.split("\0") if name and (ROOT / name).is_file()}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build --wheel`` of the work tree's tracked files, as a user or a release job builds it: from a
    copy, since setuptools writes its build folders into the tree it builds."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the wheel is compared with the files git tracks")
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in tracked_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    proc = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(source)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (built,) = out.glob("ggtorch-*.whl")
    return built


def test_every_c_source_and_header_is_found() -> None:
    """The four libraries, each with the header that declares its functions, and the header they share: what the
    wheel test below holds the wheel to."""
    libraries = ("ggtorch/quant/native", "ggtorch/ops/lowrank", "ggtorch/ops/fused", "ggtorch/ops/attention")
    declared = {f"{lib}{suffix}" for lib in libraries for suffix in (".c", ".h")}
    assert runtime_sources() == declared | {"ggtorch/ops/vec.h"}


def test_the_wheel_carries_every_file_of_the_package(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    in_package = {n for n in names if n.startswith("ggtorch/")}
    assert runtime_sources() | {"ggtorch/py.typed"} <= in_package
    assert in_package == tracked_files("ggtorch")
    assert "ggtorch_launcher.py" in names  # the console script's entry point (it catches a Ctrl-C in the import)


def test_demo_runs_from_the_wheel_in_a_fresh_environment(wheel: Path, tmp_path: Path) -> None:
    """The wheel installed alone into a new virtual environment (its dependencies seen through a path file, so
    nothing is downloaded), ggtorch imported from there, the demo run offline: every C library builds from the
    wheel's own sources into a new cache folder."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    target = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies, from this environment: a .pth line adds a folder, whose own .pth files (the editable
    # install of this checkout among them) are not read, so `import ggtorch` can only find the wheel's copy
    (Path(target) / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    where = subprocess.run([str(python), "-c", "import ggtorch; print(ggtorch.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path)
    assert where.returncode == 0 and Path(where.stdout.strip()).is_relative_to(env_dir), where.stdout + where.stderr

    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"XDG_CACHE_HOME": str(cache), "HF_HUB_OFFLINE": "1", "no_proxy": "*", "https_proxy": "http://0.0.0.0:9"}
    demo = subprocess.run([str(env_dir / "bin" / "ggtorch"), "demo", "-o", str(tmp_path / "out"), "--base-iterations",
                           "20", "--lora-iterations", "4", "-t", "1"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=600)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert (tmp_path / "out" / "lora-zen.gguf").is_file()
    if clib.compiler():  # and every library the wheel's modules build, the demo's and the rest
        libraries = subprocess.run([str(python), "-c", LOAD_EVERY_LIBRARY], capture_output=True, text=True,
                                   cwd=tmp_path, env=env)
        assert libraries.returncode == 0 and libraries.stdout.split() == ["ok"] * 4, libraries.stderr
        built = {re.sub(r"-[0-9a-f]{16}\.so$", "", p.name) for p in (cache / "ggtorch").glob("*.so")}
        assert built == {"native", "lowrank", "fused", "attention"}, demo.stderr


LOAD_EVERY_LIBRARY = """
from ggtorch.ops import attention, fused, lowrank
from ggtorch.quant import native
for module in (native, lowrank, fused, attention):
    print("ok" if module._library() is not None else f"{module.__name__}: not built")
"""

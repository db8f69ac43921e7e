"""The suite's own fetch of llama.cpp's files (tests/llama_cpp_files.py): once per machine, checked, or one message."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import llama_cpp_files
from tests.llama_cpp_files import LlamaCppFilesUnavailable, checked, converter_script, template_file, vocab_file


def test_the_files_the_tests_read_are_all_there(llama_cpp: Path) -> None:
    assert converter_script().is_file() and (llama_cpp / "conversion").is_dir()
    assert (llama_cpp / "gguf-py" / "gguf" / "gguf_reader.py").is_file()
    for name in ("llama-spm", "llama-bpe", "qwen2", "phi-3", "qwen35", "gemma-4"):
        assert all(Path(f"{vocab_file(name)}{end}").is_file() for end in ("", ".inp", ".out")), name
    assert template_file("Qwen-Qwen3-0.6B").read_text(encoding="utf-8").startswith("{%")
    assert llama_cpp.is_relative_to(llama_cpp_files.cache_root())


def test_a_file_of_another_hash_is_refused_naming_both(tmp_path: Path) -> None:
    fake = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    fake.write_bytes(b"not the sdist")
    with pytest.raises(LlamaCppFilesUnavailable) as e:
        checked(fake)
    assert llama_cpp_files.SDIST_SHA256 in str(e.value) and "another file" in str(e.value)


def test_no_package_index_is_one_message_and_leaves_no_partial_folder(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """pip pointed at a port nothing listens on, with no cache to answer from: the message says what to do, and the
    cache holds no half-unpacked folder a later run would take for a whole one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for key, value in {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_CACHE_DIR": "1", "PIP_RETRIES": "0",
                       "PIP_TIMEOUT": "2", "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(LlamaCppFilesUnavailable) as e:
        llama_cpp_files.llama_cpp_folder.__wrapped__()
    message = str(e.value)
    assert "llama-cpp-python==0.3.36 sdist" in message and "could not fetch it" in message, message
    assert "\n" not in message and str(tmp_path / "cache" / "ggtorch-tests") in message
    assert os.listdir(tmp_path / "cache" / "ggtorch-tests") == ["fetch.lock"]

"""ggtorch.io.paths: outputs compared with inputs as the files they name, name templates with every name they make."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ggtorch.errors import BadFlag
from ggtorch.io.paths import Input, Output, check_files, check_latest_name, name_max


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


@pytest.mark.parametrize("output", [
    "{d}/model.gguf",                 # the same name
    "{d}/sub/../model.gguf",          # through '..'
    "{d}/link.gguf",                  # a symbolic link to it
    "{d}/hard.gguf",                  # a hard link: the same file under another name
    "{d}/model-ITERATION.gguf",       # a template, one of whose names (model-12.gguf) it is
])
def test_an_output_that_names_an_input_is_refused(model: Path, output: str) -> None:
    d = model.parent
    (d / "sub").mkdir()
    (d / "link.gguf").symlink_to(model)
    os.link(model, d / "hard.gguf")
    if "ITERATION" in output:
        os.replace(model, d / "model-12.gguf")
        model = d / "model-12.gguf"
    with pytest.raises(BadFlag, match="would write over --model-base"):
        check_files([Input("--model-base", model)],
                    [Output("--lora-out", output.format(d=d), pattern="ITERATION", latest="LATEST")])


def test_names_that_only_look_alike_are_not_refused(model: Path) -> None:
    d = model.parent
    check_files([Input("--model-base", model)],
                [Output("--lora-out", d / "model-ITERATION.gguf.bak", pattern="ITERATION", latest="LATEST"),
                 Output("--checkpoint-out", d / "modelITERATION.gguf", pattern="X", latest="LATEST")])


@pytest.mark.parametrize(("first", "second"), [
    ("a-ITERATION.gguf", "a-LATEST.gguf"), ("a-ITERATION.gguf", "a-7.gguf"), ("x.gguf", "./x.gguf"),
    ("a-ITERATION.gguf", "a-ITERATION.gguf"),
])
def test_two_outputs_that_can_write_one_file_are_refused(tmp_path: Path, first: str, second: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadFlag, match="would write the same file"):
        check_files([], [Output("--checkpoint-out", first, pattern="ITERATION", latest="LATEST"),
                         Output("--lora-out", second, pattern="ITERATION", latest="LATEST")])


def test_a_folder_output_is_checked_against_what_it_writes_into_it(tmp_path: Path) -> None:
    adapter = tmp_path / "out" / "adapter.gguf"
    adapter.parent.mkdir()
    adapter.write_bytes(b"GGUF")
    peft = Output("--outdir", tmp_path / "out", folder=True, inside=("adapter_config.json", "a.safetensors"))
    check_files([Input("ADAPTER", adapter)], [peft])  # beside the input: fine
    (tmp_path / "out" / "a.safetensors").write_bytes(b"")
    with pytest.raises(BadFlag, match="would write over ADAPTER"):
        check_files([Input("ADAPTER", tmp_path / "out" / "a.safetensors")], [peft])
    check_files([], [Output("--outdir", tmp_path / "new" / "deeper", folder=True)])  # made with its parents


def test_names_longer_than_the_filesystem_takes_are_refused_before_any_work(tmp_path: Path) -> None:
    limit = name_max(tmp_path)
    check_files([], [Output("-o", tmp_path / ("n" * (limit - 5) + ".gguf"))])
    with pytest.raises(BadFlag, match=f"takes at most {limit}"):
        check_files([], [Output("-o", tmp_path / ("n" * (limit - 4) + ".gguf"))])
    with pytest.raises(BadFlag, match=f"takes at most {limit}"):  # room for the iteration's digits
        check_files([], [Output("-o", tmp_path / ("n" * (limit - 14) + "-ITERATION.gguf"), pattern="ITERATION",
                                latest="LATEST")])


def test_inputs_of_the_wrong_kind_and_missing_ones(tmp_path: Path) -> None:
    with pytest.raises(BadFlag, match="is a folder; --model-base takes a file"):
        check_files([Input("--model-base", tmp_path)], [])
    (tmp_path / "f").write_text("x")
    with pytest.raises(BadFlag, match="is a file; PEFT_DIR takes a folder"):
        check_files([Input("PEFT_DIR", tmp_path / "f", folder=True)], [])
    with pytest.raises(BadFlag, match="no such file or folder; start over"):
        check_files([Input("--train-data", tmp_path / "gone", folder=None, missing="start over")], [])
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(BadFlag, match="a link to nothing"):
        check_files([Input("--model-base", tmp_path / "dangling")], [])
    check_files([Input("--train-data", tmp_path, folder=None), Input("--train-data", tmp_path / "f", folder=None)], [])


def test_existing_finds_every_name_a_template_writes_latest_first(tmp_path: Path) -> None:
    for name in ("ck-2.gguf", "ck-10.gguf", "ck-LATEST.gguf", "ck-x.gguf", "other-3.gguf"):
        (tmp_path / name).write_bytes(b"")
    out = Output("--checkpoint-out", tmp_path / "ck-ITERATION.gguf", pattern="ITERATION", latest="LATEST")
    assert [p.name for p in out.existing()] == ["ck-LATEST.gguf", "ck-10.gguf", "ck-2.gguf"]
    assert Output("-o", tmp_path / "ck-3.gguf").existing() == []


@pytest.mark.parametrize("latest", ["2", "0", "10", "007"])
def test_a_latest_name_made_of_digits_is_refused_as_an_iterations_name(latest: str) -> None:
    """``--fn-latest 2 --save-every 1`` made checkpoint-2.gguf hold iteration 3: the latest copy took iteration 2's
    name. An all-digit name is one an iteration has or that reads as one (Output.existing counts it)."""
    out = Output("--checkpoint-out", "ck-ITERATION.gguf", pattern="ITERATION", latest=latest)
    assert out.name_regex().fullmatch(f"ck-{latest}.gguf")  # what the other checks take for an iteration's file
    with pytest.raises(BadFlag) as refused:
        check_latest_name("ITERATION", latest, "runs/ck-ITERATION.gguf")
    assert str(refused.value).startswith(f"--fn-latest {latest} names each output's latest copy as an iteration's "
                                         f"file (ck-{latest}.gguf would hold the newest save, not iteration "
                                         f"{int(latest)})")


@pytest.mark.parametrize("latest", ["LATEST", "2b", "last-2", ""])
def test_other_latest_names_never_take_an_iterations_name(latest: str) -> None:
    check_latest_name("ITERATION", latest, "ck-ITERATION.gguf")
    name = "ck-ITERATION.gguf".replace("ITERATION", latest, 1)
    assert name not in {f"ck-{i}.gguf" for i in range(10_000)}
    check_latest_name("", "2", "ck.gguf")  # no pattern: one fixed name, no iteration names to take


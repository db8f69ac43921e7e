"""One place per option: the training commands' flags, --help defaults and API keywords are the config fields."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import click
import pytest

import ggtorch
from ggtorch import api
from ggtorch.cli.main import main
from ggtorch.training.config import FinetuneConfig, RunConfig, TrainConfig
from tests.helpers import run_cli

COMMANDS: dict[str, type[RunConfig]] = {"finetune": FinetuneConfig, "train": TrainConfig}

NOT_FIELDS = {
    "--config",
    # the old programs' ggml memory flags: accepted and ignored with a note
    "--use-flash", "--no-flash", "-ngl", "--n-gpu-layers", "--use-alloc", "--no-alloc",
    "--mem-model", "--mem-lora", "--mem-compute", "--mem-compute0", "--mem-compute1",
}

# old spellings besides the long flags (README's flag table): spelling -> field
OLD_SPELLINGS = {
    "-c": "ctx", "-b": "batch", "-n": "adam_iter", "-s": "seed", "-t": "threads",
    "--no-checkpointing": "use_checkpointing", "--disable-restart": "enable_restart",
    "--no-separate-with-eos": "separate_with_eos", "--no-separate-with-bos": "separate_with_bos",
}
FINETUNE_SPELLINGS = {"--rank-ffn_gate": "rank_ffn_gate", "--rank-ffn_down": "rank_ffn_down",
                      "--rank-ffn_up": "rank_ffn_up"}


def _long(name: str) -> str:
    return "--" + name.replace("_", "-")


def _spellings(command: click.Command) -> dict[str, str]:
    """Every flag spelling of a command -> the name of the parameter it sets."""
    return {spelling: p.name for p in command.params if isinstance(p, click.Option)
            for spelling in (*p.opts, *p.secondary_opts)}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_field_has_its_flag_and_every_flag_a_field(command: str) -> None:
    config_cls = COMMANDS[command]
    spellings = _spellings(main.commands[command])
    names = {f.name for f in dataclasses.fields(config_cls)}
    for name in names:  # the long flag, the config-file key and the API keyword are one name
        assert spellings.get(_long(name)) == name, f"{command}: field {name} has no flag {_long(name)}"
    for spelling, name in spellings.items():
        assert name in names or spelling in NOT_FIELDS, f"{command}: {spelling} sets no field"
    assert NOT_FIELDS <= set(spellings)  # the old ignored flags are all still accepted
    expected = OLD_SPELLINGS | (FINETUNE_SPELLINGS if command == "finetune" else {})
    assert {s: spellings.get(s) for s in expected} == expected


def test_train_has_no_lora_options_and_finetune_no_model_shape() -> None:
    assert not {"lora_r", "lora_out", "rank_wq", "drop_norms", "base_dtype"} & TrainConfig.field_names()
    assert not {"vocab_model", "embd", "model_out", "outtype"} & FinetuneConfig.field_names()


def _expected_default(f: dataclasses.Field[Any]) -> str | None:
    """How --help should show the field's default, computed from the field alone (None: no default shown)."""
    info = f.metadata["option"]
    if f.default is None:
        return f"({info.default_text})" if info.default_text else None
    if f.default == ():
        return None  # a repeatable option given no times: nothing to show
    if isinstance(f.default, bool):
        if not info.off:
            return None  # a switch that is off unless given
        return _long(f.name)[2:] if f.default else info.off[2:]
    return '""' if f.default == "" else str(f.default)


def _help_rows(command: str) -> dict[str, str]:
    """Each flag spelling -> its row of ``ggtorch COMMAND --help``."""
    result = run_cli([command, "--help"], terminal_width=1000)  # one line per option
    assert result.exit_code == 0, result.output
    rows = {}
    lines = result.output.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"  (-\S.*?)(?:\s{2,}(.*))?$", line)
        if m:  # an option's spellings, then its help on the same line or (long spellings) the next
            for spelling in m.group(1).replace(",", " ").replace("/", " ").split():
                rows.setdefault(spelling, m.group(2) or lines[i + 1].strip())
    return rows


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_each_declared_range(command: str) -> None:
    """--help states the range the config checks, from the same declaration."""
    rows = _help_rows(command)
    shown = set()
    for f in dataclasses.fields(COMMANDS[command]):
        allowed = f.metadata["option"].range_text()
        if allowed is not None:
            assert f"Must be {allowed}." in rows[_long(f.name)], (f.name, rows[_long(f.name)])
            shown.add(f.name)
    assert {"ctx", "threads", "seed", "val_split"} <= shown
    assert f"at most {os.cpu_count() or 1}." in rows["--threads"]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_each_default_from_the_field(command: str) -> None:
    rows = _help_rows(command)
    for f in dataclasses.fields(COMMANDS[command]):
        row = rows[_long(f.name)]
        assert row.startswith(f.metadata["option"].help), (f.name, row)
        expected = _expected_default(f)
        if expected is None:
            assert "[default:" not in row, (f.name, row)
        else:
            assert row.endswith(f"[default: {expected}]"), (f.name, row)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_api_keywords_are_the_fields(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config_cls = COMMANDS[command]
    monkeypatch.setattr(api, "_run", lambda config, *args, **kwargs: config)  # the config the run would get
    start = getattr(ggtorch, command)
    every = {f.name: f.default for f in dataclasses.fields(config_cls)} | {"model_base": "m.gguf", "ctx": 32}
    assert start(**every) == config_cls(**every)
    with pytest.raises(ggtorch.BadFlag, match=r"adam_alfa \(did you mean adam_alpha\?\)"):
        start(model_base="m.gguf", adam_alfa=0.1)


def test_an_option_of_the_other_command_is_named() -> None:
    with pytest.raises(ggtorch.BadFlag, match="lora_r .an option of ggtorch finetune"):
        ggtorch.train(vocab_model="v.gguf", lora_r=8)
    with pytest.raises(ggtorch.BadFlag, match="vocab_model .an option of ggtorch train"):
        ggtorch.finetune(model_base="m.gguf", vocab_model="v.gguf")

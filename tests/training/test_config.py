"""FinetuneConfig: old llama.cpp defaults, config files, validation that names the flag."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import yaml

from ggtorch.data import DataOptions, RecordOptions
from ggtorch.errors import BadFlag
from ggtorch.lora import LoraConfig
from ggtorch.lora.config import MAX_RANK
from ggtorch.lora.config import OPTION_NAMES as LORA_OPTION_NAMES
from ggtorch.training.config import FinetuneConfig, OptionInfo, RunConfig, TrainConfig, choices, value_type
from ggtorch.training.optim import OPTION_NAMES, AdamConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults_are_the_old_finetune_defaults() -> None:
    c = FinetuneConfig()
    # common/train.cpp get_default_train_params_common + finetune.cpp get_default_train_params
    assert (c.ctx, c.batch, c.grad_acc, c.adam_iter, c.save_every, c.epochs) == (128, 8, 1, 256, 10, -1)
    assert (c.adam_alpha, c.adam_min_alpha, c.adam_decay, c.adam_decay_min_ndim) == (1e-3, 0.0, 0.1, 2)
    assert (c.adam_beta1, c.adam_beta2, c.adam_gclip, c.adam_epsf) == (0.9, 0.999, 1.0, 0.0)
    assert (c.warmup, c.cos_decay_steps, c.cos_decay_restart, c.cos_decay_min) == (100, 1000, 1.1, 0.1)
    # the old finetune always checkpointed; ggtorch decides from its memory estimate unless told (issue 70)
    assert not c.enable_restart and c.use_checkpointing is None
    # --checkpoint-in: none given resumes checkpoint.gguf when it is there (training.run), as the old default did
    assert (c.checkpoint_in, c.checkpoint_out, c.lora_out) == (
        None, "checkpoint-ITERATION.gguf", "ggml-lora-ITERATION-f32.gguf")
    assert (c.pattern_fn_it, c.fn_latest) == ("ITERATION", "LATEST")
    assert (c.separate_with_bos, c.separate_with_eos, c.fill_with_next_samples) == (True, False, False)
    assert c.lora_r == 4 and c.alpha == 4.0  # alpha defaults to r


@pytest.mark.parametrize("change, flag", [
    ({"ctx": 0}, "--ctx"),
    ({"batch": -1}, "--batch"),
    ({"lora_r": 0}, "--lora-r"),
    ({"rank_wq": -2}, "--rank-wq"),
    ({"val_split": 1.5}, "--val-split"),
    ({"dtype": "f64"}, "--dtype"),
    ({"lora_alpha": float("nan")}, "--lora-alpha"),
])
def test_bad_values_name_the_flag(change: dict, flag: str) -> None:
    with pytest.raises(BadFlag, match=flag):
        FinetuneConfig(**change)


def test_grad_acc_is_clamped_like_llama_cpp() -> None:
    assert FinetuneConfig(grad_acc=0).grad_acc == 1


@pytest.mark.parametrize("suffix, text", [
    (".yaml", "adam-alpha: 0.01\nctx: 64\nuse_checkpointing: false\n"),
    (".toml", "adam-alpha = 0.01\nctx = 64\nuse_checkpointing = false\n"),
])
def test_config_file_and_overrides(tmp_path: Path, suffix: str, text: str) -> None:
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    c = FinetuneConfig.from_file(path, ctx=32)
    assert (c.adam_alpha, c.ctx, c.use_checkpointing) == (0.01, 32, False)


def test_unknown_config_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("adam-alfa: 0.01\n")
    with pytest.raises(BadFlag, match="adam_alfa"):
        FinetuneConfig.from_file(path)


@pytest.mark.parametrize("preset", sorted(CONFIGS.glob("*.y*ml")) + sorted(CONFIGS.glob("*.toml")),
                         ids=lambda p: p.name)
def test_shipped_presets_load(preset: Path) -> None:
    FinetuneConfig.from_file(preset)
    TrainConfig.from_file(preset, vocab_model="v.gguf")  # a preset serves both commands


@pytest.mark.parametrize("config_cls, required", [(FinetuneConfig, {}), (TrainConfig, {"vocab_model": "v.gguf"})])
def test_config_file_keys_are_the_fields(tmp_path: Path, config_cls: type[RunConfig], required: dict) -> None:
    """Every field is a key ('-' spelling); a key of the other command is left to it; other keys are refused."""
    values = {f.name: f.default for f in dataclasses.fields(config_cls)} | required | {"ctx": 48}
    other = FinetuneConfig if config_cls is TrainConfig else TrainConfig
    foreign = sorted(other.field_names() - config_cls.field_names())[0]
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump({k.replace("_", "-"): v for k, v in {**values, foreign: None}.items()}))
    assert config_cls.from_file(path) == config_cls(**values)
    path.write_text("ctx: 64\nadam-alfa: 0.1\n")
    with pytest.raises(BadFlag, match=r"adam_alfa \(did you mean adam_alpha\?\)"):
        config_cls.from_file(path)


def _bad_values(config_cls: type[RunConfig]) -> list[tuple[str, object]]:
    """A value below its minimum or outside its choices, for every option that declares one."""
    bad = []
    for f in dataclasses.fields(config_cls):
        if f.metadata["option"].minimum is not None:
            bad.append((f.name, f.metadata["option"].minimum - 1))
        if choices(config_cls, f):
            bad.append((f.name, "nonsense"))
    return bad


@pytest.mark.parametrize("config_cls, required", [(FinetuneConfig, {}), (TrainConfig, {"vocab_model": "v.gguf"})])
def test_each_declared_rule_names_its_flag(config_cls: type[RunConfig], required: dict) -> None:
    bad = _bad_values(config_cls)
    assert {"ctx", "dtype", "on_nan", "utf8_errors", "batching"} <= {name for name, _ in bad}
    for name, value in bad:
        with pytest.raises(BadFlag, match=f"--{name.replace('_', '-')} must be "):
            config_cls(**required, **{name: value})


@pytest.mark.parametrize("options, lora", [
    ({"lora_r": 0}, {"rank": 0}), ({"lora_alpha": -1.0}, {"alpha": -1.0}), ({"lora_dropout": 1.0}, {"dropout": 1.0}),
    ({"rank_ffn_gate": -1}, {"ranks": {"ffn_gate": -1}}),
])
def test_lora_options_have_one_check(options: dict, lora: dict) -> None:
    """FinetuneConfig refuses bad LoRA options with LoraConfig's own message (the API's add_lora sees it too)."""
    with pytest.raises(BadFlag) as from_config:
        FinetuneConfig(**options)
    with pytest.raises(BadFlag) as from_lora:
        LoraConfig(**lora)
    assert str(from_config.value) == str(from_lora.value)
    assert f"--{next(iter(options)).replace('_', '-')} must be" in str(from_lora.value)


def test_option_defaults_are_the_parts_defaults() -> None:
    """Options that configure a part of the machinery default to that part's own defaults."""
    c = FinetuneConfig()
    assert AdamConfig.from_finetune(c) == AdamConfig()
    assert LoraConfig.from_finetune(c) == LoraConfig(ranks={"attn_norm": 0, "ffn_norm": 0, "output_norm": 0})
    assert DataOptions.from_finetune(c) == DataOptions(seed=c.seed)
    assert RecordOptions.from_finetune(c) == RecordOptions()
    linked = {*OPTION_NAMES.values(), *LORA_OPTION_NAMES.values(), *(f.name for f in dataclasses.fields(DataOptions)),
              *(f.name for f in dataclasses.fields(RecordOptions))}
    assert linked <= FinetuneConfig.field_names()


def _outside(info: OptionInfo, kind: type) -> list[float]:
    """Values just outside each end of a declared range."""
    step = 1 if kind is int else 1e-6
    values = []
    if info.minimum is not None:
        values.append(info.minimum - step)
    if info.above is not None:
        values.append(info.above)
    if info.maximum is not None:
        values.append(info.maximum + step)
    if info.below is not None:
        values.append(info.below)
    return values


@pytest.mark.parametrize("config_cls, required", [(FinetuneConfig, {}), (TrainConfig, {"vocab_model": "v.gguf"})])
def test_each_declared_range_is_checked_at_both_ends(config_cls: type[RunConfig], required: dict) -> None:
    """Every bound an option declares refuses the value just past it, naming the flag, the range and the value."""
    checked = set()
    for f in dataclasses.fields(config_cls):
        info = f.metadata["option"]
        for value in _outside(info, value_type(config_cls, f)):
            with pytest.raises(BadFlag, match=rf"^--{f.name.replace('_', '-')} must be {re.escape(info.range_text())}, "
                                              rf"got {re.escape(str(value))}"):
                config_cls(**required, **{f.name: value})
            checked.add(f.name)
    assert {"threads", "seed", "val_split", "eval_every", "norm_rms_eps"} <= checked
    if config_cls is FinetuneConfig:
        assert {"beta", "orpo_lambda", "label_smoothing"} <= checked


@pytest.mark.parametrize("change, message", [
    ({"lora_r": 100_000}, f"--lora-r must be at least 1 and at most {MAX_RANK}, got 100000"),
    ({"rank_exps": 100_000}, f"--rank-exps must be at least 0 and at most {MAX_RANK}, got 100000"),
    ({"threads": (os.cpu_count() or 1) + 1}, f"--threads must be at least 1 and at most {os.cpu_count() or 1}, got "),
    ({"beta": 1e30}, "--beta must be in (0, 100], got 1e+30"),
    ({"orpo_lambda": 1e30, "objective": "orpo"}, "--orpo-lambda must be at least 0 and at most 100, got 1e+30"),
    ({"seed": 2**32}, "--seed must be at least -1 and at most 4294967295, got 4294967296"),
    ({"seed": -2}, "--seed must be at least -1"),
    ({"val_split": 1.0}, "--val-split must be in [0, 1), got 1.0"),
    ({"rope_freq_base": 0.0}, "--rope-freq-base must be above 0, got 0.0; leave it out to use the model's value"),
])
def test_numbers_without_meaning_are_refused(change: dict, message: str, tmp_path: Path) -> None:
    """The issue's cases, from the API and from a config file alike (a flag passes the same config)."""
    with pytest.raises(BadFlag) as from_api:
        FinetuneConfig(**change)
    assert str(from_api.value).startswith(message)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({k.replace("_", "-"): v for k, v in change.items()}))
    with pytest.raises(BadFlag) as from_file:
        FinetuneConfig.from_file(path)
    assert str(from_file.value) == str(from_api.value)


@pytest.mark.parametrize("change, message", [
    ({"objective": "orpo", "beta": 0.5},
     "--beta applies to --objective dpo or ipo, not orpo (TRL's ORPOConfig.beta is --orpo-lambda here); drop it"),
    ({"objective": "dpo", "orpo_lambda": 0.5}, "--orpo-lambda applies to --objective orpo, not dpo; drop it"),
    ({"objective": "ipo", "orpo_lambda": 0.5}, "--orpo-lambda applies to --objective orpo, not ipo; drop it"),
    ({"beta": 0.5}, "--beta applies to --objective dpo or ipo, not sft; drop it"),
    ({"label_smoothing": 0.1}, "--label-smoothing applies to --objective dpo, not sft; drop it"),
    ({"ref_model": "r.gguf"}, "--ref-model applies to --objective dpo or ipo, not sft; drop it"),
    ({"objective": "dpo", "data_format": "chat"}, "--data-format does not apply to --objective dpo"),
])
def test_an_option_the_objective_does_not_use_is_refused(change: dict, message: str) -> None:
    with pytest.raises(BadFlag) as refused:
        FinetuneConfig(**change)
    assert str(refused.value).startswith(message)


def test_an_option_counts_as_given_when_it_differs_from_its_default() -> None:
    """One rule for a flag, a config file and a keyword: setting the default is setting nothing."""
    FinetuneConfig(objective="orpo", beta=0.1, orpo_lambda=0.5)  # beta's default: not given
    FinetuneConfig(objective="dpo", beta=0.5, label_smoothing=0.1, ref_model="r.gguf")
    c = FinetuneConfig(objective="ipo", beta=0.5)
    assert c.given("beta") and c.given("objective") and not c.given("orpo_lambda")

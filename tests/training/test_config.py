"""FinetuneConfig: old llama.cpp defaults, config files, validation that names the flag."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from ggtorch.data import DataOptions, RecordOptions
from ggtorch.errors import BadFlag
from ggtorch.lora import LoraConfig
from ggtorch.lora.config import OPTION_NAMES as LORA_OPTION_NAMES
from ggtorch.training.config import FinetuneConfig, RunConfig, TrainConfig, choices
from ggtorch.training.optim import OPTION_NAMES, AdamConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults_are_the_old_finetune_defaults() -> None:
    c = FinetuneConfig()
    # common/train.cpp get_default_train_params_common + finetune.cpp get_default_train_params
    assert (c.ctx, c.batch, c.grad_acc, c.adam_iter, c.save_every, c.epochs) == (128, 8, 1, 256, 10, -1)
    assert (c.adam_alpha, c.adam_min_alpha, c.adam_decay, c.adam_decay_min_ndim) == (1e-3, 0.0, 0.1, 2)
    assert (c.adam_beta1, c.adam_beta2, c.adam_gclip, c.adam_epsf) == (0.9, 0.999, 1.0, 0.0)
    assert (c.warmup, c.cos_decay_steps, c.cos_decay_restart, c.cos_decay_min) == (100, 1000, 1.1, 0.1)
    assert not c.enable_restart and c.use_checkpointing
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

"""FinetuneConfig: old llama.cpp defaults, config files, validation that names the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggtorch.errors import BadFlag
from ggtorch.training.config import FinetuneConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults_are_the_old_finetune_defaults() -> None:
    c = FinetuneConfig()
    # common/train.cpp get_default_train_params_common + finetune.cpp get_default_train_params
    assert (c.ctx, c.batch, c.grad_acc, c.adam_iter, c.save_every, c.epochs) == (128, 8, 1, 256, 10, -1)
    assert (c.adam_alpha, c.adam_min_alpha, c.adam_decay, c.adam_decay_min_ndim) == (1e-3, 0.0, 0.1, 2)
    assert (c.adam_beta1, c.adam_beta2, c.adam_gclip, c.adam_epsf) == (0.9, 0.999, 1.0, 0.0)
    assert (c.warmup, c.cos_decay_steps, c.cos_decay_restart, c.cos_decay_min) == (100, 1000, 1.1, 0.1)
    assert not c.enable_restart and c.use_checkpointing
    assert (c.checkpoint_in, c.checkpoint_out, c.lora_out) == (
        "checkpoint.gguf", "checkpoint-ITERATION.gguf", "ggml-lora-ITERATION-f32.gguf")
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

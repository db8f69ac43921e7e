"""Defaults that fit the model's size (issue 70): the compute dtype, activation checkpointing and the routed experts'
rank a run chooses, what a run that does not fit is told, and the mapped weights the estimate counts apart.

Where a choice depends on the memory available, the test sets what /proc/meminfo would say (``available_bytes``),
so that each side of the decision is reached on any machine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from ggtorch.api import GGUFModel
from ggtorch.errors import BadFlag
from ggtorch.io.gguf import read_gguf
from ggtorch.lora import LoraConfig
from ggtorch.lora.config import EXPERT_KINDS
from ggtorch.lora.layers import LoRAExperts
from ggtorch.models import names
from ggtorch.ops import policy
from ggtorch.training import run as run_module
from ggtorch.training.config import FinetuneConfig
from ggtorch.training.memory import GIB
from ggtorch.training.trainer import Trainer
from tests.families import Shape, write_random_model
from tests.helpers import run_cli

FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
WIDE_MOE = Shape(n_embd=64, n_ff=96, n_layer=2, head_dim=16, n_expert=32, n_expert_used=4, n_ff_exp=32)
"""A qwen3moe of 32 experts: more than the 8 that keep --lora-r by default."""


def config(model: Path, text: Path, out: Path, **more: object) -> FinetuneConfig:
    return FinetuneConfig(**{"model_base": str(model), "train_data": str(text), "ctx": 16, "batch": 2,
                             "adam_iter": 1, "threads": 1, "save_every": 0, "checkpoint_in": "", "checkpoint_out": "",
                             "lora_out": str(out / "lora.gguf"), "seed": 1, "overwrite": True, **more})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory: pytest.TempPathFactory, spm_vocab: Path) -> Path:
    return write_random_model(tmp_path_factory.mktemp("wide-moe") / "moe.gguf", "qwen3moe", spm_vocab, WIDE_MOE)


def fake_available(monkeypatch: pytest.MonkeyPatch, n_bytes: int) -> None:
    """What MemAvailable says for the rest of the test."""
    monkeypatch.setattr(run_module, "available_bytes", lambda device: n_bytes)


# --- the compute dtype ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("speedup", "dtype"), [(3.0, "bf16"), (1.6, "bf16"), (1.2, "f32"), (0.3, "f32")])
def test_a_cpu_trains_in_bf16_where_it_multiplies_bf16_faster(monkeypatch: pytest.MonkeyPatch, speedup: float,
                                                              dtype: str) -> None:
    monkeypatch.setattr(policy, "cpu_matmul_speed_vs_f32", lambda dt: speedup)
    chosen = policy.choose("cpu")
    assert (chosen.train_dtype, chosen.auto_dtype) == (dtype, "f32")  # a loaded model keeps llama.cpp's f32


def test_this_cpus_train_dtype_is_what_its_probe_measures() -> None:
    speedups = [policy.cpu_matmul_speed_vs_f32(torch.bfloat16) for _ in range(3)]
    if min(speedups) < policy.BF16_TRAIN_SPEEDUP <= max(speedups):
        pytest.skip(f"this CPU's bf16 speed-up {speedups} straddles the threshold")
    expected = "bf16" if min(speedups) >= policy.BF16_TRAIN_SPEEDUP else "f32"
    assert policy.choose("cpu").train_dtype == expected


@pytest.mark.parametrize("train_dtype", ["bf16", "f32"])
def test_dtype_auto_trains_in_the_policys_dtype_and_says_so(cpu_policy: Callable[..., policy.Policy],
                                                            stories260k: Path, texts: dict[str, Path], tmp_path: Path,
                                                            train_dtype: str) -> None:
    cpu_policy(train_dtype=train_dtype)
    trainer = Trainer(config(stories260k, texts["train"], tmp_path), log_records=False)
    assert (trainer.config.dtype, trainer.run.auto_dtype) == (train_dtype, True)
    trainer.close()
    given = Trainer(config(stories260k, texts["train"], tmp_path, dtype="f32"), log_records=False)
    assert (given.config.dtype, given.run.auto_dtype) == ("f32", False)
    given.close()
    result = run_cli(["finetune", "--model-base", stories260k, "--train-data", texts["train"], "-c", "16", "-b", "2",
                      "--only-write-lora", "--lora-out", tmp_path / "a.gguf", "--checkpoint-in", "", "-t", "1"],
                     cwd=tmp_path)
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    expected = ("compute bf16 (--dtype auto: this device multiplies bf16 natively" if train_dtype == "bf16"
                else "compute f32 (--dtype auto)")
    assert expected in first, first


def test_a_bf16_runs_model_generates_and_scores_as_it_trains(cpu_policy: Callable[..., policy.Policy],
                                                              stories260k: Path, texts: dict[str, Path],
                                                              tmp_path: Path) -> None:
    """Its float matrices are bf16 beside an f32 residual stream: the API computes it under the run's autocast (it
    raised a dtype mismatch outside it)."""
    cpu_policy(train_dtype="bf16")
    trainer = Trainer(config(stories260k, texts["train"], tmp_path), log_records=False)
    trainer.train()
    tuned = GGUFModel.from_trainer(trainer)
    assert tuned.autocast == torch.bfloat16
    assert tuned.generate("Once upon a time", n_tokens=8)
    assert math.isfinite(tuned.perplexity(texts["train"].read_text()[:2000], n_ctx=128).perplexity)
    assert trainer.model.training  # generate left it as it was
    trainer.close()


# --- activation checkpointing --------------------------------------------------------------------------------------


def test_checkpointing_is_skipped_where_the_estimate_has_room(stories260k: Path, texts: dict[str, Path],
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    roomy = Trainer(config(stories260k, texts["train"], tmp_path), log_records=False)
    assert roomy.run.auto_checkpointing and roomy.config.use_checkpointing is False
    without, need = roomy.run.memory, roomy.run.memory.resident - roomy.run.memory.runtime + roomy.run.memory.mapped
    roomy.close()
    # just too little room for every block's activations, enough for the checkpointed run's
    fake_available(monkeypatch, int(need / run_module.AUTO_CHECKPOINTING_SHARE) - 1)
    tight = Trainer(config(stories260k, texts["train"], tmp_path), log_records=False)
    assert tight.run.auto_checkpointing and tight.config.use_checkpointing is True
    assert tight.run.memory.activations < without.activations
    tight.close()
    for asked in (True, False):  # asked for: kept, whatever the memory
        kept = Trainer(config(stories260k, texts["train"], tmp_path, use_checkpointing=asked), log_records=False)
        assert (kept.config.use_checkpointing, kept.run.auto_checkpointing) == (asked, False)
        kept.close()


def test_checkpointing_never_changes_what_a_step_computes(stories260k: Path, texts: dict[str, Path],
                                                          tmp_path: Path) -> None:
    """Why each rank may choose it from its own memory: the losses and the adapter are the same either way."""
    results = []
    for asked in (True, False):
        out = tmp_path / str(asked)
        out.mkdir()
        trainer = Trainer(config(stories260k, texts["train"], out, use_checkpointing=asked, adam_iter=3,
                                 dtype="f32"), log_records=False)
        losses = [r.loss for r in trainer.train()]
        results.append((losses, {k: v.clone() for k, v in trainer.weights.checkpoint_tensors().items()}))
        trainer.close()
    (losses_on, adapter_on), (losses_off, adapter_off) = results
    assert losses_on == losses_off
    assert adapter_on.keys() == adapter_off.keys()
    assert all(torch.equal(adapter_on[k], adapter_off[k]) for k in adapter_on)


# --- the routed experts' rank and the adapter's size ---------------------------------------------------------------


@pytest.mark.parametrize(("rank", "n_expert", "expected"), [(16, 128, 1), (16, 64, 2), (16, 32, 4), (4, 256, 1),
                                                            (16, 8, 16), (4, 0, 4)])
def test_the_routed_experts_default_rank_keeps_their_adapters_near_eight_experts(rank: int, n_expert: int,
                                                                                 expected: int) -> None:
    resolved = LoraConfig(rank=rank).for_model(n_expert)
    assert {resolved.rank_of(k) for k in EXPERT_KINDS} == {expected}
    assert resolved.rank_of("attn_q") == rank
    given = LoraConfig(rank=rank, ranks={k: 3 for k in EXPERT_KINDS}).for_model(n_expert)
    assert {given.rank_of(k) for k in EXPERT_KINDS} == {3}  # --rank-exps given: kept


def test_a_moe_run_trains_its_experts_at_the_default_rank(wide_moe: Path, texts: dict[str, Path],
                                                          tmp_path: Path) -> None:
    trainer = Trainer(config(wide_moe, texts["train"], tmp_path), log_records=False)
    experts = [m for m in trainer.model.modules() if isinstance(m, LoRAExperts)]
    assert experts and {m.lora_a.shape[-2] for m in experts} == {max(1, 4 * 8 // 32)}
    assert trainer.weights.checkpoint_metadata()["training.lora.rank.ffn_gate_exps"] == 1
    # the estimate counts the same parameters, written out from the file's shapes
    base = read_gguf(wide_moe)
    counted = sum(info.shape[0] * (info.shape[1] + info.shape[2]) for name, info in base.tensors.items()
                  if (parsed := names.parse_gguf_name(name)) and parsed[0] in EXPERT_KINDS)
    assert dict(trainer.run.memory.trained_params)["the routed experts' adapters"] == counted
    assert sum(p.numel() for m in experts for p in (m.lora_a, m.lora_b)) == counted
    trainer.close()


def test_an_adapter_too_large_to_fit_is_named_with_the_flags_that_shrink_it(
        wide_moe: Path, texts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = config(wide_moe, texts["train"], tmp_path, rank_exps=512, use_checkpointing=True)
    fits = Trainer(big, log_records=False)
    memory = fits.run.memory
    fits.close()
    assert memory.trained > memory.activations + memory.loss
    fake_available(monkeypatch, memory.resident - memory.runtime - (1 << 20))
    with pytest.raises(BadFlag) as e:
        Trainer(big, log_records=False)
    message = str(e.value)
    experts = dict(memory.trained_params)["the routed experts' adapters"]
    assert f"the routed experts' adapters hold {experts / 1e6:,.1f}M parameters" in message
    assert "a smaller --rank-exps (0 adapts attention and any shared expert only) or --lora-r (now 4)" in message
    assert "--batch" not in message


def test_activations_that_do_not_fit_still_name_the_batch(stories260k: Path, texts: dict[str, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    fake_available(monkeypatch, 1 << 20)
    with pytest.raises(BadFlag, match="lower it with a smaller --batch or --ctx"):
        Trainer(config(stories260k, texts["train"], tmp_path, batch=64, ctx=256, use_checkpointing=True),
                log_records=False)


# --- mapped weights ------------------------------------------------------------------------------------------------


def test_quantized_weights_are_counted_as_mapped_apart_from_what_stays_resident(
        stories_q8: Path, stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    base = read_gguf(stories_q8)
    blocks = sum(info.nbytes for info in base.tensors.values() if info.ggml_type not in FLOAT_TYPES)
    assert blocks > 0
    quantized = Trainer(config(stories_q8, texts["train"], tmp_path), log_records=False)
    assert quantized.run.memory.mapped == blocks
    assert quantized.run.memory.total == quantized.run.memory.resident + blocks
    assert "mapped from the file" in quantized.run.memory.describe()
    quantized.close()
    decoded = Trainer(config(stories_q8, texts["train"], tmp_path, base_dtype="f32"), log_records=False)
    assert decoded.run.memory.mapped == 0  # decoded copies stay resident
    decoded.close()
    floats = Trainer(config(stories260k, texts["train"], tmp_path), log_records=False)
    assert floats.run.memory.mapped == 0
    floats.close()


def test_a_run_whose_mapped_weights_do_not_all_fit_says_it_will_page(stories_q8: Path, texts: dict[str, Path],
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    probe = Trainer(config(stories_q8, texts["train"], tmp_path, use_checkpointing=True), log_records=False)
    memory = probe.run.memory
    probe.close()
    need = memory.resident - memory.runtime
    fake_available(monkeypatch, need + memory.mapped // 2)  # room for the run, not for all of the file's blocks
    paging = Trainer(config(stories_q8, texts["train"], tmp_path, use_checkpointing=True), log_records=False)
    said = [w for w in paging.warnings if "will page them" in w]
    assert len(said) == 1 and f"{memory.mapped / GIB:.2f} GiB of quantized weights" in said[0]
    paging.train()  # and it runs
    paging.close()
    fake_available(monkeypatch, need - 1)
    with pytest.raises(BadFlag, match="this run needs about"):
        Trainer(config(stories_q8, texts["train"], tmp_path, use_checkpointing=True), log_records=False)

"""What only a CUDA GPU can show: fused decoders equal the CPU's bit for bit, the same logits, a run that picks the
GPU, bf16 and TF32 by itself, f16 with its loss scaler, out of memory named. Skipped without a GPU; bench/gpu_check.py
runs them (``pytest -m cuda``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGML_QUANT_SIZES

from ggtorch.models.loader import load_model_file
from ggtorch.ops import policy
from ggtorch.quant import DEQUANTIZERS, dequantize
from ggtorch.training.config import FinetuneConfig
from ggtorch.training.trainer import Trainer, _failed_allocation
from tests.quant.test_dequant import random_blocks

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.py)")]

BLOCK_TYPES = sorted((t for t in DEQUANTIZERS if GGML_QUANT_SIZES[t][0] > 1), key=lambda t: t.name)


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_fused_decoding_on_the_gpu_equals_the_cpu_bit_for_bit(ggml_type) -> None:
    raw = torch.from_numpy(random_blocks(ggml_type, (64, 1024), seed=int(ggml_type))).reshape(-1)
    assert policy.current("cuda").compiled_dequantize
    for dtype in (torch.float32, torch.bfloat16):
        cpu = dequantize(raw, ggml_type, (64, 1024), dtype)
        gpu = dequantize(raw.cuda(), ggml_type, (64, 1024), dtype).cpu()
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(gpu.view(bits), cpu.view(bits)), (ggml_type.name, dtype)


def test_f32_logits_on_the_gpu_equal_the_cpus(stories260k: Path) -> None:
    tokens = torch.randint(1, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    cpu = load_model_file(stories260k).model(tokens)
    gpu = load_model_file(stories260k, device="cuda").model(tokens.cuda()).cpu()
    assert float((gpu - cpu).abs().max() / cpu.abs().max()) < 1e-5


def _config(stories260k: Path, texts: dict[str, Path], tmp_path: Path, **changes: object) -> FinetuneConfig:
    return FinetuneConfig(**{**dict(model_base=str(stories260k), train_data=str(texts["train"]), ctx=64, batch=8,
                                    adam_iter=3, seed=2, checkpoint_in="", checkpoint_out="", lora_out="",
                                    log_file=str(tmp_path / "log.jsonl")), **changes})


def test_a_run_with_the_defaults_trains_on_the_gpu_in_bf16_with_tf32(stories260k: Path, texts: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    seen: list[str] = []

    class Precision:
        def on_step(self, trainer: Trainer, result: object) -> None:
            seen.append(torch.get_float32_matmul_precision())

    before = torch.get_float32_matmul_precision()
    trainer = Trainer(_config(stories260k, texts, tmp_path), [Precision()])
    results = trainer.train()
    trainer.close()
    ampere = torch.cuda.get_device_capability() >= (8, 0)
    assert trainer.device.type == "cuda" and trainer.config.dtype == ("bf16" if ampere else "f32")
    assert seen == ["high" if ampere else before] * 3 and torch.get_float32_matmul_precision() == before
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in results)


def test_f16_on_the_gpu_trains_under_its_loss_scaler(stories260k: Path, texts: dict[str, Path],
                                                     tmp_path: Path) -> None:
    trainer = Trainer(_config(stories260k, texts, tmp_path, dtype="f16", adam_iter=4))
    results = trainer.train()
    trainer.close()
    assert trainer.run.scaler is not None and [r.iteration for r in results] == [1, 2, 3, 4]
    skips = [r for r in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines()) if r["kind"] == "skip"]
    assert len(skips) == trainer.skipped_steps


def test_cudas_out_of_memory_message_is_read() -> None:
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(torch.OutOfMemoryError) as e:
        torch.empty(free * 4, dtype=torch.uint8, device="cuda")
    assert _failed_allocation(str(e.value)) is not None, str(e.value)

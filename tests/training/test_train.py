"""``ggtorch train``: from-scratch and full-finetune runs, checked against llama.cpp and g++'s libstdc++."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from ggtorch.io.gguf import read_gguf
from ggtorch.models import names
from ggtorch.models.config import ModelConfig
from ggtorch.models.init import init_tensors
from ggtorch.training.config import TrainConfig
from ggtorch.training.trainer import Trainer
from tests.helpers import losses
from tests.llama_models import llama_cpp_logits, open_llama_cpp, quantize_with_llama_cpp
from tests.training.test_finetune import run, run_whole_and_resumed

TINY = ["--embd", "64", "--ff", "128", "--head", "4", "--head-kv", "2", "--layer", "2", "-c", "32", "-b", "4",
        "--warmup", "2", "--adam-alpha", "0.01", "--seed", "3", "--no-checkpointing", "-t", "1"]
TOKENS = [1, 403, 407, 261, 378, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500, 17]
F32_TOLERANCE = 1e-4  # same f32 graph on both sides, only summation order differs (tests/models/test_llama.py)


def ours(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0].float().numpy()


def test_new_model_init_is_train_text_from_scratch(spm_vocab: Path, tmp_path: Path) -> None:
    """randomize_model's stream: one mt19937 + normal_distribution<float>, clamped to [-1, 1], in its tensor order."""
    if shutil.which("g++") is None:
        pytest.skip("g++ (libstdc++) is needed for the reference stream")
    config = ModelConfig(n_vocab=40, n_embd=8, n_layer=2, n_head=2, n_head_kv=1, n_ff=12, n_ctx_train=16)
    tensors = init_tensors(config, seed=77)
    order = ["token_embd", "output_norm", "output"]
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_down",
                 "ffn_up"]
    expected_names = [names.gguf_name(k) for k in order]
    expected_names += [names.gguf_name(k, b) for b in range(2) for k in per_layer]
    assert list(tensors) == expected_names
    total = sum(t.numel() for t in tensors.values())
    (tmp_path / "r.cpp").write_text(
        "#include <random>\n#include <cstdio>\n#include <algorithm>\n"
        "int main(){std::mt19937 g(77);std::normal_distribution<float> d(0.0f,1.0f);"
        f"for(int i=0;i<{total};++i){{float v=std::min(std::max(d(g),-1.0f),1.0f);std::printf(\"%a\\n\",v);}}}}\n")
    subprocess.run(["g++", "-O0", "-o", str(tmp_path / "r"), str(tmp_path / "r.cpp")], check=True)
    out = subprocess.run([str(tmp_path / "r")], check=True, capture_output=True, text=True).stdout.split()
    reference = np.array([float.fromhex(v) for v in out], dtype=np.float32)
    mine = torch.cat([t.reshape(-1) for t in tensors.values()]).numpy()
    np.testing.assert_array_equal(mine, reference)
    assert tensors[names.gguf_name("attn_k", 0)].shape == (4, 8)  # GQA: n_embd_kv rows


def test_scaled_init_is_gpt2s() -> None:
    """--init scaled: normal(0, 0.02) matrices, residual projections / sqrt(2 n_layer), norms 1."""
    config = ModelConfig(n_vocab=512, n_embd=256, n_layer=8, n_head=4, n_head_kv=4, n_ff=512, n_ctx_train=16)
    tensors = init_tensors(config, seed=3, init="scaled")
    assert set(tensors) == set(init_tensors(config, seed=3))  # the same tensors as the ggml init
    for name, t in tensors.items():
        kind = names.parse_gguf_name(name)[0]
        if t.dim() == 1:
            assert torch.equal(t, torch.ones_like(t)), name
            continue
        std = 0.02 / 4.0 if kind in ("attn_output", "ffn_down") else 0.02  # sqrt(2 * 8) = 4
        assert float(t.mean()) == pytest.approx(0.0, abs=4 * std / t.numel() ** 0.5), name
        assert float(t.std()) == pytest.approx(std, rel=0.02), name
    other_seed = init_tensors(config, seed=4, init="scaled")
    assert not torch.equal(tensors["blk.0.attn_q.weight"], other_seed["blk.0.attn_q.weight"])


def test_from_scratch_loss_falls_and_llama_cpp_runs_it(stories260k: Path, texts: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """A new model over stories260K's vocabulary learns tinyshakespeare; llama.cpp's logits equal ours."""
    config = TrainConfig(vocab_model=str(stories260k), train_data=str(texts["train"]), embd=64, ff=128, head=4,
                         head_kv=2, layer=2, ctx=32, batch=4, adam_iter=25, warmup=2, adam_alpha=0.01, seed=5,
                         save_every=0, checkpoint_in="", checkpoint_out="", threads=1,
                         model_out=str(tmp_path / "new-ITERATION.gguf"), use_checkpointing=False)
    trainer = Trainer(config)
    results = trainer.train()
    trainer.close()
    loss = [r.loss for r in results]
    assert np.mean(loss[-5:]) < np.mean(loss[:5]) - 1.0, loss
    written = read_gguf(tmp_path / "new-25.gguf")
    vocab = read_gguf(stories260k)
    assert written.get("tokenizer.ggml.tokens") == vocab.get("tokenizer.ggml.tokens")
    assert written.get("llama.attention.head_count_kv") == 2
    assert all(t.ggml_type == GGMLQuantizationType.F32 for t in written.tensors.values())
    ref = llama_cpp_logits(open_llama_cpp(tmp_path / "new-25.gguf", n_ctx=32), TOKENS)
    np.testing.assert_allclose(ours(trainer.model, TOKENS), ref, atol=F32_TOLERANCE * max(1.0, np.abs(ref).max()))


@pytest.mark.parametrize("mode", ["scratch", "full"])
def test_resume_is_exact(mode: str, stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    """6 iterations in one run == 3, stop, resume for 3: identical model bytes and loss sequence."""
    source = ["--vocab-model", str(stories260k), *TINY] if mode == "scratch" else \
        ["--model-base", str(stories260k), "-c", "32", "-b", "4", "--warmup", "2", "--seed", "3", "-t", "1"]
    common = ["train", *source, "--train-data", str(texts["train"]), "--save-every", "0"]
    one, two = run_whole_and_resumed(common, tmp_path)
    assert (one / "ggml-model-6-f32.gguf").read_bytes() == (two / "ggml-model-6-f32.gguf").read_bytes()
    assert losses(one / "checkpoint-log.jsonl") == losses(two / "checkpoint-log.jsonl")


def test_full_finetune_lowers_heldout_loss_and_llama_cpp_runs_it(stories260k: Path, texts: dict[str, Path],
                                                                tmp_path: Path) -> None:
    """All weights of stories260K trained on Shakespeare: held-out loss falls; llama.cpp runs the written model."""
    config = TrainConfig(model_base=str(stories260k), train_data=str(texts["train"]), val_data=str(texts["heldout"]),
                         ctx=64, batch=4, adam_iter=30, warmup=2, adam_alpha=0.003, seed=1, save_every=0,
                         checkpoint_in="", checkpoint_out="", model_out=str(tmp_path / "ft.gguf"), threads=1)
    trainer = Trainer(config)
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    trainer.close()
    assert after < before - 0.2, (before, after)
    base, written = read_gguf(stories260k), read_gguf(tmp_path / "ft.gguf")
    assert list(written.tensors) == list(base.tensors)  # tied output stays tied
    assert {k: v for k, v in written.metadata.items() if not k.startswith("tokenizer.")} == \
        {k: v for k, v in base.metadata.items() if not k.startswith("tokenizer.")}
    ref = llama_cpp_logits(open_llama_cpp(tmp_path / "ft.gguf", n_ctx=64), TOKENS)
    np.testing.assert_allclose(ours(trainer.model, TOKENS), ref, atol=F32_TOLERANCE * max(1.0, np.abs(ref).max()))


@pytest.mark.parametrize(("outtype", "ggml_type", "ftype"), [
    ("f16", GGMLQuantizationType.F16, "F16"), ("bf16", GGMLQuantizationType.BF16, "BF16"),
    ("q8_0", GGMLQuantizationType.Q8_0, "Q8_0")])
def test_outtype_equals_llama_cpp_quantizing_the_f32_model(outtype: str, ggml_type: GGMLQuantizationType,
                                                           ftype: str, stories260k: Path, texts: dict[str, Path],
                                                           tmp_path: Path) -> None:
    """--outtype: matrices in that type (norms F32), byte-equal to llama.cpp's own conversion of the f32 model."""
    common = ["train", "--vocab-model", str(stories260k), *TINY, "--train-data", str(texts["train"]), "-n", "3",
              "--checkpoint-in", "", "--checkpoint-out", ""]
    code, out = run([*common, "--model-out", "m.gguf", "--outtype", outtype], tmp_path)
    assert code == 0, out
    code, out = run([*common, "--model-out", "f32.gguf"], tmp_path)
    assert code == 0, out
    reference = read_gguf(quantize_with_llama_cpp(tmp_path / "f32.gguf", tmp_path / "ref.gguf", ftype))
    written = read_gguf(tmp_path / "m.gguf")
    assert written.get("general.file_type") == reference.get("general.file_type")
    for name, t in written.tensors.items():
        assert t.ggml_type == (GGMLQuantizationType.F32 if len(t.shape) == 1 else ggml_type), name
        assert t.ggml_type == reference.tensors[name].ggml_type, name
        assert t.data.tobytes() == reference.tensors[name].data.tobytes(), name
    logits = llama_cpp_logits(open_llama_cpp(tmp_path / "m.gguf", n_ctx=32), TOKENS)
    assert np.isfinite(logits).all()


def test_quantized_base_is_refused_with_a_pointer_to_lora(stories260k: Path, texts: dict[str, Path],
                                                         tmp_path: Path) -> None:
    q8 = quantize_with_llama_cpp(stories260k, tmp_path / "q8.gguf", "Q8_0")
    code, out = run(["train", "--model-base", str(q8), "--train-data", str(texts["train"])], tmp_path)
    assert code != 0
    assert "Q8_0" in out and "ggtorch finetune" in out


def test_bad_source_flags_and_help(stories260k: Path, tmp_path: Path) -> None:
    code, out = run(["train", "--train-data", "x.txt"], tmp_path)
    assert code != 0 and "--vocab-model" in out and "--model-base" in out
    code, out = run(["train", "--help"], tmp_path)
    assert code == 0
    for heading in ("New model shape", "Outputs and checkpoints", "Optimizer (ggml AdamW)"):
        assert heading in out
    for flag in ("--vocab-model", "--embd", "--head-kv", "--model-out", "--outtype", "--checkpoint-in",
                 "--save-every", "--adam-alpha", "--sample-start"):
        assert flag in out
    assert "--lora-r" not in out


def test_log_records_full_training(stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    """The JSON-lines log counts every weight as trainable and checkpoints say they are full."""
    code, out = run(["train", "--vocab-model", str(stories260k), *TINY, "--train-data", str(texts["train"]),
                     "-n", "2", "--checkpoint-in", ""], tmp_path)
    assert code == 0, out
    start = json.loads((tmp_path / "checkpoint-log.jsonl").read_text().splitlines()[0])
    config = ModelConfig(n_vocab=512, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128)
    n = 2 * 512 * 64 + 64 + 2 * (2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128)
    assert start["trainable_parameters"] == n, config
    assert read_gguf(tmp_path / "checkpoint-LATEST.gguf").get("training.mode") == "full"


def test_a_lora_checkpoint_does_not_resume_full_training(stories260k: Path, texts: dict[str, Path],
                                                          tmp_path: Path) -> None:
    """Each command resumes only its own kind of checkpoint, and says which command the other needs."""
    code, out = run(["finetune", "--model-base", str(stories260k), "--train-data", str(texts["train"]), "-c", "32",
                     "-b", "2", "-n", "1", "--checkpoint-in", "", "--lora-out", "", "-t", "1"], tmp_path)
    assert code == 0, out
    code, out = run(["train", "--model-base", str(stories260k), "--train-data", str(texts["train"]), "-c", "32",
                     "-b", "2", "-n", "1", "--checkpoint-in", "checkpoint-LATEST.gguf", "-t", "1"], tmp_path)
    assert code != 0 and "ggtorch finetune" in out, out

"""bench/bench_scale.py's full-size files are what llama-quantize would write: each tensor typed as llama.cpp's own
Q4_K_M quantizer types it, every block decoding to finite values of a trained model's scale, and the file one
ggtorch trains. The timed runs are the benchmark's own (minutes at 8B); here a small shape stands for them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from ggtorch.io.gguf import read_gguf
from tests.families import Shape, vocabulary_file, write_random_model
from tests.llama_models import quantize_with_llama_cpp
from tests.test_bench_report import _bench_module


@pytest.fixture(scope="module")
def scale() -> Any:
    _bench_module("bench_vs_peft")  # the module it imports its helpers from, by that name
    return _bench_module("bench_scale")


def test_each_tensor_is_typed_as_llama_cpps_q4_k_m_types_it(scale: Any, tmp_path: Path) -> None:
    """Eight layers (llama.cpp gives more bits to attn_v and ffn_down in the first and last eighth and every third
    between), rows of 256 values so that no tensor falls back to another type."""
    shape = Shape(n_embd=256, n_ff=512, n_layer=8, n_head=4, n_head_kv=2, head_dim=64)
    f32 = write_random_model(tmp_path / "f32.gguf", "llama", vocabulary_file("stories"), shape)
    theirs = read_gguf(quantize_with_llama_cpp(f32, tmp_path / "q4_k_m.gguf", "Q4_K_M"))
    ours = {name: scale.q4_k_m_type(name, info.shape, shape.n_layer) for name, info in theirs.tensors.items()}
    assert ours == {name: info.ggml_type for name, info in theirs.tensors.items()}
    assert GGMLQuantizationType.Q6_K in ours.values() and GGMLQuantizationType.Q4_K in ours.values()


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen35"])
def test_a_qwen35_hybrid_is_typed_as_llama_cpps_q4_k_m_types_it(scale: Any, tmp_path: Path, arch: str) -> None:
    """The 35B-A3B and 2B rows' families at rows of 256: DeltaNet layers (attn_qkv counted with the attention layers'
    attn_v, the convolution F32), routed and shared experts and F32 routers (qwen35moe), a tied embedding typed as
    the output (qwen35)."""
    shape = Shape(n_embd=256, n_ff=256, n_layer=8, n_head=4, n_head_kv=2, head_dim=64, n_rot=32, n_expert=4,
                  n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, delta_net=(2, 4, 128, 4), full_attention_interval=4,
                  rope_sections=(6, 6, 4, 0), tied_output=arch == "qwen35")
    f32 = write_random_model(tmp_path / "f32.gguf", arch, vocabulary_file("stories"), shape)
    theirs = read_gguf(quantize_with_llama_cpp(f32, tmp_path / "q4_k_m.gguf", "Q4_K_M"))
    ours = scale.q4_k_m_types({name: info.shape for name, info in theirs.tensors.items()}, shape.n_layer)
    assert ours == {name: info.ggml_type for name, info in theirs.tensors.items()}
    assert ours["blk.0.attn_qkv.weight"] == ours["blk.3.attn_v.weight"] == GGMLQuantizationType.Q6_K
    assert ours["blk.1.attn_qkv.weight"] == GGMLQuantizationType.Q4_K


@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
                                       GGMLQuantizationType.Q6_K])
def test_random_blocks_decode_to_finite_values_of_a_trained_models_scale(scale: Any, ggml_type: Any) -> None:
    width = 4096
    blocks = scale.random_blocks(np.random.default_rng(0), ggml_type, (64, width))
    values = gguf.quants.dequantize(blocks.reshape(-1), ggml_type)  # gguf-py's numpy decoder, not ggtorch's
    assert values.size == 64 * width and np.isfinite(values).all()
    assert 0.3 < values.std() * math.sqrt(width) < 3  # about 1/sqrt(row width), as a trained matrix's rows


def test_the_file_is_written_whole_and_ggtorch_trains_it(scale: Any, tmp_path: Path) -> None:
    path = scale.write_model("smoke", tmp_path)
    f = read_gguf(path)
    n_vocab = len(read_gguf(vocabulary_file("llama-bpe")).metadata["tokenizer.ggml.tokens"])
    assert f.tensors["token_embd.weight"].shape == (n_vocab, 256) and f.get("llama.block_count") == 2
    assert {info.ggml_type for info in f.tensors.values()} == {GGMLQuantizationType.F32, GGMLQuantizationType.Q4_K,
                                                               GGMLQuantizationType.Q6_K}
    shapes, per_token = scale.matrix_shapes(path)
    assert per_token == sum(o * i * k for o, i, k in shapes) == 2 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 256 * 512) \
        + n_vocab * 256
    result = scale.child_ggtorch({"model": str(path), "text": str(Path(__file__).parent / "fixtures" /
                                                                   "tinyshakespeare.txt"),
                                  "ctx": 32, "batch": 1, "steps": 1, "threads": 1, "workdir": str(tmp_path),
                                  "manage_process": False})  # in this worker: its malloc and threads stay
    assert all(math.isfinite(loss) for loss in result["loss"]) and len(result["step_s"]) == 2
    shares = result["shares"]
    assert result["estimate_mapped_gib"] > 0 and list(shares) == ["decode", "products", "attention", "rest"]
    assert math.isclose(sum(shares.values()), 1.0) and all(0 < v < 1 for v in shares.values())

"""Every family's forward against llama.cpp and against an independent float64 forward.

The models are tests/families.py's presets: random weights around a real vocabulary, written by
gguf-py, quantized by llama.cpp. 48 tokens cross every preset's sliding window. llama.cpp runs with an
F32 KV cache and without flash attention (which would round K and V to f16); its context of 64 is
padded to 256, which is the context that picks phi3's long or short rope factors, so ggtorch's model
is told the same context.

gemma's GELU: ggml's CPU backend reads GELU from a table indexed by the input rounded to fp16
(GGML_GELU_FP16), its GPU backends and transformers compute the formula. ggtorch computes the formula
(the gradient of a table is zero almost everywhere), so gemma's logits are compared with the float64
forward to 1e-4 and with llama.cpp's CPU to the table's rounding, which a second test shows is the
whole difference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from ggtorch.errors import BadGGUF, Unsupported
from ggtorch.io.gguf import read_gguf
from ggtorch.models.config import ModelConfig
from ggtorch.models.loader import build_model
from ggtorch.models.model import Transformer
from tests import reference_forward
from tests.families import FAMILY_PRESETS, eval_tokens
from tests.llama_models import llama_cpp_logits, open_llama_cpp, rewrite_gguf
from tests.models.test_model import TOLERANCE, assert_top1_agrees

LLAMA_CPP_CONTEXT = 256
"""llama.cpp's per-sequence context for n_ctx=64 (it pads contexts to 256)."""
PRESETS = list(FAMILY_PRESETS)
GEMMA = [name for name, (arch, _, _) in FAMILY_PRESETS.items() if arch.startswith("gemma")]
ONE_PER_FAMILY = ["llama3_rope_freqs", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mistral3", "smollm3", "granite",
                  "qwen35", "gemma4"]
MOE = ["qwen3moe", "qwen2moe", "llama_moe", "gpt_oss", "qwen35moe", "gemma4moe"]
GELU_TABLE_TOLERANCE = 0.02
"""ggml-cpu's fp16 GELU table against the formula, through a few layers (measured up to ~5e-3 in gemma2/3, 0.011 in
gemma4, whose per-layer embeddings add a GELU to every layer)."""


def load(path: Path, keep_quantized: bool = True) -> Transformer:
    f = read_gguf(path)
    model = build_model(f, ModelConfig.from_gguf(f), keep_quantized=keep_quantized)
    model.n_ctx = LLAMA_CPP_CONTEXT
    return model


def ggtorch_logits(path: Path, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return load(path)(torch.tensor([tokens]))[0].numpy()


def tokens_for(path: Path) -> list[int]:
    return eval_tokens(ModelConfig.from_gguf(read_gguf(path)).n_vocab)


@functools.cache
def float64_model(path: Path) -> reference_forward.Model:
    """The float64 forward's weights, read once per file (gguf-py's reader is slow on large vocabularies)."""
    return reference_forward.load(path)


@pytest.fixture(scope="module")
def llama_cpp_f32(family_model: Callable[..., Path]) -> Callable[[str], np.ndarray]:
    cache: dict[str, np.ndarray] = {}

    def logits(name: str) -> np.ndarray:
        if name not in cache:
            path = family_model(name)
            cache[name] = llama_cpp_logits(open_llama_cpp(path, 64), tokens_for(path))
        return cache[name]

    return logits


@pytest.mark.parametrize("name", PRESETS)
def test_f32_logits_equal_llama_cpp(family_model: Callable[..., Path], llama_cpp_f32: Callable[[str], np.ndarray],
                                    name: str) -> None:
    path = family_model(name)
    ours, ref = ggtorch_logits(path, tokens_for(path)), llama_cpp_f32(name)
    tol = GELU_TABLE_TOLERANCE if name in GEMMA else TOLERANCE["F32"]
    assert np.abs(ours - ref).max() <= tol, f"{name}: max |diff| {np.abs(ours - ref).max():.3g} > {tol}"
    assert_top1_agrees(ours, ref, tol, min_fraction=1.0 if name not in GEMMA else 0.95)


# not qwen2_tied: qwen2 and qwen3 check its block and a tied head; a float64 head over its 151k rows only takes time
@pytest.mark.parametrize("name", [name for name in PRESETS if name != "qwen2_tied"])
def test_f32_logits_equal_float64_forward(family_model: Callable[..., Path], name: str) -> None:
    path = family_model(name)
    tokens = tokens_for(path)
    ref = reference_forward.forward(float64_model(path), tokens, n_ctx_seq=LLAMA_CPP_CONTEXT,
                                    gelu_mode="tanh")
    np.testing.assert_allclose(ggtorch_logits(path, tokens), ref, rtol=0, atol=TOLERANCE["F32"])


@pytest.mark.parametrize("name", GEMMA)
def test_gemma_difference_from_llama_cpp_is_its_gelu_table(family_model: Callable[..., Path],
                                                           llama_cpp_f32: Callable[[str], np.ndarray],
                                                           name: str) -> None:
    """The float64 forward with ggml-cpu's fp16 GELU table lands far closer to llama.cpp than with the
    formula: what separates ggtorch from llama.cpp's CPU on gemma is that table, nothing else."""
    path = family_model(name)
    model = float64_model(path)
    ref = llama_cpp_f32(name)
    tokens = tokens_for(path)
    table = np.abs(reference_forward.forward(model, tokens, gelu_mode="ggml") - ref).max()
    formula = np.abs(reference_forward.forward(model, tokens, gelu_mode="tanh") - ref).max()
    assert table < formula / 2, f"{name}: table {table:.3g}, formula {formula:.3g}"


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M", "Q5_0"])
@pytest.mark.parametrize("name", ONE_PER_FAMILY + MOE)
def test_quantized_logits_equal_llama_cpp(family_model: Callable[..., Path], name: str, ftype: str) -> None:
    if ftype == "Q4_K_M":
        name += "-wide"  # rows K-quants can take
    path = family_model(name, ftype)
    tokens = tokens_for(path)
    ref = llama_cpp_logits(open_llama_cpp(path, 64), tokens)
    ours = ggtorch_logits(path, tokens)
    tol = TOLERANCE["Q8_0"]
    assert np.abs(ours - ref).max() <= tol, f"{name} {ftype}: max |diff| {np.abs(ours - ref).max():.3g} > {tol}"
    assert_top1_agrees(ours, ref, tol)
    matrices = {t.ggml_type.name for t in read_gguf(path).tensors.values() if len(t.shape) == 2}
    experts = {t.ggml_type.name for t in read_gguf(path).tensors.values() if len(t.shape) == 3}
    wanted = {"Q4_K_M": "Q4_K", "Q8_0": "Q8_0", "Q5_0": "Q5_0"}[ftype]
    assert wanted in matrices, matrices
    assert name.split("-")[0] not in MOE or wanted in experts, experts


def test_gpt_oss_as_released_mxfp4_experts_equal_llama_cpp(family_model: Callable[..., Path]) -> None:
    """gpt-oss's files carry MXFP4 experts (llama.cpp's MXFP4_MOE: the other matrices Q8_0); ggtorch keeps the
    experts in their blocks and computes llama.cpp's logits."""
    from ggtorch.quant.modules import QuantExperts

    path = family_model("gpt_oss", "MXFP4_MOE")
    tokens = tokens_for(path)
    model = load(path)
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert experts and {m.ggml_type.name for m in experts} == {"MXFP4"}
    with torch.no_grad():
        ours = model(torch.tensor([tokens]))[0].numpy()
    ref = llama_cpp_logits(open_llama_cpp(path, 64), tokens)
    tol = TOLERANCE["Q8_0"]
    assert np.abs(ours - ref).max() <= tol, f"max |diff| {np.abs(ours - ref).max():.3g} > {tol}"
    assert_top1_agrees(ours, ref, tol)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3", "qwen3", "qwen2moe", "gpt_oss", "qwen35", "gemma4",
                                  "gemma4moe"])
def test_kv_cache_equals_full_forward(family_model: Callable[..., Path], name: str) -> None:
    """Generation through the cache (sliding windows, per-layer rope, q/k norms, a DeltaNet layer's carried
    convolution window and state, gemma4's layers reading an earlier layer's cached K/V) computes the full forward."""
    model = load(family_model(name))
    tokens = torch.tensor([tokens_for(family_model(name))[:40]])
    with torch.no_grad():
        full = model(tokens)[0]
        cache = model.new_cache(1, 40)
        steps = [model(tokens[:, :7], cache=cache)[0], model(tokens[:, 7:12], cache=cache)[0]]
        steps += [model(tokens[:, i:i + 1], cache=cache)[0] for i in range(12, 40)]
    torch.testing.assert_close(torch.cat(steps), full, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["gemma2", "gemma3_pattern", "gpt_oss", "qwen35", "gemma4"])
def test_packed_rows_equal_separate_forwards(family_model: Callable[..., Path], name: str) -> None:
    """Two records packed in one row, positions restarting: each computes as if alone (sliding windows too; a
    DeltaNet layer's convolution and state start afresh at the second record)."""
    model = load(family_model(name))
    tokens = tokens_for(family_model(name))
    a, b = tokens[:30], tokens[30:48]
    row = torch.tensor([a + b])
    positions = torch.tensor([list(range(30)) + list(range(18))])
    segments = torch.tensor([[0] * 30 + [1] * 18])
    with torch.no_grad():
        packed = model(row, positions=positions, segments=segments)[0]
        alone = torch.cat([model(torch.tensor([a]))[0], model(torch.tensor([b]))[0]])
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-4)


def test_sliding_window_changes_what_a_layer_sees(family_model: Callable[..., Path], tmp_path: Path) -> None:
    """The window matters: the same file with a window wider than the sequence computes other logits
    after the window's end, and the same ones before it."""
    path = family_model("gemma2")
    wide = rewrite_gguf(path, tmp_path / "wide.gguf", set_keys={"gemma2.attention.sliding_window": 4096})
    tokens = tokens_for(path)
    narrow_logits, wide_logits = ggtorch_logits(path, tokens), ggtorch_logits(wide, tokens)
    window = ModelConfig.from_gguf(read_gguf(path)).sliding_window
    np.testing.assert_allclose(narrow_logits[:window], wide_logits[:window], rtol=0, atol=1e-5)
    assert np.abs(narrow_logits[window:] - wide_logits[window:]).max() > 0.1


EXPECTED_CONFIG = {
    "qwen2": dict(arch="qwen2", tied_output=False, biases=("attn_q", "attn_k", "attn_v"), fused_qkv=False),
    "qwen3": dict(arch="qwen3", tied_output=True, head_dim=32, n_embd_q=128),
    "gemma2": dict(arch="gemma2", tied_output=True, sliding_window=16, swa_layers=(True, False, True, False),
                   attn_softcap=2.0, final_softcap=10.0, attention_scale=32 ** -0.5),
    "gemma2_defaults": dict(sliding_window=4096, swa_layers=(True, False), attn_softcap=50.0, final_softcap=30.0,
                            rope_freq_base=10000.0, rope_freq_base_swa=10000.0),
    "gemma3": dict(swa_layers=(True,) * 5 + (False,), rope_freq_base=1e6, rope_freq_scale=1 / 8,
                   rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0, final_softcap=0.0),
    "gemma3_pattern": dict(swa_layers=(True, False, True, False), rope_freq_base_swa=5000.0, tied_output=False),
    "phi3": dict(fused_qkv=True, n_rot=16, rope_long_short=True, n_ctx_orig=4096, sliding_window=0),
    "qwen3moe": dict(n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff_shexp=None),
    "qwen2moe": dict(n_expert=6, n_expert_used=2, n_ff_exp=32, n_ff_shexp=64, biases=("attn_q", "attn_k", "attn_v")),
    "llama_moe": dict(n_expert=4, n_expert_used=2, n_ff_exp=64),  # llama's experts are n_ff wide
    "qwen3_yarn": dict(rope_yarn=True, rope_freq_scale=0.25, n_ctx_orig=64),
    "smollm3": dict(tied_output=True, n_rot=16),
    "mistral3": dict(rope_yarn=True, rope_freq_scale=0.25, n_ctx_orig=16, yarn_beta_fast=16.0, yarn_beta_slow=2.0,
                     yarn_log_mul=0.5, attn_temp_scale=0.1, n_rot=32),
    # gpt-oss: even layers slide with the global rope (YaRN included); its loader reads no YaRN beta keys
    "gpt_oss": dict(arch="gpt-oss", biases=("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp",
                                            "ffn_gate_exps", "ffn_down_exps", "ffn_up_exps"),
                    swa_layers=(True, False, True, False), sliding_window=16, rope_yarn=True, rope_freq_scale=0.25,
                    rope_freq_base_swa=150000.0, rope_freq_scale_swa=0.25, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
                    n_ctx_orig=64, n_expert=8, n_expert_used=2, n_ff_exp=96),
    # qwen35: block_count 5 of which 1 MTP block, every fourth layer full attention (the interval key absent)
    "qwen35": dict(arch="qwen35", n_layer=4, n_layer_nextn=1, recurrent_layers=(True, True, True, False),
                   ssm_k_heads=2, ssm_v_heads=4, ssm_state=16, ssm_conv_kernel=4, ssm_inner=64,
                   rope_sections=(3, 3, 2, 0), n_rot=16, head_dim=32, n_embd_q_proj=256, tied_output=True),
    # gemma4: per-layer arrays, sliding layers' own head size and rope width, the last two layers sharing K/V
    "gemma4": dict(arch="gemma4", swa_layers=(True, True, True, False, True, False), head_dim=32, head_dim_swa=16,
                   n_rot=32, n_rot_swa=16, n_head_kv_layers=(2, 2, 2, 1, 2, 1), n_ff=128,
                   n_ff_layers=(128, 128, 128, 128, 256, 256), n_layer_kv_shared=2, n_embd_per_layer=8,
                   attention_scale=1.0, rope_freqs=True, rope_freq_base=1e6, rope_freq_base_swa=10000.0,
                   final_softcap=30.0, layer_output_scale=True, tied_output=True),
    "gemma4moe": dict(n_expert=8, n_expert_used=2, n_ff_exp=32, fused_gate_up_exps=True, expert_scales=True,
                      k_as_v_layers=(False, True, False, True), n_embd_per_layer=0, n_layer_kv_shared=0),
}


@pytest.mark.parametrize("name", list(EXPECTED_CONFIG))
def test_config_reads_llama_cpps_keys_and_defaults(family_model: Callable[..., Path], name: str) -> None:
    config = ModelConfig.from_gguf(read_gguf(family_model(name)))
    for field, value in EXPECTED_CONFIG[name].items():
        assert getattr(config, field) == pytest.approx(value), field


BROKEN = {
    # family preset, change, error type, what the message must name
    "qwen2 bias of the wrong length": ("qwen2", dict(add_tensors={"blk.1.attn_k.bias": np.zeros(7, np.float32)}),
                                       BadGGUF, r"'blk\.1\.attn_k\.bias' has shape \(7,\)"),
    "qwen3 without a k norm": ("qwen3", dict(drop_tensors=("blk.0.attn_k_norm.weight",)), BadGGUF,
                               r"'blk\.0\.attn_k_norm\.weight' is missing"),
    "gemma2 without a post-FFN norm": ("gemma2", dict(drop_tensors=("blk.3.post_ffw_norm.weight",)), BadGGUF,
                                       r"'blk\.3\.post_ffw_norm\.weight' is missing"),
    "gemma2 with an output matrix": ("gemma2", dict(add_tensors={"output.weight": np.zeros((32000, 64), np.float32)}),
                                     Unsupported, r"'output\.weight' is not part of a gemma2 model"),
    "gemma3 with a key_length the q norm does not fit": (
        "gemma3", dict(set_keys={"gemma3.attention.key_length": 16, "gemma3.attention.value_length": 16}),
        BadGGUF, r"'blk\.0\.attn_\w+\.weight' has shape"),
    "phi3 fused up of the wrong width": ("phi3", dict(add_tensors={"blk.0.ffn_up.weight": np.zeros((128, 96),
                                                                                                    np.float32)}),
                                         BadGGUF, r"'blk\.0\.ffn_up\.weight' has shape \(128, 96\), "
                                                  r"expected \(256, 96\)"),
    "phi3 with a bias llama.cpp does not read": ("phi3", dict(add_tensors={"blk.0.ffn_down.bias": np.zeros(96,
                                                                                                           np.float32)}),
                                                 Unsupported, r"'blk\.0\.ffn_down\.bias' is not part of a phi3 model"),
    "gemma2 sliding window pattern too short": ("gemma2", dict(set_keys={"gemma2.attention.sliding_window_pattern":
                                                                         [True, False]}),
                                                BadGGUF, r"sliding_window_pattern' has 2 entries for 4 layers"),
    "expert stack with the wrong number of experts": (
        "qwen3moe", dict(add_tensors={"blk.1.ffn_up_exps.weight": np.zeros((7, 64, 64), np.float32)}), BadGGUF,
        r"'blk\.1\.ffn_up_exps\.weight' holds 7 experts, but 'qwen3moe\.expert_count' is 8"),
    "more experts used than there are": ("llama_moe", dict(set_keys={"llama.expert_used_count": 5}), BadGGUF,
                                         r"'llama\.expert_used_count' = 5 must be between 1 and "
                                         r"'llama\.expert_count' = 4"),
    "no experts used": ("qwen3moe", dict(set_keys={"qwen3moe.expert_used_count": 0}), BadGGUF,
                        r"'qwen3moe\.expert_used_count' = 0 must be between 1"),
    "qwen3moe without experts": ("qwen3moe", dict(drop_keys=("qwen3moe.expert_count",)), BadGGUF,
                                 r"qwen3moe model needs 'qwen3moe\.expert_count' > 0"),
    "MoE without its router": ("qwen3moe", dict(drop_tensors=("blk.0.ffn_gate_inp.weight",)), BadGGUF,
                               r"'blk\.0\.ffn_gate_inp\.weight' is missing"),
    "MoE without an expert gate": ("llama_moe", dict(drop_tensors=("blk.1.ffn_gate_exps.weight",)), BadGGUF,
                                   r"'blk\.1\.ffn_gate_exps\.weight' is missing"),
    "qwen2moe without its shared-expert gate": ("qwen2moe", dict(drop_tensors=("blk.0.ffn_gate_inp_shexp.weight",)),
                                                BadGGUF, r"'blk\.0\.ffn_gate_inp_shexp\.weight' is missing"),
    "gpt-oss without its attention sinks": ("gpt_oss", dict(drop_tensors=("blk.2.attn_sinks.weight",)), BadGGUF,
                                            r"'blk\.2\.attn_sinks\.weight' is missing"),
    "qwen3moe with a router bias llama.cpp does not read": (
        "qwen3moe", dict(add_tensors={"blk.0.ffn_gate_inp.bias": np.zeros(8, np.float32)}), Unsupported,
        r"'blk\.0\.ffn_gate_inp\.bias' is not part of a qwen3moe model"),
    "gpt-oss expert bias of the wrong width": (
        "gpt_oss", dict(add_tensors={"blk.1.ffn_up_exps.bias": np.zeros((8, 32), np.float32)}), BadGGUF,
        r"'blk\.1\.ffn_up_exps\.bias' has shape \(8, 32\), expected \(8, 96\)"),
    "granite without its logit scale": ("granite", dict(drop_keys=("granite.logit_scale",)), BadGGUF,
                                        r"granite\.logit_scale"),
    "qwen35 without a decay rate": ("qwen35", dict(drop_tensors=("blk.1.ssm_a",)), BadGGUF,
                                    r"'blk\.1\.ssm_a' is missing"),
    "qwen35 convolution of the wrong width": (
        "qwen35", dict(add_tensors={"blk.0.ssm_conv1d.weight": np.zeros((64, 4), np.float32)}), BadGGUF,
        r"'blk\.0\.ssm_conv1d\.weight' has shape \(64, 4\), expected \(128, 4\)"),
    "qwen35 without its state size": ("qwen35", dict(drop_keys=("qwen35.ssm.state_size",)), BadGGUF,
                                      r"'qwen35\.ssm\.state_size' is missing"),
    "qwen35 pattern that makes layer 3 recurrent": (
        "qwen35", dict(set_keys={"qwen35.full_attention_interval": 5}), Unsupported,
        r"'blk\.3\.attn_\w+\.weight' is not part of a qwen35 model"),
    "qwen35 recurrent-layer pattern too short": (
        "qwen35", dict(set_keys={"qwen35.attention.recurrent_layers": [True, False]}), BadGGUF,
        r"'qwen35\.attention\.recurrent_layers' must be a bool per block"),
    "qwen35 value heads not a multiple of key heads": ("qwen35", dict(set_keys={"qwen35.ssm.group_count": 3}),
                                                       BadGGUF, r"not a multiple of ssm group count 3"),
    "qwen35 without rope sections": ("qwen35", dict(drop_keys=("qwen35.rope.dimension_sections",)), BadGGUF,
                                     r"'qwen35\.rope\.dimension_sections' is missing"),
    "qwen2 without a head count": ("qwen2", dict(drop_keys=("qwen2.attention.head_count",)), BadGGUF,
                                   r"qwen2\.attention\.head_count"),
    "gemma4 without the per-layer embedding width": (
        "gemma4", dict(drop_keys=("gemma4.embedding_length_per_layer_input",)), BadGGUF,
        r"'gemma4\.embedding_length_per_layer_input' is missing"),
    "gemma4 without its sliding-window pattern": (
        "gemma4", dict(drop_keys=("gemma4.attention.sliding_window_pattern",)), BadGGUF,
        r"'gemma4\.attention\.sliding_window_pattern' is missing"),
    "gemma4 KV head array of the wrong length": (
        "gemma4", dict(set_keys={"gemma4.attention.head_count_kv": [2, 2, 2]}), BadGGUF,
        r"'gemma4\.attention\.head_count_kv' has 3 entries for 6 layers"),
    "gemma4 sharing layers that read a layer of the other kind": (
        "gemma4", dict(set_keys={"gemma4.attention.shared_kv_layers": 1}), BadGGUF,
        r"layer 5 \(global\) would read the K/V of layer 4"),
    "gemma4 sliding layer with a global head size": (
        "gemma4", dict(set_keys={"gemma4.attention.key_length_swa": 32, "gemma4.attention.value_length_swa": 32}),
        BadGGUF, r"'blk\.0\.attn_\w+\.weight' has shape"),
    "gemma4 without a per-layer projection": ("gemma4", dict(drop_tensors=("blk.2.proj.weight",)), BadGGUF,
                                              r"'blk\.2\.proj\.weight' is missing"),
    "gemma4 with K/V in a sharing layer": (
        "gemma4", dict(add_tensors={"blk.5.attn_k.weight": np.zeros((32, 64), np.float32)}), Unsupported,
        r"'blk\.5\.attn_k\.weight' is not part of a gemma4 model"),
    "gemma4 MoE without its router scale": ("gemma4moe", dict(drop_tensors=("blk.1.ffn_gate_inp.scale",)), BadGGUF,
                                            r"'blk\.1\.ffn_gate_inp\.scale' is missing"),
    "gemma4 MoE expert scales of the wrong count": (
        "gemma4moe", dict(add_tensors={"blk.0.ffn_down_exps.scale": np.ones(4, np.float32)}), BadGGUF,
        r"'blk\.0\.ffn_down_exps\.scale' has shape \(4,\), expected \(8,\)"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_family_file_names_the_tensor_or_key(family_model: Callable[..., Path], tmp_path: Path,
                                                    case: str) -> None:
    name, changes, error, message = BROKEN[case]
    path = rewrite_gguf(family_model(name), tmp_path / "broken.gguf", **changes)
    with pytest.raises(error, match=message):
        f = read_gguf(path)
        build_model(f, ModelConfig.from_gguf(f))


def transformers_overrides(name: str, model: reference_forward.Model) -> dict:
    """Config values transformers' GGUF loader (5.x) drops for a family, passed back by hand.

    Its loader maps too few keys: qwen3's head size, the MoE expert widths, gemma's query scale, soft-caps,
    layer pattern and local rope, phi3's partial rope and LongRoPE factors, Llama 3's rope_freqs schedule, YaRN.
    Its modeling code computes these families correctly once told, which makes it a second, independent forward.
    """
    c = model.config
    if name.endswith("_yarn"):  # the loader drops rope.scaling.* (YaRN) altogether
        yarn = {"rope_parameters": {"rope_type": "yarn", "rope_theta": c.rope_freq_base,
                                    "factor": 1.0 / c.rope_freq_scale,
                                    "original_max_position_embeddings": c.n_ctx_orig}}
        return yarn | ({"head_dim": c.head_dim_k} if name.startswith("qwen3") else {})
    if name == "qwen3":
        return {"head_dim": c.head_dim_k}
    if name == "qwen3moe":  # and llama.cpp always normalizes the top-k weights of qwen3moe
        return {"head_dim": c.head_dim_k, "moe_intermediate_size": model.meta["qwen3moe.expert_feed_forward_length"],
                "norm_topk_prob": True}
    if name == "qwen2moe":
        return {"moe_intermediate_size": model.meta["qwen2moe.expert_feed_forward_length"],
                "shared_expert_intermediate_size": model.meta["qwen2moe.expert_shared_feed_forward_length"]}
    if name.startswith("gemma2"):
        return {"query_pre_attn_scalar": c.head_dim_k, "attn_logit_softcapping": c.attn_softcap,
                "final_logit_softcapping": c.final_softcap}
    if name.startswith("gemma3"):
        full = {"rope_type": "default", "rope_theta": c.rope_freq_base}
        if c.rope_freq_scale != 1.0:
            full = {"rope_type": "linear", "factor": 1.0 / c.rope_freq_scale, "rope_theta": c.rope_freq_base}
        return {"query_pre_attn_scalar": c.head_dim_k, "final_logit_softcapping": c.final_softcap or None,
                "layer_types": ["sliding_attention" if s else "full_attention" for s in c.is_swa],
                "rope_parameters": {"full_attention": full,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_freq_base_swa}}}
    if name == "phi3":
        return {"rope_parameters": {"rope_type": "longrope", "rope_theta": c.rope_freq_base,
                                    "partial_rotary_factor": c.n_rot / c.head_dim_k,
                                    "short_factor": model.w["rope_factors_short.weight"].tolist(),
                                    "long_factor": model.w["rope_factors_long.weight"].tolist(),
                                    "original_max_position_embeddings": c.n_ctx_orig},
                "original_max_position_embeddings": c.n_ctx_orig}
    if name.startswith("llama3"):  # tests/families.py's rope_freqs: the converter's llama3 schedule
        return {"rope_parameters": {"rope_type": "llama3", "rope_theta": c.rope_freq_base, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}}
    return {}


def hf_from_llama_underneath(path: Path, tmp: Path) -> torch.nn.Module:
    """transformers' own model of a mistral3, smollm3 or granite GGUF (Ministral3ForCausalLM, SmolLM3ForCausalLM,
    GraniteForCausalLM).

    Its GGUF loader knows none of these architectures, so the file is read as the llama it is underneath (the same
    tensors and q/k row order) and the weights move into the family's model class, whose own code adds what
    differs, configured from the file's keys: YaRN with mscale_all_dim and Llama 4's attention temperature
    (Ministral 3), layers without rope (SmolLM3), the four multipliers (Granite)."""
    from transformers import (
        AutoModelForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
        Ministral3Config,
        Ministral3ForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )

    f = read_gguf(path)
    arch = f.architecture
    ours = {k: v for k, v in f.metadata.items() if k.startswith(f"{arch}.")}
    as_llama = rewrite_gguf(path, tmp / "as-llama.gguf", arch="llama", drop_keys=tuple(ours),
                            set_keys={"llama." + k.split(".", 1)[1]: v for k, v in ours.items()})
    llama = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=as_llama.name, dtype=torch.float32)

    def key(name: str) -> float:
        return float(ours[f"{arch}.{name}"])

    shape = dict(vocab_size=llama.config.vocab_size, hidden_size=int(key("embedding_length")),
                 intermediate_size=int(key("feed_forward_length")), num_hidden_layers=int(key("block_count")),
                 num_attention_heads=int(key("attention.head_count")),
                 num_key_value_heads=int(key("attention.head_count_kv")),
                 rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
                 max_position_embeddings=int(key("context_length")),
                 tie_word_embeddings="output.weight" not in f.tensors)
    if arch == "granite":
        model = GraniteForCausalLM(GraniteConfig(
            **shape, embedding_multiplier=key("embedding_scale"), residual_multiplier=key("residual_scale"),
            attention_multiplier=key("attention.scale"), logits_scaling=key("logit_scale"),
            rope_parameters={"rope_type": "default", "rope_theta": key("rope.freq_base")}))
    elif arch == "smollm3":
        model = SmolLM3ForCausalLM(SmolLM3Config(**shape, no_rope_layer_interval=4, pad_token_id=None, rope_parameters={
            "rope_type": "default", "rope_theta": key("rope.freq_base")}))
    else:
        head_dim = int(key("attention.key_length"))
        model = Ministral3ForCausalLM(Ministral3Config(**shape, head_dim=head_dim, rope_parameters={
            "rope_type": "yarn", "rope_theta": key("rope.freq_base"), "factor": key("rope.scaling.factor"),
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            "beta_fast": key("rope.scaling.yarn_beta_fast"), "beta_slow": key("rope.scaling.yarn_beta_slow"),
            "mscale": 1.0, "mscale_all_dim": key("rope.scaling.yarn_log_multiplier"),
            "llama_4_scaling_beta": key("attention.temperature_scale")}))
    model.load_state_dict(llama.state_dict(), strict=False)  # a tied lm_head is the embedding already
    model.tie_weights()
    return model.eval()


def hf_gpt_oss(model: reference_forward.Model) -> torch.nn.Module:
    """transformers' own model of a gpt-oss GGUF (GptOssForCausalLM), configured from the file's keys.

    Its GGUF loader cannot read one: it reads each rope.scaling key's name length as its value (and fails on it), maps
    no expert or sink tensors, and drops head_dim and the sliding window. The weights move in by
    hand, undoing the converter: gate and up interleave again in gate_up_proj (gate at even columns), and the
    expert matrices go back to transformers' (in, out) layout. YaRN truncates its correction range as ggml does
    (transformers' gpt-oss default does not)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    c, w = model.config, model.w
    n_ff = int(model.meta["gpt-oss.expert_feed_forward_length"])
    config = GptOssConfig(
        vocab_size=c.n_vocab, hidden_size=c.n_embd, intermediate_size=n_ff, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, num_key_value_heads=c.n_head_kv, head_dim=c.head_dim_k,
        num_local_experts=c.n_expert, num_experts_per_tok=c.n_expert_used, sliding_window=c.n_swa,
        layer_types=["sliding_attention" if s else "full_attention" for s in c.is_swa], rms_norm_eps=c.rms_eps,
        max_position_embeddings=c.n_ctx_train, tie_word_embeddings=False, attn_implementation="eager",
        rope_parameters={"rope_type": "yarn", "rope_theta": c.rope_freq_base, "factor": 1.0 / c.rope_freq_scale,
                         "original_max_position_embeddings": c.n_ctx_orig, "beta_fast": c.yarn_beta_fast,
                         "beta_slow": c.yarn_beta_slow, "truncate": True})
    state = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight": w["output_norm.weight"],
             "lm_head.weight": w["output.weight"]}
    for i in range(c.n_layer):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        state |= {q + "input_layernorm.weight": w[p + "attn_norm.weight"],
                  q + "post_attention_layernorm.weight": w[p + "post_attention_norm.weight"],
                  q + "self_attn.sinks": w[p + "attn_sinks.weight"],
                  q + "mlp.router.weight": w[p + "ffn_gate_inp.weight"],
                  q + "mlp.router.bias": w[p + "ffn_gate_inp.bias"],
                  q + "mlp.experts.down_proj": w[p + "ffn_down_exps.weight"].transpose(0, 2, 1),
                  q + "mlp.experts.down_proj_bias": w[p + "ffn_down_exps.bias"]}
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
            state |= {q + f"self_attn.{theirs}.weight": w[p + f"attn_{ours}.weight"],
                      q + f"self_attn.{theirs}.bias": w[p + f"attn_{ours}.bias"]}
        gate, up = w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"]  # (n_expert, n_ff, n_embd)
        gate_up = np.empty((c.n_expert, c.n_embd, 2 * n_ff))
        gate_up[..., ::2], gate_up[..., 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
        gate_up_bias = np.empty((c.n_expert, 2 * n_ff))
        gate_up_bias[:, ::2], gate_up_bias[:, 1::2] = w[p + "ffn_gate_exps.bias"], w[p + "ffn_up_exps.bias"]
        state |= {q + "mlp.experts.gate_up_proj": gate_up, q + "mlp.experts.gate_up_proj_bias": gate_up_bias}
    hf = GptOssForCausalLM(config)
    hf.load_state_dict({k: torch.tensor(np.ascontiguousarray(v), dtype=torch.float32) for k, v in state.items()},
                       strict=True)
    return hf.eval()


OWN_MODEL = ("mistral3", "smollm3", "granite", "gpt_oss")
"""Presets transformers' GGUF loader cannot read: their files go into transformers' own class of the family."""


@functools.cache
def transformers_model(name: str, path: Path) -> torch.nn.Module:
    """transformers' model of preset ``name`` (written at ``path``), once per file: its GGUF loader's with the config
    values it drops put back, or its own class of the family (:data:`OWN_MODEL`). Callers that change it (peft)
    change a copy."""
    if name == "gpt_oss":
        return hf_gpt_oss(float64_model(path))
    if name in OWN_MODEL:
        tmp = path.parent / f"{path.stem}-as-llama"
        tmp.mkdir(exist_ok=True)
        return hf_from_llama_underneath(path, tmp)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                **transformers_overrides(name, float64_model(path))).eval()


@pytest.mark.parametrize("name", OWN_MODEL)
def test_logits_equal_transformers_own_model_of_the_family(family_model: Callable[..., Path], name: str) -> None:
    path = family_model(name)
    tokens = tokens_for(path)
    with torch.no_grad():
        theirs = transformers_model(name, path)(torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(ggtorch_logits(path, tokens), theirs, rtol=0, atol=TOLERANCE["F32"])


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma2", "gemma3", "phi3", "llama3_rope_freqs",
                                  "mistral_headdim", "qwen3moe", "qwen2moe", "qwen3_yarn", "llama_yarn"])
def test_logits_equal_transformers_on_the_same_gguf(family_model: Callable[..., Path], name: str) -> None:
    path = family_model(name)
    tokens = tokens_for(path)
    hf = transformers_model(name, path)
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(ggtorch_logits(path, tokens), theirs, rtol=0, atol=TOLERANCE["F32"])


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "gemma3", "phi3_long", "gemma4"])
def test_perplexity_equals_the_float64_forward(family_model: Callable[..., Path], name: str) -> None:
    """llama-perplexity's definition (second half of each chunk scored) on ggtorch's quantized-model path,
    against the same sums over the float64 forward's logits."""
    from ggtorch.models.generate import llama_cpp_context, perplexity

    path = family_model(name)
    n_ctx = 16
    tokens = eval_tokens(ModelConfig.from_gguf(read_gguf(path)).n_vocab, n=3 * n_ctx + 5, seed=7)
    ours = perplexity(load(path), tokens, n_ctx)
    nll, first = 0.0, n_ctx // 2
    for c in range(len(tokens) // n_ctx):
        chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
        logits = reference_forward.forward(float64_model(path), chunk, n_ctx_seq=llama_cpp_context(n_ctx),
                                           gelu_mode="tanh")
        logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        nll -= sum(logprobs[i, chunk[i + 1]] for i in range(first, n_ctx - 1))
    assert ours.n_scored == 3 * (n_ctx - 1 - first)
    assert ours.nll == pytest.approx(nll / ours.n_scored, rel=1e-5)


@pytest.mark.parametrize("name", ["qwen2_tied", "qwen3", "gemma3", "phi3", "qwen3moe", "mistral3", "smollm3",
                                  "granite", "gpt_oss", "qwen35", "qwen35moe", "gemma4"])
def test_info_generate_and_perplexity_commands_run(family_model: Callable[..., Path], shakespeare: Path, tmp_path: Path,
                                                   name: str) -> None:
    from tests.helpers import run_cli

    path = family_model(name)
    text = tmp_path / "text.txt"
    text.write_text(shakespeare.read_text(encoding="utf-8")[:2000], encoding="utf-8")
    info = run_cli(["info", path])
    assert info.exit_code == 0 and f"architecture:  {FAMILY_PRESETS[name][0]}" in info.output, info.output
    ppl = run_cli(["perplexity", "-m", path, "-f", text, "-c", "32"])
    assert ppl.exit_code == 0 and "perplexity: " in ppl.output, ppl.output
    gen = run_cli(["generate", "-m", path, "-p", "To be", "-n", "6"])
    assert gen.exit_code == 0 and "6 tokens in" in gen.output, gen.output


@pytest.mark.parametrize("name", ["qwen3", "phi3", "llama3_tied", "llama_moe", "qwen35"])
def test_greedy_generation_equals_llama_cpps(family_model: Callable[..., Path], name: str) -> None:
    """Token by token through the KV cache (qwen35: a DeltaNet layer's state), ggtorch and llama.cpp pick the same
    argmax."""
    from ggtorch.models.generate import generate_tokens

    path = family_model(name)
    prompt = tokens_for(path)[:5]
    ours = generate_tokens(load(path), prompt, 12)
    llm = open_llama_cpp(path, 64)
    llm.reset()
    llm.eval(prompt)
    theirs = []
    for _ in range(12):
        theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([theirs[-1]])
    assert ours == theirs

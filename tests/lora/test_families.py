"""LoRA on every model family: which matrices get adapters, and llama.cpp applying the written adapter.

The bases are tests/families.py's presets quantized to Q8_0 by llama.cpp (one per family); the
reference is llama.cpp loading ggtorch's GGUF LoRA onto the same file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ggtorch.errors import BadFlag, Unsupported
from ggtorch.io.gguf import read_gguf
from ggtorch.lora import LoraConfig, attach_lora, lora_modules
from ggtorch.lora.adapter_file import adapter_from_model, load_adapter_into, read_adapter, write_adapter
from ggtorch.lora.config import LAYER_ORDER, MATRIX_KINDS
from ggtorch.models import names
from ggtorch.models.config import ModelConfig
from ggtorch.models.loader import build_model
from ggtorch.quant.modules import QuantEmbedding, QuantExperts, QuantLinear
from ggtorch.rng import MT19937, libstdcpp_normal
from tests.families import eval_tokens
from tests.helpers import losses
from tests.llama_models import llama_cpp_logits
from tests.lora.test_adapter_file import ggtorch_logits, llama_cpp_with_adapter, trained_looking_model
from tests.models.test_families import GELU_TABLE_TOLERANCE
from tests.models.test_model import TOLERANCE
from tests.training.test_finetune import SMALL, run_whole_and_resumed

N_TOKENS = 32
LLAMA_CPP_CONTEXT = 256
"""llama.cpp's context for n_ctx=64 (padded to 256): phi3 picks its rope factors from it."""
SEPARATE = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
UNTIED = {"token_embd", "output"}
ATTENTION = {"attn_q", "attn_k", "attn_v", "attn_output"}
EXPERTS = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
DELTA_NET = {"attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out"}
EXPECTED_KINDS: dict[str, set[str]] = {
    "qwen2": SEPARATE | UNTIED,  # q/k/v biases stay as they are
    "qwen3": SEPARATE,  # tied; q/k norms are not adapted
    "gemma2": SEPARATE,  # always tied; post norms are not adapted
    "gemma3": SEPARATE,
    "phi3": {"attn_qkv", "attn_output", "ffn_up", "ffn_down"} | UNTIED,  # fused q|k|v and gate|up
    "llama3_tied": SEPARATE,
    "qwen3moe": ATTENTION | EXPERTS | UNTIED,  # routers are not adapted
    "qwen2moe": ATTENTION | EXPERTS | {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"} | UNTIED,
    "llama_moe": ATTENTION | EXPERTS | UNTIED,
    "mistral3": SEPARATE | UNTIED,
    "smollm3": SEPARATE,  # tied
    "granite": SEPARATE | UNTIED,
    "gpt_oss": ATTENTION | EXPERTS | UNTIED,  # routers, sinks and biases are not adapted
    # DeltaNet layers: fused q|k|v, gate, beta, alpha and output (not the convolution, dt bias, decay rates, norm)
    "qwen35": SEPARATE | DELTA_NET,  # tied
    "qwen35moe": ATTENTION | EXPERTS | {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"} | DELTA_NET | UNTIED,
    # tied; the per-layer embeddings' gate and projection in each block, not the model-wide projection
    "gemma4": SEPARATE | {"per_layer_inp_gate", "per_layer_proj"},
    "gemma4moe": SEPARATE | {"ffn_gate_up_exps", "ffn_down_exps"},  # the dense MLP beside fused gate|up experts
}
"""Preset -> the kinds a default LoRA adapts (every matrix llama.cpp can take an adapter for)."""
GRANITE_ALPHA = 32.0
"""granite's residual and logit scales shrink what an adapter changes: a larger alpha keeps it well above the
quantized tolerance."""


def kind_of(gguf_name: str) -> str:
    parsed = names.parse_gguf_name(gguf_name)
    assert parsed is not None, gguf_name
    return parsed[0]


@pytest.mark.parametrize("name", list(EXPECTED_KINDS))
def test_every_matrix_kind_is_adapted_on_a_quantized_base(family_model: Callable[..., Path], name: str) -> None:
    path = family_model(name, "Q8_0")
    f, model = trained_looking_model(path)
    wrapped = {m.gguf_name: m for _, m in lora_modules(model)}
    assert {kind_of(n) for n in wrapped} == EXPECTED_KINDS[name]
    n_layer = len(model.layers)
    for kind in EXPECTED_KINDS[name] - UNTIED:  # every layer holding the kind (a hybrid's layers differ)
        held = {names.gguf_name(kind, i) for i in range(n_layer) if names.gguf_name(kind, i) in f.tensors}
        assert held and {n for n in wrapped if kind_of(n) == kind} == held
    for gguf, m in wrapped.items():  # the base stays as the file holds it: quantized blocks (llama.cpp's F16
        quantized = f.tensors[gguf].ggml_type.name not in ("F32", "F16")  # fallback for narrow rows: a float matrix)
        assert isinstance(m.base, QuantLinear | QuantEmbedding | QuantExperts) == quantized, gguf
    assert any(isinstance(m.base, QuantLinear) for m in wrapped.values())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_a", ".lora_b")) for n in trainable)


@pytest.mark.parametrize("name", list(EXPECTED_KINDS))
def test_llama_cpp_applies_the_written_adapter_as_ggtorch(family_model: Callable[..., Path], tmp_path: Path,
                                                          name: str) -> None:
    path = family_model(name, "Q8_0")
    f, model = trained_looking_model(path, alpha=GRANITE_ALPHA if name == "granite" else 8.0)
    model.n_ctx = LLAMA_CPP_CONTEXT
    adapter = adapter_from_model(model, f)
    assert {kind_of(n) for n in adapter.pairs} == EXPECTED_KINDS[name]
    written = write_adapter(tmp_path / "adapter.gguf", adapter)
    assert read_gguf(written).architecture == f.architecture

    tokens = eval_tokens(model.config.n_vocab, N_TOKENS)
    ref = llama_cpp_logits(llama_cpp_with_adapter(path, written), tokens)
    ref_base = llama_cpp_logits(llama_cpp_with_adapter(path, None), tokens)
    ours = ggtorch_logits(model, tokens)
    tol = TOLERANCE["Q8_0"]
    assert np.abs(ours - ref).max() <= tol, f"{name}: max |diff| {np.abs(ours - ref).max():.3g}"
    assert np.abs(ref - ref_base).max() > 5 * tol  # the adapter matters far more than the tolerance


@pytest.mark.parametrize("name", ["phi3", "qwen3moe", "gemma4moe"])
def test_fused_and_expert_adapters_equal_llama_cpp_in_f32(family_model: Callable[..., Path], tmp_path: Path,
                                                         name: str) -> None:
    """At F32 precision: the rows of phi3's fused attn_qkv and gate|up adapters land where llama.cpp
    splits the fused products; each expert's pair is the one llama.cpp's mul_mat_id picks for it; gemma4's
    per-expert scale multiplies the stack's product and not the adapter's (llama.cpp's w_s), and its fused gate|up
    adapter splits as the product does. gemma4 against llama.cpp's CPU is within its fp16 GELU table, and the same
    model without the adapter shows that the adapter moves the logits far more."""
    path = family_model(name)
    f, model = trained_looking_model(path)
    model.n_ctx = LLAMA_CPP_CONTEXT
    written = write_adapter(tmp_path / "adapter.gguf", adapter_from_model(model, f))
    tokens = eval_tokens(model.config.n_vocab, N_TOKENS)
    ref = llama_cpp_logits(llama_cpp_with_adapter(path, written), tokens)
    tol = GELU_TABLE_TOLERANCE if name.startswith("gemma") else TOLERANCE["F32"]
    assert np.abs(ggtorch_logits(model, tokens) - ref).max() <= tol
    ref_base = llama_cpp_logits(llama_cpp_with_adapter(path, None), tokens)
    assert np.abs(ref - ref_base).max() > 10 * tol


@pytest.mark.parametrize("name,kind", [("qwen3", "token_embd"), ("gemma2", "output"), ("llama3_tied", "output")])
def test_tied_outputs_are_skipped_and_refused_when_asked_for(family_model: Callable[..., Path], name: str,
                                                             kind: str) -> None:
    f = read_gguf(family_model(name, "Q8_0"))
    model = build_model(f, ModelConfig.from_gguf(f), keep_quantized=True)
    with pytest.raises(Unsupported, match="ties its output projection"):
        attach_lora(model, LoraConfig(ranks={kind: 4}))


def test_a_fused_model_draws_the_init_stream_for_its_own_kinds_only(family_model: Callable[..., Path]) -> None:
    """phi3 has no attn_q/k/v and no ffn_gate: attn_qkv takes q/k/v's place in the old order, and the
    kinds it lacks draw nothing (norms off still draw their rank-1 values, as for llama)."""
    f = read_gguf(family_model("phi3", "Q8_0"))
    model = build_model(f, ModelConfig.from_gguf(f), keep_quantized=True)
    r, seed = 4, 7
    attach_lora(model, LoraConfig(rank=r), seed=seed)
    c = model.config
    n_embd, n_qkv = c.n_embd, c.n_embd_q + 2 * c.n_embd_kv
    stream = np.clip(libstdcpp_normal(MT19937(seed), 200_000), -1, 1)

    def old_a(offset: int, n_in: int) -> np.ndarray:  # old layout ne=[r, n_in]: torch (n_in, r)
        scale = np.float32(1) / np.sqrt(np.float32(r + n_in), dtype=np.float32)
        return (stream[offset:offset + r * n_in] * scale).reshape(n_in, r)

    off_output = r * n_embd + n_embd  # token_embd, output_norm
    off_qkv = off_output + r * n_embd + n_embd  # output, attn_norm
    off_o = off_qkv + r * n_embd
    off_down = off_o + r * c.n_embd_q + n_embd  # attn_output, ffn_norm (no ffn_gate)
    off_up = off_down + r * c.n_ff
    layer = model.layers[0]
    np.testing.assert_array_equal(model.output.lora_a.detach().numpy(), old_a(off_output, n_embd).T)
    np.testing.assert_array_equal(layer.attn.qkv.lora_a.detach().numpy(), old_a(off_qkv, n_embd).T)
    np.testing.assert_array_equal(layer.attn.o.lora_a.detach().numpy(), old_a(off_o, c.n_embd_q).T)
    np.testing.assert_array_equal(layer.ffn.down.lora_a.detach().numpy(), old_a(off_down, c.n_ff).T)
    np.testing.assert_array_equal(layer.ffn.up.lora_a.detach().numpy(), old_a(off_up, n_embd).T)
    assert tuple(layer.attn.qkv.lora_b.shape) == (n_qkv, r)
    assert tuple(layer.ffn.up.lora_b.shape) == (2 * c.n_ff, r)


def test_rank_qkv_sets_the_fused_kind_and_is_recorded_only_when_given(family_model: Callable[..., Path]) -> None:
    from ggtorch.training.config import FinetuneConfig

    assert "attn_qkv" in MATRIX_KINDS and LAYER_ORDER.index("attn_qkv") == LAYER_ORDER.index("attn_v") + 1
    given = LoraConfig.from_finetune(FinetuneConfig(model_base="m.gguf", train_data="t.txt", rank_qkv=2))
    default = LoraConfig.from_finetune(FinetuneConfig(model_base="m.gguf", train_data="t.txt", lora_r=8))
    assert given.rank_of("attn_qkv") == 2 and default.rank_of("attn_qkv") == 8
    assert given.metadata()["training.lora.rank.attn_qkv"] == 2
    assert "training.lora.rank.attn_qkv" not in default.metadata()  # a llama checkpoint's old keys

    f = read_gguf(family_model("phi3", "Q8_0"))
    model = build_model(f, ModelConfig.from_gguf(f), keep_quantized=True)
    with pytest.raises(BadFlag, match="--rank-wq 8 sets the LoRA rank of attn_q, which this phi3 model does not"):
        attach_lora(model, LoraConfig(rank=4, ranks={"attn_qkv": 2, "attn_q": 8}))  # attn_q: not in this model
    attach_lora(model, LoraConfig(rank=4, ranks={"attn_qkv": 2}))
    ranks = {m.gguf_name: m.rank for _, m in lora_modules(model)}
    assert ranks["blk.0.attn_qkv.weight"] == 2 and ranks["blk.0.attn_output.weight"] == 4
    assert not any(".attn_q." in n for n in ranks)


@pytest.mark.parametrize("name", ["qwen3", "phi3", "qwen3moe", "qwen35", "gemma4"])
def test_finetune_resumes_exactly_and_llama_cpp_runs_the_adapter(family_model: Callable[..., Path],
                                                                 texts: dict[str, Path], tmp_path: Path,
                                                                 name: str) -> None:
    """`ggtorch finetune` on a quantized non-llama base: 6 iterations == 3 + resumed 3, byte for byte, and the
    adapter it writes runs in llama.cpp as in ggtorch."""
    base_path = family_model(name, "Q8_0")
    common = ["finetune", "--model-base", str(base_path), "--train-data", str(texts["train"]), *SMALL,
              "--save-every", "0"]
    one, two = run_whole_and_resumed(common, tmp_path)
    adapter_path = one / "ggml-lora-LATEST-f32.gguf"
    assert adapter_path.read_bytes() == (two / "ggml-lora-LATEST-f32.gguf").read_bytes()
    assert losses(one / "checkpoint-log.jsonl") == losses(two / "checkpoint-log.jsonl")
    assert len(losses(one / "checkpoint-log.jsonl")) == 6

    adapter = read_adapter(adapter_path)
    assert adapter.architecture == name and {kind_of(n) for n in adapter.pairs} == EXPECTED_KINDS[name]
    # applied to the F32 original of the base, where ggtorch and llama.cpp agree to float rounding
    f32_path = family_model(name)
    f = read_gguf(f32_path)
    model = build_model(f, ModelConfig.from_gguf(f))
    model.n_ctx = LLAMA_CPP_CONTEXT
    load_adapter_into(model, f, [(adapter, 1.0)])
    tokens = eval_tokens(model.config.n_vocab, N_TOKENS)
    ref = llama_cpp_logits(llama_cpp_with_adapter(f32_path, adapter_path), tokens)
    ref_base = llama_cpp_logits(llama_cpp_with_adapter(f32_path, None), tokens)
    ours = ggtorch_logits(model, tokens)
    tol = GELU_TABLE_TOLERANCE if name.startswith("gemma") else TOLERANCE["F32"]  # llama.cpp's CPU GELU table
    assert np.abs(ours - ref).max() <= tol, f"{name}: {np.abs(ours - ref).max():.3g}"
    assert np.abs(ref - ref_base).max() > 100 * TOLERANCE["F32"]  # six steps moved the model

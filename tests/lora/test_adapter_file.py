"""GGUF LoRA adapters: what ggtorch writes, llama.cpp loads and applies the same way.

The reference is llama.cpp itself (``llama_adapter_lora_init`` + ``llama_set_adapters_lora``
through llama-cpp-python's ``lora_path``/``lora_scale``), never ggtorch's own reader.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from ggtorch.errors import BadGGUF, GGTorchError
from ggtorch.io.gguf import read_gguf
from ggtorch.lora import LoraConfig, attach_lora, lora_modules
from ggtorch.lora.adapter_file import (
    LoraAdapter,
    LoraPair,
    adapter_from_model,
    load_adapter_into,
    read_adapter,
    write_adapter,
)
from ggtorch.models import names
from ggtorch.models.config import ModelConfig
from ggtorch.models.loader import build_model
from tests.llama_models import llama_cpp_logits, open_llama_cpp
from tests.models.test_model import TOLERANCE, random_tokens

N_TOKENS = 32


def llama_cpp_with_adapter(model_path: Path, adapter_path: Path | None, scale: float = 1.0):
    extra = {"lora_path": str(adapter_path), "lora_scale": scale} if adapter_path else {}
    return open_llama_cpp(model_path, 64, **extra)


def trained_looking_model(path: Path, ranks: dict[str, int] | None = None, alpha: float = 8.0):
    """A model with every matrix adapted (rank 4, alpha 8) and B drawn at random, as after training."""
    f = read_gguf(path)
    model = build_model(f, ModelConfig.from_gguf(f), keep_quantized=True)
    attach_lora(model, LoraConfig(rank=4, alpha=alpha, ranks=ranks or {}), seed=1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=gen) * 0.1)
    return f, model


def ggtorch_logits(model: torch.nn.Module, tokens: list[int], user_scale: float = 1.0) -> np.ndarray:
    saved = [(m, m.scale) for _, m in lora_modules(model)]
    for m, s in saved:
        m.scale = s * user_scale
    try:
        with torch.no_grad():
            return model(torch.tensor([tokens]))[0].float().numpy()
    finally:
        for m, s in saved:
            m.scale = s


@pytest.mark.parametrize("ftype", ["F32", "Q8_0"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_llama_cpp_applies_the_written_adapter_as_ggtorch(random_llama: Callable[..., Path], tmp_path: Path,
                                                          ftype: str, scale: float) -> None:
    base_path = random_llama(ftype)
    f, model = trained_looking_model(base_path)
    adapter = adapter_from_model(model, f, {"general.name": "test adapter"})
    kinds = {name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0] for name in adapter.pairs}
    assert kinds == {"token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output",
                     "ffn_gate", "ffn_down", "ffn_up"}
    path = write_adapter(tmp_path / "adapter.gguf", adapter)

    tokens = random_tokens(32000, N_TOKENS)
    ref = llama_cpp_logits(llama_cpp_with_adapter(base_path, path, scale), tokens)
    ref_base = llama_cpp_logits(llama_cpp_with_adapter(base_path, None), tokens)
    ours = ggtorch_logits(model, tokens, scale)
    tol = TOLERANCE[ftype]
    assert np.abs(ours - ref).max() <= tol
    # The adapter matters far more than the tolerance: this is not base-vs-base agreement.
    assert np.abs(ref - ref_base).max() > 5 * tol


def test_adapter_round_trips_and_loads_onto_a_fresh_model(random_llama: Callable[..., Path], tmp_path: Path) -> None:
    base_path = random_llama("F32")
    f, model = trained_looking_model(base_path)
    path = write_adapter(tmp_path / "a.gguf", adapter_from_model(model, f))
    back = read_adapter(path)
    assert back.alpha == 8.0 and back.architecture == "llama"
    for name, (a, b) in ((n, (p.a, p.b)) for n, p in adapter_from_model(model, f).pairs.items()):
        assert torch.equal(back.pairs[name].a, a) and torch.equal(back.pairs[name].b, b)

    tokens = random_tokens(32000, N_TOKENS)
    fresh = build_model(f, ModelConfig.from_gguf(f), keep_quantized=True)
    load_adapter_into(fresh, f, [(back, 0.5)])
    np.testing.assert_allclose(ggtorch_logits(fresh, tokens), ggtorch_logits(model, tokens, 0.5), atol=1e-4, rtol=0)


def test_stacked_adapters_equal_llama_cpps_sum(random_llama: Callable[..., Path], tmp_path: Path) -> None:
    """Two adapters at scales 1 and 0.5 stack to Σ s·ΔW: checked against one merged-by-hand adapter."""
    base_path = random_llama("F32")
    f, m1 = trained_looking_model(base_path)
    _, m2 = trained_looking_model(base_path, alpha=2.0)
    a1, a2 = adapter_from_model(m1, f), adapter_from_model(m2, f)
    fresh = build_model(f, ModelConfig.from_gguf(f))
    load_adapter_into(fresh, f, [(a1, 1.0), (a2, 0.5)])
    tokens = random_tokens(32000, 16)
    with torch.no_grad():
        ours = fresh(torch.tensor([tokens]))[0]
        plain = build_model(f, ModelConfig.from_gguf(f))
        for name in a1.pairs:  # the formula, applied to float weights directly
            module = plain.get_submodule(names.gguf_to_module(name))
            module.weight.data = module.weight.data + a1.delta(name, 1.0) + a2.delta(name, 0.5)
        expected = plain(torch.tensor([tokens]))[0]
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
def test_lower_precision_adapters_load_in_llama_cpp(random_llama: Callable[..., Path], tmp_path: Path,
                                                    dtype: str) -> None:
    base_path = random_llama("F32")
    f, model = trained_looking_model(base_path)
    path = write_adapter(tmp_path / f"a-{dtype}.gguf", adapter_from_model(model, f), dtype=dtype)
    tokens = random_tokens(32000, 16)
    ref = llama_cpp_logits(llama_cpp_with_adapter(base_path, path), tokens)
    ours = ggtorch_logits(model, tokens)
    # The adapter's own rounding (f16 2^-11, bf16 2^-8, q8_0 ~1/254 relative) on a delta of size ~1.
    assert np.abs(ours - ref).max() <= {"f16": 0.02, "bf16": 0.15, "q8_0": 0.15}[dtype]
    assert read_adapter(path).pairs.keys() == adapter_from_model(model, f).pairs.keys()


def test_bad_adapters_are_refused(random_llama: Callable[..., Path], stories260k: Path, tmp_path: Path) -> None:
    base_path = random_llama("F32")
    f, model = trained_looking_model(base_path)
    adapter = adapter_from_model(model, f)
    stories = read_gguf(stories260k)
    fresh = build_model(stories, ModelConfig.from_gguf(stories))
    layers_only = LoraAdapter("llama", adapter.alpha, {k: v for k, v in adapter.pairs.items() if k.startswith("blk.")})
    with pytest.raises(GGTorchError, match="tensors do not fit the base model .*: the adapter was made for another"):
        load_adapter_into(fresh, stories, [(layers_only, 1.0)])

    other_arch = LoraAdapter("qwen2", adapter.alpha, adapter.pairs)
    with pytest.raises(GGTorchError, match="the adapter is for a qwen2 model"):
        load_adapter_into(build_model(f, ModelConfig.from_gguf(f)), f, [(other_arch, 1.0)])

    name = "blk.0.attn_q.weight"
    pair = adapter.pairs[name]
    broken = LoraAdapter("llama", 4.0, {name: LoraPair(pair.a[:3], pair.b)})
    with pytest.raises(GGTorchError, match="rank 3 but lora_b of rank 4"):
        load_adapter_into(build_model(f, ModelConfig.from_gguf(f)), f, [(broken, 1.0)])

    with pytest.raises(BadGGUF, match="is a model, not a LoRA adapter"):
        read_adapter(base_path)


def test_token_embd_adapter_on_a_tied_base_is_refused(stories260k: Path) -> None:
    """llama.cpp aborts when an adapter targets token_embd of a model whose output is tied to it."""
    stories = read_gguf(stories260k)
    pair = LoraPair(torch.zeros(512, 4), torch.zeros(64, 4))
    adapter = LoraAdapter("llama", 4.0, {"token_embd.weight": pair})
    with pytest.raises(GGTorchError, match="ties its output"):
        load_adapter_into(build_model(stories, ModelConfig.from_gguf(stories)), stories, [(adapter, 1.0)])


def test_norm_adapters_cannot_go_into_a_llama_cpp_file(stories260k: Path) -> None:
    f = read_gguf(stories260k)
    model = build_model(f, ModelConfig.from_gguf(f))
    attach_lora(model, LoraConfig(ranks={"attn_norm": 1}))
    with pytest.raises(GGTorchError, match="cannot carry norm-vector deltas"):
        adapter_from_model(model, f)
    assert all(not n.endswith("_norm.weight") for n in adapter_from_model(model, f, drop_norms=True).pairs)

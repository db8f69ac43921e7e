"""The torch llama against llama.cpp: same tokens in, same logits out.

llama.cpp runs through llama-cpp-python with ``logits_all=True`` and an F32 KV cache, so on
F32 weights both sides compute the same f32 graph and agree to float rounding. On other
weight types llama.cpp converts the *activations* too before each matmul (to f16 for F16
weights, bf16 for BF16, q8_0 / q8_K blocks for quantized weights) while ggtorch multiplies
the dequantized weights by f32 activations; the tolerances below are the size of that
activation rounding, measured on these models and stated per type.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from ggtorch.io.gguf import read_gguf
from ggtorch.models.config import ModelConfig
from ggtorch.models.loader import build_model
from ggtorch.models.model import Transformer
from tests.llama_models import llama_cpp_logits, open_llama_cpp, rewrite_gguf

N_TOKENS = 48

# ftype -> max |logit difference| allowed (logits here reach about +-20, std about 4).
TOLERANCE: dict[str, float] = {
    # Same f32 graph on both sides: only summation order differs (measured ~1e-5).
    "F32": 1e-4,
    # llama.cpp rounds activations to f16 (rel. 2^-11) for the matmul (measured ~6e-3).
    "F16": 0.03,
    # ... and to bf16 (rel. 2^-8) for BF16 weights (measured ~0.05).
    "BF16": 0.2,
}
# Quantized weights: llama.cpp quantizes activations to 8-bit blocks (q8_0 / q8_K, rel. error
# up to 1/254 per element) before the integer dot products; measured max 0.16-0.26 over
# all the types below.
QUANTIZED = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K",
             "IQ4_NL", "IQ4_XS"]
TOLERANCE |= {ftype: 0.6 for ftype in QUANTIZED}


def torch_logits(path: Path, tokens: list[int], dtype: torch.dtype = torch.float32) -> np.ndarray:
    f = read_gguf(path)
    model = build_model(f, ModelConfig.from_gguf(f), dtype=dtype)
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0].float().numpy()


def random_tokens(n_vocab: int, n: int, seed: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, n_vocab, n - 1).tolist()  # BOS, then anything


def assert_top1_agrees(ours: np.ndarray, ref: np.ndarray, tol: float, min_fraction: float = 0.9) -> None:
    """Argmax equal at >= min_fraction of positions, and every disagreement a near-tie in llama.cpp's logits."""
    ours_top, ref_top = ours.argmax(-1), ref.argmax(-1)
    agree = ours_top == ref_top
    assert agree.mean() >= min_fraction, f"top-1 agrees at only {agree.mean():.2%} of positions"
    pos = np.nonzero(~agree)[0]
    gap = ref[pos, ref_top[pos]] - ref[pos, ours_top[pos]]
    assert np.all(gap <= 2 * tol), f"top-1 differs where llama.cpp's margin is {gap.max():.3f} > {2 * tol}"


def test_stories260k_logits_equal_llama_cpp(stories260k: Path) -> None:
    tokens = [1, 403, 407, 261, 378] + random_tokens(512, N_TOKENS - 5, seed=2)[1:]
    llm = open_llama_cpp(stories260k, n_ctx=64)
    ref = llama_cpp_logits(llm, tokens)
    ours = torch_logits(stories260k, tokens)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=TOLERANCE["F32"])
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.fixture(scope="module")
def f32_logits(random_llama: Callable[..., Path]) -> np.ndarray:
    """Logits of the unquantized random llama: the baseline every quantized type departs from."""
    return torch_logits(random_llama("F32"), random_tokens(32000, N_TOKENS))


@pytest.mark.parametrize("ftype", ["F32", "F16", "BF16", *QUANTIZED])
def test_random_llama_logits_equal_llama_cpp(random_llama: Callable[..., Path], f32_logits: np.ndarray,
                                              ftype: str) -> None:
    path = random_llama(ftype)
    tokens = random_tokens(32000, N_TOKENS)
    llm = open_llama_cpp(path, n_ctx=64)
    ref = llama_cpp_logits(llm, tokens)
    del llm
    ours = torch_logits(path, tokens)
    tol = TOLERANCE[ftype]
    diff = np.abs(ours - ref)
    assert diff.max() <= tol, f"{ftype}: max |diff| {diff.max():.4g} > {tol}"
    assert_top1_agrees(ours, ref, tol)
    if ftype in QUANTIZED and ftype != "Q8_0":
        # The comparison sees the weights' quantization: the unquantized model is much further
        # from llama.cpp's logits than ggtorch's dequantized model is.
        assert np.abs(f32_logits - ref).mean() > 2 * diff.mean()


def test_rope_freq_factors_equal_llama_cpp(random_llama: Callable[..., Path], tmp_path: Path) -> None:
    """Llama 3.1-style rope_freqs.weight divides each pair's frequency, as llama.cpp does."""
    base = random_llama("F32")
    factors = np.linspace(1.0, 8.0, 16).astype(np.float32)  # head_dim 32 -> 16 pairs
    path = rewrite_gguf(base, tmp_path / "freqs.gguf", add_tensors={"rope_freqs.weight": factors})
    tokens = random_tokens(32000, 32)
    ref = llama_cpp_logits(open_llama_cpp(path, n_ctx=32), tokens)
    ours = torch_logits(path, tokens)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=TOLERANCE["F32"])
    assert np.abs(torch_logits(base, tokens) - ours).max() > 0.1  # the factors matter


def full_and_cached_logits(model: Transformer, tokens: list[int], prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one full forward, and through a KV cache: the prefix, a 5-token chunk, then one at a time."""
    x = torch.tensor([tokens])
    with torch.no_grad():
        full = model(x)[0]
        cache = model.new_cache(1, len(tokens))
        steps = [model(x[:, :prefix], cache=cache)[0], model(x[:, prefix:prefix + 5], cache=cache)[0]]
        steps += [model(x[:, i:i + 1], cache=cache)[0] for i in range(prefix + 5, len(tokens))]
    return full, torch.cat(steps)


@pytest.mark.parametrize("which", ["stories260k", "random_llama"])
def test_kv_cache_equals_full_forward(which: str, request: pytest.FixtureRequest) -> None:
    fixture = request.getfixturevalue(which)
    path = fixture if which == "stories260k" else fixture("F32")
    f = read_gguf(path)
    model = build_model(f, ModelConfig.from_gguf(f))
    tokens = random_tokens(model.config.n_vocab, 40, seed=3)
    full, cached = full_and_cached_logits(model, tokens, prefix=7)
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-4)


def test_rope_depends_on_relative_position_only(stories260k: Path) -> None:
    """Rope makes q.k a function of the position difference: shifting every position keeps the logits."""
    f = read_gguf(stories260k)
    model = build_model(f, ModelConfig.from_gguf(f))
    tokens = torch.tensor([random_tokens(512, 12, seed=4)])
    with torch.no_grad():
        at0, at300 = model(tokens), model(tokens, start_pos=300)
    torch.testing.assert_close(at300, at0, rtol=0, atol=2e-3)


def test_batch_rows_are_independent(stories260k: Path) -> None:
    f = read_gguf(stories260k)
    model = build_model(f, ModelConfig.from_gguf(f))
    a, b = random_tokens(512, 16, seed=6), random_tokens(512, 16, seed=7)
    with torch.no_grad():
        both = model(torch.tensor([a, b]))
        torch.testing.assert_close(both[1], model(torch.tensor([b]))[0], rtol=0, atol=1e-5)


def test_config_built_model_runs_and_ties_output() -> None:
    config = ModelConfig(n_vocab=50, n_embd=32, n_layer=2, n_head=4, n_head_kv=2, n_ff=64, n_ctx_train=32,
                         tied_output=True)
    model = Transformer(config)
    assert model.output.weight is model.tok_embd.weight
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 50)

"""The fused decoders a GPU runs (torch.compile of each type's decoder, ``Policy.compiled_dequantize``) equal the
eager ones bit for bit: compiled here by Inductor's CPU backend from the graphs CUDA's Triton kernels are made of
(``pytest -m cuda`` checks every type on a GPU)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from ggtorch.ops import policy
from ggtorch.quant import DEQUANTIZERS, compiled_decoder, dequantize
from tests.quant.test_dequant import random_blocks

COMPILED_HERE = (T.Q4_0, T.Q8_0, T.Q2_K, T.Q4_K, T.Q6_K, T.IQ2_XXS, T.IQ4_XS, T.TQ1_0, T.MXFP4)
"""One type of each decoder module and field layout (nibbles, crumbs, words; f16 scales first or last in the
block; grid and trit tables; e8m0 scales): compiling all 23 takes Inductor's CPU backend about 110 s on 2 cores.
tests/test_cuda.py checks every type on a GPU."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bit patterns (NaN payloads and signed zeros compared too)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("ggml_type", COMPILED_HERE, ids=lambda t: t.name)
def test_a_compiled_decoder_equals_the_eager_one_bit_for_bit(ggml_type: T) -> None:
    """Three block counts through the compiled decoder: the first compiles it for its count, the second once more
    for any count (a tensor's last chunk is shorter), the third reuses that."""
    _, ts = GGML_QUANT_SIZES[ggml_type]
    raw = torch.from_numpy(random_blocks(ggml_type, (24, 2 * 256), seed=int(ggml_type))).reshape(-1, ts)
    fused = compiled_decoder(ggml_type, "cpu")
    for n in (raw.shape[0], 7, 13):
        assert torch.equal(_bits(fused(raw[:n])), _bits(DEQUANTIZERS[ggml_type](raw[:n]))), (ggml_type.name, n)


def test_dequantize_under_compiled_decoders_chunks_as_the_eager_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dequantize`` on a device whose policy compiles (CUDA's): the same tensor, chunk by chunk, as the eager
    decoders give it."""
    import ggtorch.quant

    monkeypatch.setattr(ggtorch.quant, "_compiled", {})
    raw = torch.from_numpy(random_blocks(T.Q4_K, (40, 512), seed=3)).reshape(-1)
    eager = dequantize(raw, T.Q4_K, (40, 512), torch.bfloat16)
    compiled = policy.choose("cpu").replace(c_dequantize=False, compiled_dequantize=True, decode_step_values=9 * 256)
    with policy.using(compiled):
        fused = dequantize(raw, T.Q4_K, (40, 512), torch.bfloat16)
    assert torch.equal(_bits(fused), _bits(eager))
    assert list(ggtorch.quant._compiled) == [T.Q4_K]  # it took the compiled decoder

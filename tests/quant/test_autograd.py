"""Autograd over raw ggml blocks and the quant modules, against llama.cpp's own dequantization.

W comes from llama.cpp's quantizer (``ggml_quantize_chunk``) and the reference float W from
llama.cpp's ``to_float``, so every expected value is independent of ggtorch's decoders.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from torch import nn

from ggtorch.quant import SUPPORTED_TYPES
from ggtorch.quant import autograd as qa
from ggtorch.quant.modules import QuantEmbedding, QuantLinear, dequantize_modules

pytestmark = pytest.mark.xdist_group("llama.cpp IQ grids")
"""With tests/quant/test_dequant.py's on one worker: llama.cpp builds its IQ1 and IQ2 grids once per process,
seconds each."""

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
ALL_TYPES = sorted(SUPPORTED_TYPES, key=int)


_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _blocks(ggml_type: T, n_rows: int, n_cols: int, ggml_quantize, ggml_to_float, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw uint8 (rows, row bytes), llama.cpp's float W (rows, cols)) for a random matrix.

    Cached per module (llama.cpp's IQ quantizers are slow): callers must not modify the result.
    """
    key = (ggml_type, n_rows, n_cols, seed)
    if key not in _CACHE:
        _CACHE[key] = _make_blocks(ggml_type, n_rows, n_cols, ggml_quantize, ggml_to_float, seed)
    return _CACHE[key]


def _make_blocks(ggml_type: T, n_rows: int, n_cols: int, ggml_quantize, ggml_to_float, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    data = np.random.default_rng(seed).standard_normal((n_rows, n_cols)).astype(np.float32)
    if ggml_type == T.F32:
        raw = data.view(np.uint8)
    elif ggml_type == T.F16:
        raw = data.astype(np.float16).view(np.uint8)
    elif ggml_type == T.BF16:
        raw = (data.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # truncation is fine: any bits
    else:
        raw = ggml_quantize(data, ggml_type)
    raw = np.ascontiguousarray(raw).reshape(n_rows, -1)
    w = ggml_to_float(raw, ggml_type).reshape(n_rows, n_cols)
    return torch.from_numpy(raw.copy()), torch.from_numpy(w.copy())


def _cols(ggml_type: T) -> int:
    return 2 * GGML_QUANT_SIZES[ggml_type][0] if ggml_type not in FLOAT_TYPES else 48


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_forward_backward_and_gradcheck(ggml_type: T, ggml_quantize, ggml_to_float) -> None:
    n_out, n_in = 7, _cols(ggml_type)
    raw, w = _blocks(ggml_type, n_out, n_in, ggml_quantize, ggml_to_float)
    w64 = w.double()
    x = torch.randn(2, 2, n_in, dtype=torch.float64, requires_grad=True)
    # chunk of 2 rows: forward and backward walk three chunks
    y = qa.quant_linear(x, raw, ggml_type, (n_out, n_in), chunk_bytes=2 * n_in * 8)
    torch.testing.assert_close(y, x @ w64.T, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    (grad_x,) = torch.autograd.grad(y, x, g)
    torch.testing.assert_close(grad_x, g @ w64, rtol=1e-12, atol=1e-12)
    # fast_mode: checks J·v for random v (one pass per output, not per input element)
    assert torch.autograd.gradcheck(
        lambda t: qa.quant_linear(t, raw, ggml_type, (n_out, n_in), chunk_bytes=2 * n_in * 8), (x,),
        fast_mode=True)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_embedding_gathers_rows(ggml_type: T, ggml_quantize, ggml_to_float) -> None:
    n_vocab, n_embd = 7, _cols(ggml_type)
    raw, w = _blocks(ggml_type, n_vocab, n_embd, ggml_quantize, ggml_to_float)
    ids = torch.tensor([[0, 6, 3, 3], [5, 5, 1, 0]])
    emb = QuantEmbedding(raw, ggml_type, (n_vocab, n_embd))
    torch.testing.assert_close(emb(ids), w[ids], rtol=0, atol=0)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_embedding_path_gradcheck(ggml_type: T, ggml_quantize, ggml_to_float) -> None:
    """The embedding of a quantized table with a LoRA delta, differentiated w.r.t. the pair."""
    from ggtorch.lora import LoRAEmbedding

    n_vocab, n_embd = 7, _cols(ggml_type)
    raw, w = _blocks(ggml_type, n_vocab, n_embd, ggml_quantize, ggml_to_float)
    module = LoRAEmbedding(QuantEmbedding(raw, ggml_type, (n_vocab, n_embd)), rank=2, alpha=3.0).double()
    module.base.dtype = torch.float64
    ids = torch.tensor([[1, 6, 1], [0, 2, 5]])
    a = torch.randn(n_vocab, 2, dtype=torch.float64, requires_grad=True)
    b = torch.randn(n_embd, 2, dtype=torch.float64, requires_grad=True)

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(module, {"lora_a": a, "lora_b": b}, (ids,))

    torch.testing.assert_close(f(a, b), w.double()[ids] + 1.5 * a[ids] @ b.T)
    assert torch.autograd.gradcheck(f, (a, b), fast_mode=True)


def test_only_the_raw_blocks_are_saved_for_backward(ggml_quantize, ggml_to_float) -> None:
    raw, _ = _blocks(T.Q4_0, 64, 64, ggml_quantize, ggml_to_float)
    m = QuantLinear(raw, T.Q4_0, (64, 64))
    y = m(torch.randn(3, 64, requires_grad=True))
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 2 and saved[0].dtype == torch.uint8 and saved[1] is None
    assert saved[0].data_ptr() == raw.data_ptr()  # a reference, no copy, no float W
    assert not m.raw.requires_grad


def test_inside_keeping_dequantized_the_decoded_matrix_is_saved_and_backward_equals(ggml_quantize,
                                                                                   ggml_to_float) -> None:
    """keeping_dequantized (a checkpointed block's recomputation): W decoded in forward is saved for
    backward, which then decodes nothing; the gradient is the same bit for bit."""
    from ggtorch.quant import autograd

    raw, w = _blocks(T.Q4_0, 64, 64, ggml_quantize, ggml_to_float)
    m = QuantLinear(raw, T.Q4_0, (64, 64))
    x, g = torch.randn(3, 64), torch.randn(3, 64)
    grads = []
    for keep in (False, True):
        xi = x.clone().requires_grad_()
        with autograd.keeping_dequantized() if keep else contextlib.nullcontext():
            y = m(xi)
        saved = y.grad_fn.saved_tensors
        assert (saved[1] is not None) is keep
        if keep:
            torch.testing.assert_close(saved[1], w, rtol=0, atol=0)
        y.backward(g)
        grads.append(xi.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    with autograd.keeping_dequantized():  # no gradient for x: nothing to keep
        assert m(x).grad_fn is None or m(x).grad_fn.saved_tensors[1] is None


def test_a_budget_keeps_matrices_in_the_order_they_run_until_it_is_spent(ggml_quantize, ggml_to_float,
                                                                         cpu_policy) -> None:
    """keeping_dequantized(budget): products keep W while what they keep together fits the budget (no
    per-matrix limit), the rest decode again in backward; gradients are the same bit for bit."""
    from ggtorch.quant import autograd

    cpu_policy(keep_dequantized_bytes=0)  # the checkpointed blocks' limit plays no part
    shapes = [(32, 64), (64, 32), (16, 64)]  # decoded f32: 8 KiB each, then 4 KiB
    mats = [QuantLinear(_blocks(T.Q4_0, *shape, ggml_quantize, ggml_to_float)[0], T.Q4_0, shape) for shape in shapes]
    x, g = torch.randn(3, 64), torch.randn(3, 16)
    grads, kept = [], []
    for budget in (None, 12 << 10):
        xi = x.clone().requires_grad_()
        outs = []
        with autograd.keeping_dequantized(budget) if budget else contextlib.nullcontext():
            for m in mats:
                outs.append(m(outs[-1] if outs else xi))
        kept.append([o.grad_fn.saved_tensors[1] is not None for o in outs])
        outs[-1].backward(g)
        grads.append(xi.grad)
    assert kept == [[False, False, False], [True, False, True]]  # 8 KiB kept; the next 8 no longer fit; 4 do
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_storage_is_reused_by_the_next_forward_and_guards_an_older_graph(ggml_quantize, ggml_to_float) -> None:
    """keeping_dequantized(budget, storage): the matrices are decoded into the list's memory, which the next
    forward writes again (no new allocation per step) with gradients equal to decoding again in backward;
    the backward of a graph whose kept matrix was overwritten raises instead of using the new values."""
    from ggtorch.quant import autograd

    shapes = [(32, 64), (64, 32)]
    mats = [QuantLinear(_blocks(T.Q4_0, *shape, ggml_quantize, ggml_to_float, seed=i)[0], T.Q4_0, shape)
            for i, shape in enumerate(shapes)]
    storage: list[torch.Tensor] = []

    def grad(x: torch.Tensor, g: torch.Tensor, keep: bool) -> torch.Tensor:
        x = x.clone().requires_grad_()
        with autograd.keeping_dequantized(1 << 20, storage) if keep else contextlib.nullcontext():
            y = mats[1](mats[0](x))
        y.backward(g)
        return x.grad

    pointers = []
    for seed in (0, 1):
        x, g = torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)), torch.randn(3, 64)
        torch.testing.assert_close(grad(x, g, keep=True), grad(x, g, keep=False), rtol=0, atol=0)
        pointers.append([m.data_ptr() for m in storage])
    assert len(pointers[0]) == 2 and pointers[0] == pointers[1]

    x = torch.randn(3, 64, requires_grad=True)
    with autograd.keeping_dequantized(1 << 20, storage):
        older = mats[0](x)
    with autograd.keeping_dequantized(1 << 20, storage):
        mats[0](torch.randn(3, 64, requires_grad=True))  # rewrites storage[0] before older's backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        older.sum().backward()


def test_chunk_size_bounds_rows() -> None:
    assert qa.rows_per_chunk(4096, torch.float32, 4 << 20) == 256
    assert qa.rows_per_chunk(4096, torch.bfloat16, 4 << 20) == 512
    assert qa.rows_per_chunk(1 << 22, torch.float32, 1024) == 1  # never zero rows


def test_chunked_equals_unchunked(ggml_quantize, ggml_to_float) -> None:
    raw, w = _blocks(T.Q6_K, 37, 512, ggml_quantize, ggml_to_float)
    x = torch.randn(5, 512)
    whole = qa.quant_linear(x, raw, T.Q6_K, (37, 512), chunk_bytes=1 << 30)
    tiny = qa.quant_linear(x, raw, T.Q6_K, (37, 512), chunk_bytes=1)  # one row per chunk
    torch.testing.assert_close(tiny, whole, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(whole, x @ w.T, rtol=1e-5, atol=1e-4)


def test_autocast_bf16(ggml_quantize, ggml_to_float) -> None:
    raw, w = _blocks(T.Q8_0, 64, 128, ggml_quantize, ggml_to_float)
    m = QuantLinear(raw, T.Q8_0, (64, 128))
    x = torch.randn(4, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16  # as autocast's F.linear
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32  # the gradient comes back in the input's dtype
    torch.testing.assert_close(y.float(), x.detach() @ w.T, rtol=2e-2, atol=0.25)
    torch.testing.assert_close(x.grad, w.sum(0).expand(4, -1), rtol=2e-2, atol=0.1)


def test_module_construction_does_not_copy(ggml_quantize, ggml_to_float) -> None:
    raw, _ = _blocks(T.Q4_K, 8, 256, ggml_quantize, ggml_to_float)
    flat = raw.reshape(-1)
    m = QuantLinear(flat, T.Q4_K, (8, 256))
    assert m.raw.data_ptr() == flat.data_ptr() and m.raw.shape == (8, 144)
    with pytest.raises(ValueError, match="bytes"):
        QuantLinear(flat[:-1], T.Q4_K, (8, 256))


def test_state_dict_round_trip_keeps_type_and_shape(ggml_quantize, ggml_to_float) -> None:
    raw, w = _blocks(T.Q5_K, 4, 256, ggml_quantize, ggml_to_float)
    src = QuantLinear(raw, T.Q5_K, (4, 256))
    other_raw, _ = _blocks(T.Q8_0, 4, 256, ggml_quantize, ggml_to_float, seed=1)
    dst = QuantLinear(other_raw, T.Q8_0, (4, 256))  # another type, another byte count
    dst.load_state_dict(src.state_dict())
    assert dst.ggml_type == T.Q5_K and dst.shape == (4, 256)
    torch.testing.assert_close(dst.dequantized_weight(), w, rtol=0, atol=0)
    path_sd = nn.Sequential(src).state_dict()
    assert set(path_sd) == {"0.raw", "0._extra_state"}


def test_to_moves_buffers_and_ignores_float_casts(ggml_quantize, ggml_to_float) -> None:
    raw, _ = _blocks(T.Q4_0, 4, 64, ggml_quantize, ggml_to_float)
    m = QuantLinear(raw, T.Q4_0, (4, 64))
    m.to(torch.bfloat16)
    assert m.raw.dtype == torch.uint8
    m.to("meta")
    assert m.raw.is_meta and m.raw.dtype == torch.uint8


def test_dequantize_modules_shares_tied_weights(ggml_quantize, ggml_to_float) -> None:
    raw, w = _blocks(T.Q4_1, 12, 64, ggml_quantize, ggml_to_float)
    model = nn.Module()
    model.emb = QuantEmbedding(raw, T.Q4_1, (12, 64))
    model.out = QuantLinear(model.emb.raw, T.Q4_1, (12, 64))  # tied: the same buffer
    x = torch.randn(3, 64)
    y_quant = model.out(x)
    dequantize_modules(model)
    assert isinstance(model.out, nn.Linear) and isinstance(model.emb, nn.Embedding)
    assert model.out.weight is model.emb.weight and not model.out.weight.requires_grad
    torch.testing.assert_close(model.emb.weight, w, rtol=0, atol=0)
    torch.testing.assert_close(model.out(x), y_quant, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_lora_grads_equal_dequantized_base(ggml_type: T, ggml_quantize, ggml_to_float) -> None:
    """Every supported type: a LoRA over the quantized base trains like one over the float base."""
    from ggtorch.lora import LoRALinear
    from ggtorch.ops.matmul import Linear

    n_out, n_in = 7, _cols(ggml_type)
    raw, w = _blocks(ggml_type, n_out, n_in, ggml_quantize, ggml_to_float)
    float_base = Linear(n_in, n_out, bias=False)  # the float module ggtorch builds (same GEMM kernels)
    float_base.weight = nn.Parameter(w.clone(), requires_grad=False)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, n_in, generator=gen) * 0.1, torch.randn(n_out, 3, generator=gen) * 0.1
    x = torch.randn(4, n_in, generator=gen)
    results = []
    for base in (QuantLinear(raw, ggml_type, (n_out, n_in)), float_base):
        m = LoRALinear(base, rank=3, alpha=6.0)
        with torch.no_grad():
            m.lora_a.copy_(a)
            m.lora_b.copy_(b)
        loss = m(x).square().mean()
        loss.backward()
        results.append((loss.detach(), m.lora_a.grad, m.lora_b.grad))
    for got, want in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

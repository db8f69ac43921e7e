"""attention.c against softmax attention written out in float64 (f32: within twice torch's own f32 error; bf16,
where the library computes it: within 1.25 times the error of torch's flash kernel in bf16): outputs and the
gradients of q, k and v for causal, packed, bidirectional and sliding-window masks, grouped-query heads,
sequences that end inside an 8-query tile and a 64-query block, head widths from 8 (padded) to 256, inputs read through
strides; a query that sees no key; the same bits on one thread and two; what it takes and refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ggtorch.ops import attention as native

pytestmark = pytest.mark.skipif(native._library() is None, reason="no C compiler to build attention.c")

SCALE = 0.17
BF16 = pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
    native._library() is None or not native.dtype_taken(torch.bfloat16), reason="built without bf16 dot products"))
DTYPES = [pytest.param(torch.float32, id="f32"), BF16]


def _allowed(kind: str, B: int, T: int) -> torch.Tensor | None:
    """None (causal) or a (B|1, 1, T, T) / (T, T) boolean mask, True where a query may see a key."""
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if kind == "causal":
        return None
    if kind == "window":  # gemma's sliding window, shorter than the sequence
        return causal & (torch.arange(T)[:, None] - torch.arange(T)[None, :] < 9)
    segments = torch.stack([torch.arange(T) * (2 + b) // T for b in range(B)])  # 2 and 3 records per row
    same = (segments[:, :, None] == segments[:, None, :])[:, None]
    return same & causal if kind == "packed" else same


def _formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    T = q.shape[2]
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    seen = torch.ones(T, T, dtype=torch.bool).tril() if allowed is None else allowed
    scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~seen, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _inputs(B: int, H: int, Hkv: int, T: int, D: int, strided: bool, seed: int = 0) -> list[torch.Tensor]:
    """q (B, H, T, D), k and v (B, Hkv, T, D): views of (B, T, heads, D) tensors, as a model's projections
    give them, or contiguous."""
    gen = torch.Generator().manual_seed(seed)

    def one(heads: int, scale: float) -> torch.Tensor:
        if strided:
            return (torch.randn(B, T, heads, D, generator=gen) * scale).transpose(1, 2)
        return torch.randn(B, heads, T, D, generator=gen) * scale

    return [one(H, 3.0), one(Hkv, 1.0), one(Hkv, 1.0)]


def _grads(fn, tensors: list[torch.Tensor], grad_out: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    leaves = [t.detach().to(dtype).requires_grad_() for t in tensors]
    y = fn(*leaves)
    y.backward(grad_out.to(dtype))
    return [y.detach().double()] + [t.grad.double() for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["causal", "packed", "bidirectional", "window"])
@pytest.mark.parametrize(("H", "Hkv"), [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize(("T", "D"), [(37, 16), (130, 64), (200, 256), (45, 8), (70, 40)],
                         ids=["short", "blocks", "wide", "narrow", "uneven"])
@pytest.mark.parametrize("strided", [True, False], ids=["strided", "contiguous"])
def test_outputs_and_gradients_equal_the_formula_in_float64(dtype: torch.dtype, kind: str, H: int, Hkv: int, T: int,
                                                            D: int, strided: bool) -> None:
    B = 2
    tensors = _inputs(B, H, Hkv, T, D, strided)
    allowed = _allowed(kind, B, T)
    grad_out = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1))
    assert native.takes(*(t.to(dtype) for t in tensors), allowed)
    got = _grads(lambda q, k, v: native.attention(q, k, v, SCALE, allowed), tensors, grad_out, dtype)
    want = _grads(lambda q, k, v: _formula(q, k, v, allowed), tensors, grad_out, torch.float64)
    if dtype == torch.float32:  # against torch's own rounding of the formula
        peer = _grads(lambda q, k, v: _formula(q, k, v, allowed), tensors, grad_out, dtype)
        factor = 2.0
    else:  # against torch's flash kernel, which rounds the probabilities and score gradients to bf16 too
        peer = _grads(lambda q, k, v: _sdpa(q, k, v, allowed), tensors, grad_out, dtype)
        factor = 1.25

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    for name, a, t, b in zip(("out", "q", "k", "v"), got, peer, want, strict=True):
        assert rel(a, b) < max(1e-6, factor * rel(t, b)), (name, rel(a, b), rel(t, b))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None, scale=SCALE,
                                          enable_gqa=q.shape[1] != k.shape[1])


def test_the_output_and_gradients_are_stored_tokens_first() -> None:
    """(B, H, T, D) views of (B, T, H, D) memory: the model's transpose back to (B, T, H·D) is a view."""
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, 24, 32, strided=False))
    y = native.attention(q, k, v, SCALE)
    assert y.transpose(1, 2).is_contiguous()
    grads = torch.autograd.grad(y, (q, k, v), torch.ones_like(y))
    assert all(g.transpose(1, 2).is_contiguous() for g in grads)


def test_a_query_that_sees_no_key_gets_zero() -> None:
    """As torch's scaled_dot_product_attention: output 0, and nothing flows back from that row."""
    T = 20
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    allowed[5] = False
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 2, T, 16, strided=True))
    y = native.attention(q, k, v, SCALE, allowed)
    assert torch.equal(y[:, :, 5], torch.zeros_like(y[:, :, 5]))
    grad_out = torch.zeros_like(y)
    grad_out[:, :, 5] = 1.0
    y.backward(grad_out)
    assert all(torch.equal(t.grad, torch.zeros_like(t.grad)) for t in (q, k, v))
    others = allowed.clone()
    others[5, 0] = True  # row 5 sees key 0 only: the other rows' outputs are unchanged
    torch.testing.assert_close(native.attention(q, k, v, SCALE, others)[:, :, :5], y[:, :, :5], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_same_bits_on_one_thread_and_two(dtype: torch.dtype) -> None:
    tensors = _inputs(2, 8, 2, 150, 64, strided=True)
    grad_out = torch.randn(2, 8, 150, 64, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(_grads(lambda q, k, v: native.attention(q, k, v, SCALE), tensors, grad_out, dtype))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_what_it_takes() -> None:
    q, k, v = _inputs(1, 4, 2, 32, 64, strided=True)
    assert native.takes(q, k, v, None)
    assert native.takes(*(t.bfloat16() for t in (q, k, v)), None) == native.dtype_taken(torch.bfloat16)
    assert not native.takes(*(t.half() for t in (q, k, v)), None)
    if native.dtype_taken(torch.bfloat16):  # bf16 keys and values are read as pairs: even strides only
        odd = torch.randn(1, 32, 2 * 64 + 1, dtype=torch.bfloat16)[..., :128].view(1, 32, 2, 64).transpose(1, 2)
        assert not native.takes(q.bfloat16(), odd, odd, None)
    narrow = _inputs(1, 4, 2, 32, 8, strided=True)
    assert native.takes(*narrow, None)  # padded to whole vectors
    wide = _inputs(1, 1, 1, 32, native.MAX_HEAD + 8, strided=True)
    assert not native.takes(*wide, None)
    long = _inputs(1, 1, 1, native.MAX_TOKENS + 1, 16, strided=True)
    assert not native.takes(*long, None)
    per_head = torch.ones(1, 4, 32, 32, dtype=torch.bool)
    assert not native.takes(q, k, v, per_head)  # one mask for every head
    assert not native.takes(q, k[:, :, :16], v[:, :, :16], None)  # cross-attention

"""Training attention as batched products (and through attention.c where it is built: every test runs both ways) against
torch's own scaled_dot_product_attention in float64: outputs and gradients of q, k, v, causal, packed and
non-causal masks, grouped-query heads, one block of queries and several (the last one partial); and the dispatch:
the written-out paths only where the policy's written_attention_max_tokens allows and a backward follows.
gpt-oss's sinks through SDPA against the softmax with sinks written out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ggtorch.models.attention import (
    BLOCK_ROWS,
    NARROW_COLUMNS,
    _key_ends,
    attention,
)
from ggtorch.ops import attention as native
from ggtorch.ops import policy

SCALE = 0.125
C_NODE = "GeneratedBackwardFor_ggtorch_attention_defaultBackward"
"""The backward node of the ``ggtorch::attention`` op (attention.c)."""
WRITTEN_OUT = ("_ProductAttentionBackward", C_NODE)
"""The training paths' backward nodes: the batched products' and attention.c's."""


def _node(y: torch.Tensor) -> str:
    """The name of the backward node that computed ``y``, past the slice that cuts a padded head."""
    node = y.grad_fn
    while type(node).__name__ == "SliceBackward0":
        node = node.next_functions[0][0]
    return type(node).__name__


@pytest.fixture(autouse=True, params=[False, True], ids=["products", "c"])
def in_c(request: pytest.FixtureRequest, cpu_policy) -> bool:
    """Each test with attention.c off, and on where it is built."""
    if request.param and native._library() is None:
        pytest.skip("no C compiler to build attention.c")
    cpu_policy(c_attention=request.param)
    return request.param


def max_tokens() -> int:
    """The CPU policy's longest written-out training attention."""
    return policy.current("cpu").written_attention_max_tokens


def _written_out_node(dtype: torch.dtype, in_c: bool) -> str:
    """The backward node a training call on the written-out paths gets."""
    c = in_c and native.dtype_taken(dtype)
    return C_NODE if c else "_ProductAttentionBackward"


def _qkv(B: int, H: int, Hkv: int, T: int, q_scale: float = 4.0, seed: int = 0, D: int = 64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen) * q_scale  # scores of a few units, as in a trained model
    k, v = (torch.randn(B, Hkv, T, D, generator=gen) for _ in range(2))
    return [q, k, v]


def _packed_mask(B: int, T: int, causal: bool = True) -> torch.Tensor:
    """(B, 1, T, T): rows of several records, causal inside each (or not), nothing across."""
    segments = torch.stack([torch.arange(T) // (T // (2 + b)) for b in range(B)])  # (B, T)
    same = segments[:, :, None] == segments[:, None, :]
    return (same & torch.ones(T, T, dtype=torch.bool).tril())[:, None] if causal else same[:, None]


def _mask(masking: str, B: int, T: int) -> torch.Tensor | None:
    return {"causal": None, "packed": _packed_mask(B, T),
            "bidirectional": _packed_mask(B, T, causal=False)}[masking]


def _run(fn, tensors: list[torch.Tensor], dtype: torch.dtype, grad_out: torch.Tensor) -> tuple[list[torch.Tensor], str]:
    leaves = [t.detach().to(dtype, copy=True).requires_grad_() for t in tensors]
    y = fn(*leaves)
    node = _node(y)
    y.backward(grad_out.to(dtype))
    return [y.detach().double()] + [t.grad.double() for t in leaves], node


def _reference(tensors: list[torch.Tensor], grad_out: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=SCALE,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return _run(sdpa, tensors, torch.float64, grad_out)[0]


@pytest.mark.parametrize(("dtype", "D"), [(torch.float32, 64), (torch.bfloat16, 64),
                                          (torch.float32, NARROW_COLUMNS // 2)], ids=["f32", "bf16", "f32-narrow"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("masking", ["causal", "packed", "bidirectional"])
@pytest.mark.parametrize("T", [64, 2 * BLOCK_ROWS + 44], ids=["one-block", "three-blocks"])
def test_products_match_sdpa_in_float64(dtype: torch.dtype, heads: tuple[int, int], masking: str, T: int, D: int,
                                        cpu_policy, in_c: bool) -> None:
    """f32: to f32 rounding. bf16: no further from float64 than torch's flash kernel in bf16 (the
    path it replaces), times 1.25. A bidirectional mask lets a block's queries see keys past its
    end, which the blocks must then include. Narrow f32 heads take the transposed products.
    (The length limit is lifted to T: the dispatch has its own tests.)"""
    cpu_policy(written_attention_max_tokens=T)
    B = 2
    tensors = _qkv(B, heads[0], heads[1], T, D=D)
    grad_out = torch.randn(B, heads[0], T, D, generator=torch.Generator().manual_seed(1))
    mask = _mask(masking, B, T)
    want = _reference(tensors, grad_out, mask)
    got, node = _run(lambda q, k, v: attention(q, k, v, scale=SCALE, causal=mask is None, mask=mask),
                     tensors, dtype, grad_out)
    assert node == _written_out_node(dtype, in_c)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    if dtype == torch.float32:
        for g, w in zip(got, want, strict=True):
            assert rel(g, w) < 1e-6
        return
    flash, _ = _run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                                   scale=SCALE, enable_gqa=heads[0] != heads[1]),
                    tensors, dtype, grad_out)
    for name, g, f, w in zip(("out", "q", "k", "v"), got, flash, want, strict=True):
        assert rel(g, w) <= 1.25 * rel(f, w), (name, rel(g, w), rel(f, w))


def test_each_block_meets_the_keys_its_queries_may_see() -> None:
    """Under a causal mask a block stops at its last query; a packed causal mask no later; a
    bidirectional one at the end of each block's last record."""
    T = 2 * BLOCK_ROWS + 44
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert _key_ends(causal, T) == [BLOCK_ROWS, 2 * BLOCK_ROWS, T]
    assert _key_ends(_packed_mask(2, T), T) == [BLOCK_ROWS, 2 * BLOCK_ROWS, T]
    # one row of two records of T/2 tokens: block 0 (queries 0..BLOCK_ROWS-1) lies in the first, which
    # ends at T/2; blocks 1 and 2 reach into the second, which ends at T
    assert _key_ends(_packed_mask(1, T, causal=False), T) == [T // 2, T, T]


def test_the_products_path_and_flash_give_the_same_training_step_result() -> None:
    """Above the length limit the same call goes to flash; both agree (f32, causal, GQA)."""
    T = max_tokens()
    tensors = _qkv(1, 8, 2, T, q_scale=1.0)
    grad_out = torch.randn(1, 8, T, 64, generator=torch.Generator().manual_seed(2))
    results = []
    for limit in (T, T - 1):
        with policy.using(policy.current("cpu").replace(written_attention_max_tokens=limit)):
            got, node = _run(lambda q, k, v: attention(q, k, v, scale=SCALE, causal=True), tensors,
                             torch.float32, grad_out)
        results.append(got)
        assert (node in WRITTEN_OUT) == (limit == T), node
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("D", [NARROW_COLUMNS // 2, 64, 256], ids=["narrow", "d64", "wide"])
def test_the_length_limit_depends_on_dtype_only(dtype: torch.dtype, D: int) -> None:
    """Every head width takes the products up to its dtype's limit, and flash past it."""
    limit = max_tokens()
    for T, products in ((limit, True), (limit + 1, False)):
        q, k, v = (t.to(dtype).requires_grad_() for t in _qkv(1, 2, 1, T, D=D))
        y = attention(q, k, v, scale=SCALE, causal=True)
        assert (_node(y) in WRITTEN_OUT) == products, (T, D)


def test_inference_and_cache_calls_keep_flash() -> None:
    q, k, v = _qkv(1, 4, 4, 16)
    with torch.no_grad():
        y = attention(q, k, v, scale=SCALE, causal=True)
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE))
    q.requires_grad_()
    y = attention(q[:, :, -4:], k, v, scale=SCALE, causal=False)  # 4 new queries over 16 cached keys
    assert _node(y) not in WRITTEN_OUT


def _sinks_formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   allowed: torch.Tensor) -> torch.Tensor:
    """ggml_soft_max_add_sinks written out: each head's sink logit joins its rows' softmax denominators."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~allowed, float("-inf"))  # (B, H, T, S)
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    sink = torch.exp(sinks.view(1, -1, 1, 1) - scores.amax(dim=-1, keepdim=True))
    return e / (e.sum(dim=-1, keepdim=True) + sink) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masking", ["causal", "packed", "decoding"])
def test_sinks_through_the_fused_kernel_equal_the_formula_in_float64(dtype: torch.dtype, masking: str) -> None:
    """gpt-oss's sinks as one more key of SDPA: outputs and the gradients of q, k, v and the sinks equal the
    written-out softmax with the sinks in its denominators (grouped-query heads; decoding: 5 queries at the end
    of 40 keys)."""
    B, H, Hkv, T = 2, 8, 2, 40
    q, k, v = _qkv(B, H, Hkv, T, q_scale=2.0)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(5)) * 2
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = {"causal": None, "packed": _packed_mask(B, T), "decoding": causal[-5:]}[masking]
    if masking == "decoding":
        q = q[:, :, -5:]
    allowed = causal if mask is None else mask
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))

    def ours(q, k, v, s):
        return attention(q, k, v, scale=SCALE, causal=mask is None, mask=mask, sinks=s)

    got, _ = _run(ours, [q, k, v, sinks], dtype, grad_out)
    ref, _ = _run(lambda q, k, v, s: _sinks_formula(q, k, v, s, allowed), [q, k, v, sinks], torch.float64, grad_out)
    tol = 1e-5 if dtype == torch.float32 else 0.03  # bf16: the inputs' own rounding
    for name, a, b in zip(("out", "q", "k", "v", "sinks"), got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=tol * max(1.0, float(b.abs().max())), msg=name)
    assert float(ref[4].abs().min()) > 1e-3  # every sink takes a share of its rows


@pytest.mark.parametrize("masking", ["causal", "packed"])
def test_under_bf16_autocast_scores_and_softmax_stay_f32(masking: str) -> None:
    """Autocast would run the f32 score products in bf16 (and round the scores before the softmax): the products
    path switches it off, so a step under autocast is the step without it, bit for bit."""
    tensors = _qkv(2, 4, 2, BLOCK_ROWS + 40)
    grad_out = torch.randn(2, 4, BLOCK_ROWS + 40, 64, generator=torch.Generator().manual_seed(3))
    mask = _mask(masking, 2, BLOCK_ROWS + 40)

    def products(q, k, v):
        return attention(q, k, v, scale=SCALE, causal=mask is None, mask=mask)

    plain, node = _run(products, tensors, torch.bfloat16, grad_out)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast, _ = _run(products, tensors, torch.bfloat16, grad_out)
    assert node in WRITTEN_OUT
    assert all(torch.equal(a, b) for a, b in zip(plain, autocast, strict=True))


def test_a_mask_that_is_the_causal_one_takes_the_causal_path() -> None:
    """gemma's sliding window over a sequence shorter than the window is the causal mask: given as a mask, the
    call computes what the causal call computes, bit for bit (attention.c then skips the masked triangle)."""
    T = BLOCK_ROWS + 40
    tensors = _qkv(2, 4, 2, T)
    grad_out = torch.randn(2, 4, T, 64, generator=torch.Generator().manual_seed(4))
    window = torch.arange(T)[:, None] - torch.arange(T)[None, :] < 2 * T
    mask = torch.ones(T, T, dtype=torch.bool).tril() & window
    causal, _ = _run(lambda q, k, v: attention(q, k, v, scale=SCALE, causal=True), tensors, torch.float32, grad_out)
    masked, _ = _run(lambda q, k, v: attention(q, k, v, scale=SCALE, causal=False, mask=mask), tensors,
                     torch.float32, grad_out)
    assert all(torch.equal(a, b) for a, b in zip(causal, masked, strict=True))

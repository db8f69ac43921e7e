"""Causal self-attention for training: on CPU for short sequences (:func:`products_max_tokens`) the scores
written out a block of queries at a time against only the keys it may see, in C (:mod:`ggtorch.ops.attention`,
where it takes the call: f32, and bf16 on CPUs with bf16 dot products) or as batched matrix products;
``F.scaled_dot_product_attention`` everywhere else (gpt-oss's sinks included); on a device whose policy says so (CUDA),
FlexAttention's fused kernel for every training mask (:mod:`ggtorch.ops.flex_attention`).

torch's CPU flash attention walks the sequence in small blocks; at training lengths that is
slower than writing the score matrix out and running plain batched products. The products go a
block of :data:`BLOCK_ROWS` queries at a time against only the keys that block may see (under a
causal mask, the keys up to its last query), so the masked upper triangle beyond the diagonal
blocks is never computed: a quarter of the work at two blocks, 3/8 at four. Their price is memory:
each block's probabilities are saved for backward, where flash keeps one log-sum-exp per row, and
past the length limit that memory grows with the square of the sequence.

Precision matches flash's: scores, softmax and its backward in f32, the products with the
probabilities in the input dtype, as the flash kernel does for bf16, under autocast too (which
would otherwise run the f32 score products in bf16 and round the scores before the softmax). Key
and value gradients are summed over the blocks in the input dtype (bf16 partial sums stay within flash's error in
tests/models/test_attention.py; an f32 accumulator would cost a pass per block).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ggtorch.ops import attention as native
from ggtorch.ops import flex_attention, policy

SINK_COLUMNS = 8
"""Columns added to each query and key head to carry gpt-oss's sinks (:func:`_attention_with_sinks`): the first
holds the sink, the others keep the head size a multiple of 8, as CUDA's fused kernels want it."""

NARROW_COLUMNS = 16
"""Below this many output columns an f32 batched product runs transposed (:func:`_bmm`)."""

BLOCK_ROWS = 128
"""Queries per block of the products path: small enough that the blocks skip most of the masked
triangle, large enough for full-speed batched products (and few enough blocks per call: at 64 rows
isolated calls ran faster, whole training steps of tiny models slower, the rest no faster)."""


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
              mask: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
              softcap: float = 0.0) -> torch.Tensor:
    """softmax(q k^T · scale + masking) v for q (B, H, T, D) and k, v (B, Hkv, S, D), H a multiple
    of Hkv (query head h reads key/value head h // (H / Hkv), as llama.cpp's broadcast does).

    ``mask`` (broadcastable to (B, 1, T, S), True where a query may attend) or ``causal``. ``sinks`` (H,):
    gpt-oss's per-head logit that joins every softmax's denominator (ggml_soft_max_add_sinks). ``softcap``:
    gemma's cap·tanh(q·k / cap) before the scale (no family has both).
    """
    flex = policy.current(q.device).flex_attention
    if flex and _training_self_attention(q, k, v):
        return flex_attention.attention(q, k, v, scale=scale, causal=causal, mask=mask, softcap=softcap, sinks=sinks,
                                        compiled=flex == "compiled")
    if softcap:
        return _capped_attention(q, k, v, scale, softcap, mask, causal)
    if sinks is not None:
        return _attention_with_sinks(q, k, v, scale, causal, mask, sinks)
    if _as_products(q, k, v, causal, mask):
        if native.takes(q, k, v, mask):
            return native.attention(q, k, v, scale, None if causal or _is_causal(mask, q.shape[2]) else mask)
        return _ProductAttention.apply(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                          mask: torch.Tensor | None, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax denominators also hold exp(sinks[h]), through the fused kernel: one more key,
    first, that every query sees and whose value is zero, so it adds its share to the denominator and nothing
    to the output. Its score is the sink: query head h carries sinks[h] / scale in an extra column, real keys
    0 there and the sink key 1 (a sink per query head survives grouped-query attention). Flash keeps one
    log-sum-exp per row where written-out scores keep every probability."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    dtype = q.dtype

    def widened(t: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        rest = t.new_zeros(*t.shape[:-1], SINK_COLUMNS - (first is not None))
        return torch.cat((t, rest) if first is None else (t, first, rest), dim=-1)

    sink_column = (sinks.float() / scale).to(dtype).view(1, H, 1, 1).expand(B, H, T, 1)
    sink_key = q.new_zeros(B, Hkv, 1, D + SINK_COLUMNS)
    sink_key[..., D] = 1.0
    keys = torch.cat((sink_key, widened(k.to(dtype))), dim=2)  # (B, Hkv, 1 + S, D + SINK_COLUMNS)
    values = torch.cat((q.new_zeros(B, Hkv, 1, D + SINK_COLUMNS), widened(v.to(dtype))), dim=2)
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device)
        if causal:
            mask = mask.tril(diagonal=S - T)
    mask = torch.cat((mask.new_ones(*mask.shape[:-1], 1), mask), dim=-1)  # the sink key: seen by every query
    out = F.scaled_dot_product_attention(widened(q, sink_column), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=H != Hkv)
    return out[..., :D]


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap · tanh(x / cap): gemma's soft-capping of attention scores and logits."""
    return torch.tanh(x / cap) * cap


def causal_mask(T: int, S: int, device: torch.device) -> torch.Tensor:
    """(T, S) True where query t (at position S - T + t) may see key s: s <= its position."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cap: float,
                      mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """Attention with soft-capped scores, in llama.cpp's order: cap·tanh(q·k / cap), times the scale,
    masked, softmax (f32), times v. Written out, where no fused kernel takes a cap (SDPA's)."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    k = k.repeat_interleave(G, dim=1) if G > 1 else k
    v = v.repeat_interleave(G, dim=1) if G > 1 else v
    scores = softcap(q.float() @ k.float().transpose(-1, -2), cap) * scale  # (B, H, T, S)
    if causal:
        mask = causal_mask(T, k.shape[2], q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1).to(v.dtype) @ v).to(q.dtype)


def _training_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """A training step's attention (a backward follows, queries and keys the same tokens), what the written-out
    and FlexAttention paths take: one kernel per shape serves every step; inference and generation's growing caches
    keep flash."""
    return (q.shape[2] == k.shape[2] and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad))


def _is_causal(mask: torch.Tensor, T: int) -> bool:
    """Whether a boolean mask of a T-token self-attention is the causal one (a sliding window longer than the
    sequence is), so that a kernel may skip the masked triangle."""
    causal = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()
    return mask.shape[-2:] == (T, T) and bool((mask == causal).all())


def products_max_tokens(dtype: torch.dtype, device: torch.device | str) -> int:
    """Longest sequence whose training attention on ``device`` runs written out, in C or as batched products (the
    policy's ``written_attention_max_tokens``; 0: never). On CPU up to 512 tokens both beat flash at every head
    width they take; past it the batched products' saved probabilities outgrow the gain
    (:func:`saved_keys_per_query`), and attention.c's buffers end there (its MAX_TOKENS)."""
    p = policy.current(device)
    return p.written_attention_max_tokens if dtype in p.written_attention_dtypes else 0


def saved_keys_per_query(T: int) -> float:
    """Probabilities the products path saves per query of a causal T-token sequence, on average:
    a block's queries keep one per key up to the block's end."""
    return sum((r1 - r0) * r1 for r0, r1 in _blocks(T)) / T


def _blocks(T: int) -> list[tuple[int, int]]:
    """The query blocks (r0, r1) of a T-token sequence, the last one shorter when T is not a multiple."""
    return [(r0, min(r0 + BLOCK_ROWS, T)) for r0 in range(0, T, BLOCK_ROWS)]


def _as_products(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> bool:
    """Training (a backward will follow) on CPU, self-attention over a short sequence, causal or a
    boolean mask; inference and KV-cache calls keep flash."""
    return (_training_self_attention(q, k, v) and q.shape[2] <= products_max_tokens(q.dtype, q.device)
            and k.dtype == v.dtype == q.dtype and (causal or (mask is not None and mask.dtype == torch.bool)))


def _key_ends(allowed: torch.Tensor, T: int) -> list[int]:
    """Per block of queries, one past the last key any of its queries may see (at least one key)."""
    last = (allowed.reshape(-1, T, T).any(dim=0) * torch.arange(1, T + 1, device=allowed.device)).amax(dim=-1)
    return [max(1, int(last[r0:r1].max())) for r0, r1 in _blocks(T)]


def _rows(t: torch.Tensor, r0: int, r1: int, n_kv: int) -> torch.Tensor:
    """Positions r0..r1 of (B, H, T, D) as (B·Hkv, G·n, D): one KV head's query heads stacked along the
    rows, so grouped-query attention needs no copies of k and v."""
    B, H, _, D = t.shape
    return t[:, :, r0:r1].reshape(B * n_kv, (H // n_kv) * (r1 - r0), D)


def _runs_transposed(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a @ b runs as its transpose, b^T a^T: an f32 product into fewer than :data:`NARROW_COLUMNS`
    columns (a narrow head's outputs and gradients), whose few rows the CPU GEMM handles far better
    than few columns."""
    return a.dtype == torch.float32 and b.shape[-1] < NARROW_COLUMNS


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (batched); a transposed view when :func:`_runs_transposed`."""
    if _runs_transposed(a, b):
        return torch.bmm(b.mT, a.mT).mT
    return torch.bmm(a, b)


def _add_bmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b (batched) for a block's slice of a key or value gradient. Into a strided slice,
    an f32 baddbmm_ runs far slower than the product and a separate add; so does a transposed one."""
    if acc.dtype != torch.float32 or (acc.is_contiguous() and not _runs_transposed(a, b)):
        acc.baddbmm_(a, b)
    else:
        acc += _bmm(a, b)


class _ProductAttention(torch.autograd.Function):
    """Attention as bmm, softmax, bmm per block of queries; backward as four bmm and softmax's backward.

    Block i's queries r0..r1 meet keys 0..end_i (:func:`_key_ends`); the mask, as an additive 0/-inf
    bias, and the scale go into the scores in one pass (bias + scale·s rounds as s·scale does).
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):
            return _ProductAttention._forward(ctx, q, k, v, allowed, scale)

    @staticmethod
    def _forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        G = H // Hkv
        k3, v3 = k.reshape(B * Hkv, T, D), v.reshape(B * Hkv, T, D)
        k3f = k3.float()
        if allowed is None:  # causal: -inf above the diagonal, each block's keys end at its last query
            bias = torch.full((T, T), float("-inf"), device=q.device).triu_(1)
            ends = [r1 for _, r1 in _blocks(T)]
        else:
            bias = torch.zeros(allowed.shape, dtype=torch.float32, device=q.device).masked_fill_(~allowed,
                                                                                              float("-inf"))
            if bias.dim() == 4:  # (B|1, 1, T, T): one bias for every head of a row
                bias = bias.unsqueeze(2)  # (B|1, 1, 1, T, T)
            ends = _key_ends(allowed, T)
        out = torch.empty(B * Hkv, G, T, D, dtype=q.dtype, device=q.device)
        probs = []
        for (r0, r1), end in zip(_blocks(T), ends, strict=True):
            scores = torch.bmm(_rows(q, r0, r1, Hkv).float(), k3f[:, :end].transpose(1, 2))  # (B·Hkv, G·n, end)
            s5 = scores.view(B, Hkv, G, r1 - r0, end)
            torch.add(bias[..., r0:r1, :end], s5, alpha=scale, out=s5)
            p = torch.softmax(scores, dim=-1, out=scores).to(q.dtype)
            out[:, :, r0:r1] = _bmm(p, v3[:, :end]).reshape(B * Hkv, G, r1 - r0, D)
            probs.append(p)
        ctx.save_for_backward(q, k3, v3, out, *probs)
        ctx.scale, ctx.ends, ctx.kv_shape = scale, ends, k.shape
        return out.view(B, H, T, D)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        with torch.autocast(grad_out.device.type, enabled=False):
            return _ProductAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k3, v3, out, *probs = ctx.saved_tensors
        B, H, T, D = q.shape
        Hkv = ctx.kv_shape[1]
        G = H // Hkv
        g = grad_out.to(out.dtype)  # (B, H, T, D)
        # softmax backward: p · (dp - sum_j p_j dp_j), the sum being rowwise g·out
        row_dot = (g.float() * out.view(B, H, T, D).float()).sum(dim=-1, keepdim=True)  # (B, H, T, 1)
        row_dot = row_dot.view(B * Hkv, G, T, 1)
        grad_q = torch.empty(B * Hkv, G, T, D, dtype=q.dtype, device=q.device)
        grad_k = torch.zeros(B * Hkv, T, D, dtype=q.dtype, device=q.device)
        grad_v = torch.zeros_like(grad_k)
        for (r0, r1), end, p in zip(_blocks(T), ctx.ends, probs, strict=True):
            g3 = _rows(g, r0, r1, Hkv)  # (B·Hkv, G·n, D)
            _add_bmm_(grad_v[:, :end], p.transpose(1, 2), g3)
            grad_probs = torch.bmm(g3, v3[:, :end].transpose(1, 2)).float()  # (B·Hkv, G·n, end)
            grad_probs.view(B * Hkv, G, r1 - r0, end).sub_(row_dot[:, :, r0:r1])
            grad_scores = grad_probs.mul_(p).mul_(ctx.scale).to(q.dtype)
            grad_q[:, :, r0:r1] = _bmm(grad_scores, k3[:, :end]).reshape(B * Hkv, G, r1 - r0, D)
            _add_bmm_(grad_k[:, :end], grad_scores.transpose(1, 2), _rows(q, r0, r1, Hkv))
        kv_shape = ctx.kv_shape
        return (grad_q.view(B, H, T, D), grad_k.view(kv_shape), grad_v.view(kv_shape),
                None, None)

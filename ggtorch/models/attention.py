"""Causal self-attention for training: batched matrix products on CPU for short sequences,
``F.scaled_dot_product_attention`` everywhere else.

torch's CPU flash attention walks the sequence in small blocks; at training lengths that is
slower than writing the (T, T) score matrix out and running four plain batched products.
:data:`PRODUCTS_MAX_TOKENS` keeps the products up to the lengths where they measured faster
(bf16 wins longer than f32). Their price is memory: the probabilities (B, H, T, T) are saved for
backward instead of flash's per-row log-sum-exp.

Precision matches flash's: scores, softmax and its backward in f32, the products with the
probabilities in the input dtype, as the flash kernel does for bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PRODUCTS_MAX_TOKENS: dict[torch.dtype, int] = {torch.float32: 128, torch.bfloat16: 256}
"""Longest sequence, by dtype, whose training attention on CPU runs as batched products."""


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T · scale + masking) v for q (B, H, T, D) and k, v (B, Hkv, S, D), H a multiple
    of Hkv (query head h reads key/value head h // (H / Hkv), as llama.cpp's broadcast does).

    ``mask`` (broadcastable to (B, 1, T, S), True where a query may attend) or ``causal``.
    """
    if _as_products(q, k, v, causal, mask):
        allowed = mask if mask is not None else torch.ones(q.shape[2], q.shape[2], dtype=torch.bool,
                                                               device=q.device).tril()
        return _ProductAttention.apply(q, k, v, allowed, scale)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _as_products(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> bool:
    """Training (a backward will follow) on CPU, self-attention over a short sequence, causal or a
    boolean mask; inference and KV-cache calls keep flash."""
    T, S = q.shape[2], k.shape[2]
    return (q.device.type == "cpu" and T == S and T <= PRODUCTS_MAX_TOKENS.get(q.dtype, 0)
            and k.dtype == v.dtype == q.dtype and (causal or (mask is not None and mask.dtype == torch.bool))
            and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


class _ProductAttention(torch.autograd.Function):
    """Attention as bmm, softmax, bmm; backward as four bmm and softmax's backward.

    Query heads of one KV head are stacked along the rows, (B·Hkv, G·T, D) against (B·Hkv, T, D),
    so grouped-query attention needs no copies of k and v and their gradients come out summed
    over the group.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                allowed: torch.Tensor, scale: float) -> torch.Tensor:
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        G = H // Hkv
        q3 = q.reshape(B * Hkv, G * T, D)
        k3, v3 = k.reshape(B * Hkv, T, D), v.reshape(B * Hkv, T, D)
        scores = torch.bmm(q3.float(), k3.float().transpose(1, 2)).mul_(scale)  # (B·Hkv, G·T, T), f32
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=q.device).masked_fill_(~allowed, float("-inf"))
        if bias.dim() == 4:  # (B|1, 1, T, T): one bias for every head of a row
            bias = bias.unsqueeze(2)  # (B|1, 1, 1, T, T)
        scores.view(B, Hkv, G, T, T).add_(bias)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)  # (B·Hkv, G·T, T)
        out = torch.bmm(probs, v3)  # (B·Hkv, G·T, D)
        ctx.save_for_backward(q3, k3, v3, probs, out)
        ctx.scale, ctx.shapes = scale, (q.shape, k.shape)
        return out.view(B, H, T, D)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        q3, k3, v3, probs, out = ctx.saved_tensors
        q_shape, kv_shape = ctx.shapes
        g3 = grad_out.reshape(out.shape).to(out.dtype)  # (B·Hkv, G·T, D)
        grad_v = torch.bmm(probs.transpose(1, 2), g3)  # (B·Hkv, T, D)
        grad_probs = torch.bmm(g3, v3.transpose(1, 2))  # (B·Hkv, G·T, T)
        # softmax backward: p · (dp - sum_j p_j dp_j), the sum being rowwise g·out
        row_dot = (g3.float() * out.float()).sum(dim=-1, keepdim=True)  # (B·Hkv, G·T, 1)
        grad_scores = (grad_probs.float() - row_dot).mul_(probs).mul_(ctx.scale).to(q3.dtype)
        grad_q = torch.bmm(grad_scores, k3)  # (B·Hkv, G·T, D)
        grad_k = torch.bmm(grad_scores.transpose(1, 2), q3)  # (B·Hkv, T, D)
        return grad_q.view(q_shape), grad_k.view(kv_shape), grad_v.view(kv_shape), None, None

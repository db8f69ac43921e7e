"""Next-token cross-entropy over a large vocabulary, in row chunks.

``F.cross_entropy`` on (N, V) logits materializes log-softmax (N, V), then in backward a
one-hot gradient (N, V) and the log-softmax gradient (N, V): three vocabulary-sized f32
tensors besides the logits (for batch 4 x 256 tokens x 32000 words, 131 MB each) and five
passes over them. Here forward keeps only the per-row log-sum-exp (N,), and backward writes
``softmax - onehot`` straight into the one gradient tensor autograd needs, a few rows at a
time so the temporaries stay in cache. The gradient is softmax's output (its fused kernel is
several times faster than a separate exp), the log-sum-exp is recomputed by it, not stored as
probabilities. Same values as ``F.cross_entropy`` up to f32 rounding,
including ``ignore_index=-100`` rows, which count for nothing and get a zero gradient.
"""

from __future__ import annotations

from typing import Literal

import torch

IGNORE_INDEX = -100
CHUNK_BYTES = 4 << 20
"""Bytes of f32 logits handled per chunk: large enough to amortize per-op overhead, small
enough to stay in cache between the exp and the write of the gradient."""


def _row_chunks(n_rows: int, n_cols: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_BYTES // (4 * n_cols))
    return [(r0, min(r0 + step, n_rows)) for r0 in range(0, n_rows, step)]


class _TokenCrossEntropy(torch.autograd.Function):
    """Per-row ``logsumexp(logits) - logits[target]`` (0 where target == ignore_index), f32."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        n, v = logits.shape
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, 0)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for r0, r1 in _row_chunks(n, v):
            lse[r0:r1] = torch.logsumexp(logits[r0:r1].float(), dim=-1)
        picked = logits.gather(1, safe[:, None])[:, 0].float()
        ctx.save_for_backward(logits, lse, safe, valid)
        return (lse - picked) * valid

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        logits, lse, safe, valid = ctx.saved_tensors
        n, v = logits.shape
        g = grad_out.float() * valid  # (N,)
        grad = torch.empty(n, v, dtype=torch.float32, device=logits.device)
        for r0, r1 in _row_chunks(n, v):
            p = grad[r0:r1]  # (rows, V): softmax's own kernel, written in place (much faster than exp)
            torch.softmax(logits[r0:r1].float(), dim=-1, out=p)
            p.mul_(g[r0:r1, None]).scatter_add_(1, safe[r0:r1, None], -g[r0:r1, None])
        return grad.to(logits.dtype), None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                  reduction: Literal["mean", "sum", "none"] = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` (..., V) against class ids ``targets`` (...), computed in f32.

    ``mean`` divides the sum by the number of counted positions (targets != -100), as
    ``F.cross_entropy`` does; ``sum`` and ``none`` (per position, 0 where ignored) are there so a
    caller can sum over micro-batches and divide by a global count.
    """
    losses = _TokenCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    if reduction == "none":
        return losses.reshape(targets.shape)
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / (targets != IGNORE_INDEX).sum()
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")

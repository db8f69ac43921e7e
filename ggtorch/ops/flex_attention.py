"""Training attention through FlexAttention: one fused kernel for every mask the models make.

SDPA's fused kernels take a causal flag or, some of them, a dense additive mask; packed records, sliding windows,
gemma's soft-capped scores and gpt-oss's sinks otherwise send a GPU to its math kernel, which writes the (T x S)
scores out. FlexAttention instead compiles one kernel (Triton on CUDA) from a mask function evaluated per block of
scores, skipping the blocks a mask empties, and keeps one log-sum-exp per query row for backward:

- the mask: causal (queries at the last T of S positions), or any boolean mask the model built (packed records'
  segments, a window's distances; (T, S) or (B, 1, T, S)), read per element inside the kernel;
- a soft-cap: ``cap * tanh(q.k / cap) * scale`` as a score modification, in llama.cpp's order;
- sinks: the kernel's log-sum-exp ``lse`` of each row gives the share a sink's ``exp(sink)`` would have taken of
  the denominator, ``out * sigmoid(lse - sink)``, differentiable through ``lse``.

The policy (``Policy.flex_attention``) says whether training attention comes here and whether compiled (a GPU) or as
torch's eager reference of the same computation (the CPU's tests of the masks and modifications).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

_compiled: Callable[..., object] | None = None


def _kernel(compiled: bool) -> Callable[..., object]:
    """torch.compile's flex_attention (one per process; it compiles a kernel per mask kind and shape), or the eager
    reference."""
    global _compiled
    if not compiled:
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def block_mask(mask: torch.Tensor | None, causal: bool, B: int, T: int, S: int,
               device: torch.device) -> BlockMask | None:
    """The FlexAttention block mask of a causal attention (queries at positions S-T..S-1) or of a boolean ``mask``
    broadcastable to (B, 1, T, S); None when every query sees every key."""
    if mask is None:
        if not causal:
            return None
        offset = S - T

        def causal_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return kv <= q + offset

        return create_block_mask(causal_mod, None, None, T, S, device=device)
    batched = mask.dim() == 4 and mask.shape[0] > 1
    dense = (mask.expand(B, 1, T, S)[:, 0] if batched else mask.reshape(-1, T, S)[0]).contiguous()

    def dense_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return dense[b, q, kv] if batched else dense[q, kv]

    return create_block_mask(dense_mod, B if batched else None, None, T, S, device=device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
              mask: torch.Tensor | None = None, softcap: float = 0.0, sinks: torch.Tensor | None = None,
              compiled: bool = True) -> torch.Tensor:
    """softmax(scores + masking) v for q (B, H, T, D), k and v (B, Hkv, S, D): scores q.k·scale, or
    cap·tanh(q.k / cap)·scale with ``softcap``; ``sinks`` (H,) join each row's denominator."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    k, v = k.to(q.dtype), v.to(q.dtype)
    score_mod = None
    if softcap:
        cap = softcap

        def capped(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor,
                   kv: torch.Tensor) -> torch.Tensor:
            return cap * torch.tanh(score / cap) * scale

        score_mod = capped
    run = _kernel(compiled)
    out = run(q, k, v, score_mod=score_mod, block_mask=block_mask(mask, causal, B, T, S, q.device),
              scale=1.0 if softcap else scale, enable_gqa=H != k.shape[1],
              return_aux=AuxRequest(lse=True) if sinks is not None else None)
    if sinks is None:
        return out  # type: ignore[return-value]
    out, aux = out  # type: ignore[misc]
    kept = torch.sigmoid(aux.lse - sinks.float().view(1, H, 1))  # (B, H, T): the share the sink leaves
    return (out.float() * kept[..., None]).to(q.dtype)

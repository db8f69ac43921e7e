"""Next-token cross-entropy over a large vocabulary, in row chunks.

``F.cross_entropy`` on (N, V) logits materializes log-softmax (N, V), then in backward a
one-hot gradient (N, V) and the log-softmax gradient (N, V): three vocabulary-sized f32
tensors besides the logits (for batch 4 x 256 tokens x 32000 words, 131 MB each) and five
passes over them. Here forward keeps only the per-row log-sum-exp (N,), and backward writes
``softmax - onehot`` straight into the one gradient tensor autograd needs, a few rows at a
time so the temporaries stay in cache. The gradient is softmax's output (its fused kernel beats
a separate exp), the log-sum-exp is recomputed by it, not stored as probabilities. Same values
as ``F.cross_entropy`` up to f32 rounding, including ``ignore_index=-100`` rows, which count for
nothing and get a zero gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from ggtorch.data import IGNORE_INDEX
from ggtorch.lora import LoRALinear, frozen_float_weight
from ggtorch.lora.product import down, grad_a, grad_b, grad_down, input_grad_, rank_r_native, up_
from ggtorch.models.model import has_forward_hooks
from ggtorch.ops import fused, policy
from ggtorch.ops.matmul import add_mm_, mm, mm_t, uses_onednn
from ggtorch.ops.recompute import checkpoint
from ggtorch.quant.autograd import compute_dtype
from ggtorch.quant.modules import QuantLinear

Reduction = Literal["mean", "sum", "none"]
"""Of the counted targets' losses: their mean, their sum, or each one (0 where ignored), in the targets' shape."""


def _row_chunks(n_rows: int, n_cols: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(start, end) of each chunk of rows whose ``n_cols`` f32 values fill ``chunk_bytes`` (one row at least)."""
    step = max(1, chunk_bytes // (4 * n_cols))
    return [(r0, min(r0 + step, n_rows)) for r0 in range(0, n_rows, step)]


class _TokenCrossEntropy(torch.autograd.Function):
    """Per-row ``logsumexp(logits) - logits[target]`` (0 where target == ignore_index), f32."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        n, v = logits.shape
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, 0)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for r0, r1 in _row_chunks(n, v, policy.current(logits.device).loss_chunk_bytes):
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
        for r0, r1 in _row_chunks(n, v, policy.current(logits.device).loss_chunk_bytes):
            p = grad[r0:r1]  # (rows, V): softmax's own kernel, written in place (much faster than exp)
            torch.softmax(logits[r0:r1].float(), dim=-1, out=p)
            p.mul_(g[r0:r1, None]).scatter_add_(1, safe[r0:r1, None], -g[r0:r1, None])
        return grad.to(logits.dtype), None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: Reduction = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` (..., V) against class ids ``targets`` (...), computed in f32.

    ``mean`` divides the sum by the number of counted positions (targets != -100), as
    ``F.cross_entropy`` does; ``sum`` and ``none`` (per position, 0 where ignored) are there so a
    caller can sum over micro-batches and divide by a global count.

    ggml's ``cross_entropy_loss`` adds ε = 1e-9 to the softmax probabilities; in f32 that changes
    log p only where p is below ~1e-7, i.e. never for a target the model has learned anything
    about, so the exact log-softmax form stands in for it.
    """
    return _reduced(_TokenCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)), targets,
                    reduction)


# --- the output projection and the loss in one pass ---------------------------------------------

# Chunk sizes are the device policy's (ggtorch.ops.policy): with a LoRA on the output, chunks are whole rows of
# head_chunk_bytes, about 256 rows for a 32000-word vocabulary, where the chunk's GEMMs run near full speed (fewer
# rows slow the output matmul down), and those buffers are reused for every chunk of a call, except on oneDNN's
# path, whose logits are fresh per chunk (it has no out=). Without one, chunks are slab_rows rows by a slab of
# slab_bytes. Where the policy says a softmax may write over its input (CPU; CUDA's kernels read each element
# before writing it) the probabilities take the logits' memory, elsewhere a buffer of their own.


TINY_PROBABILITY = 2.0 ** -100
"""Below this a target's f32 probability has lost precision (f32 normals end at 2**-126), so its
loss comes from the log-sum-exp of recomputed logits instead of ``-log(p)``."""


def _row_losses(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``logsumexp(logits) - logits[target]`` per row (f32, 0 where not ``valid``)."""
    return (torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[:, None])[:, 0]) * valid


def _row_losses_from_probs(probs: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                           exact_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The same losses as ``-log(probs[target])``: the gradient needs the softmax anyway, and the
    log-sum-exp's own passes over the vocabulary (max, subtract, exp, sum) are saved.

    Rows whose target probability is below 2**-100 (a loss above ~69) take the log-sum-exp of
    their logits, recomputed by ``exact_logits(row indices)`` (the softmax overwrote them), so the
    value never becomes inf."""
    p_target = probs.gather(1, targets[:, None])[:, 0]
    losses = torch.where(valid, -torch.log(p_target), 0.0)  # not * valid: an ignored row may give inf
    tiny = (p_target < TINY_PROBABILITY) & valid
    if bool(tiny.any()):
        rows = tiny.nonzero()[:, 0]
        losses[rows] = _row_losses(exact_logits(rows), targets[rows], valid[rows])
    return losses


def _linear_pass(x: torch.Tensor, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None, weight: torch.Tensor,
                 targets: torch.Tensor, scale: float, need_grad: bool, row_weights: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One pass of :class:`_LinearCrossEntropy` over the vocabulary, a chunk of rows at a time: the per-row losses
    (N,) and, with ``need_grad``, the gradients of their sum (each row's weighted by ``row_weights``) with respect to
    x, lora_a and lora_b, computed while each chunk's softmax is at hand."""
    n, c = x.shape
    v = weight.shape[0]
    dtype = weight.dtype
    f32 = torch.float32
    lora = lora_a is not None
    with torch.autocast(x.device.type, enabled=False):
        xc = x.to(dtype)
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, 0)
        keep = valid.float() if row_weights is None else valid * row_weights.float()
        h = b = None
        native = False
        if lora:  # the LoRA product's rank-r half (ggtorch.lora.product), a chunk of rows at a time
            a, b = lora_a.to(dtype), lora_b.to(dtype)
            native = rank_r_native(xc, a)
            h = down(xc, a, native)  # (N, r)
        losses = torch.empty(n, dtype=f32, device=x.device)
        grad_x = torch.empty(n, c, dtype=f32, device=x.device) if need_grad else None
        grad_h = torch.empty(n, h.shape[1], dtype=f32, device=x.device) if need_grad and lora else None
        grads_b = torch.zeros(v, h.shape[1], dtype=f32, device=x.device) if need_grad and lora else None
        step = head_rows(v, x.device)
        # Chunk buffers live for the whole call: a fresh (rows, V) tensor per chunk is returned to
        # the OS and page-faulted back in every time (glibc gives such large blocks back at once).
        # oneDNN (f32 on CPU) has no out=, so its logits are fresh per chunk; the softmax is then
        # written over the f32 logits where its kernels allow that (each row's max and sum are
        # taken before any element is written).
        rows_max = min(step, n)
        logits_buf = None if uses_onednn(xc, weight) else torch.empty(rows_max, v, dtype=dtype, device=x.device)
        f32_buf = None if dtype == f32 else torch.empty(rows_max, v, dtype=f32, device=x.device)
        in_place = policy.current(x.device).in_place_softmax
        probs_buf = None if in_place or not need_grad else torch.empty(rows_max, v, dtype=f32, device=x.device)

        def logits_of(rows: slice | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            logits = mm_t(xc[rows], weight) if out is None else torch.matmul(xc[rows], weight.T, out=out)
            return up_(logits, h[rows], b, scale, native) if lora else logits  # (rows, V)

        for r0 in range(0, n, step):
            r1 = min(r0 + step, n)
            logits = logits_of(slice(r0, r1), None if logits_buf is None else logits_buf[:r1 - r0])
            logits32 = logits if f32_buf is None else f32_buf[:r1 - r0].copy_(logits)
            if not need_grad:
                losses[r0:r1] = _row_losses(logits32, safe[r0:r1], valid[r0:r1])
                continue
            p = torch.softmax(logits32, dim=-1, out=logits32 if probs_buf is None else probs_buf[:r1 - r0])
            losses[r0:r1] = _row_losses_from_probs(p, safe[r0:r1], valid[r0:r1],
                                                   lambda rows, r0=r0: logits_of(rows + r0).float())
            p.scatter_add_(1, safe[r0:r1, None], torch.full((r1 - r0, 1), -1.0, dtype=f32, device=x.device))
            p.mul_(keep[r0:r1, None])  # d(weighted row loss)/d(logits), 0 for ignored rows
            if dtype != f32:
                p = logits.copy_(p)  # the logits are spent: their buffer takes p in the compute dtype
            grad_x[r0:r1] = mm(p, weight)
            if lora:
                grad_h[r0:r1] = grad_down(p, b, scale, native)
                grads_b += grad_b(p, h[r0:r1], scale, native)
        grads_a = None
        if need_grad and lora:
            grads_a = grad_a(x.float(), grad_h, native).float()  # (r, C)
            input_grad_(grad_x, grad_h, lora_a.float(), native)
    return losses, grad_x, grads_a, grads_b


class _LinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(x @ W.T [+ s·(x @ A.T) @ B.T], targets)`` per row, or their sum, chunked over rows.

    For the sum, the gradient is computed in forward while each chunk's logits are at hand (softmax - onehot
    is only needed once), kept as (N, C) / LoRA-sized tensors, and scaled by the upstream
    gradient in backward: the (N, V) logits never exist, neither do their gradient or a second
    pass over W. Per row (``per_row``, as preference objectives weigh each answer's tokens by a weight known only
    after the forward), forward computes the losses alone and backward takes a second pass with the rows' weights:
    two passes over W for any number of answers. Everything is computed in ``weight.dtype`` for the matmuls (as
    autocast would) and f32 for the softmax.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None,  # type: ignore[override]
                weight: torch.Tensor, targets: torch.Tensor, scale: float, per_row: bool = False) -> torch.Tensor:
        ctx.dtypes = (x.dtype, None if lora_a is None else lora_a.dtype, None if lora_b is None else lora_b.dtype)
        ctx.per_row, ctx.scale = per_row, scale
        need_grad = any(ctx.needs_input_grad[:3])
        if per_row:
            losses = _linear_pass(x, lora_a, lora_b, weight, targets, scale, need_grad=False)[0]
            ctx.save_for_backward(x, lora_a, lora_b, weight, targets)
            return losses
        losses, *grads = _linear_pass(x, lora_a, lora_b, weight, targets, scale, need_grad)
        ctx.save_for_backward(*grads)
        return losses.sum()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        if ctx.per_row:
            x, lora_a, lora_b, weight, targets = ctx.saved_tensors
            grad_x, grad_a_, grad_b_ = _linear_pass(x, lora_a, lora_b, weight, targets, ctx.scale, True, grad_out)[1:]
            g = torch.ones((), device=x.device)
        else:
            grad_x, grad_a_, grad_b_ = ctx.saved_tensors
            g = grad_out.float()
        x_dtype, a_dtype, b_dtype = ctx.dtypes
        gx = (grad_x * g).to(x_dtype) if grad_x is not None and ctx.needs_input_grad[0] else None
        ga = (grad_a_ * g).to(a_dtype) if grad_a_ is not None and ctx.needs_input_grad[1] else None
        gb = (grad_b_ * g).to(b_dtype) if grad_b_ is not None and ctx.needs_input_grad[2] else None
        return gx, ga, gb, None, None, None, None


def slab_chunk(n_rows: int, n_embd: int, device: torch.device | str) -> tuple[int, int]:
    """(rows, vocabulary columns) of a chunk of :class:`_SlabCrossEntropy` on ``device``; its slab of W is no
    bigger than its logits."""
    p = policy.current(device)
    rows = min(n_rows, p.slab_rows)
    return rows, max(1, p.slab_bytes // (4 * max(rows, n_embd)))


def head_rows(n_vocab: int, device: torch.device | str) -> int:
    """Tokens per chunk of the loss's whole-row paths (a LoRA on the output, a head of more than one projection):
    as many rows of ``n_vocab`` f32 logits as the policy's ``head_chunk_bytes`` holds (what the memory estimate
    counts)."""
    return max(1, policy.current(device).head_chunk_bytes // (4 * n_vocab))


class _SlabCrossEntropy(torch.autograd.Function):
    """``cross_entropy(x @ W.T, targets)`` per row, W taken a slab of vocabulary rows at a time.

    The online softmax (as flash attention does over keys): each row keeps its running max ``m``, its
    sum ``s`` of ``exp(logit - m)`` and the running ``sum exp(logit - m) · W[v]`` (N, C), rescaled when
    ``m`` grows; the gradient is that sum over ``s`` minus the target's row of W, so each slab of W is
    used once for both products and dropped. A quantized W is dequantized one slab at a time: neither
    the whole float W nor a (rows, V) block exists, and every chunk's GEMMs have all the batch's rows
    (at most the policy's ``slab_rows``), which a 262,144-word vocabulary would otherwise cut to a few dozen.
    On CPU a slab's softmax is one pass in C (:func:`ggtorch.ops.fused.softmax_slab_`), whose row maxima
    move only when a logit rises well above them, so the sums are seldom rescaled; elsewhere torch's ops
    take the exact maxima, a pass over the slab per op.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, targets: torch.Tensor, n_vocab: int,  # type: ignore[override]
                slab: Callable[[int, int], torch.Tensor], rows_of: Callable[[torch.Tensor], torch.Tensor],
                multiplier: float = 1.0, cap: float = 0.0) -> torch.Tensor:
        n, c = x.shape
        f32 = torch.float32
        need_grad = ctx.needs_input_grad[0]
        with torch.autocast(x.device.type, enabled=False):
            valid = targets != IGNORE_INDEX
            safe = torch.where(valid, targets, 0).to(torch.int64)
            run_max = torch.full((n,), -torch.inf, dtype=f32, device=x.device)
            run_sum = torch.zeros(n, dtype=f32, device=x.device)
            picked = torch.zeros(n, dtype=f32, device=x.device)
            acc = torch.zeros(n, c, dtype=f32, device=x.device) if need_grad else None
            rescale = torch.empty(n, dtype=f32, device=x.device)
            rows, width = slab_chunk(n, c, x.device)
            xc = None
            for v0 in range(0, n_vocab, width):
                v1 = min(v0 + width, n_vocab)
                w = slab(v0, v1)  # (width, C) in the compute dtype
                if xc is None:
                    xc = x.to(w.dtype)
                for r0 in range(0, n, rows):
                    r = slice(r0, min(r0 + rows, n))
                    logits = mm_t(xc[r], w)  # (rows, width) in the compute dtype
                    slope = None
                    if multiplier != 1.0 or cap:
                        logits, slope = _mapped_logits(logits, multiplier, cap)
                    if fused.softmax_slab_takes(logits):  # one pass in C, the exponentials over the logits
                        moved = fused.softmax_slab_(logits, safe[r], v0, run_max[r], run_sum[r], picked[r],
                                                    rescale[r])
                        e = logits
                    else:
                        logits = logits.float()
                        t = safe[r] - v0
                        inside = (t >= 0) & (t < v1 - v0)
                        picked[r] += torch.where(inside, logits.gather(1, t.clamp(0, v1 - v0 - 1)[:, None])[:, 0],
                                                 0.0)
                        new_max = torch.maximum(run_max[r], logits.amax(dim=1))
                        torch.exp(run_max[r] - new_max, out=rescale[r])
                        e = logits.sub_(new_max[:, None]).exp_()
                        run_sum[r] = run_sum[r] * rescale[r] + e.sum(dim=1)
                        e = e.to(w.dtype)
                        run_max[r], moved = new_max, True
                    if acc is not None:
                        if moved:
                            acc[r].mul_(rescale[r, None])  # a view: acc itself
                        if slope is not None:  # d z / d logit: the chain rule through the head's map
                            e = (e.float() * slope).to(w.dtype)
                        if w.dtype == f32:
                            add_mm_(acc[r], e, w)
                        else:
                            acc[r].add_(mm(e, w))
            losses = (run_max + torch.log(run_sum) - picked) * valid
            grad_x = None  # of each row's loss: backward weighs the rows
            if acc is not None:
                target_rows = rows_of(safe).float()
                if multiplier != 1.0 or cap:  # the target logit's slope
                    target_rows.mul_(_slope(picked, multiplier, cap)[:, None])
                grad_x = acc.div_(run_sum[:, None]).sub_(target_rows).mul_(valid[:, None])
        ctx.save_for_backward(grad_x)
        ctx.x_dtype = x.dtype
        return losses

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (grad_x,) = ctx.saved_tensors
        if grad_x is None or not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None, None
        return (grad_x * grad_out.float()[:, None]).to(ctx.x_dtype), None, None, None, None, None, None


def _mapped_logits(logits: torch.Tensor, multiplier: float, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's map of a slab of logits, in f32 and in the order ``Transformer.head`` takes (granite's scale, then
    gemma's cap·tanh(l / cap)), and its slope d z / d logit per element."""
    z = logits.float()
    if multiplier != 1.0:
        z = z.mul_(multiplier)
    if not cap:
        return z, torch.full_like(z[:1, :1], multiplier)
    z = z.div_(cap).tanh_()
    slope = (1 - z * z).mul_(multiplier)
    return z.mul_(cap), slope


def _slope(z: torch.Tensor, multiplier: float, cap: float) -> torch.Tensor:
    """d z / d logit at mapped values ``z`` (what :func:`_mapped_logits` gives for one element)."""
    return (1 - (z / cap) ** 2) * multiplier if cap else torch.full_like(z, multiplier)


def _output_parts(output: torch.nn.Module, x: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None:
    """(W in the compute dtype, lora_a, lora_b, scale) of a LoRA on the output projection, for the
    row-chunked fused loss (a frozen output without one takes :class:`_SlabCrossEntropy`).

    None (use the plain path) for anything else: a LoRA whose forward is not that product (see
    :meth:`LoRALinear.linear_parts`), a foreign module, or a quantized W whose float copy would be
    bigger than the logits it saves.
    """
    if not isinstance(output, LoRALinear):
        return None
    parts = output.linear_parts()
    if parts is None:
        return None
    base, lora_a, lora_b, scale = parts
    dtype = compute_dtype(x)
    if isinstance(base, QuantLinear):
        if base.in_features * torch.empty((), dtype=dtype).element_size() > 4 * x.shape[0]:
            return None
        weight = base.dequantized_weight(dtype)
    else:
        weight = frozen_float_weight(base, dtype)
        if weight is None:
            return None
    return weight, lora_a, lora_b, scale


def _weight_slabs(output: torch.nn.Module, x: torch.Tensor
                  ) -> tuple[int, Callable[[int, int], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None:
    """(n_vocab, W's rows [v0, v1) in the compute dtype, W's rows at given ids) of an output projection
    without a LoRA, for :class:`_SlabCrossEntropy`; None for anything else (a LoRALinear included:
    frozen_float_weight takes only the plain linear types)."""
    dtype = compute_dtype(x)
    if isinstance(output, QuantLinear):
        return (output.out_features, lambda v0, v1: output.weight_rows(v0, v1, dtype),
                lambda ids: output.rows_at(ids, dtype))
    weight = frozen_float_weight(output, dtype)
    if weight is None:
        return None
    return weight.shape[0], lambda v0, v1: weight[v0:v1], lambda ids: weight.index_select(0, ids)


def output_cross_entropy(output: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                         reduction: Reduction = "mean") -> torch.Tensor:
    """``cross_entropy(output(hidden), targets)`` without materializing the (N, V) logits.

    ``output`` is the model's output projection (``nn.Linear``, ``QuantLinear``, or a
    ``LoRALinear`` around either); ``hidden`` (..., C) the normed hidden states
    (``Transformer.forward(..., hidden_only=True)``). Call it under the same autocast as the model.
    Other modules, and LoRA with dropout, go through ``output(hidden)`` and :func:`cross_entropy`.
    """
    slab_loss = _slab_cross_entropy(output, hidden, targets, reduction)
    if slab_loss is not None:
        return slab_loss
    x = hidden.reshape(-1, hidden.shape[-1])
    parts = None if has_forward_hooks(output) else _output_parts(output, x)
    if parts is None:
        return cross_entropy(output(hidden).float(), targets, reduction)
    weight, lora_a, lora_b, scale = parts
    losses = _LinearCrossEntropy.apply(x, lora_a, lora_b, weight, targets.reshape(-1), scale, reduction == "none")
    return _reduced(losses, targets, reduction)


def _slab_cross_entropy(output: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                        reduction: Reduction, head_map: tuple[float, float] = (1.0, 0.0)
                        ) -> torch.Tensor | None:
    """The loss over ``output``'s vocabulary a slab at a time (:class:`_SlabCrossEntropy`), the logits mapped by
    ``head_map`` (multiplier, cap); None where the output is not a frozen projection (a LoRA that computes, a
    forward hook that expects to see the module's call and its logits)."""
    if isinstance(output, LoRALinear) and output.passes_through and not has_forward_hooks(output):
        output = output.base  # merged or switched off: the frozen projection's slab path
    if has_forward_hooks(output):
        return None
    x = hidden.reshape(-1, hidden.shape[-1])
    slabs = _weight_slabs(output, x)
    if slabs is None:
        return None
    return _reduced(_SlabCrossEntropy.apply(x, targets.reshape(-1), *slabs, *head_map), targets, reduction)


def _reduced(losses: torch.Tensor, targets: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    """Per-target losses (N,) (or a fused loss's sum of them, for "sum" and "mean") as ``reduction`` asks."""
    if reduction == "none":
        return losses.reshape(targets.shape)
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / (targets != IGNORE_INDEX).sum()
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def head_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                       n_vocab: int, reduction: Reduction = "mean") -> torch.Tensor:
    """``cross_entropy(head(hidden), targets)`` for a head that is more than one projection (an output
    bias, gemma's final soft-capping), a chunk of tokens at a time: each chunk's logits exist only
    while it is computed, and again in backward (activation checkpointing), never (tokens, V) whole.
    A chunk holds :func:`head_rows` tokens (the rows the memory estimate counts): each
    chunk computes the whole head again, so fewer rows would repeat its product (and a quantized
    output's decoding) for nothing."""
    x = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)

    def chunk_losses(xc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        return cross_entropy(head(xc), tc, "none")

    step = head_rows(n_vocab, x.device)
    chunks = [(r0, min(r0 + step, x.shape[0])) for r0 in range(0, x.shape[0], step)]
    losses = [checkpoint(chunk_losses, x[r0:r1], t[r0:r1]) if torch.is_grad_enabled()
              else chunk_losses(x[r0:r1], t[r0:r1]) for r0, r1 in chunks]
    return _reduced(torch.cat(losses) if losses else x.new_zeros(0, dtype=torch.float32), targets, reduction)


def model_cross_entropy(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                        reduction: Reduction = "mean") -> torch.Tensor:
    """The loss of a Transformer's normed hidden states: the fused output loss when its logits are the
    output projection alone or an elementwise map of it (a scale, a soft-cap) over a frozen output; else its head a
    chunk of tokens at a time."""
    if model.plain_head:
        return output_cross_entropy(model.output, hidden, targets, reduction)
    mapped = model.head_map
    slab_loss = None if mapped is None else _slab_cross_entropy(model.output, hidden, targets, reduction, mapped)
    if slab_loss is not None:
        return slab_loss
    return head_cross_entropy(model.head, hidden, targets, model.config.n_vocab, reduction)

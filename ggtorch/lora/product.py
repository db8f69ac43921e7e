"""The fused base + delta product of a LoRALinear over a frozen base, as one autograd node."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ggtorch.ops import lowrank, policy
from ggtorch.ops.matmul import Linear, mm, mm_t
from ggtorch.quant.autograd import kept_dequantized, quant_mm, quant_mm_t
from ggtorch.quant.modules import QuantExperts, QuantLinear

Product = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class Products:
    """A frozen matrix's products for 2-D operands in one dtype, without autograd: ``forward(x, w)`` is
    x @ W.T, ``input_grad(g, w)`` is g @ W. ``decode()`` is W decoded once when the product should keep
    it for backward (a quantized W inside ``keeping_dequantized``), else None; handed back as ``w``, the
    products use it instead of decoding W again, with the same results."""

    forward: Product
    input_grad: Product
    decode: Callable[[], torch.Tensor | None] = lambda: None


def _float_products(w: torch.Tensor) -> Products:
    return Products(lambda x, _: mm_t(x, w), lambda g, _: mm(g, w))


def _frozen_products(base: nn.Module, dtype: torch.dtype) -> Products | None:
    """A base layer's products in ``dtype`` when its weight takes no gradient (a bias-free float
    Linear whose weight is frozen, or a QuantLinear); None for anything else."""
    if isinstance(base, QuantLinear):
        return _quant_products(base, base.raw, dtype)
    if (isinstance(base, nn.Linear) and base.weight.dtype != dtype
            and not torch.is_autocast_enabled(base.weight.device.type)):
        return None  # a half-precision base without autocast: the plain path keeps the delta in f32
    w = frozen_float_weight(base, dtype)  # (out, in); a cast only under autocast, as F.linear's would be
    if w is None:
        return None
    return _float_products(w)


def _expert_products(base: nn.Module, e: int, dtype: torch.dtype) -> Products:
    """The products of expert ``e`` of a frozen stack (Experts or QuantExperts) in ``dtype``: a quantized
    expert is dequantized in each call, so forward and backward decode it only when it has rows."""
    if isinstance(base, QuantExperts):  # never kept: a block's routed experts together can be large
        return _quant_products(base, base.raw[e], None)
    return _float_products(base.weight[e].to(dtype))  # (out, in)


def _quant_products(base: QuantLinear | QuantExperts, raw: torch.Tensor, keep_dtype: torch.dtype | None) -> Products:
    """The products of one matrix of ``base`` whose blocks are ``raw`` (out, row_nbytes), dequantized per
    call; with ``keep_dtype``, decoded once in it and kept where kept_dequantized says so."""
    ggml_type, n_in, chunk_bytes = base.ggml_type, base.shape[-1], base.chunk_bytes
    shape = (raw.shape[0], n_in)
    return Products(lambda x, w: quant_mm_t(x, raw, ggml_type, n_in, chunk_bytes, w),
                    lambda g, w: quant_mm(g, raw, ggml_type, n_in, chunk_bytes, w),
                    lambda: None if keep_dtype is None else kept_dequantized(raw, ggml_type, shape, keep_dtype))


def frozen_float_weight(base: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """W in ``dtype`` of a bias-free ``nn.Linear`` or ggtorch ``Linear`` whose weight takes no
    gradient: its forward is ``x @ W.T``, which the one-node LoRA and the fused loss compute
    themselves. None for anything else, subclasses included (their forward may differ)."""
    if type(base) in (nn.Linear, Linear) and base.bias is None and not base.weight.requires_grad:
        return base.weight.to(dtype)
    return None


class _LoRAProduct(torch.autograd.Function):
    """``base(x) + s·(x @ A.T) @ B.T`` for a frozen base, as one autograd node.

    As two nodes, ``y + delta`` copies the base's output once more and backward sums two input
    gradients of x (the base's and the delta's). Here the delta is added into the base's product
    in place and its input gradient into the base's. Computed in ``dtype`` (the autocast dtype, or
    x's), as autocast would compute the two F.linear calls; gradients come back in their tensors'
    dtypes. On CPU the rank-r products run in ggtorch.ops.lowrank, which reads each activation
    once (the products of :func:`_lowrank_products` are the same formulas); elsewhere they go
    through ggtorch.ops.matmul.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,  # type: ignore[override]
                products: Products, dtype: torch.dtype) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)  # (N, in)
            a_c, b_c = a.to(dtype), b.to(dtype)  # (r, in), (out, r)
            native = _lowrank_products(x2, a_c)
            h = lowrank.project(x2, a_c) if native else mm_t(x2, a_c)  # (N, r)
            w = products.decode() if ctx.needs_input_grad[0] else None  # W kept for backward, or None
            y = products.forward(x2, w)  # (N, out)
            if native and lowrank.takes(y):
                lowrank.expand_(y, h, b_c.T.contiguous(), scale)
            else:
                y.addmm_(h, b_c.T, alpha=scale)
        ctx.save_for_backward(x2, h, a_c, b_c, w)
        ctx.products, ctx.scale, ctx.x_meta = products, scale, (x.shape, x.dtype, a.dtype, b.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # type: ignore[override]
        x2, h, a_c, b_c, w = ctx.saved_tensors
        x_shape, x_dtype, a_dtype, b_dtype = ctx.x_meta
        grad_x = grad_a = grad_b = None
        with torch.autocast(grad_y.device.type, enabled=False):
            g = grad_y.reshape(-1, grad_y.shape[-1]).to(x2.dtype)  # (N, out)
            native = _lowrank_products(x2, a_c, h)
            if native:
                g = g.contiguous()
                grad_h = lowrank.project(g, b_c.T.contiguous(), ctx.scale)  # (N, r)
            else:
                grad_h = mm(g, b_c).mul_(ctx.scale)
            if ctx.needs_input_grad[0]:
                acc = ctx.products.input_grad(g, w)  # (N, in)
                if native and lowrank.takes(acc, grad_h):
                    lowrank.expand_(acc, grad_h, a_c)
                else:
                    acc.addmm_(grad_h.to(acc.dtype), a_c.to(acc.dtype))
                grad_x = acc.to(x_dtype).view(x_shape)
            if ctx.needs_input_grad[1]:
                grad_a = (lowrank.reduce(x2, grad_h) if native
                          else mm(grad_h.T.contiguous(), x2)).to(a_dtype)  # (r, in)
            if ctx.needs_input_grad[2]:
                if native:
                    grad_b = lowrank.reduce(g, h, ctx.scale).T.contiguous().to(b_dtype)  # (out, r)
                else:  # h.T @ g, then transposed: g.T @ h would hand MKL a transposed (N, out) operand, a slow case
                    grad_b = mm(h.T.contiguous(), g).mul_(ctx.scale).T.contiguous().to(b_dtype)
        return grad_x, grad_a, grad_b, None, None, None


def _lowrank_products(x2: torch.Tensor, a: torch.Tensor, *others: torch.Tensor, layers: int = 1) -> bool:
    """Whether the rank-r products of input rows ``x2`` and ``a`` (r, in) run in ggtorch.ops.lowrank: the operands
    its kind and r at most the policy's ``lowrank_max_rank`` per layer whose A are stacked in ``a``: each of its
    loops reads the activation from memory once for all ranks (the rest from cache), so a group of q, k and v at
    the single layer's widest rank still reads x once where three layers read it three times."""
    return a.shape[0] <= layers * policy.current(x2.device).lowrank_max_rank and lowrank.takes(x2, a, *others)


SHARED_LAYERS = 3
"""Layers whose stacked A the shared-input product's rank-r loops take at a single layer's widest rank each."""


class _SharedInputLoRA(torch.autograd.Function):
    """``base_i(x) + s_i·(x @ A_i.T) @ B_i.T`` for layers over one frozen base each that read the same x (q, k
    and v; gate and up), as one autograd node: the :class:`_LoRAProduct` of each, with x cast once, its
    rank-r products made over the layers' stacked A ([A_0; A_1; ...]) so that each pass over x serves them
    all (the projection forward, A's gradient), and the input gradient summed here, in f32 when x is f32,
    with one pass of the stacked A's product, where separate layers' gradients come back one by one for
    autograd to sum. ``pairs`` is A_0, B_0, A_1, B_1, ...
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scales: tuple[float, ...], products: tuple[Products, ...],  # type: ignore[override]
                dtype: torch.dtype, *pairs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)  # (N, in)
            a_c = [a.to(dtype) for a in pairs[0::2]]  # (r_i, in)
            b_c = [b.to(dtype) for b in pairs[1::2]]  # (out_i, r_i)
            a_all = torch.cat(a_c)  # (R, in)
            native = _lowrank_products(x2, a_all, layers=SHARED_LAYERS)
            h = lowrank.project(x2, a_all) if native else mm_t(x2, a_all)  # (N, R)
            hs = [part.contiguous() for part in h.split([a.shape[0] for a in a_c], dim=1)]  # (N, r_i)
            ws = [p.decode() if ctx.needs_input_grad[0] else None for p in products]
            ys = []
            for p, w, h_i, b, s in zip(products, ws, hs, b_c, scales, strict=True):
                y = p.forward(x2, w)  # (N, out_i)
                if native and lowrank.takes(y):
                    lowrank.expand_(y, h_i, b.T.contiguous(), s)
                else:
                    y.addmm_(h_i, b.T, alpha=s)
                ys.append(y.view(*x.shape[:-1], y.shape[-1]))
        ctx.save_for_backward(x2, a_all, *hs, *b_c, *(w for w in ws if w is not None))
        ctx.products, ctx.scales, ctx.kept = products, scales, [w is not None for w in ws]
        ctx.x_meta = (x.shape, x.dtype, [a.dtype for a in pairs[0::2]], [b.dtype for b in pairs[1::2]])
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grad_ys: torch.Tensor):  # type: ignore[override]
        n = len(ctx.products)
        x2, a_all, *rest = ctx.saved_tensors
        hs, b_c, kept = rest[:n], rest[n:2 * n], iter(rest[2 * n:])
        ws = [next(kept) if k else None for k in ctx.kept]
        x_shape, x_dtype, a_dtypes, b_dtypes = ctx.x_meta
        needs = ctx.needs_input_grad
        grad_x = None
        grad_pairs: list[torch.Tensor | None] = []
        with torch.autocast(x2.device.type, enabled=False):
            gs = [g.reshape(-1, g.shape[-1]).to(x2.dtype).contiguous() for g in grad_ys]  # (N, out_i)
            native = _lowrank_products(x2, a_all, *hs, *gs, layers=SHARED_LAYERS)
            grad_hs = [lowrank.project(g, b.T.contiguous(), s) if native else mm(g, b).mul_(s)
                       for g, b, s in zip(gs, b_c, ctx.scales, strict=True)]  # (N, r_i)
            grad_h = torch.cat(grad_hs, dim=1)  # (N, R)
            if needs[0]:
                acc_dtype = torch.promote_types(x2.dtype, x_dtype)  # bf16 products summed in f32 for an f32 x
                acc = ctx.products[0].input_grad(gs[0], ws[0]).to(acc_dtype)  # (N, in)
                for p, g, w in zip(ctx.products[1:], gs[1:], ws[1:], strict=True):
                    acc.add_(p.input_grad(g, w))
                grad_h_acc, a_acc = grad_h.to(acc_dtype), a_all.to(acc_dtype)
                if native and lowrank.takes(acc, grad_h_acc, a_acc):
                    lowrank.expand_(acc, grad_h_acc, a_acc)
                else:
                    acc.addmm_(grad_h_acc, a_acc)
                grad_x = acc.to(x_dtype).view(x_shape)
            grad_a_all = None
            if any(needs[4::2]):
                grad_a_all = (lowrank.reduce(x2, grad_h) if native
                              else mm(grad_h.T.contiguous(), x2))  # (R, in)
            offsets = [0]
            for h_i in hs:
                offsets.append(offsets[-1] + h_i.shape[1])
            for i, (g, h_i, s) in enumerate(zip(gs, hs, ctx.scales, strict=True)):
                grad_a = grad_b = None
                if needs[4 + 2 * i]:
                    grad_a = grad_a_all[offsets[i]:offsets[i + 1]].to(a_dtypes[i], copy=True)  # not a view
                if needs[5 + 2 * i]:
                    if native:
                        grad_b = lowrank.reduce(g, h_i, s).T.contiguous().to(b_dtypes[i])  # (out_i, r_i)
                    else:
                        grad_b = mm(h_i.T.contiguous(), g).mul_(s).T.contiguous().to(b_dtypes[i])
                grad_pairs += [grad_a, grad_b]
        return (grad_x, None, None, None, *grad_pairs)


def shared_input_lora(x: torch.Tensor, scales: tuple[float, ...], products: tuple[Products, ...],
                      dtype: torch.dtype, pairs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The outputs of :class:`_SharedInputLoRA` (one per product) for layers reading x."""
    return _SharedInputLoRA.apply(x, scales, products, dtype, *pairs)

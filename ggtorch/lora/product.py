"""The fused base + delta product of a LoRALinear over a frozen base, as one autograd node."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ggtorch.ops import lowrank
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


def _lowrank_products(x2: torch.Tensor, a: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the rank-r products of a layer with input rows ``x2`` and ``a`` (r, in) run in ggtorch.ops.lowrank."""
    return a.shape[0] <= lowrank.MAX_RANK and lowrank.takes(x2, a, *others)

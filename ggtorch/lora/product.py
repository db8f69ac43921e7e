"""The fused base + delta product of a LoRALinear over a frozen base, as one autograd node."""

from __future__ import annotations

from collections.abc import Callable, Iterator
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


# --- the rank-r half of a LoRA product: s·(x @ A.T) @ B.T and its gradients, written once ---------------------------
# In ggtorch.ops.lowrank's C loops, which read each activation once (``native``, where the operands suit them too), or
# in torch's products, the same formulas. The LoRA node below and the fused loss's output head
# (ggtorch.training.loss) compute with these.

def rank_r_native(x2: torch.Tensor, a: torch.Tensor, *others: torch.Tensor, layers: int = 1) -> bool:
    """Whether the rank-r products of input rows ``x2`` and ``a`` (r, in) run in ggtorch.ops.lowrank: the operands
    its kind and r at most the policy's ``lowrank_max_rank`` per layer whose A are stacked in ``a``: each of its
    loops reads the activation from memory once for all ranks (the rest from cache), so a group of q, k and v at
    the single layer's widest rank still reads x once where three layers read it three times."""
    return a.shape[0] <= layers * policy.current(x2.device).lowrank_max_rank and lowrank.takes(x2, a, *others)


def down(x2: torch.Tensor, a: torch.Tensor, native: bool) -> torch.Tensor:
    """h = x @ A.T (N, r), in x's dtype."""
    return lowrank.project(x2, a) if native and lowrank.takes(x2, a) else mm_t(x2, a)


def up_(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float, native: bool) -> torch.Tensor:
    """y += s·h @ B.T in place (y (N, out), B (out, r)); returns y."""
    if native and lowrank.takes(y):
        return lowrank.expand_(y, h, b.T.contiguous(), scale)
    return y.addmm_(h, b.T, alpha=scale)


def grad_down(g: torch.Tensor, b: torch.Tensor, scale: float, native: bool) -> torch.Tensor:
    """The gradient of h from the output's g (N, out): s·g @ B (N, r)."""
    if native and lowrank.takes(g, b):
        return lowrank.project(g, b.T.contiguous(), scale)
    return mm(g, b).mul_(scale)


def input_grad_(acc: torch.Tensor, grad_h: torch.Tensor, a: torch.Tensor, native: bool) -> torch.Tensor:
    """acc += grad_h @ A in place: the delta's part of the input gradient; returns acc."""
    grad_h, a = grad_h.to(acc.dtype), a.to(acc.dtype)
    if native and lowrank.takes(acc, grad_h, a):
        return lowrank.expand_(acc, grad_h, a)
    return acc.addmm_(grad_h, a)


def grad_a(x2: torch.Tensor, grad_h: torch.Tensor, native: bool) -> torch.Tensor:
    """A's gradient grad_h.T @ x (r, in): f32 from the C loops, x's dtype from torch's."""
    if native and lowrank.takes(x2, grad_h):
        return lowrank.reduce(x2, grad_h)
    return mm(grad_h.T.contiguous(), x2)


def grad_b(g: torch.Tensor, h: torch.Tensor, scale: float, native: bool) -> torch.Tensor:
    """B's gradient s·g.T @ h (out, r), contiguous."""
    if native and lowrank.takes(g, h):
        return lowrank.reduce(g, h, scale).T.contiguous()
    # h.T @ g, then transposed: g.T @ h would hand MKL a transposed (N, out) operand, a slow case
    return mm(h.T.contiguous(), g).mul_(scale).T.contiguous()


SHARED_LAYERS = 3
"""Layers whose stacked A the shared-input product's rank-r loops take at a single layer's widest rank each."""


class _LoRAProducts(torch.autograd.Function):
    """``y_i = base_i(x) + s_i·(x @ A_i.T) @ B_i.T`` for one or more layers over a frozen base each that read the same
    x (one LoRALinear; q, k and v; gate and up), as one autograd node.

    As separate nodes, ``y + delta`` copies the base's output once more and backward sums the input gradients of x
    (each base's and each delta's) one by one. Here each delta is added into its base's product in place, x is cast
    once, the rank-r products are made over the layers' stacked A ([A_0; A_1; ...]) so that each pass over x serves
    them all (the projection forward, A's gradient), and the input gradient is summed here: with one pass of the
    stacked A's product, and in f32 when x is f32 and several layers' bf16 products add up. Computed in ``dtype``
    (the autocast dtype, or x's), as autocast would compute the F.linear calls; gradients come back in their tensors'
    dtypes. ``pairs`` is A_0, B_0, A_1, B_1, ...
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scales: tuple[float, ...], products: tuple[Products, ...],  # type: ignore[override]
                dtype: torch.dtype, *pairs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(products)
        layers = 1 if n == 1 else SHARED_LAYERS
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)  # (N, in)
            a_c = [a.to(dtype) for a in pairs[0::2]]  # (r_i, in)
            b_c = [b.to(dtype) for b in pairs[1::2]]  # (out_i, r_i)
            a_all = a_c[0] if n == 1 else torch.cat(a_c)  # (R, in)
            native = rank_r_native(x2, a_all, layers=layers)
            h = down(x2, a_all, native)  # (N, R)
            hs = [h] if n == 1 else [part.contiguous() for part in h.split([a.shape[0] for a in a_c], dim=1)]
            ws = [p.decode() if ctx.needs_input_grad[0] else None for p in products]  # W kept for backward, or None
            ys = []
            for p, w, h_i, b, s in zip(products, ws, hs, b_c, scales, strict=True):
                y = up_(p.forward(x2, w), h_i, b, s, native)  # (N, out_i)
                ys.append(y.view(*x.shape[:-1], y.shape[-1]))
        ctx.save_for_backward(x2, a_all, *hs, *b_c, *(w for w in ws if w is not None))
        ctx.products, ctx.scales, ctx.kept, ctx.layers = products, scales, [w is not None for w in ws], layers
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
            gs = [g.reshape(-1, g.shape[-1]).to(x2.dtype) for g in grad_ys]  # (N, out_i)
            native = rank_r_native(x2, a_all, *hs, layers=ctx.layers)
            if native:
                gs = [g.contiguous() for g in gs]
            grad_hs = [grad_down(g, b, s, native) for g, b, s in zip(gs, b_c, ctx.scales, strict=True)]  # (N, r_i)
            grad_h = grad_hs[0] if n == 1 else torch.cat(grad_hs, dim=1)  # (N, R)
            if needs[0]:
                # one layer's input gradient in x2's dtype; several bf16 ones summed in f32 for an f32 x
                acc_dtype = x2.dtype if n == 1 else torch.promote_types(x2.dtype, x_dtype)
                acc = ctx.products[0].input_grad(gs[0], ws[0]).to(acc_dtype)  # (N, in)
                for p, g, w in zip(ctx.products[1:], gs[1:], ws[1:], strict=True):
                    acc.add_(p.input_grad(g, w))
                grad_x = input_grad_(acc, grad_h, a_all, native).to(x_dtype).view(x_shape)
            grad_a_all = grad_a(x2, grad_h, native) if any(needs[4::2]) else None  # (R, in)
            offset = 0
            for i, (g, h_i, s) in enumerate(zip(gs, hs, ctx.scales, strict=True)):
                r = h_i.shape[1]
                a_i = b_i = None
                if needs[4 + 2 * i]:  # a copy of its rows, not a view into the stacked gradient
                    a_i = grad_a_all[offset:offset + r].to(a_dtypes[i], copy=n > 1)
                if needs[5 + 2 * i]:
                    b_i = grad_b(g, h_i, s, native).to(b_dtypes[i])  # (out_i, r_i)
                grad_pairs += [a_i, b_i]
                offset += r
        return (grad_x, None, None, None, *grad_pairs)


class _ExpertLoRAProducts(torch.autograd.Function):
    """``y[rows of e] = base[e](x_e) + s·(x_e @ A[e].T) @ B[e].T`` over a frozen stack of experts, for the rows x
    grouped by expert (``counts[e]`` rows for expert e), as one autograd node.

    Each expert computes what the one-layer _LoRAProducts computes on its rows, with the same helpers in the same
    order, so the values are the same bit for bit; but A and B are cast once for the stack, and the gradients of A
    (E, r, in) and B (E, out, r) are assembled here (zero for an expert no row was routed to) instead of by
    autograd from a node per expert. A MoE layer's experts see a few rows each (a token's k experts among many),
    so per-expert bookkeeping, not arithmetic, was most of their cost: 25,000 nodes a step at Qwen3-30B-A3B's
    shape.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: list[int], scale: float,  # type: ignore[override]
                products: Callable[[int], Products], dtype: torch.dtype, a: torch.Tensor,
                b: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)  # (N, in)
            a_c, b_c = a.to(dtype), b.to(dtype)  # (E, r, in), (E, out, r)
            y = x2.new_empty(x2.shape[0], b.shape[1])  # (N, out)
            h = x2.new_empty(x2.shape[0], a.shape[1])  # (N, r)
            for e, r0, r1 in _spans(counts):
                x_e, a_e = x2[r0:r1], a_c[e]
                native = rank_r_native(x_e, a_e)
                h_e = down(x_e, a_e, native)  # (n_e, r)
                h[r0:r1] = h_e
                y[r0:r1] = up_(products(e).forward(x_e, None), h_e, b_c[e], scale, native)
        ctx.save_for_backward(x2, a_c, b_c, h)
        ctx.counts, ctx.scale, ctx.products = counts, scale, products
        ctx.meta = (x.shape, x.dtype, a.dtype, b.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # type: ignore[override]
        x2, a_c, b_c, h = ctx.saved_tensors
        x_shape, x_dtype, a_dtype, b_dtype = ctx.meta
        needs = ctx.needs_input_grad
        grad_x = x2.new_zeros(x2.shape) if needs[0] else None  # (N, in)
        grad_a_all = torch.zeros(a_c.shape, dtype=a_dtype, device=a_c.device) if needs[5] else None
        grad_b_all = torch.zeros(b_c.shape, dtype=b_dtype, device=b_c.device) if needs[6] else None
        with torch.autocast(x2.device.type, enabled=False):
            g_all = grad_y.reshape(-1, grad_y.shape[-1]).to(x2.dtype)  # (N, out)
            for e, r0, r1 in _spans(ctx.counts):
                x_e, h_e = x2[r0:r1], h[r0:r1]
                native = rank_r_native(x_e, a_c[e], h_e)
                g = g_all[r0:r1].contiguous() if native else g_all[r0:r1]
                grad_h = grad_down(g, b_c[e], ctx.scale, native)  # (n_e, r)
                if grad_x is not None:
                    acc = ctx.products(e).input_grad(g, None).to(x2.dtype)  # (n_e, in)
                    grad_x[r0:r1] = input_grad_(acc, grad_h, a_c[e], native)
                if grad_a_all is not None:
                    grad_a_all[e] = grad_a(x_e, grad_h, native)
                if grad_b_all is not None:
                    grad_b_all[e] = grad_b(g, h_e, ctx.scale, native)
        if grad_x is not None:
            grad_x = grad_x.to(x_dtype).view(x_shape)
        return grad_x, None, None, None, None, grad_a_all, grad_b_all


def _spans(counts: list[int]) -> Iterator[tuple[int, int, int]]:
    """(expert, first row, end row) of each expert with rows, for rows grouped by expert."""
    r0 = 0
    for e, n in enumerate(counts):
        if n:
            yield e, r0, r0 + n
        r0 += n


def expert_lora_products(x: torch.Tensor, counts: list[int], scale: float, products: Callable[[int], Products],
                         dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``base[e](x_e) + scale·(x_e @ A[e].T) @ B[e].T`` (N, out) for the rows x (N, in) grouped by expert, with
    ``products(e)`` expert e's frozen products, A (E, r, in) and B (E, out, r), as one node."""
    return _ExpertLoRAProducts.apply(x, counts, scale, products, dtype, a, b)


def lora_products(x: torch.Tensor, scales: tuple[float, ...], products: tuple[Products, ...],
                  dtype: torch.dtype, pairs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The outputs ``base_i(x) + s_i·(x @ A_i.T) @ B_i.T`` of layers reading x, one per product, as one node."""
    return _LoRAProducts.apply(x, scales, products, dtype, *pairs)


def delta_only(n_out: int, n_in: int) -> Products:
    """The products of a base that adds nothing (zeros), for a delta computed apart from its base's own forward: a
    base that trains, dropout on the delta's input, a half-precision base whose delta stays in f32."""
    return Products(lambda x, _: x.new_zeros(x.shape[0], n_out), lambda g, _: g.new_zeros(g.shape[0], n_in))

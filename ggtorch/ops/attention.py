"""Causal or masked self-attention of training on CPU in C (``attention.c``, built on first use by
:mod:`ggtorch.ops.clib`), as an autograd Function: f32, and bf16 where the CPU has bf16 dot products
(AVX512-BF16).

Written in torch ops (models.attention's products path), a step's attention copies q, k, v and the
gradients into (batch·head, tokens, head) layout and writes out the scores, which it scales, masks,
softmaxes, casts and combines with their gradient in passes of their own between the batched products. Here
each task reads q, k and v through their strides (the head contiguous), keeps its scores in cache from the
products to the softmax, and skips the masked triangle 8 queries at a time; the output and the gradients
are written into (batch, tokens, heads, head) buffers, so the model's transpose back to (batch, tokens,
channels) is a view. Backward recomputes the probabilities from each row's saved log-sum-exp, as flash
attention does, so nothing of size tokens² is kept between forward and backward. Scores, softmax and their
gradient are f32; in bf16 the probabilities and score gradients are rounded to bf16 for the products that
take them, as torch's flash kernel rounds them.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from ggtorch.ops import clib, policy

SOURCE = Path(__file__).with_name("attention.c")
FLAGS = ("-O3", "-fno-math-errno")
"""Compiler flags besides those :func:`ggtorch.ops.clib.load` adds (no errno for the log-sum-exp's logf)."""

HEAD_MULTIPLE = 16
"""The kernels read a head in whole 16-wide vectors: :func:`attention` pads a narrower head (or one between two
multiples) with zero columns up to a multiple of this."""

MAX_HEAD = 256
MAX_TOKENS = 512
"""The widest head and the longest sequence the kernels' buffers take (attention.c's MAX_HEAD, MAX_KEYS)."""


@functools.cache
def _library() -> ctypes.CDLL | None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    return clib.load_declared(SOURCE, FLAGS, {
        "ggtorch_attention": (i32, [p, p, p, p, p, i64, i64, i64, i64, i64, p, p, i64, f32, i32, i32]),
        "ggtorch_attention_backward": (i32, [p, p, p, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, p, p, i64, f32,
                                             i32, i32]),
        "ggtorch_attention_bf16": (i32, []),
    })


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`attention` computes this call: self-attention on CPU (as many keys as queries, at most
    :data:`MAX_TOKENS`) in a dtype it takes (:func:`dtype_taken`), each head contiguous and at most
    :data:`MAX_HEAD` wide (bf16: k and v with even strides, read as pairs, unless a padded head copies them), a
    boolean mask shared by the heads or none (causal)."""
    D, T = q.shape[-1], q.shape[2]
    return (q.device.type == "cpu" and policy.current(q.device).c_attention and q.dtype == k.dtype == v.dtype
            and dtype_taken(q.dtype)
            and T == k.shape[2] <= MAX_TOKENS and D <= MAX_HEAD
            and (q.dtype == torch.float32 or D % HEAD_MULTIPLE or all(s % 2 == 0 for t in (k, v)
                                                                     for s in t.stride()[:3]))
            and all(t.stride(-1) == 1 for t in (q, k, v))
            and (mask is None or (mask.dtype == torch.bool and _shared_by_heads(mask, q))))


@functools.cache
def _bf16_built() -> bool:
    lib = _library()
    return lib is not None and bool(lib.ggtorch_attention_bf16())


def dtype_taken(dtype: torch.dtype) -> bool:
    """f32 wherever the library is built; bf16 where it was built for the CPU's bf16 dot products (AVX512-BF16)."""
    return _library() is not None and (dtype == torch.float32 or (dtype == torch.bfloat16 and _bf16_built()))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T · scale, masked) v for q (B, H, T, D), k and v (B, Hkv, T, D): causal when ``mask`` is
    None, else ``mask`` (broadcastable to (B, 1, T, T)) True where a query may see a key. A query that may see
    no key gets 0. Requires :func:`takes`.

    A head whose size is not a multiple of :data:`HEAD_MULTIPLE` (stories260K's 8) runs padded with zero columns:
    they add exact zeros to every score, and their outputs and gradients are cut off."""
    return _Attention.apply(q, k, v, mask, scale)


def _as_4d(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` with leading dimensions of 1 up to four (a view)."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask


def _shared_by_heads(mask: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether ``mask`` is (B or 1, 1, T, T) once broadcast: one mask for every head of a sequence."""
    m = _as_4d(mask)
    return m.dim() == 4 and m.shape[1] == 1 and m.shape[0] in (1, q.shape[0])


def _mask_rows(mask: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A mask :func:`_shared_by_heads` as (B or 1, T, T) bytes and its sequence stride (0 when shared)."""
    T = q.shape[2]
    m = _as_4d(mask)
    m = m[:, 0].expand(m.shape[0], T, T).contiguous().view(torch.uint8)
    return m, (T * T if m.shape[0] > 1 else 0)


def _strides(*tensors: torch.Tensor) -> torch.Tensor:
    """Each (B, heads, T, D) tensor's sequence, head and token strides, in elements, for the C calls."""
    return torch.tensor([s for t in tensors for s in t.stride()[:3]], dtype=torch.int64)


def _check(status: int) -> None:
    """A C call's status: 1 when a task could not allocate its buffers (a few hundred KiB each)."""
    if status:
        raise MemoryError("out of memory for attention.c's buffers (a few hundred KiB per thread); free memory or "
                          "train under a policy without c_attention (ggtorch.ops.policy)")


def _heads_last(B: int, H: int, T: int, D: int, like: torch.Tensor) -> torch.Tensor:
    """A (B, H, T, D) tensor stored as (B, T, H, D): ``transpose(1, 2).reshape(B, T, H·D)`` is then a view."""
    return torch.empty(B, T, H, D, dtype=like.dtype, device=like.device).transpose(1, 2)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        width = q.shape[-1]
        ctx.pad = -width % HEAD_MULTIPLE
        if ctx.pad:
            q, k, v = (F.pad(t, (0, ctx.pad)) for t in (q, k, v))
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        out = _heads_last(B, H, T, D, q)
        lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
        rows, mask_stride = _mask_rows(mask, q) if mask is not None else (None, 0)
        strides = _strides(q, k, v, out)
        _check(_library().ggtorch_attention(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), B, H, Hkv, T, D,
            strides.data_ptr(), None if rows is None else rows.data_ptr(), mask_stride, scale,
            q.dtype == torch.bfloat16, torch.get_num_threads()))
        ctx.save_for_backward(q, k, v, out, lse, rows)
        ctx.scale, ctx.mask_stride = scale, mask_stride
        return out[..., :width] if ctx.pad else out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse, rows = ctx.saved_tensors
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        g = grad_out.to(q.dtype)
        if ctx.pad:
            g = F.pad(g, (0, ctx.pad))
        if g.stride(-1) != 1 or any(s % 2 for s in g.stride()[:3]):
            g = g.contiguous()
        grad_q, grad_k, grad_v = _heads_last(B, H, T, D, q), _heads_last(B, Hkv, T, D, k), _heads_last(B, Hkv, T, D, v)
        strides = _strides(q, k, v, out, g, grad_q, grad_k, grad_v)
        part = None  # each query head's dK, dV, summed over the heads that share a key head; else the heads' own
        if H != Hkv:
            part = torch.empty(2 * B * H * T * D, dtype=torch.float32, device=q.device)
        _check(_library().ggtorch_attention_backward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), g.data_ptr(), lse.data_ptr(), grad_q.data_ptr(),
            grad_k.data_ptr(), grad_v.data_ptr(), None if part is None else part.data_ptr(), B, H, Hkv, T, D,
            strides.data_ptr(), None if rows is None else rows.data_ptr(), ctx.mask_stride, ctx.scale,
            q.dtype == torch.bfloat16, torch.get_num_threads()))
        if ctx.pad:
            return grad_q[..., :-ctx.pad], grad_k[..., :-ctx.pad], grad_v[..., :-ctx.pad], None, None
        return grad_q, grad_k, grad_v, None, None

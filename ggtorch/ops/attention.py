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
from typing import Any

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
    return clib.load_declared(SOURCE, FLAGS)


_built: tuple[bool, bool] | None = None
"""(attention.c is built, it computes bf16), asked once: a module global, which torch.compile reads as a
constant."""


def _builds() -> tuple[bool, bool]:
    global _built
    if _built is None:
        lib = _library()
        _built = (lib is not None, lib is not None and bool(lib.ggtorch_attention_bf16()))
    return _built


def built() -> bool:
    """Whether attention.c is built and loaded."""
    return _builds()[0]


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


def _bf16_built() -> bool:
    return _builds()[1]


def dtype_taken(dtype: torch.dtype) -> bool:
    """f32 wherever the library is built; bf16 where it was built for the CPU's bf16 dot products (AVX512-BF16)."""
    return built() and (dtype == torch.float32 or (dtype == torch.bfloat16 and _bf16_built()))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T · scale, masked) v for q (B, H, T, D), k and v (B, Hkv, T, D): causal when ``mask`` is
    None, else ``mask`` (broadcastable to (B, 1, T, T)) True where a query may see a key. A query that may see
    no key gets 0. Requires :func:`takes`.

    A head whose size is not a multiple of :data:`HEAD_MULTIPLE` (stories260K's 8) runs padded with zero columns:
    they add exact zeros to every score, and their outputs and gradients are cut off."""
    width = q.shape[-1]
    pad = -width % HEAD_MULTIPLE
    if pad:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    rows, mask_stride = _mask_rows(mask, q) if mask is not None else (None, 0)
    out, _ = _attention_op(q, k, v, rows, mask_stride, scale)
    return out[..., :width] if pad else out


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


# --- attention.c's functions as torch ops (what torch.compile and FakeTensor see), with their autograd formula -------
# Registered with torch.library's define/impl (a torch.library.custom_op would import torch._dynamo on its first call).

torch.library.define("ggtorch::attention", "(Tensor q, Tensor k, Tensor v, Tensor? mask_rows, int mask_stride, "
                                           "float scale) -> (Tensor, Tensor)")
torch.library.define("ggtorch::attention_backward", "(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor g, "
                                                    "Tensor? mask_rows, int mask_stride, float scale) "
                                                    "-> (Tensor, Tensor, Tensor)")


@torch.library.impl("ggtorch::attention", "cpu")
def _attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_rows: torch.Tensor | None,
                   mask_stride: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """attention.c's forward for a head of a multiple of HEAD_MULTIPLE: the output, (B, H, T, D) stored as (B, T,
    H, D), and each row's log-sum-exp (B, H, T) f32."""
    B, H, T, D = q.shape
    out = _heads_last(B, H, T, D, q)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    strides = _strides(q, k, v, out)
    _check(_library().ggtorch_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), B, H, k.shape[1], T, D,
        strides.data_ptr(), None if mask_rows is None else mask_rows.data_ptr(), mask_stride, scale,
        q.dtype == torch.bfloat16, torch.get_num_threads()))
    return out, lse


@torch.library.register_fake("ggtorch::attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_rows: torch.Tensor | None, mask_stride: int,
      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, T, D = q.shape
    return _heads_last(B, H, T, D, q), q.new_empty(B, H, T, dtype=torch.float32)


def _attention_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, rows, mask_stride, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], rows)
    ctx.scale, ctx.mask_stride = scale, mask_stride


def _attention_backward(ctx: Any, grad_out: torch.Tensor, _grad_lse: torch.Tensor) -> tuple[Any, ...]:
    q, k, v, out, lse, rows = ctx.saved_tensors
    g = grad_out.to(q.dtype)
    if g.stride(-1) != 1 or any(s % 2 for s in g.stride()[:3]):
        g = g.contiguous()
    grad_q, grad_k, grad_v = _attention_backward_op(q, k, v, out, lse, g, rows, ctx.mask_stride, ctx.scale)
    return grad_q, grad_k, grad_v, None, None, None


torch.library.register_autograd("ggtorch::attention", _attention_backward, setup_context=_attention_setup)


@torch.library.impl("ggtorch::attention_backward", "cpu")
def _attention_backward_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                            g: torch.Tensor, mask_rows: torch.Tensor | None, mask_stride: int,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention.c's gradients of q, k and v from the output's gradient ``g``, laid out as the output is."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    grad_q, grad_k, grad_v = _heads_last(B, H, T, D, q), _heads_last(B, Hkv, T, D, k), _heads_last(B, Hkv, T, D, v)
    strides = _strides(q, k, v, out, g, grad_q, grad_k, grad_v)
    part = None  # each query head's dK, dV, summed over the heads that share a key head; else the heads' own
    if H != Hkv:
        part = torch.empty(2 * B * H * T * D, dtype=torch.float32, device=q.device)
    _check(_library().ggtorch_attention_backward(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), g.data_ptr(), lse.data_ptr(), grad_q.data_ptr(),
        grad_k.data_ptr(), grad_v.data_ptr(), None if part is None else part.data_ptr(), B, H, Hkv, T, D,
        strides.data_ptr(), None if mask_rows is None else mask_rows.data_ptr(), mask_stride, scale,
        q.dtype == torch.bfloat16, torch.get_num_threads()))
    return grad_q, grad_k, grad_v


@torch.library.register_fake("ggtorch::attention_backward")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
      mask_rows: torch.Tensor | None, mask_stride: int,
      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    return _heads_last(B, H, T, D, q), _heads_last(B, Hkv, T, D, k), _heads_last(B, Hkv, T, D, v)


_attention_op = torch.ops.ggtorch.attention.default
_attention_backward_op = torch.ops.ggtorch.attention_backward.default

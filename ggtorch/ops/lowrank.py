"""LoRA's rank-r products on CPU in one pass over the activation (``lowrank.c``), built on first use.

A LoRA step multiplies every adapted layer's input and output gradient by matrices r columns wide:
``x @ A.T`` and ``y += s·h @ B.T`` forward, ``g @ B``, ``h.T @ g``, ``g_h.T @ x`` and ``acc += g_h @ A``
backward. For a GEMM those are degenerate shapes, paid for by the cost of reading the activation
several times; :mod:`ggtorch.ops.clib` builds ``lowrank.c``, whose loops read it once.

:func:`project`, :func:`expand_` and :func:`reduce` compute what their torch formulas compute (f32
accumulation, bf16 rounded as torch rounds), for contiguous f32 or bf16 CPU tensors of rank up to the
policy's ``lowrank_max_rank`` (:func:`takes`); their results do not depend on the thread count. Elsewhere
(other devices, other dtypes, no compiler, a policy without ``c_lowrank``) callers keep torch's products.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from ggtorch.ops import clib, policy

SOURCE = Path(__file__).with_name("lowrank.c")
FLAGS = ("-O3",)
"""Compiler flags besides those :func:`ggtorch.ops.clib.load` adds: products and sums may fuse into FMAs."""

DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _library() -> ctypes.CDLL | None:
    return clib.load_declared(SOURCE, FLAGS)


_built: bool | None = None


def available() -> bool:
    """Whether the library is built (or can be: there is a C compiler and a cache folder to build it in). Asked
    once: a module global, which torch.compile reads as a constant."""
    global _built
    if _built is None:
        _built = _library() is not None
    return _built


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the library computes with these operands: contiguous CPU tensors of one dtype of :data:`DTYPES`
    whose policy runs the rank-r products in C (the caller checks the rank against the policy's
    ``lowrank_max_rank``)."""
    first = tensors[0]
    return (first.device.type == "cpu" and policy.current(first.device).c_lowrank and first.dtype in DTYPES
            and all(t.device.type == "cpu" and t.dtype == first.dtype and t.is_contiguous() for t in tensors)
            and available())


def project(x: torch.Tensor, m: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale · x @ m.T`` for x (N, K) and m (r, K), in their dtype: the (N, r) projection of an activation."""
    if m.shape[1] != x.shape[1]:
        raise ValueError(f"project: x is {tuple(x.shape)} and m {tuple(m.shape)}")
    return _project(x, m, scale)


def expand_(y: torch.Tensor, h: torch.Tensor, mt: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``y += scale · h @ mt`` in place for y (N, M), h (N, r) and mt (r, M), one dtype; returns y."""
    (n, m), r = y.shape, h.shape[1]
    if h.shape[0] != n or mt.shape != (r, m):
        raise ValueError(f"expand_: y is {tuple(y.shape)}, h {tuple(h.shape)} and mt {tuple(mt.shape)}")
    _expand_(y, h, mt, scale)
    return y


def reduce(x: torch.Tensor, h: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale · h.T @ x`` for x (N, K) and h (N, r), in f32 whatever their dtype: a rank-r gradient."""
    if h.shape[0] != x.shape[0]:
        raise ValueError(f"reduce: x is {tuple(x.shape)} and h {tuple(h.shape)}")
    return _reduce(x, h, scale)


# --- lowrank.c's functions as torch ops (what torch.compile and FakeTensor see); callers check the operands ---
# Registered with torch.library's define/impl: a torch.library.custom_op imports torch._dynamo on its first call
# (seconds of every command's start) and costs several times the dispatch.

torch.library.define("ggtorch::lowrank_project", "(Tensor x, Tensor m, float scale) -> Tensor")
torch.library.define("ggtorch::lowrank_expand_", "(Tensor(a!) y, Tensor h, Tensor mt, float scale) -> ()")
torch.library.define("ggtorch::lowrank_reduce", "(Tensor x, Tensor h, float scale) -> Tensor")


@torch.library.impl("ggtorch::lowrank_project", "cpu")
def _project_cpu(x: torch.Tensor, m: torch.Tensor, scale: float) -> torch.Tensor:
    (n, k), r = x.shape, m.shape[0]
    out = torch.empty(n, r, dtype=x.dtype)
    _library().ggtorch_lowrank_project(x.data_ptr(), m.data_ptr(), out.data_ptr(), n, k, r, scale,
                                       x.dtype == torch.bfloat16, torch.get_num_threads())
    return out


@torch.library.register_fake("ggtorch::lowrank_project")
def _(x: torch.Tensor, m: torch.Tensor, scale: float) -> torch.Tensor:
    return x.new_empty(x.shape[0], m.shape[0])


@torch.library.impl("ggtorch::lowrank_expand_", "cpu")
def _expand_cpu(y: torch.Tensor, h: torch.Tensor, mt: torch.Tensor, scale: float) -> None:
    (n, m), r = y.shape, h.shape[1]
    if _library().ggtorch_lowrank_expand(y.data_ptr(), h.data_ptr(), mt.data_ptr(), n, m, r, scale,
                                         y.dtype == torch.bfloat16, torch.get_num_threads()) != 0:
        raise ValueError(f"expand_: rank {r} is wider than lowrank.c takes")
    clib.written(y)


@torch.library.register_fake("ggtorch::lowrank_expand_")
def _(y: torch.Tensor, h: torch.Tensor, mt: torch.Tensor, scale: float) -> None:
    return None


@torch.library.impl("ggtorch::lowrank_reduce", "cpu")
def _reduce_cpu(x: torch.Tensor, h: torch.Tensor, scale: float) -> torch.Tensor:
    (n, k), r = x.shape, h.shape[1]
    out = torch.empty(r, k, dtype=torch.float32)
    _library().ggtorch_lowrank_reduce(x.data_ptr(), h.data_ptr(), out.data_ptr(), n, k, r, scale,
                                      x.dtype == torch.bfloat16, torch.get_num_threads())
    return out


@torch.library.register_fake("ggtorch::lowrank_reduce")
def _(x: torch.Tensor, h: torch.Tensor, scale: float) -> torch.Tensor:
    return x.new_empty(h.shape[1], x.shape[1], dtype=torch.float32)


_project = torch.ops.ggtorch.lowrank_project.default
_expand_ = torch.ops.ggtorch.lowrank_expand_.default
_reduce = torch.ops.ggtorch.lowrank_reduce.default

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
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    operands = [p, p, p, i64, i64, i32, f32, i32, i32]
    return clib.load_declared(SOURCE, FLAGS, {
        "ggtorch_lowrank_project": (None, operands), "ggtorch_lowrank_reduce": (None, operands),
        "ggtorch_lowrank_expand": (ctypes.c_int, operands),  # -1: r past the C loops' widest
    })


def available() -> bool:
    """Whether the library is built (or can be: there is a C compiler and a cache folder to build it in)."""
    return _library() is not None


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the library computes with these operands: contiguous CPU tensors of one dtype of :data:`DTYPES`
    whose policy runs the rank-r products in C (the caller checks the rank against the policy's
    ``lowrank_max_rank``)."""
    first = tensors[0]
    return (first.device.type == "cpu" and policy.current(first.device).c_lowrank and first.dtype in DTYPES
            and all(t.device.type == "cpu" and t.dtype == first.dtype and t.is_contiguous() for t in tensors)
            and _library() is not None)


def _run(name: str, operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor], n: int, k: int, r: int,
         scale: float, bf16: bool) -> int | None:
    """``ggtorch_lowrank_<name>`` of lowrank.c on three tensors' data, (n, k, r), on torch's intra-op thread count."""
    lib = _library()
    assert lib is not None
    return getattr(lib, f"ggtorch_lowrank_{name}")(*(t.data_ptr() for t in operands), n, k, r, scale, bf16,
                                                     torch.get_num_threads())


def project(x: torch.Tensor, m: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale · x @ m.T`` for x (N, K) and m (r, K), in their dtype: the (N, r) projection of an activation."""
    (n, k), r = x.shape, m.shape[0]
    if m.shape[1] != k:
        raise ValueError(f"project: x is {tuple(x.shape)} and m {tuple(m.shape)}")
    out = torch.empty(n, r, dtype=x.dtype)
    _run("project", (x, m, out), n, k, r, scale, x.dtype == torch.bfloat16)
    return out


def expand_(y: torch.Tensor, h: torch.Tensor, mt: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``y += scale · h @ mt`` in place for y (N, M), h (N, r) and mt (r, M), one dtype; returns y."""
    (n, m), r = y.shape, h.shape[1]
    if h.shape[0] != n or mt.shape != (r, m):
        raise ValueError(f"expand_: y is {tuple(y.shape)}, h {tuple(h.shape)} and mt {tuple(mt.shape)}")
    if _run("expand", (y, h, mt), n, m, r, scale, y.dtype == torch.bfloat16) != 0:
        raise ValueError(f"expand_: rank {r} is wider than lowrank.c takes")
    return clib.written(y)


def reduce(x: torch.Tensor, h: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale · h.T @ x`` for x (N, K) and h (N, r), in f32 whatever their dtype: a rank-r gradient."""
    (n, k), r = x.shape, h.shape[1]
    if h.shape[0] != n:
        raise ValueError(f"reduce: x is {tuple(x.shape)} and h {tuple(h.shape)}")
    out = torch.empty(r, k, dtype=torch.float32)
    _run("reduce", (x, h, out), n, k, r, scale, x.dtype == torch.bfloat16)
    return out

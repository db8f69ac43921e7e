"""The f32 matrix products of training and inference, through oneDNN on CPUs where it beats MKL.

torch's f32 ``mm`` on CPU is MKL's sgemm. oneDNN's f32 inner product, the library torch already
routes bf16 matmuls through, runs a llama's products faster on AMD's AVX-512 CPUs, where MKL does
not take its fastest paths; on Intel's, MKL's own vendor, MKL is the faster one (``python
bench/bench_gemm.py`` shows both on a machine; figures in BENCHMARKS.md and the commit that made
the choice per vendor). Both give ordinary f32 GEMM results, in different summation orders; the
choice is fixed per CPU (not measured per process), so two runs on one machine compute alike.

Whether a CPU takes oneDNN is its policy's choice (:attr:`ggtorch.ops.policy.Policy.onednn_f32`).
Everything else takes torch's own ops: other devices, bf16/f16 (whose CPU mm is oneDNN
already), builds without oneDNN, and ``torch.backends.mkldnn.enabled = False``. ``mm_t``, ``mm``
and ``add_mm_`` carry no autograd: the Functions that call them (the quantized matmul, the fused
loss) define their own backward; ``linear`` and ``Linear`` (the float base layers) do.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ggtorch.ops import policy

ONEDNN_MIN_MACS = 1 << 20
ONEDNN_MIN_DIM = 512
"""Products stay on torch.mm below 2**20 multiply-adds or when both dims of w are under 512: there
oneDNN's fixed cost per call loses to MKL, so tiny models keep their speed. Above, it wins on a
llama's matrices at any row count and on LoRA's rank-r products of a llama's activations."""


@functools.cache
def _onednn_works() -> bool:
    """Whether this torch build has oneDNN's inner product (``y = x @ w.T``) and it computes one: probed once."""
    try:
        probe = _onednn_mm_t(torch.ones(1, 2), torch.ones(3, 2))
    except (AttributeError, RuntimeError):
        return False
    return torch.equal(probe, torch.full((1, 3), 2.0))


_onednn: bool | None = None


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's inner product. Asked once: a module global, which torch.compile reads
    as a constant."""
    global _onednn
    if _onednn is None:
        _onednn = _onednn_works()
    return _onednn


def _onednn_mm_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """oneDNN's ``x @ w.T``."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")


def uses_onednn(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``mm_t(x, w)`` (x @ w.T) runs on oneDNN rather than torch's default GEMM."""
    return (x.device.type == "cpu" and w.device.type == "cpu" and policy.current(x.device).onednn_f32
            and x.dtype == torch.float32 and w.dtype == torch.float32
            and max(w.shape) >= ONEDNN_MIN_DIM and x.numel() * w.shape[0] >= ONEDNN_MIN_MACS
            and torch.backends.mkldnn.enabled and onednn_available())


def mm_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for x (..., in) and w (out, in); no autograd."""
    if uses_onednn(x, w):
        with torch.no_grad():
            return _onednn_mm_t(x, w)
    return torch.matmul(x, w.T)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D a (n, k) and b (k, m); no autograd (oneDNN takes b as a transposed view)."""
    return mm_t(a, b.T)


def add_mm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` (in place where the kernel allows: ``addmm_`` off oneDNN)."""
    if uses_onednn(a, b.T):
        return acc.add_(mm(a, b))
    return acc.addmm_(a, b)


class _Linear(torch.autograd.Function):
    """``x @ w.T`` with gradients for whichever of x and w require one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w)
        return mm_t(x, w)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        n_out, n_in = w.shape
        g = grad_y.reshape(-1, n_out)
        grad_x = mm(g, w).reshape(*grad_y.shape[:-1], n_in) if ctx.needs_input_grad[0] else None
        grad_w = mm(g.T, x.reshape(-1, n_in)) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` (no bias), its products on oneDNN where :func:`uses_onednn`; elsewhere,
    and under autocast (which picks its own dtype and kernel), ``F.linear`` itself."""
    if not uses_onednn(x, w) or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, w)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _Linear.apply(x, w)
    return mm_t(x, w)


class Linear(nn.Linear):
    """``nn.Linear`` whose bias-free f32 CPU products run on oneDNN; the same parameters and
    state dict, and ``isinstance(m, nn.Linear)`` holds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight)

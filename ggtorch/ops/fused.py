"""RMSNorm and the gated units (SwiGLU, GeGLU) as autograd Functions that keep less for backward than their
op-by-op form, and rope; on CPU each in C, as is the loss's online softmax (:func:`softmax_slab_`).

Written op by op, ``silu(g) * u`` keeps three (tokens, n_ff) tensors alive until backward
(g, silu(g), u) and RMSNorm keeps its input and the normalized copy; every intermediate is
also a fresh allocation, so more is saved and memory is walked more often than needed. These
Functions compute the forward with the same ops in the same order (bit-identical outputs), save
only their inputs (and RMSNorm's per-row 1/rms), and recompute the cheap rest in backward.

Their *outputs* are saved too, by whoever consumes them: the LoRA ``A`` of the next linear
layer keeps its input for its own gradient. Inside :func:`recompute_outputs` those saves keep
a recipe instead (the Function's own saved inputs, which live anyway) and the output is
recomputed, bit-identically, when backward needs it, so it never stays resident.

On CPU, for contiguous f32 or bf16 tensors, the norm and the gated units run in ``fused.c`` (built on first
use by :mod:`ggtorch.ops.clib`), as does rope (:func:`rope`, which models.model's apply_rope takes where it
can): one pass over their inputs each way instead of one per op, computing in f32 and rounding bf16
results once. Elsewhere (other devices or dtypes, no compiler, a policy without ``c_fused``) torch's ops run.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from ggtorch.ops import clib, policy

SOURCE = Path(__file__).with_name("fused.c")
FLAGS = ("-O3", "-fno-math-errno")
"""Compiler flags besides those :func:`ggtorch.ops.clib.load` adds: the square root inlined (no errno to set)."""


@functools.cache
def _library() -> ctypes.CDLL | None:
    return clib.load_declared(SOURCE, FLAGS)


_built: tuple[bool, bool] | None = None
"""(fused.c is built, it has rope), asked once: a module global, which torch.compile reads as a constant."""


def _builds() -> tuple[bool, bool]:
    global _built
    if _built is None:
        lib = _library()
        _built = (lib is not None, lib is not None and bool(lib.ggtorch_rope_built()))
    return _built


def built() -> bool:
    """Whether fused.c is built and loaded."""
    return _builds()[0]


def _native(*tensors: torch.Tensor) -> bool:
    """Whether ``fused.c`` computes with these operands: contiguous CPU tensors of one shape and one dtype, f32 or
    bf16, whose policy runs these loops in C, and the library built."""
    first = tensors[0]
    return (first.device.type == "cpu" and policy.current(first.device).c_fused
            and first.dtype in (torch.float32, torch.bfloat16) and all(
        t.device.type == "cpu" and t.dtype == first.dtype and t.shape == first.shape and t.is_contiguous()
        for t in tensors) and built())


_registries: list[WeakIdKeyDictionary] = []
"""Outputs that may be saved as recipes (by tensor identity, with their version when made); one per active
:func:`recompute_outputs`."""


class _Recipe:
    """How to make an output again; the first unpack computes it, later ones (q, k and v share an
    input) reuse it until the graph lets the recipe go."""

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: tuple[Any, ...]) -> None:
        self.fn, self.inputs = fn, inputs
        self.value: torch.Tensor | None = None

    def make(self) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.fn(*self.inputs)
        return self.value


def _remember(output: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs: Any) -> None:
    """Within :func:`recompute_outputs`: ``output`` may be saved as ``fn(*inputs)``, made again in backward."""
    if _registries:
        _registries[-1][output] = (output._version, _Recipe(fn, inputs))


def _pack(t: torch.Tensor) -> Any:
    # the very output, or a view of all of it (linear layers flatten (B, T, C) to (B*T, C)), unchanged in place
    # since it was made
    original = t if t._base is None else t._base
    entry = _registries[-1].get(original) if _registries else None
    if entry is not None and t.numel() == original.numel() and t.is_contiguous() and t._version == entry[0]:
        return entry[1], t.shape
    return t


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, tuple):
        recipe, shape = packed
        return recipe.make().view(shape)
    return packed


@contextmanager
def recompute_outputs() -> Iterator[None]:
    """Within: tensors saved for backward that are rms_norm / swiglu / geglu outputs are recomputed in
    backward instead of kept. (Inside activation-checkpointed regions checkpointing's own hooks
    apply instead.) An eager-mode saving: under torch.compile the graph's partitioner makes this choice."""
    _registries.append(WeakIdKeyDictionary())
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _registries.pop()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dimension with gain ``weight``, computed in f32 (ggml's rms_norm then mul): in fused.c
    (the ``ggtorch::rms_norm`` op) where the policy and the operands allow, else torch's ops."""
    if _native(x) and weight.device.type == "cpu" and weight.shape == x.shape[-1:]:
        out, rstd = _rms_norm_op(x, weight, eps)
        _remember(out, _normed, x, weight, rstd, x.dtype)  # the same products: bit-identical to out
        return out
    return _RMSNorm.apply(x, weight, eps)


class _RMSNorm(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * w`` in f32, returned in x's dtype, through torch's ops."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        out = _normed(xf, weight, rstd, x.dtype)
        _remember(out, _normed, x, weight, rstd, x.dtype)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        return (*_rms_norm_grads(x, weight, rstd, grad, *ctx.needs_input_grad[:2], native=False), None)


def _normed(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The normalized output in ``dtype`` (x: the input, already f32 in the forward)."""
    return (x.float() * rstd).mul_(weight.float()).to(dtype)


def _rms_norm_grads(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor, need_x: bool,
                    need_w: bool, native: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """RMSNorm's gradients of x (in fused.c with ``native``) and of the gain (torch's ops), None where not needed."""
    grad, grad_x, grad_w = grad.contiguous(), None, None
    if need_x and native and _native(x, grad):
        grad_x = _rms_norm_backward_op(x, weight, rstd, grad)
        if not need_w:
            return grad_x, None
    xf, gf = x.float(), grad.float()
    if need_x and grad_x is None:
        # d/dx of w·x·r with r = (mean(x^2) + eps)^-1/2:  r·(g·w) - x·r^3·mean(g·w·x)
        gw = gf * weight.float()
        coef = (gw * xf).mean(dim=-1, keepdim=True).mul_(rstd.pow(3))
        grad_x = gw.mul_(rstd).sub_(xf * coef).to(x.dtype)
    if need_w:
        grad_w = (gf * xf * rstd).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return grad_x, grad_w


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the SwiGLU of llama's feed-forward."""
    return _glu_of(gate, up, False)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate) * up``, the GeGLU of gemma's feed-forward, with GELU's tanh approximation: the formula ggml
    writes (ggml_gelu_f32) and gemma was trained with.

    ggml's CPU backend reads GELU from a table indexed by the input rounded to fp16 (GGML_GELU_FP16), its GPU
    backends compute the formula; ggtorch computes the formula on every device, so training sees its smooth
    gradient (tests/models check the table's few-1e-3 difference on CPU)."""
    return _glu_of(gate, up, True)


def _glu_of(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(gate) * up``: in fused.c (the ``ggtorch::glu`` op) where the policy and the operands allow, else
    torch's ops; backward recomputes act(gate) instead of keeping it."""
    out = _glu_op(gate, up, gelu) if _native(gate, up) else _GLU.apply(gate, up, gelu)
    _remember(out, _glu, gate, up, gelu)
    return out


def _glu(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` without autograd, the way the forward computed it."""
    if _native(gate, up):
        return _glu_op(gate, up, gelu)
    return _activation(gate, gelu).mul_(up)


class _GLU(torch.autograd.Function):
    """``act(gate) * up`` through torch's ops, act silu (SwiGLU) or with ``gelu`` GELU's tanh approximation
    (GeGLU)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        ctx.gelu = gelu
        return _activation(gate, gelu).mul_(up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        return (*_glu_grads(gate, up, grad.contiguous(), ctx.gelu, *ctx.needs_input_grad[:2]), None)


def _glu_grads(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, gelu: bool, need_gate: bool,
               need_up: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``act(gate) * up`` through torch's ops: the activation's own backward kernel, one pass,
    where the formula written out takes several."""
    if gelu:
        grad_gate = torch.ops.aten.gelu_backward(grad * up, gate, approximate="tanh") if need_gate else None
    else:
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if need_gate else None
    grad_up = _activation(gate, gelu).mul_(grad) if need_up else None
    return grad_gate, grad_up


def _activation(gate: torch.Tensor, gelu: bool) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)


ROPE_MAX_D = 1024
"""The widest head fused.c rotates (its ROPE_MAX_D: the row's angles, twice over, sit on the stack)."""


def rope_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether :func:`rope` runs in ``fused.c``: x (B, T, H, D) contiguous, every dim rotated (D = 2 · the angles'
    width), its angles contiguous f32 (T, D/2) or (B, T, D/2), all on the CPU, and the library's rope built in
    vectors (its scalar loops, from compilers without vector shuffles, are slower than torch's ops)."""
    if x.dim() != 4:
        return False
    B, T, _, D = x.shape
    return (_native(x) and _rope_built() and D == 2 * cos.shape[-1] <= ROPE_MAX_D
            and cos.shape == sin.shape and cos.shape[:-1] in ((T,), (B, T))
            and all(a.dtype == torch.float32 and a.device.type == "cpu" and a.is_contiguous() for a in (cos, sin)))


def _rope_built() -> bool:
    """Whether the library has rope (built by a compiler with vector shuffles)."""
    return _builds()[1]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, halves: bool) -> torch.Tensor:
    """Rope of x (B, T, H, D) in its own dtype for :func:`rope_takes` operands, in one pass of f32 arithmetic
    (the torch ops widen bf16 to f32 and round back in passes of their own): pair i, (x[i], x[i + D/2]) with
    ``halves`` (NEOX) else (x[2i], x[2i+1]) (NORM), rotated by the angle whose cos and sin are column i.
    Backward rotates back and saves only the angles."""
    return _rope_op(x, cos, sin, halves, 1.0)


SOFTMAX_HEADROOM = 30.0
"""How far a slab's largest logit may rise above a row's reference before :func:`softmax_slab_` moves the reference
and the row's sums are rescaled: e^30 ≈ 1e13 leaves a sum over a 262,144-word vocabulary, and its products with
an output matrix, far inside f32's and bf16's range (not f16's: f16 logits take torch's ops)."""


def softmax_slab_takes(logits: torch.Tensor) -> bool:
    """Whether :func:`softmax_slab_` runs on these logits: a 2-D CPU tensor in f32 or bf16 with contiguous rows."""
    return (logits.device.type == "cpu" and policy.current(logits.device).c_fused and logits.dim() == 2
            and logits.stride(1) == 1
            and logits.dtype in (torch.float32, torch.bfloat16) and built())


def softmax_slab_(logits: torch.Tensor, targets: torch.Tensor, v0: int, run_max: torch.Tensor,
                  run_sum: torch.Tensor, picked: torch.Tensor, rescale: torch.Tensor) -> bool:
    """One slab of an online softmax in ``fused.c``, the logits of vocabulary ids v0.. overwritten by their
    exponentials: for :func:`softmax_slab_takes` logits (rows, width), targets (rows,) int64, and running f32 rows
    (rows,) each, contiguous: each row's target logit is added to ``picked`` when the slab holds it, and
    e^(logit - run_max) summed into ``run_sum``, run_max moving (by at least :data:`SOFTMAX_HEADROOM`) only when
    a logit would otherwise give more than e^SOFTMAX_HEADROOM. True when it moved for some row: the caller's sums
    of these exponentials must then be multiplied by ``rescale`` (1 elsewhere), as run_sum has been."""
    rows = logits.shape[0]
    for t, dtype in ((targets, torch.int64), (run_max, torch.float32), (run_sum, torch.float32),
                     (picked, torch.float32), (rescale, torch.float32)):
        if t.shape != (rows,) or t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"softmax_slab_: a row tensor of shape {tuple(t.shape)} and {t.dtype}, "
                             f"expected ({rows},) {dtype}, contiguous, on the CPU")
    _softmax_slab_op(logits, targets, v0, run_max, run_sum, picked, rescale)
    if torch.compiler.is_compiling():  # a trace does not read data: its caller rescales, by 1 where nothing moved
        return True
    return bool((rescale != 1).any())


# --- fused.c's functions as torch ops (what torch.compile and FakeTensor see), with their autograd formulas --------
# Each is called only for operands the functions above checked (_native, rope_takes, softmax_slab_takes). Registered
# with torch.library's define/impl: a torch.library.custom_op imports torch._dynamo on its first call (seconds of
# every command's start) and costs several times the dispatch.

def _bf16(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16


torch.library.define("ggtorch::rms_norm", "(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)")
torch.library.define("ggtorch::rms_norm_backward", "(Tensor x, Tensor weight, Tensor rstd, Tensor grad) -> Tensor")
torch.library.define("ggtorch::glu", "(Tensor gate, Tensor up, bool gelu) -> Tensor")
torch.library.define("ggtorch::glu_backward", "(Tensor gate, Tensor up, Tensor grad, bool gelu, bool need_gate, "
                                              "bool need_up) -> (Tensor, Tensor)")
torch.library.define("ggtorch::rope", "(Tensor x, Tensor cos, Tensor sin, bool halves, float sign) -> Tensor")
torch.library.define("ggtorch::softmax_slab_", "(Tensor(a!) logits, Tensor targets, int v0, Tensor(b!) run_max, "
                                               "Tensor(c!) run_sum, Tensor(d!) picked, Tensor(e!) rescale) -> ()")


@torch.library.impl("ggtorch::rms_norm", "cpu")
def _rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fused.c's forward: the output in x's dtype and the per-row 1/rms in f32, shaped (..., 1)."""
    out = torch.empty_like(x)
    rstd = torch.empty(*x.shape[:-1], 1, dtype=torch.float32)
    w = weight.float().contiguous()  # held here: a temporary's memory would be freed before the call
    C = x.shape[-1]
    _library().ggtorch_rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), rstd.data_ptr(), x.numel() // C, C, eps,
                                _bf16(x), torch.get_num_threads())
    return out, rstd


@torch.library.register_fake("ggtorch::rms_norm")
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


def _rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    ctx.save_for_backward(inputs[0], inputs[1], output[1])


def _rms_norm_backward(ctx: Any, grad: torch.Tensor, _grad_rstd: torch.Tensor) -> tuple[Any, ...]:
    x, weight, rstd = ctx.saved_tensors
    return (*_rms_norm_grads(x, weight, rstd, grad, *ctx.needs_input_grad[:2], native=True), None)


torch.library.register_autograd("ggtorch::rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)


@torch.library.impl("ggtorch::rms_norm_backward", "cpu")
def _rms_norm_backward_cpu(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                           grad: torch.Tensor) -> torch.Tensor:
    """fused.c's input gradient for a contiguous ``grad`` in x's dtype."""
    grad_x = torch.empty_like(x)
    w = weight.float().contiguous()
    C = x.shape[-1]
    _library().ggtorch_rms_norm_backward(x.data_ptr(), w.data_ptr(), rstd.data_ptr(), grad.data_ptr(),
                                         grad_x.data_ptr(), x.numel() // C, C, _bf16(x), torch.get_num_threads())
    return grad_x


@torch.library.register_fake("ggtorch::rms_norm_backward")
def _(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.impl("ggtorch::glu", "cpu")
def _glu_cpu(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """fused.c's ``act(gate) * up``."""
    out = torch.empty_like(gate)
    _library().ggtorch_glu(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), gelu, _bf16(gate),
                           torch.get_num_threads())
    return out


@torch.library.register_fake("ggtorch::glu")
def _(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    return torch.empty_like(gate)


def _glu_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.gelu = inputs[2]


def _glu_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    gate, up = ctx.saved_tensors
    need_gate, need_up = ctx.needs_input_grad[:2]
    grad = grad.contiguous()
    if not _native(gate, up, grad):
        return (*_glu_grads(gate, up, grad, ctx.gelu, need_gate, need_up), None)
    grad_gate, grad_up = _glu_backward_op(gate, up, grad, ctx.gelu, need_gate, need_up)
    return grad_gate if need_gate else None, grad_up if need_up else None, None


torch.library.register_autograd("ggtorch::glu", _glu_backward, setup_context=_glu_setup)


@torch.library.impl("ggtorch::glu_backward", "cpu")
def _glu_backward_cpu(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, gelu: bool, need_gate: bool,
                      need_up: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fused.c's gradients of ``act(gate) * up`` for a contiguous ``grad``; an empty tensor where not needed."""
    grad_gate = torch.empty_like(gate) if need_gate else gate.new_empty(0)
    grad_up = torch.empty_like(up) if need_up else up.new_empty(0)
    _library().ggtorch_glu_backward(gate.data_ptr(), up.data_ptr(), grad.data_ptr(),
                                    grad_gate.data_ptr() if need_gate else None,
                                    grad_up.data_ptr() if need_up else None,
                                    gate.numel(), gelu, _bf16(gate), torch.get_num_threads())
    return grad_gate, grad_up


@torch.library.register_fake("ggtorch::glu_backward")
def _(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, gelu: bool, need_gate: bool,
      need_up: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(gate) if need_gate else gate.new_empty(0)), (
        torch.empty_like(up) if need_up else up.new_empty(0))


@torch.library.impl("ggtorch::rope", "cpu")
def _rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, halves: bool, sign: float) -> torch.Tensor:
    """fused.c's rotation of contiguous x (B, T, H, D) by the angles (by their negatives with ``sign`` -1)."""
    B, T, H, D = x.shape
    out = torch.empty_like(x)
    if _library().ggtorch_rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), B * T, T, H, D // 2,
                               halves, cos.dim() == 3, sign, _bf16(x), torch.get_num_threads()):
        raise ValueError(f"rope: fused.c does not take heads of {D} values (see rope_takes)")
    return out


@torch.library.register_fake("ggtorch::rope")
def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, halves: bool, sign: float) -> torch.Tensor:
    return torch.empty_like(x)


def _rope_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    _, cos, sin, halves, sign = inputs
    ctx.save_for_backward(cos, sin)
    ctx.halves, ctx.sign = halves, sign


def _rope_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    cos, sin = ctx.saved_tensors
    return _rope_op(grad.contiguous(), cos, sin, ctx.halves, -ctx.sign), None, None, None, None


torch.library.register_autograd("ggtorch::rope", _rope_backward, setup_context=_rope_setup)


@torch.library.impl("ggtorch::softmax_slab_", "cpu")
def _softmax_slab_cpu(logits: torch.Tensor, targets: torch.Tensor, v0: int, run_max: torch.Tensor,
                      run_sum: torch.Tensor, picked: torch.Tensor, rescale: torch.Tensor) -> None:
    """fused.c's slab of the online softmax (``rescale`` tells the rows whose reference moved)."""
    rows, width = logits.shape
    _library().ggtorch_softmax_slab(
        logits.data_ptr(), rows, width, logits.stride(0), targets.data_ptr(), v0, run_max.data_ptr(),
        run_sum.data_ptr(), picked.data_ptr(), rescale.data_ptr(), SOFTMAX_HEADROOM, _bf16(logits),
        torch.get_num_threads())
    for t in (logits, run_max, run_sum, picked, rescale):
        clib.written(t)


@torch.library.register_fake("ggtorch::softmax_slab_")
def _(logits: torch.Tensor, targets: torch.Tensor, v0: int, run_max: torch.Tensor, run_sum: torch.Tensor,
      picked: torch.Tensor, rescale: torch.Tensor) -> None:
    return None


_rms_norm_op = torch.ops.ggtorch.rms_norm.default
_rms_norm_backward_op = torch.ops.ggtorch.rms_norm_backward.default
_glu_op = torch.ops.ggtorch.glu.default
_glu_backward_op = torch.ops.ggtorch.glu_backward.default
_rope_op = torch.ops.ggtorch.rope.default
_softmax_slab_op = torch.ops.ggtorch.softmax_slab_.default

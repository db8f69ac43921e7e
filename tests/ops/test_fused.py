"""The fused RMSNorm / SwiGLU / GeGLU Functions against the op-by-op formulas autograd differentiates itself, in float64
and in their own dtype, through torch's ops and through fused.c (the ``native`` fixture runs a test both ways)."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from ggtorch.ops import clib, fused, policy
from ggtorch.ops.fused import geglu, rms_norm, swiglu


@pytest.fixture(params=[False, True], ids=["torch", "fused.c"])
def native(request: pytest.FixtureRequest, cpu_policy) -> bool:
    if request.param and not clib.compiler():
        pytest.skip("no C compiler")
    cpu_policy(c_fused=request.param)
    return request.param


GLUS = {"swiglu": (swiglu, F.silu), "geglu": (geglu, lambda x: F.gelu(x, approximate="tanh"))}
"""Each gated unit and its activation as torch's op computes it."""


def reference_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def test_rms_norm_forward_is_bit_identical_to_the_op_by_op_form(native: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 17, 96, generator=g) * 3
    w = torch.randn(96, generator=g)
    if native:  # its own order of the sum of squares: within a few f32 steps, and recomputed bit-identically
        out = rms_norm(x, w, 1e-5)
        torch.testing.assert_close(out, reference_rms_norm(x, w, 1e-5), rtol=4e-7, atol=1e-7)
        _, rstd = fused._rms_norm_op(x, w, 1e-5)
        assert torch.equal(out, fused._normed(x, w, rstd, x.dtype))
    else:
        assert torch.equal(rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [5, 16, 96, 1000])
def test_rms_norm_and_its_input_gradient_against_float64(native: bool, dtype: torch.dtype, width: int) -> None:
    """Every tail of the 16-wide vectors; one rounding of the f32 result (bf16: of the f32 value)."""
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(7, width, generator=g) * 3).to(dtype).requires_grad_()
    w = torch.randn(width, generator=g).to(dtype)  # bf16 models hold their norms' gains in bf16
    dy = torch.randn(7, width, generator=g).to(dtype)
    out = rms_norm(x, w, 1e-5)
    (grad,) = torch.autograd.grad(out, x, dy)
    x64 = x.detach().double().requires_grad_()
    out64 = reference_rms_norm(x64, w.double(), 1e-5)
    (grad64,) = torch.autograd.grad(out64, x64, dy.double())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-2}
    assert out.dtype == grad.dtype == dtype
    torch.testing.assert_close(out.double(), out64, **tol)
    torch.testing.assert_close(grad.double(), grad64, **tol)


@pytest.mark.parametrize("needs", [(True, False), (True, True)])
def test_rms_norm_gradients_equal_autograd_of_the_formula(native: bool, needs: tuple[bool, bool]) -> None:
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(4, 9, 64, generator=g) * 2
    w0 = torch.randn(64, generator=g)
    up = torch.randn(4, 9, 64, generator=g)
    grads = []
    for fn in (rms_norm, reference_rms_norm):
        x = x0.clone().requires_grad_(needs[0])
        w = w0.clone().requires_grad_(needs[1])
        (fn(x, w, 1e-6) * up).sum().backward()
        grads.append((x.grad, w.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)
    if needs[1]:
        torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-4)
    else:
        assert grads[0][1] is None


def test_rms_norm_keeps_the_input_dtype_under_bf16(native: bool) -> None:
    x = torch.randn(2, 3, 32).to(torch.bfloat16).requires_grad_()
    w = torch.randn(32)
    y = rms_norm(x, w, 1e-5)
    assert y.dtype == torch.bfloat16
    if native:  # its 1/rms may differ from the ops' in the last f32 bit: within one bf16 rounding
        torch.testing.assert_close(y, reference_rms_norm(x, w, 1e-5), rtol=4e-3, atol=1e-6)
    else:
        assert torch.equal(y, reference_rms_norm(x, w, 1e-5))
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("glu", GLUS)
def test_glu_forward_is_bit_identical_and_gradients_match_autograd(native: bool, glu: str) -> None:
    g = torch.Generator().manual_seed(3)
    gate0 = torch.randn(4, 7, 48, generator=g) * 4
    up0 = torch.randn(4, 7, 48, generator=g)
    dy = torch.randn(4, 7, 48, generator=g)
    outs, grads = [], []
    unit, act = GLUS[glu]
    for fn in (unit, lambda a, b: act(a) * b):
        gate, up = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
        y = fn(gate, up)
        (y * dy).sum().backward()
        outs.append(y.detach())
        grads.append((gate.grad, up.grad))
    if native:  # its own exp: within a few f32 steps
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(outs[0], outs[1])
    # torch's f32 GELU and its derivative are 0 where its tanh has rounded to -1 (gates below about -5);
    # fused.c's sigmoid form keeps that tail's few 1e-6 (float64's: test_glu_and_its_gradients_against_float64)
    tail = 1e-5 if native and glu == "geglu" else 0.0
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=max(1e-6, tail))
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-6, atol=max(1e-7, tail))


@pytest.mark.parametrize("glu", GLUS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [7, 16, 2049, 40000])
def test_glu_and_its_gradients_against_float64(native: bool, glu: str, dtype: torch.dtype, n: int) -> None:
    """Every tail of the vectors and of the threads' chunks, gates out to where e^-g over- and underflows."""
    g = torch.Generator().manual_seed(n)
    gate = (torch.randn(n, generator=g) * 8).to(dtype)
    gate[: min(n, 4)] = torch.tensor([-100.0, -87.5, 88.5, 100.0])[: min(n, 4)].to(dtype)
    up = torch.randn(n, generator=g).to(dtype)
    dy = torch.randn(n, generator=g).to(dtype)
    gate_, up_ = gate.clone().requires_grad_(), up.clone().requires_grad_()
    unit, act = GLUS[glu]
    out = unit(gate_, up_)
    grads = torch.autograd.grad(out, (gate_, up_), dy)
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    out64 = act(g64) * u64
    grads64 = torch.autograd.grad(out64, (g64, u64), dy.double())
    tol = {"rtol": 2e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}
    if glu == "geglu" and not native and dtype == torch.float32:  # torch's tanh saturates: 0 for a few 1e-6
        tol["atol"] = 1e-5
    for ours, exact in zip((out, *grads), (out64, *grads64), strict=True):
        assert ours.dtype == dtype
        torch.testing.assert_close(ours.double(), exact, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_c_results_do_not_depend_on_the_thread_count(dtype: torch.dtype) -> None:
    if not clib.compiler():
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(5)
    gate, up, dy = (torch.randn(300, 1000, generator=g).to(dtype) for _ in range(3))
    w = torch.randn(1000, generator=g)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out, rstd = fused._rms_norm_op(gate, w, 1e-6)
            results.append([fused._glu(gate, up, False), fused._glu(gate, up, True), out,
                            fused._rms_norm_backward_op(gate, w, rstd, dy),
                            *fused._glu_backward_op(gate, up, dy, True, True, True)])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r, strict=True))


@pytest.mark.parametrize("glu", GLUS)
def test_glu_gradcheck_float64(glu: str) -> None:
    g = torch.Generator().manual_seed(4)
    gate = torch.randn(3, 10, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(3, 10, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(GLUS[glu][0], (gate, up))


def test_fused_functions_keep_less_for_backward(native: bool) -> None:
    """What the point is: SwiGLU keeps 2 (not 3) activation tensors, RMSNorm 1 (not 2) plus 1/rms."""
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    x = torch.randn(8, 256, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        swiglu(x * 1, x * 2)
    assert sum(n for n in sizes if n == x.numel()) == 2 * x.numel()
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rms_norm(x * 1, torch.ones(256), 1e-5)
    assert sum(n for n in sizes if n == x.numel()) == x.numel()


def _lora_grads(model: torch.nn.Module, tokens: torch.Tensor, autocast: bool, recompute: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            fused.recompute_outputs() if recompute else nullcontext():
        logits = model(tokens)
    logits.float().logsumexp(-1).sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("autocast", [False, True])
def test_recomputed_outputs_give_bit_identical_gradients_and_are_not_kept(monkeypatch: pytest.MonkeyPatch,
                                                                          autocast: bool, native: bool) -> None:
    """A forward inside recompute_outputs (the training step's) saves rms_norm/swiglu outputs as recipes; backward
    must not notice."""
    from ggtorch.lora import LoraConfig, attach_lora
    from ggtorch.models import model as llama
    from ggtorch.models.config import ModelConfig

    torch.manual_seed(0)
    model = llama.Transformer(ModelConfig(n_vocab=64, n_embd=32, n_layer=2, n_head=4, n_head_kv=2, n_ff=48,
                                    n_ctx_train=16))
    for p in model.parameters():
        p.requires_grad_(False)
    attach_lora(model, LoraConfig(rank=2, init="torch"), seed=0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)  # B = 0 would hide any error in the A gradients
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    recipes = []
    real_pack = fused._pack
    monkeypatch.setattr(fused, "_pack", lambda t: recipes.append(real_pack(t)) or recipes[-1])
    with_recompute = _lora_grads(model, tokens, autocast, recompute=True)
    if not autocast:  # per layer: the norms' outputs (q, k and v's node; gate and up's), SwiGLU's (down); and the
        # output norm's (the output's LoRA)
        assert sum(isinstance(r, tuple) for r in recipes) == 2 * 3 + 1
    else:  # autocast saves its bf16 copies of the norms' outputs; SwiGLU's bf16 output is a recipe
        assert sum(isinstance(r, tuple) for r in recipes) == 2
    kept = _lora_grads(model, tokens, autocast, recompute=False)
    assert all(torch.equal(a, b) for a, b in zip(with_recompute, kept, strict=True))


def test_a_changed_output_is_saved_as_is_not_recomputed(native: bool) -> None:
    """An output edited in place after the forward no longer equals its recipe: it must be kept."""
    g, u = torch.randn(4, 8), torch.randn(4, 8)
    a = torch.randn(3, 8, requires_grad=True)
    with fused.recompute_outputs():
        p = fused.swiglu(g, u)
        p.mul_(2)  # version bump
        packed = fused._pack(p.view(4, 8))
    assert packed is not None and not isinstance(packed, tuple)
    with fused.recompute_outputs():
        q = fused.swiglu(g, u)
        h = torch.nn.functional.linear(q, a)
    h.sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(4, 3).T @ (torch.nn.functional.silu(g) * u), rtol=1e-5, atol=1e-5)


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, halves: bool) -> torch.Tensor:
    """The rotation written out in float64: pair i is (x[i], x[i + D/2]) with ``halves``, else (x[2i], x[2i+1])."""
    x, c, s = x.double(), cos.double().unsqueeze(-2), sin.double().unsqueeze(-2)  # angles over the heads
    half = cos.shape[-1]
    x0, x1 = (x[..., :half], x[..., half:]) if halves else (x[..., 0::2], x[..., 1::2])
    r0, r1 = x0 * c - x1 * s, x0 * s + x1 * c
    return torch.cat((r0, r1), dim=-1) if halves else torch.stack((r0, r1), dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("halves", [False, True], ids=["norm", "neox"])
@pytest.mark.parametrize("head", [6, 20, 64, 256])
@pytest.mark.parametrize("per_row", [False, True])
def test_rope_and_its_gradient_against_float64(native: bool, dtype: torch.dtype, halves: bool, head: int,
                                               per_row: bool) -> None:
    """fused.c's rope (every tail of the vectors, angles per position or per row) and the torch ops it replaces:
    both within one rounding of the exact rotation, forward and backward (the rotation back)."""
    from ggtorch.models.model import apply_rope, rope_angles_at

    B, T, H = 2, 9, 3
    g = torch.Generator().manual_seed(head)
    positions = torch.randint(0, 500, (B, T), generator=g) if per_row else torch.arange(T)
    cos, sin = rope_angles_at(positions, head, 10000.0, 1.0)
    x = (torch.randn(B, T, H, head, generator=g) * 2).to(dtype).requires_grad_()
    dy = torch.randn(B, T, H, head, generator=g).to(dtype)
    if native:
        assert fused.rope_takes(x, cos, sin) == (fused._library().ggtorch_rope_built() == 1)
    out = apply_rope(x, cos, sin, halves)
    (grad,) = torch.autograd.grad(out, x, dy)
    x64 = x.detach().double().requires_grad_()
    out64 = reference_rope(x64, cos, sin, halves)
    (grad64,) = torch.autograd.grad(out64, x64, dy.double())
    tol = {"rtol": 2e-6, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-2}
    assert out.dtype == grad.dtype == dtype
    torch.testing.assert_close(out.double(), out64, **tol)
    torch.testing.assert_close(grad.double(), grad64, **tol)


def test_rope_in_fused_c_equals_the_torch_ops_and_the_thread_count_does_not_matter() -> None:
    if not clib.compiler() or not fused._library().ggtorch_rope_built():
        pytest.skip("no C compiler, or one without vector shuffles")
    from ggtorch.models.model import rope_angles_at

    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 50, 4, 64, generator=g)
    cos, sin = rope_angles_at(torch.arange(50), 64, 10000.0, 1.0)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append([fused.rope(x, cos, sin, halves) for halves in (False, True)])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r, strict=True))
    from ggtorch.models.model import apply_rope

    with policy.using(policy.current("cpu").replace(c_fused=False)):
        # the same products and sums, each rounded (no FMA): bit-equal to the ops', f32 and bf16
        for halves, ours in zip((False, True), results[0], strict=True):
            assert torch.equal(ours, apply_rope(x, cos, sin, halves))
            assert torch.equal(fused.rope(x.bfloat16(), cos, sin, halves), apply_rope(x.bfloat16(), cos, sin, halves))


def test_rope_leaves_wide_heads_and_strided_views_to_torch() -> None:
    x = torch.zeros(1, 2, 1, fused.ROPE_MAX_D + 2)
    angles = torch.zeros(2, x.shape[-1] // 2)
    assert not fused.rope_takes(x, angles, angles)
    heads_first = torch.zeros(1, 2, 4, 64).transpose(1, 2)  # (B, T, H, D) as a view: not contiguous
    angles = torch.zeros(4, 32)
    assert not fused.rope_takes(heads_first, angles, angles)
    if fused._library() is not None and fused._library().ggtorch_rope_built():
        assert fused.rope_takes(heads_first.contiguous(), angles, angles)


def _slab_rows(rows: int, dtype: torch.dtype, width: int, n_vocab: int, threads: int | None = None,
               ld: int | None = None) -> tuple[torch.Tensor, ...]:
    """Every slab of (rows, n_vocab) logits through fused.c's online softmax, with the caller's sums of
    the exponentials times a (n_vocab, 3) matrix rescaled as softmax_slab_ asks: (logits, targets,
    run_max, run_sum, picked, the sums, whether any slab moved a row's reference)."""
    g = torch.Generator().manual_seed(rows + width)
    logits = torch.randn(rows, n_vocab, generator=g, dtype=torch.float64) * 4
    logits[1] += torch.linspace(0, 100, n_vocab, dtype=torch.float64)  # rises past the headroom, slab by slab
    logits[2] -= torch.linspace(0, 200, n_vocab, dtype=torch.float64)  # later slabs underflow to 0
    logits = logits.to(dtype)
    w = torch.randn(n_vocab, 3, generator=g, dtype=torch.float64)
    targets = torch.randint(0, n_vocab, (rows,), generator=g)
    run_max = torch.full((rows,), -torch.inf)
    run_sum, picked, rescale = torch.zeros(rows), torch.zeros(rows), torch.empty(rows)
    acc = torch.zeros(rows, 3, dtype=torch.float64)
    any_moved = False
    saved = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        for v0 in range(0, n_vocab, width):
            v1 = min(v0 + width, n_vocab)
            buffer = torch.zeros(rows, ld or v1 - v0, dtype=dtype)  # ld: rows of a wider buffer
            slab = buffer[:, :v1 - v0]
            slab.copy_(logits[:, v0:v1])
            moved = fused.softmax_slab_(slab, targets, v0, run_max, run_sum, picked, rescale)
            assert torch.equal(buffer[:, v1 - v0:], torch.zeros_like(buffer[:, v1 - v0:]))  # nothing past the slab
            assert moved == bool((rescale != 1).any())
            any_moved |= moved
            assert slab.float().max() <= math.exp(fused.SOFTMAX_HEADROOM) * (1 + 2**-8)  # bf16: rounded up
            acc = acc * rescale.double()[:, None] + slab.double() @ w[v0:v1]
    finally:
        torch.set_num_threads(saved)
    return logits, targets, run_max, run_sum, picked, acc / run_sum.double()[:, None], w, any_moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("width", "ld"), [(5, None), (16, None), (100, None), (1000, None), (100, 128)])
def test_softmax_slabs_against_float64(dtype: torch.dtype, width: int, ld: int | None) -> None:
    """The loss's online softmax over slabs of a vocabulary, every vector tail: log-sum-exp, the target's
    logit and softmax @ W against float64 from the same (rounded) logits; rows whose logits rise by more
    than the headroom move their reference, others never do."""
    if not clib.compiler():
        pytest.skip("no C compiler")
    logits, targets, run_max, run_sum, picked, mean_w, w, any_moved = _slab_rows(6, dtype, width, 1000, ld=ld)
    exact = logits.double()
    torch.testing.assert_close(run_max.double() + run_sum.double().log(), exact.logsumexp(dim=1), rtol=1e-6, atol=1e-5)
    assert torch.equal(picked.double(), exact.gather(1, targets[:, None])[:, 0])
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(mean_w, exact.softmax(dim=1) @ w, **tol)
    assert any_moved == (width < 1000)  # row 1's logits rise 100 over the vocabulary
    assert run_max[1] >= exact[1].max() - fused.SOFTMAX_HEADROOM


def test_softmax_slabs_do_not_depend_on_the_thread_count() -> None:
    if not clib.compiler():
        pytest.skip("no C compiler")
    runs = [_slab_rows(300, torch.bfloat16, 100, 1000, threads=n)[2:6] for n in (1, 2, 3)]
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run, strict=True))


def test_softmax_slab_refuses_a_row_tensor_of_the_wrong_kind() -> None:
    if fused._library() is None:
        pytest.skip("no C compiler")
    logits, rows = torch.zeros(4, 8), torch.zeros(4)
    with pytest.raises(ValueError, match="int64"):
        fused.softmax_slab_(logits, torch.zeros(4, dtype=torch.int32), 0, rows, rows.clone(), rows.clone(),
                            rows.clone())
    assert not fused.softmax_slab_takes(torch.zeros(4, 8, dtype=torch.float16))
    assert not fused.softmax_slab_takes(torch.zeros(8, 4).T)


def test_softmax_slab_counts_as_an_in_place_change() -> None:
    """A graph that saved the logits must see them overwritten, as after ``exp_``; the running rows are
    recorded as changed too."""
    if fused._library() is None:
        pytest.skip("no C compiler")
    saved = torch.randn(4, 40, requires_grad=True).exp()  # exp keeps its output for its backward
    rows = [torch.full((4,), -torch.inf), torch.zeros(4), torch.zeros(4), torch.empty(4)]
    before = [t._version for t in (saved, *rows)]
    fused.softmax_slab_(saved.detach(), torch.zeros(4, dtype=torch.int64), 0, *rows)
    assert [t._version for t in (saved, *rows)] == [b + 1 for b in before]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()

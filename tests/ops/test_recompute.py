"""ggtorch's activation checkpointing against torch.utils.checkpoint's non-reentrant form and against
no checkpointing: the same gradients (dropout's random numbers, autocast), with the intermediates gone."""

from __future__ import annotations

import subprocess
import sys
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ggtorch.ops.recompute import checkpoint


def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, p: float = 0.3) -> torch.Tensor:
    """A small MLP block with dropout, SiLU and a residual: ops that save inputs, outputs and masks."""
    h = torch.nn.functional.dropout(x @ w1, p=p, training=True)
    return x + torch.nn.functional.silu(h) @ w2


def grads_of(run: str, autocast: bool = False, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Gradients of x, w1, w2 through two blocks run with ``run``'s checkpointing, and the caller's RNG
    state after backward."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=gen, requires_grad=True)
    w1, w2 = (torch.randn(8, 16, generator=gen).requires_grad_(), torch.randn(16, 8, generator=gen).requires_grad_())
    torch.manual_seed(seed)
    call = {"none": lambda *a: block(*a), "ggtorch": lambda *a: checkpoint(block, *a),
            "torch": lambda *a: torch_checkpoint(block, *a, use_reentrant=False)}[run]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = call(call(x, w1, w2), w1, w2)
    torch.rand(3)  # the caller draws between forward and backward: recomputation must not see it
    y.float().pow(2).sum().backward()
    return [x.grad, w1.grad, w2.grad], torch.get_rng_state()


@pytest.mark.parametrize("autocast", [False, True], ids=["f32", "bf16 autocast"])
def test_gradients_equal_no_checkpointing_and_torch_s(autocast: bool) -> None:
    plain, plain_rng = grads_of("none", autocast)
    ours, our_rng = grads_of("ggtorch", autocast)
    theirs, _ = grads_of("torch", autocast)
    for a, b, c in zip(ours, plain, theirs, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(our_rng, plain_rng)  # the caller's random stream goes on as without checkpointing
    other, _ = grads_of("ggtorch", autocast, seed=1)
    assert not torch.equal(other[1], ours[1])  # the dropout masks matter: the comparison above is not void


def test_the_intermediates_are_dropped_in_forward_and_recomputed_once_per_backward() -> None:
    calls, kept = [], []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        h = x * 2
        kept.append(weakref.ref(h))
        return h.sin()  # sin saves its input h

    x = torch.randn(4, requires_grad=True)
    y = fn(x)
    assert kept[-1]() is not None  # without checkpointing the graph holds h
    del y
    y = checkpoint(fn, x)
    assert kept[-1]() is None and len(calls) == 2
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    assert len(calls) == 4  # one recomputation per backward pass
    assert torch.allclose(x.grad, 2 * 2 * torch.cos(2 * x.detach()))


def test_a_region_inside_a_region_runs_twice_not_three_times() -> None:
    """A DeltaNet mixer's region inside a checkpointed block: the block's recomputation already remakes it, so the
    inner function runs in forward and in that recomputation only, with the gradients of no checkpointing; alone,
    the inner region still drops its intermediates."""
    calls = []

    def inner(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (x * 3).sin()

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return checkpoint(inner, x @ w).cos() @ w

    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    want = torch.autograd.grad(((x @ w * 3).sin().cos() @ w).square().sum(), (x, w))
    got = torch.autograd.grad(checkpoint(block, x, w).square().sum(), (x, w))
    assert len(calls) == 2
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    calls.clear()
    torch.autograd.grad(block(x, w).square().sum(), (x, w))
    assert len(calls) == 2  # forward, and its own recomputation in backward


def test_without_grad_it_is_the_call() -> None:
    calls = []
    with torch.no_grad():
        out = checkpoint(lambda x: calls.append(1) or x + 1, torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0)) and calls == [1]


def test_a_function_that_computes_something_else_again_is_named() -> None:
    steps = iter([True, False])

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin().sin() if next(steps) else x.sin()

    y = checkpoint(fn, torch.randn(3, requires_grad=True))
    with pytest.raises(RuntimeError, match="saved 1 tensors when recomputed, 2 the first time"):
        y.sum().backward()


def test_a_finetune_does_not_import_torch_s_compiler() -> None:
    """torch.utils.checkpoint and torch.optim.Optimizer import torch._dynamo on first use: seconds of every
    run's start, for nothing ggtorch uses."""
    code = ("import sys, torch\n"
            "from ggtorch.ops.recompute import checkpoint\n"
            "from ggtorch.training.optim import AdamConfig, GGMLAdamW\n"
            "w = torch.nn.Parameter(torch.randn(4, 4))\n"
            "opt = GGMLAdamW([('w', w, 2)], AdamConfig(warmup=0))\n"
            "checkpoint(lambda x: (x @ w).sin(), torch.randn(2, 4)).sum().backward()\n"
            "opt.step()\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"

"""ggtorch's C loops as torch ops (``ggtorch::*``): torch's own checker (``torch.library.opcheck``) on each, so that
FakeTensor, torch.compile (AOT autograd) and autograd see what the C functions do, and the ops' values against
torch's formulas where the op has no other test."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ggtorch.ops import attention, fused, lowrank
from ggtorch.quant import native

pytestmark = pytest.mark.skipif(native._library() is None, reason="no C compiler to build the libraries")


def _random(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = False, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_(grad)


def _q8_0_blocks(rows: int, cols: int) -> torch.Tensor:
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    return torch.from_numpy(gguf.quantize(values, gguf.GGMLQuantizationType.Q8_0)).reshape(-1, 34)


def _cases() -> dict[str, list[tuple]]:
    """Arguments of each op: f32 and, where the op takes it, bf16; operands as the Python wrappers check them."""
    q8 = _q8_0_blocks(4, 64)
    cases: dict[str, list[tuple]] = {
        "lowrank_project": [(_random(64, 32, dtype=d), _random(4, 32, dtype=d, seed=1), 0.5)
                            for d in (torch.float32, torch.bfloat16)],
        "lowrank_reduce": [(_random(64, 32, dtype=d), _random(64, 4, dtype=d, seed=1), 2.0)
                           for d in (torch.float32, torch.bfloat16)],
        "lowrank_expand_": [(_random(64, 16, dtype=d), _random(64, 4, dtype=d, seed=1), _random(4, 16, dtype=d, seed=2),
                             0.5) for d in (torch.float32, torch.bfloat16)],
        "dequantize_": [(q8, int(gguf.GGMLQuantizationType.Q8_0), torch.empty(q8.shape[0] * 32, dtype=d))
                        for d in (torch.float32, torch.bfloat16)],
        "rms_norm": [(_random(3, 5, 32, dtype=d, grad=True), _random(32, grad=True, seed=1), 1e-5)
                     for d in (torch.float32, torch.bfloat16)],
        "rms_norm_backward": [(_random(6, 32), _random(32, seed=1), _random(6, 1, seed=2).abs(),
                               _random(6, 32, seed=3))],
        "glu": [(_random(4, 32, dtype=d, grad=True), _random(4, 32, dtype=d, grad=True, seed=1), gelu)
                for d in (torch.float32, torch.bfloat16) for gelu in (False, True)],
        "glu_backward": [(_random(4, 32), _random(4, 32, seed=1), _random(4, 32, seed=2), True, need_gate, need_up)
                         for need_gate, need_up in ((True, True), (True, False), (False, True))],
        "softmax_slab_": [(_random(8, 64) * 10, torch.tensor([0, 5, 63, 64, 100, 3, 7, 9]), 0,
                           torch.full((8,), -torch.inf), torch.zeros(8), torch.zeros(8), torch.empty(8))],
    }
    if fused._rope_built():
        cases["rope"] = [(_random(2, 8, 4, 16, dtype=d, grad=True), _random(8, 8, seed=1), _random(8, 8, seed=2),
                          halves, 1.0) for d in (torch.float32, torch.bfloat16) for halves in (False, True)]
    q, k, v = (_random(2, h, 24, 16, grad=True, seed=i) for i, h in enumerate((4, 2, 2)))
    mask = torch.ones(24, 24, dtype=torch.bool).tril()
    rows = mask.expand(1, 24, 24).contiguous().view(torch.uint8)
    cases["attention"] = [(q, k, v, None, 0, 0.25), (q, k, v, rows, 0, 0.25)]
    with torch.no_grad():
        out, lse = torch.ops.ggtorch.attention(q, k, v, None, 0, 0.25)
    grad = _random(2, 4, 24, 16, seed=5)
    cases["attention_backward"] = [(q.detach(), k.detach(), v.detach(), out, lse, grad, None, 0, 0.25)]
    return cases


CASES = _cases() if native._library() is not None else {}


def test_every_ggtorch_op_is_checked() -> None:
    registered = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("ggtorch::")}
    assert registered - {"rope"} <= CASES.keys() <= registered


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name: str) -> None:
    """Schema (what it mutates), autograd registration, the fake against the real op's outputs (shapes, strides,
    dtypes), and AOT autograd's trace with dynamic shapes."""
    op = getattr(torch.ops.ggtorch, name).default
    for args in CASES[name]:
        torch.library.opcheck(op, args)


def test_the_ops_values_are_the_formulas() -> None:
    """The ops called directly give what their torch formulas give (the wrappers' own tests cover the rest)."""
    x, m, h = _random(64, 32), _random(4, 32, seed=1), _random(64, 4, seed=2)
    torch.testing.assert_close(lowrank.project(x, m, 0.5), 0.5 * x @ m.T)
    torch.testing.assert_close(lowrank.reduce(x, h, 2.0), 2.0 * h.T @ x)
    gate, up = _random(4, 32), _random(4, 32, seed=1)
    torch.testing.assert_close(fused.swiglu(gate, up), F.silu(gate) * up)
    q, k, v = (_random(1, 2, 16, 16, seed=i) for i in range(3))
    torch.testing.assert_close(attention.attention(q, k, v, 0.25),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25))


def test_a_mutating_op_marks_its_output_changed() -> None:
    """``lowrank_expand_`` writes y in place: autograd refuses a graph that saved y before, as after ``add_``."""
    w = torch.randn(16, 16, requires_grad=True)
    y = torch.randn(8, 16) @ w
    s = y.sin()  # saves y
    lowrank.expand_(y.detach(), _random(8, 4), _random(4, 16, seed=1))  # the same memory, changed
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.sum().backward()

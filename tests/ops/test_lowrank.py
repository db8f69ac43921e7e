"""ggtorch.ops.lowrank: the C loops of LoRA's rank-r products against the same formulas in float64 and in torch."""

from __future__ import annotations

import pytest
import torch

from ggtorch.ops import lowrank

pytestmark = pytest.mark.skipif(not lowrank.available(), reason="no C compiler to build ggtorch/ops/lowrank.c")

SHAPES = [(1024, 768, 4), (37, 50, 3), (5, 2048, 16), (1, 17, 1), (130, 64, 8), (3, 16, 5)]
"""(N rows, K columns, r): the common case, and every tail: rows not a multiple of 4, columns not a multiple of
16 or of the 64-column tiles, r not a multiple of 4, a single row or column of the small matrix."""


def _operands(n: int, k: int, r: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in ((n, k), (r, k), (n, r))]


def _close_to(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within f32 rounding of sums of up to K terms, or one bf16 rounding of the result."""
    rtol = 2e-6 if dtype == torch.float32 and got.dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * float(want.abs().max()))


@pytest.mark.parametrize("dtype", lowrank.DTYPES)
@pytest.mark.parametrize(("n", "k", "r"), SHAPES)
def test_the_three_products_against_float64(n: int, k: int, r: int, dtype: torch.dtype) -> None:
    x, m, h = _operands(n, k, r, dtype)
    x64, m64, h64 = (t.double() for t in (x, m, h))
    projected = lowrank.project(x, m, 0.5)
    assert projected.dtype == dtype and projected.shape == (n, r)
    _close_to(projected, 0.5 * x64 @ m64.T, dtype)

    y = torch.randn(n, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = y.double() + 0.5 * h64 @ m64
    assert lowrank.expand_(y, h, m, 0.5) is y
    _close_to(y, want, dtype)

    reduced = lowrank.reduce(x, h, 0.5)
    assert reduced.dtype == torch.float32 and reduced.shape == (r, k)  # f32 whatever the operands
    torch.testing.assert_close(reduced.double(), 0.5 * h64.T @ x64, rtol=2e-6,
                               atol=2e-6 * float((h64.T.abs() @ x64.abs()).max()))


@pytest.mark.parametrize(("n", "k", "r"), SHAPES[:3])
def test_bf16_results_are_the_f32_sums_rounded_as_torch_rounds(n: int, k: int, r: int) -> None:
    """bf16 operands widen exactly, sum in f32 and round once: the bf16 result is torch's f32 product of the
    same operands rounded to bf16, but where summation order moved the f32 sum across a rounding boundary."""
    x, m, h = _operands(n, k, r, torch.bfloat16, seed=2)
    got = lowrank.project(x, m)
    want = (x.float() @ m.float().T).bfloat16()
    differ = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert int(differ.max()) <= 1 and float((differ > 0).float().mean()) < 0.02
    y = torch.randn(n, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = (y.float() + h.float() @ m.float()).bfloat16()
    lowrank.expand_(y, h, m)
    differ = (y.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert int(differ.max()) <= 1 and float((differ > 0).float().mean()) < 0.02


def test_bf16_specials_round_as_torch_does() -> None:
    """A NaN stays a NaN, an infinity an infinity, and a sum past bf16's largest value rounds to infinity."""
    x = torch.tensor([[float("nan")] + [0.0] * 15, [float("inf")] + [0.0] * 15, [3.0e38] + [0.0] * 15,
                      [1.0] * 16], dtype=torch.bfloat16)
    m = torch.tensor([[1.0] * 16, [2.0] * 16], dtype=torch.bfloat16)
    got = lowrank.project(x, m).float()
    assert got[0].isnan().all() and got[1].isposinf().all()
    assert got[2, 0] == float(torch.tensor(3.0e38).bfloat16().float()) and got[2, 1].isposinf()
    assert torch.equal(got[3], torch.tensor([16.0, 32.0]))


@pytest.mark.parametrize("dtype", lowrank.DTYPES)
def test_the_results_do_not_depend_on_the_thread_count(dtype: torch.dtype, monkeypatch) -> None:
    """Every output element is one thread's sum in a fixed order: 1, 2 and 3 threads give the same bits."""
    x, m, h = _operands(515, 700, 6, dtype, seed=4)
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        y = torch.ones(515, 700, dtype=dtype)
        results.append((lowrank.project(x, m, 0.25), lowrank.expand_(y, h, m, 2.0), lowrank.reduce(x, h, 0.5)))
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            assert torch.equal(got, want)


def test_expand_counts_as_an_in_place_change() -> None:
    """A graph that saved y must see it overwritten, as after ``addmm_``."""
    saved = torch.randn(8, 32, requires_grad=True).exp()  # exp keeps its output for its backward
    h, m = torch.randn(8, 2), torch.randn(2, 32)
    before = saved._version
    lowrank.expand_(saved.detach(), h, m)
    assert saved._version == before + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_operands_it_does_not_take() -> None:
    f32 = torch.randn(4, 32)
    assert lowrank.takes(f32, torch.randn(2, 32))
    assert not lowrank.takes(f32, torch.randn(2, 32).bfloat16())  # mixed dtypes
    assert not lowrank.takes(f32.half())
    assert not lowrank.takes(f32.T)  # not contiguous
    assert not lowrank.takes(f32.to("meta"))
    with pytest.raises(ValueError, match="project"):
        lowrank.project(f32, torch.randn(2, 31))


def test_a_policy_without_the_c_loops_means_torch(cpu_policy) -> None:
    assert lowrank.takes(torch.randn(4, 32))
    cpu_policy(c_lowrank=False)
    assert not lowrank.takes(torch.randn(4, 32)) and lowrank.available()

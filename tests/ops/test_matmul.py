"""ggtorch.ops.matmul: f32 products on oneDNN, checked against float64 and against torch's own ops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ggtorch.ops import matmul, policy

ONEDNN = torch.backends.mkldnn.is_available()
MIN_MACS, MIN_DIM = matmul.ONEDNN_MIN_MACS, matmul.ONEDNN_MIN_DIM  # the shipped size rule (the fixture lifts it)


@pytest.fixture(autouse=True)
def _every_size_on_onednn(monkeypatch: pytest.MonkeyPatch, cpu_policy) -> None:
    """The oneDNN path on any CPU, small shapes included (the size rule and the per-vendor default
    have their own tests)."""
    cpu_policy(onednn_f32=True)
    monkeypatch.setattr(matmul, "ONEDNN_MIN_MACS", 0)
    monkeypatch.setattr(matmul, "ONEDNN_MIN_DIM", 0)


@pytest.mark.parametrize(("vendor", "onednn"), [("GenuineIntel", False), ("AuthenticAMD", True),
                                                 ("HygonGenuine", True), ("", True)])
def test_f32_products_take_onednn_except_on_intel_cpus(vendor: str, onednn: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """MKL is the faster f32 GEMM on Intel's CPUs, oneDNN on AMD's (bench/bench_gemm.py): the CPU policy's choice."""
    monkeypatch.setattr(policy, "cpu_vendor", lambda: vendor)
    chosen = policy.choose("cpu")
    assert chosen.onednn_f32 is onednn
    with policy.using(chosen):
        x, w = _randn(64, 768), _randn(768, 768, seed=1)
        assert matmul.uses_onednn(x, w) is (onednn and ONEDNN)
        _close_to_f64(matmul.mm_t(x, w), x.double() @ w.double().T)


def test_the_cpu_vendor_is_read() -> None:
    if not Path("/proc/cpuinfo").is_file() or "vendor_id" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no vendor_id in /proc/cpuinfo")
    assert policy.cpu_vendor() in Path("/proc/cpuinfo").read_text() and policy.cpu_vendor()


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close_to_f64(got: torch.Tensor, want64: torch.Tensor) -> None:
    """f32 GEMM accuracy: rms error a few 1e-7 of the values' rms (another order of summation
    than MKL's, but no reduced precision: bf16 inputs would be ~1e-3)."""
    assert got.dtype == torch.float32 and got.shape == want64.shape
    err = (got.double() - want64).pow(2).mean().sqrt() / want64.pow(2).mean().sqrt()
    assert err < 2e-6, err


def _onednn_ran(fn) -> bool:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return any("_linear_pointwise" in e.key for e in prof.key_averages())


def test_this_build_takes_the_onednn_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matmul, "ONEDNN_MIN_MACS", MIN_MACS)
    monkeypatch.setattr(matmul, "ONEDNN_MIN_DIM", MIN_DIM)
    if not ONEDNN:
        pytest.skip("this torch build has no oneDNN")
    w = _randn(768, 768, seed=1)
    for rows, expected in ((64, True), (2, True), (1, False)):  # one row: 0.59 M multiply-adds
        x = _randn(rows, 768)
        assert matmul.uses_onednn(x, w) is expected and _onednn_ran(lambda x=x: matmul.mm_t(x, w)) is expected
    x = _randn(64, 768)
    assert not matmul.uses_onednn(x.bfloat16(), w.bfloat16())  # bf16 mm is oneDNN already
    assert not matmul.uses_onednn(x.double(), w.double())
    small = _randn(256, 256)  # a tiny model's matrix: oneDNN's per-call cost would dominate
    assert not matmul.uses_onednn(_randn(1024, 256), small)


@pytest.mark.parametrize("layout", ["2d", "3d", "x transposed view", "w transposed view"])
def test_products_equal_float64(layout: str) -> None:
    x, w = _randn(4, 50, 96), _randn(80, 96, seed=1)
    if layout == "2d":
        x = x[0]
    if layout == "x transposed view":
        x = _randn(96, 50).T
    if layout == "w transposed view":
        w = _randn(96, 80, seed=1).T
    _close_to_f64(matmul.mm_t(x, w), x.double() @ w.double().T)
    if x.dim() == 2:
        b = _randn(96, 70, seed=2)
        _close_to_f64(matmul.mm(x, b), x.double() @ b.double())
        acc = _randn(x.shape[0], 70, seed=3)
        want = acc.double() + x.double() @ b.double()
        _close_to_f64(matmul.add_mm_(acc, x, b), want)
        _close_to_f64(acc, want)  # in place


def test_empty_and_other_dtypes_take_torch() -> None:
    w = _randn(8, 16)
    assert matmul.mm_t(torch.empty(0, 16), w).shape == (0, 8)
    xb, wb = _randn(5, 16).bfloat16(), w.bfloat16()
    assert torch.equal(matmul.mm_t(xb, wb), xb @ wb.T)


@pytest.mark.parametrize("grads", ["x", "w", "both"])
def test_linear_gradients_equal_float64(grads: str) -> None:
    x, w, g = _randn(3, 20, 96), _randn(80, 96, seed=1), _randn(3, 20, 80, seed=2)
    x.requires_grad_(grads in ("x", "both"))
    w.requires_grad_(grads in ("w", "both"))
    x64 = x.detach().double().requires_grad_(x.requires_grad)
    w64 = w.detach().double().requires_grad_(w.requires_grad)
    y = matmul.linear(x, w)
    y.backward(g)
    F.linear(x64, w64).backward(g.double())
    _close_to_f64(y.detach(), F.linear(x64, w64).detach())
    for ours, ref in ((x, x64), (w, w64)):
        if ours.requires_grad:
            _close_to_f64(ours.grad, ref.grad)
        else:
            assert ours.grad is None


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's flags() touches tf32 too
def test_linear_is_f_linear_where_onednn_is_not_used(cpu_policy) -> None:
    x, w = _randn(6, 32), _randn(16, 32, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast keeps its own kernel and dtype
        y = matmul.linear(x, w)
        assert y.dtype == torch.bfloat16 and torch.equal(y, F.linear(x, w))
    with torch.backends.mkldnn.flags(enabled=False):
        assert not matmul.uses_onednn(x, w) and torch.equal(matmul.linear(x, w), F.linear(x, w))
    cpu_policy(onednn_f32=False)
    assert not _onednn_ran(lambda: matmul.linear(x, w))
    assert torch.equal(matmul.linear(x, w), F.linear(x, w))


def test_linear_module_is_an_nn_linear() -> None:
    m = matmul.Linear(32, 16, bias=False)
    ref = nn.Linear(32, 16, bias=False)
    ref.load_state_dict(m.state_dict())
    assert isinstance(m, nn.Linear) and list(m.state_dict()) == ["weight"]
    x = _randn(5, 32)
    _close_to_f64(m(x).detach(), x.double() @ m.weight.detach().double().T)
    if ONEDNN:
        assert _onednn_ran(lambda: m(x))
    biased = matmul.Linear(32, 16)
    torch.testing.assert_close(biased(x), F.linear(x, biased.weight, biased.bias))


def test_the_loaded_model_runs_its_matrices_on_onednn(stories260k) -> None:
    from ggtorch.models.loader import load_model_file

    model = load_model_file(stories260k).model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is matmul.Linear for m in linears)
    if ONEDNN:
        assert _onednn_ran(lambda: model(torch.tensor([[1, 2, 3]])))

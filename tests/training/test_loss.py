"""ggtorch.training.loss against torch's F.cross_entropy on materialized logits (values and gradients), every test
with the output loss's online softmax in torch's ops and in fused.c."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from ggtorch.io.encode import quantize
from ggtorch.lora import LoRALinear
from ggtorch.ops import clib, policy
from ggtorch.quant import autograd as quant_autograd
from ggtorch.quant import modules as quant_modules
from ggtorch.quant.modules import QuantLinear
from ggtorch.training import loss as loss_mod
from ggtorch.training.loss import cross_entropy, output_cross_entropy


@pytest.fixture(autouse=True, params=[False, True], ids=["torch", "fused.c"])
def native(request: pytest.FixtureRequest, cpu_policy) -> bool:
    if request.param and not clib.compiler():
        pytest.skip("no C compiler")
    cpu_policy(c_fused=request.param)
    return request.param


def _case(n: int, v: int, n_ignored: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 4
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.randperm(n, generator=g)[:n_ignored]] = -100
    return logits, targets


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("n_ignored", [0, 5])
def test_equals_torch_cross_entropy(reduction: str, n_ignored: int, cpu_policy) -> None:
    cpu_policy(loss_chunk_bytes=7 * 4 * 1000)  # 7 rows per chunk: a ragged last chunk
    logits, targets = _case(40, 1000, n_ignored)
    ours_in = logits.clone().requires_grad_()
    ref_in = logits.clone().requires_grad_()
    ours = cross_entropy(ours_in.view(4, 10, 1000), targets.view(4, 10), reduction)
    ref = F.cross_entropy(ref_in, targets, reduction=reduction).view(ours.shape)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)
    weights = torch.randn(ours.shape)  # a non-uniform upstream gradient for "none"
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-5, atol=1e-7)
    if n_ignored:
        ignored = targets == -100
        assert torch.all(ours_in.grad[ignored] == 0)
        if reduction == "none":
            assert torch.all(ours.view(-1)[ignored] == 0)


def test_all_ignored_mean_is_nan_like_torch() -> None:
    logits, targets = _case(6, 50, 6)
    assert torch.isnan(cross_entropy(logits, targets)) and torch.isnan(F.cross_entropy(logits, targets))
    assert cross_entropy(logits, targets, "sum").item() == 0.0


def test_bf16_logits_give_bf16_gradient_computed_in_f32() -> None:
    logits, targets = _case(8, 300, 0)
    low = logits.bfloat16().requires_grad_()
    loss = cross_entropy(low, targets)
    assert loss.dtype == torch.float32
    loss.backward()
    assert low.grad.dtype == torch.bfloat16
    ref = logits.bfloat16().float().requires_grad_()
    F.cross_entropy(ref, targets).backward()
    torch.testing.assert_close(loss, F.cross_entropy(logits.bfloat16().float(), targets))
    torch.testing.assert_close(low.grad.float(), ref.grad, rtol=1e-2, atol=1e-4)


def test_bad_reduction() -> None:
    logits, targets = _case(2, 5, 0)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, targets, "avg")  # type: ignore[arg-type]


# --- output_cross_entropy: the output projection fused with the loss -------------------------------

N_EMBD, N_VOCAB = 64, 500


def _output(kind: str, lora: bool) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(N_VOCAB, N_EMBD, generator=g) / 4
    if kind == "linear":
        base: nn.Module = nn.Linear(N_EMBD, N_VOCAB, bias=False)
        base.weight = nn.Parameter(w, requires_grad=False)
    else:
        raw = torch.from_numpy(quantize(w, GGMLQuantizationType.Q8_0)).reshape(-1)
        base = QuantLinear(raw, GGMLQuantizationType.Q8_0, (N_VOCAB, N_EMBD))
    if not lora:
        return base
    module = LoRALinear(base, rank=3, alpha=6.0)
    with torch.no_grad():  # B != 0 so the adapter changes the logits and gets a gradient through A
        module.lora_a.copy_(torch.randn(3, N_EMBD, generator=g) / 8)
        module.lora_b.copy_(torch.randn(N_VOCAB, 3, generator=g) / 8)
    return module


@pytest.mark.parametrize("kind", ["linear", "quant"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_fused_output_loss_equals_logits_then_cross_entropy(kind: str, lora: bool, autocast: bool,
                                                           cpu_policy) -> None:
    # with LoRA: 7 rows per chunk; without: 16 rows by 54 columns
    cpu_policy(head_chunk_bytes=7 * 4 * N_VOCAB, slab_rows=16, slab_bytes=7 * 4 * N_VOCAB)
    output = _output(kind, lora)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 30, N_EMBD, generator=g)
    targets = torch.randint(0, N_VOCAB, (3, 30), generator=g)
    targets[0, :4] = -100
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    results = []
    for fused_loss in (True, False):
        h = hidden.clone().requires_grad_()
        params = [p for p in output.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        with ctx:
            loss = (output_cross_entropy(output, h, targets) if fused_loss
                    else F.cross_entropy(output(h).float().reshape(-1, N_VOCAB), targets.reshape(-1)))
        (loss * 3).backward()
        results.append((loss.detach(), h.grad, [p.grad.clone() for p in params]))
    (ours, ours_gx, ours_gp), (ref, ref_gx, ref_gp) = results
    tol = {"rtol": 2e-2, "atol": 2e-3} if autocast else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(ours, ref, **tol)
    torch.testing.assert_close(ours_gx, ref_gx, **tol)
    assert torch.all(ours_gx[0, :4] == 0)
    assert len(ours_gp) == (2 if lora else 0)
    for a, b in zip(ours_gp, ref_gp, strict=True):
        torch.testing.assert_close(a, b, **tol)
        assert b.abs().max() > 0


@pytest.mark.parametrize("kind", ["linear", "quant"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_fused_output_loss_per_target_takes_any_weighting_of_the_targets(kind: str, lora: bool, autocast: bool,
                                                                         cpu_policy) -> None:
    """reduction "none" (what a preference objective sums per answer, then weighs by a factor known only after the
    forward): each target's loss, and the gradients of any weighted sum of them, equal the logits written out."""
    cpu_policy(head_chunk_bytes=7 * 4 * N_VOCAB, slab_rows=16, slab_bytes=7 * 4 * N_VOCAB)
    output = _output(kind, lora)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 20, N_EMBD, generator=g)
    targets = torch.randint(0, N_VOCAB, (2, 20), generator=g)
    targets[1, 3:9] = -100
    weights = torch.randn(2, 20, generator=g)  # of both signs, as d(DPO loss)/d(logp) per answer
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    params = [p for p in output.parameters() if p.requires_grad]
    results = []
    for fused_loss in (True, False):
        h = hidden.clone().requires_grad_()
        with ctx:
            losses = (output_cross_entropy(output, h, targets, "none") if fused_loss
                      else F.cross_entropy(output(h).float().reshape(-1, N_VOCAB), targets.reshape(-1),
                                           reduction="none").reshape(2, 20))
        grads = torch.autograd.grad((losses * weights).sum(), [h, *params])
        results.append((losses.detach(), grads))
    (ours, ours_grads), (ref, ref_grads) = results
    tol = {"rtol": 2e-2, "atol": 2e-3} if autocast else {"rtol": 1e-5, "atol": 1e-6}
    assert ours.shape == targets.shape and torch.all(ours[1, 3:9] == 0)
    torch.testing.assert_close(ours, ref, **tol)
    assert len(ours_grads) == (3 if lora else 1)
    for a, b in zip(ours_grads, ref_grads, strict=True):  # bf16: weights of both signs cancel, so scale-relative
        torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * (10 * float(b.abs().max()) if autocast
                                                                              else 1.0))
        assert b.abs().max() > 0


@pytest.mark.parametrize("gap", [5.0, 60.0, 300.0])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("in_place", [True, False])
def test_fused_output_loss_of_very_unlikely_targets(gap: float, lora: bool, in_place: bool,
                                                    cpu_policy) -> None:
    """A target logit ``gap`` below the rest: past a gap of ~104 its f32 probability underflows
    (the loss as -log(p) would be inf); the loss and gradient must still be logsumexp's. Chunks of
    4 rows put such rows in later chunks too (their logits are recomputed by row index), with the
    softmax over the logits' buffer and (as on devices not known to allow that) beside it."""
    cpu_policy(head_chunk_bytes=4 * 4 * N_VOCAB, slab_bytes=4 * 4 * N_VOCAB, slab_rows=4, in_place_softmax=in_place)
    output = _output("linear", lora)
    base = output.base if lora else output
    hidden = torch.zeros(1, 10, N_EMBD)
    hidden[0, :, 0] = 1.0
    hidden[0, :, 1] = torch.linspace(-3, 3, 10)  # rows differ: a recomputed row must be the right one
    targets = torch.tensor([[7, 8, 9, 7, -100, 1, 9, 2, 8, 3]])  # an ignored row's stand-in target is id 0
    base.weight.data[7:10, 0] = -gap
    base.weight.data[0, 0] = -300.0  # underflows even when the counted rows do not
    h = hidden.clone().requires_grad_()
    ours = output_cross_entropy(output, h, targets, "sum")
    ours.backward()
    h_ref = hidden.clone().requires_grad_()
    ref = F.cross_entropy(output(h_ref).reshape(-1, N_VOCAB), targets.reshape(-1), reduction="sum")
    ref.backward()
    assert ref.item() > 4 * gap  # the rows really are that unlikely
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-6)


def test_fused_output_loss_dequantizes_a_quantized_output_one_slab_at_a_time(monkeypatch: pytest.MonkeyPatch,
                                                                               cpu_policy) -> None:
    """Without a LoRA on it, a quantized output matrix is never dequantized whole (Gemma's 262,144 rows
    would be 671 MB in f32): its slabs cover the vocabulary once, plus the targets' rows."""
    cpu_policy(slab_bytes=4 * 64 * 100)  # slabs of 100 vocabulary rows
    decoded: list[tuple[int, ...]] = []
    real = quant_modules.dequantize
    for module in (quant_modules, quant_autograd):  # the slabs (QuantLinear.weight_rows), the targets' rows
        monkeypatch.setattr(module, "dequantize",
                            lambda raw, t, shape, dtype: decoded.append(shape) or real(raw, t, shape, dtype))
    output = _output("quant", lora=False)
    hidden = torch.randn(2, 10, N_EMBD, requires_grad=True)
    targets = torch.randint(0, N_VOCAB, (2, 10))
    loss = output_cross_entropy(output, hidden, targets)
    loss.backward()
    assert decoded == [(100, N_EMBD)] * 5 + [(20, N_EMBD)]
    ref_h = hidden.detach().clone().requires_grad_()
    ref = F.cross_entropy(output(ref_h).reshape(-1, N_VOCAB), targets.reshape(-1))
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_h.grad, rtol=1e-5, atol=1e-6)


def test_fused_output_loss_falls_back_for_lora_with_dropout() -> None:
    output = _output("linear", lora=True)
    output.dropout = nn.Dropout(0.5)
    hidden, targets = torch.randn(2, 5, N_EMBD), torch.randint(0, N_VOCAB, (2, 5))
    torch.manual_seed(0)
    ours = output_cross_entropy(output, hidden, targets)
    torch.manual_seed(0)
    ref = F.cross_entropy(output(hidden).reshape(-1, N_VOCAB), targets.reshape(-1))
    torch.testing.assert_close(ours, ref)


def test_fused_output_loss_sum_and_no_grad() -> None:
    output = _output("linear", lora=False)
    hidden, targets = torch.randn(2, 5, N_EMBD), torch.randint(0, N_VOCAB, (2, 5))
    with torch.no_grad():
        total = output_cross_entropy(output, hidden, targets, "sum")
    ref = F.cross_entropy(output(hidden).reshape(-1, N_VOCAB), targets.reshape(-1), reduction="sum")
    torch.testing.assert_close(total, ref)


def test_fused_output_loss_runs_the_modules_forward_hooks() -> None:
    """A hook on the output layer (to inspect or poison logits) still sees its call."""
    output = _output("linear", lora=False)
    seen = []
    output.register_forward_hook(lambda m, args, out: seen.append(out.shape) or out * 2)
    hidden, targets = torch.randn(2, 5, N_EMBD), torch.randint(0, N_VOCAB, (2, 5))
    ours = output_cross_entropy(output, hidden, targets)
    assert seen == [(2, 5, N_VOCAB)]
    ref = F.cross_entropy(output(hidden).reshape(-1, N_VOCAB), targets.reshape(-1))
    torch.testing.assert_close(ours, ref)


def test_fused_output_loss_takes_a_lora_layer_only_through_its_linear_parts() -> None:
    """The fused path computes the LoRA product itself when the layer offers its parts, and calls the layer
    (plain path) when it does not; the values are the same either way."""

    class Counting(LoRALinear):
        offers_parts = True
        calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return super().forward(x)

        def linear_parts(self):  # type: ignore[no-untyped-def]
            return super().linear_parts() if self.offers_parts else None

    source = _output("linear", lora=True)
    output = Counting(source.base, rank=3, alpha=6.0)
    output.load_state_dict(source.state_dict())
    hidden, targets = torch.randn(2, 5, N_EMBD), torch.randint(0, N_VOCAB, (2, 5))
    fused = output_cross_entropy(output, hidden, targets)
    assert output.calls == 0
    output.offers_parts = False
    plain = output_cross_entropy(output, hidden, targets)
    assert output.calls == 1
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_vocab", [32000, 262144])
def test_a_head_of_more_than_one_projection_takes_the_estimated_rows_per_chunk(n_vocab: int) -> None:
    """gemma's soft-capped head, a chunk of tokens at a time: as many tokens per chunk as head_chunk_bytes holds f32
    logit rows (32 at gemma's 262,144 words, 262 at llama's 32,000; the rows training.memory counts), so the head's
    product runs once per chunk, not once per token or two; its loss and gradients equal the whole head's."""
    gen = torch.Generator().manual_seed(3)
    n_tokens, n_embd = 100, 8
    weight = torch.randn(n_vocab, n_embd, generator=gen)
    hidden = torch.randn(n_tokens, n_embd, generator=gen, requires_grad=True)
    targets = torch.randint(0, n_vocab, (n_tokens,), generator=gen)
    targets[::7] = -100
    calls = []

    def head(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return 30.0 * torch.tanh((x @ weight.T) / 30.0)

    rows = policy.current("cpu").head_chunk_bytes // (4 * n_vocab)
    with torch.no_grad():
        loss_mod.head_cross_entropy(head, hidden, targets, n_vocab)
    assert calls == [rows] * (n_tokens // rows) + ([n_tokens % rows] if n_tokens % rows else [])

    got = loss_mod.head_cross_entropy(head, hidden, targets, n_vocab)
    (got_grad,) = torch.autograd.grad(got, hidden)
    expected = F.cross_entropy(head(hidden), targets, ignore_index=-100)
    (expected_grad,) = torch.autograd.grad(expected, hidden)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-4, atol=1e-7)

    weights = torch.randn(n_tokens, generator=gen)  # per target, as a preference objective weighs its answers
    got = loss_mod.head_cross_entropy(head, hidden, targets, n_vocab, "none")
    (got_grad,) = torch.autograd.grad((got * weights).sum(), hidden)
    expected = F.cross_entropy(head(hidden), targets, ignore_index=-100, reduction="none")
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), hidden)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("kind", ["linear", "quant"])
@pytest.mark.parametrize(("multiplier", "cap"), [(1.0, 30.0), (0.125, 0.0), (0.5, 4.0)],
                         ids=["gemma soft-cap", "granite scale", "both"])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_mapped_head_takes_the_vocabulary_a_slab_at_a_time(kind: str, multiplier: float, cap: float,
                                                            autocast: bool, cpu_policy) -> None:
    """A frozen output under the head's elementwise map (gemma's final soft-cap, granite's logit scale): the slab
    loss, with the map's slope in the gradient, equals the loss of the whole mapped logits written out (float64)."""
    from ggtorch.models.attention import softcap

    cpu_policy(slab_rows=16, slab_bytes=7 * 4 * N_VOCAB)
    output = _output(kind, lora=False)
    g = torch.Generator().manual_seed(4)
    hidden = (torch.randn(3, 30, N_EMBD, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, N_VOCAB, (3, 30), generator=g)
    targets[1, :5] = -100
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        x = hidden.reshape(-1, N_EMBD)
        ours = loss_mod._SlabCrossEntropy.apply(x, targets.reshape(-1), *loss_mod._weight_slabs(output, x),
                                                multiplier, cap).sum()
    (ours_grad,) = torch.autograd.grad(ours, hidden)
    weight = output.weight if kind == "linear" else output.dequantized_weight(torch.float32)
    h64 = hidden.detach().double().requires_grad_()
    logits = (h64 @ weight.double().T) * multiplier
    logits = softcap(logits, cap) if cap else logits
    ref = F.cross_entropy(logits.reshape(-1, N_VOCAB), targets.reshape(-1), reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref, h64)
    tol = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(ours.double(), ref, **tol)
    torch.testing.assert_close(ours_grad.double(), ref_grad, **tol)
    assert torch.all(ours_grad[1, :5] == 0)


def test_a_soft_capped_model_trains_its_loss_through_the_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    """gemma's head (a soft-cap over a frozen output) takes the slab loss, not a chunk of whole logit rows, and its
    loss and gradient equal the head's logits written out."""
    from ggtorch.models.config import ModelConfig
    from ggtorch.models.model import Transformer
    from ggtorch.training.loss import model_cross_entropy

    torch.manual_seed(0)
    model = Transformer(ModelConfig(n_vocab=300, n_embd=32, n_layer=1, n_head=2, n_head_kv=1, n_ff=48,
                                    n_ctx_train=32, final_softcap=5.0))
    model.requires_grad_(False)
    monkeypatch.setattr(loss_mod, "head_cross_entropy", lambda *a, **k: pytest.fail("took the whole-row path"))
    hidden = torch.randn(2, 10, 32, requires_grad=True)
    targets = torch.randint(0, 300, (2, 10))
    ours = model_cross_entropy(model, hidden, targets)
    (ours_grad,) = torch.autograd.grad(ours, hidden)
    ref = F.cross_entropy(model.head(hidden).reshape(-1, 300), targets.reshape(-1))
    (ref_grad,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_grad, ref_grad, rtol=1e-5, atol=1e-7)

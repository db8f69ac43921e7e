"""FlexAttention, CUDA's training attention (``Policy.flex_attention``), checked on the CPU through torch's eager
reference of the same kernel: every mask the models hand it (causal, packed records, a sliding window, both),
gemma's soft-cap and gpt-oss's sinks, with grouped-query heads, against the softmax written out in float64 here;
outputs and the gradients of q, k, v (and of the sinks). The model routes training attention there, and only there,
when its device's policy says so."""

from __future__ import annotations

import pytest
import torch

from ggtorch.models import attention as model_attention
from ggtorch.ops import flex_attention, policy

SCALE = 0.125
T, D = 40, 16


def _reference(q, k, v, mask, softcap, sinks):
    """softmax over keys (and a sink) of the masked, optionally capped, scaled scores, times v, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scores = q @ k.transpose(-1, -2)
    scores = (softcap * torch.tanh(scores / softcap) if softcap else scores) * SCALE
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return (torch.softmax(torch.cat((scores, sink), -1), -1)[..., :-1] @ v)
    return torch.softmax(scores, -1) @ v


def _masks(kind: str, B: int) -> tuple[torch.Tensor | None, bool, torch.Tensor]:
    """(mask handed to the kernel, causal flag, the (B, 1, T, T) mask it means)."""
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    segments = torch.tensor([[0] * 13 + [1] * 27, [0] * 30 + [1] * 10])[:B]
    positions = torch.stack([torch.cat((torch.arange(13), torch.arange(27))), torch.cat((torch.arange(30),
                                                                                       torch.arange(10)))])[:B]
    packed = (segments[:, :, None] == segments[:, None, :]) & causal
    window = (torch.arange(T)[:, None] - torch.arange(T)[None, :] < 7) & causal
    packed_window = packed & (positions[:, :, None] - positions[:, None, :] < 7)
    if kind == "causal":
        return None, True, causal.expand(B, 1, T, T)
    if kind == "window":
        return window, False, window.expand(B, 1, T, T)
    if kind == "packed":
        return packed[:, None], False, packed[:, None]
    return packed_window[:, None], False, packed_window[:, None]


def flex_forward(*args, **kwargs) -> torch.Tensor:
    """The kernel's forward through torch's eager reference, which has no backward on the CPU (its gradients are
    checked on a GPU: tests/test_cuda.py)."""
    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return REAL_FLEX(*detached, **{**kwargs, "compiled": False})


REAL_FLEX = flex_attention.attention


@pytest.mark.parametrize("kind", ["causal", "window", "packed", "packed window"])
@pytest.mark.parametrize("extra", ["plain", "softcap", "sinks"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_flex_equals_the_softmax_written_out(kind: str, extra: str, heads: tuple[int, int]) -> None:
    H, Hkv = heads
    B = 2
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=gen)
    k = torch.randn(B, Hkv, T, D, generator=gen)
    v = torch.randn(B, Hkv, T, D, generator=gen)
    sinks = torch.randn(H, generator=gen) + 1 if extra == "sinks" else None
    cap = 5.0 if extra == "softcap" else 0.0
    mask, causal, meant = _masks(kind, B)
    out = flex_forward(q, k, v, scale=SCALE, causal=causal, mask=mask, softcap=cap, sinks=sinks)
    torch.testing.assert_close(out.double(), _reference(q, k, v, meant, cap, sinks), rtol=1e-5, atol=1e-5)


def test_training_attention_goes_to_flex_only_where_the_policy_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a policy with flex_attention, a training call (a backward follows, T == S) takes the kernel; generation
    (no grad, or a cache longer than the queries) keeps SDPA; the CPU's own policy never takes it."""
    calls: list[bool] = []

    def spy(*args, **kwargs):
        calls.append(kwargs["compiled"])
        return flex_forward(*args, **kwargs)

    monkeypatch.setattr(flex_attention, "attention", spy)
    q = torch.randn(1, 4, 8, D, requires_grad=True)
    k = v = torch.randn(1, 2, 8, D)
    model_attention.attention(q, k, v, scale=SCALE, causal=True)
    assert calls == []
    with policy.using(policy.choose("cpu").replace(flex_attention="eager")):
        model_attention.attention(q, k, v, scale=SCALE, causal=True)
        assert calls == [False]
        with torch.no_grad():
            model_attention.attention(q, k, v, scale=SCALE, causal=True)
        model_attention.attention(q[:, :, -1:], k, v, scale=SCALE, causal=False)
    assert calls == [False]
    assert policy.cuda_policy((9, 0)).flex_attention == "compiled"


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss", "gemma4"])
def test_a_family_trains_through_flex_as_through_the_cpus_paths(name: str, family_model,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A LoRA training forward of a family with a soft-cap and windows (gemma2), sinks and windows (gpt-oss), or
    per-layer head widths and shared K/V (gemma4), packed records included: every attention call goes to
    FlexAttention with the masks the model built, and the loss is the CPU paths' loss."""
    from ggtorch.lora import LoraConfig, attach_lora, trainable_parameters
    from ggtorch.models.loader import load_model_file
    from ggtorch.training.loss import model_cross_entropy

    model = load_model_file(family_model(name)).model
    attach_lora(model, LoraConfig(rank=2), seed=1)
    with torch.no_grad():
        for _, p, _ in trainable_parameters(model):
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    tokens = torch.randint(1, 500, (2, 49), generator=torch.Generator().manual_seed(2))
    positions = torch.stack([torch.arange(48), torch.cat((torch.arange(20), torch.arange(28)))])
    segments = torch.stack([torch.zeros(48, dtype=torch.long), (torch.arange(48) >= 20).long()])

    def loss() -> torch.Tensor:
        hidden = model(tokens[:, :-1], positions=positions, segments=segments, hidden_only=True)
        return model_cross_entropy(model, hidden, tokens[:, 1:]).detach()

    cpu = loss()
    calls: list[int] = []
    monkeypatch.setattr(flex_attention, "attention", lambda *a, **k: calls.append(1) or flex_forward(*a, **k))
    with policy.using(policy.choose("cpu").replace(flex_attention="eager")):
        flex = loss()
    assert len(calls) == sum(1 for layer in model.layers if hasattr(layer, "attn"))
    torch.testing.assert_close(flex, cpu, rtol=1e-5, atol=1e-6)

"""Mixture-of-experts layers: only routed experts run, and they compute what a plain formula computes.

llama.cpp parity of MoE files (F32 and quantized, routing included) is in tests/models/test_families.py
(presets qwen3moe, qwen2moe, llama_moe); these tests check what logits cannot show: that an expert no
token was routed to is never dequantized, in forward or backward, and that gradients through routing
equal those of a token-by-token formula written separately.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ggtorch.lora import LoraConfig, attach_lora
from ggtorch.models.model import DenseAndExperts, MoE, Transformer
from ggtorch.quant import autograd
from ggtorch.quant.modules import QuantExperts
from tests.families import eval_tokens
from tests.models.test_families import load

NO_EXPERT_LORA = {"ffn_gate_exps": 0, "ffn_up_exps": 0, "ffn_down_exps": 0}


def routing_margins(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """Per token, the smallest gap over the MoE layers between the probabilities of its last chosen
    expert and the best expert not chosen: where it is tiny, another program's rounding (llama.cpp's,
    or a requantized merge's) may pick the other expert."""
    gaps: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])
        if isinstance(module, DenseAndExperts):  # gemma4's router reads the residual stream (its second input)
            x = module.router_input(args[1].reshape(-1, args[1].shape[-1]))
        probs = torch.softmax(module.router_logits(x), dim=-1).sort(dim=-1, descending=True).values
        gaps.append(probs[:, module.n_used - 1] - probs[:, module.n_used])

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, MoE)]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return torch.stack(gaps).min(dim=0).values


def every_expert(moe: MoE, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """(N, k, C) as MoE._routed computes it, with every expert run on every token and the routed ones kept."""
    N = x.shape[0]
    y = moe._ffn(x.repeat(moe.n_expert, 1), [N] * moe.n_expert).reshape(moe.n_expert, N, -1)  # (E, N, C)
    return y[experts, torch.arange(N, device=x.device).unsqueeze(-1)]


def set_routed_only(model: torch.nn.Module, routed_only: bool) -> None:
    """Each MoE layer computes its routed experts only (its own code), or every expert (:func:`every_expert`)."""
    for m in model.modules():
        if isinstance(m, MoE):
            if routed_only:
                m.__dict__.pop("_routed", None)
            else:
                m._routed = types.MethodType(every_expert, m)


@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe", "llama_moe"])
def test_routed_experts_equal_every_expert_computed(family_model: Callable[..., Path], name: str) -> None:
    """Logits and the gradient of every weight (a full finetune of the F32 file) are those of the
    model that runs every expert on every token."""
    model = load(family_model(name), keep_quantized=False)
    for p in model.parameters():
        p.requires_grad_(True)
    tokens = torch.tensor([eval_tokens(model.config.n_vocab, 24)])
    results = []
    for routed_only in (True, False):
        set_routed_only(model, routed_only)
        model.zero_grad()
        logits = model(tokens)
        logits.logsumexp(-1).mean().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (routed, routed_grads), (dense, dense_grads) = results
    torch.testing.assert_close(routed, dense, rtol=0, atol=1e-5)
    for n, g in routed_grads.items():
        torch.testing.assert_close(g, dense_grads[n], rtol=1e-4, atol=1e-6, msg=n)
    experts = routed_grads["layers.0.ffn.gate_exps.weight"]
    assert experts.abs().sum(dim=(1, 2)).ne(0).all()  # 24 tokens reach every expert here


def token_by_token(layer: MoE, x: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The MoE layer's formula for each token alone, in float64: softmax over the router, top k, weights
    (normalized or not), the sum of the chosen experts' SwiGLU FFNs, plus a gated shared expert."""
    w = {n: p.detach().double().requires_grad_(p.requires_grad) for n, p in layer.named_parameters()}
    out = []
    for token in x.double():
        probs = torch.softmax(w["router.weight"] @ token, dim=0)
        chosen = sorted(range(len(probs)), key=lambda e: -float(probs[e].detach()))[:layer.n_used]
        weights = torch.stack([probs[e] for e in chosen])
        if normalize:
            weights = weights / weights.sum()
        y = sum(weight * (w["down_exps.weight"][e] @ (torch.nn.functional.silu(w["gate_exps.weight"][e] @ token)
                                                      * (w["up_exps.weight"][e] @ token)))
                for e, weight in zip(chosen, weights, strict=True))
        if layer.shared is not None:
            hidden = torch.nn.functional.silu(w["shared.gate.weight"] @ token) * (w["shared.up.weight"] @ token)
            y = y + torch.sigmoid(w["shared_gate"] @ token) * (w["shared.down.weight"] @ hidden)
        out.append(y)
    return torch.stack(out), w


@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_moe_layer_and_its_gradients_equal_a_token_by_token_formula(family_model: Callable[..., Path],
                                                                    name: str) -> None:
    layer = load(family_model(name), keep_quantized=False).layers[0].ffn
    assert isinstance(layer, MoE)
    for p in layer.parameters():
        p.requires_grad_(True)
    x = torch.randn(12, layer.router.in_features, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y = layer(x)
    ref_x = x.detach().double().requires_grad_(True)
    ref, ref_w = token_by_token(layer, ref_x, normalize=name != "qwen2moe")
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5)
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    (y * probe).sum().backward()
    (ref * probe.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=0, atol=1e-5)  # through experts and weights
    assert ref_w["router.weight"].grad.abs().sum() > 0
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref_w[n].grad, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("expert_lora", [True, False], ids=["lora-on-experts", "attention-lora"])
def test_a_quantized_expert_is_dequantized_only_when_a_token_is_routed_to_it(
        family_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, expert_lora: bool) -> None:
    """Forward and backward each decode every routed expert of each stack exactly once, and nothing else."""
    model = load(family_model("qwen3moe", "Q8_0"))
    attach_lora(model, LoraConfig(rank=4, ranks={} if expert_lora else NO_EXPERT_LORA))
    stacks = {m.raw.data_ptr(): (path, m) for path, m in model.named_modules() if isinstance(m, QuantExperts)}
    assert len(stacks) == 3 * model.config.n_layer
    routed: dict[int, set[int]] = {}

    def record_routes(module: MoE, args: tuple[torch.Tensor, ...]) -> None:
        with torch.no_grad():
            _, experts = module.route(args[0].reshape(-1, args[0].shape[-1]))
        routed[id(module)] = set(experts.flatten().tolist())

    for m in model.modules():
        if isinstance(m, MoE):
            m.register_forward_pre_hook(record_routes)
    decoded: list[tuple[str, str, int]] = []  # (phase, stack path, expert)
    phase = "forward"
    original = autograd._dequantize_rows

    def recording(raw: torch.Tensor, *args: object) -> torch.Tensor:
        for ptr, (path, stack) in stacks.items():
            offset = raw.data_ptr() - ptr
            if 0 <= offset < stack.raw.numel():
                decoded.append((phase, path, offset // stack.raw[0].numel()))
        return original(raw, *args)

    monkeypatch.setattr(autograd, "_dequantize_rows", recording)
    tokens = eval_tokens(model.config.n_vocab, 3, seed=5)  # 3 tokens x top 2 reach at most 6 of 8 experts
    loss = model(torch.tensor([tokens])).logsumexp(-1).mean()
    phase = "backward"
    loss.backward()

    layer_of = {path: path.split(".ffn.")[0] + ".ffn" for path, _ in stacks.values()}
    moe_ids = {path: id(m) for path, m in model.named_modules() if isinstance(m, MoE)}
    assert any(len(experts) < model.config.n_expert for experts in routed.values())
    for phase in ("forward", "backward"):
        for path, _ in stacks.values():
            seen = sorted(e for p, s, e in decoded if p == phase and s == path)
            assert seen == sorted(routed[moe_ids[layer_of[path]]]), (phase, path)

"""Gated DeltaNet in training: what a layer keeps for backward, against what autograd would keep through it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ggtorch.io.gguf import read_gguf
from ggtorch.models.config import ModelConfig
from ggtorch.models.delta_net import GatedDeltaNet
from ggtorch.models.loader import build_model
from ggtorch.ops.recompute import _region


def kept_bytes(forward: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes ``forward`` leaves allocated beyond its output: what autograd keeps for backward (torch's profiler
    counts every allocation and free of the CPU allocator), and the output."""
    with torch.no_grad():
        output_only = _net_allocated(forward)[0]
    kept, out = _net_allocated(forward)
    return kept - output_only, out


def _net_allocated(forward: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = forward()
    return sum(event.self_cpu_memory_usage for event in prof.events()), out


def test_a_layer_keeps_its_regions_inputs_not_the_rules_products(family_model: Callable[..., Path]) -> None:
    """The convolution, norms and delta rule are made again in backward from the projections (the fused q|k|v,
    the gate z, beta, g): the layer keeps those and the region's output, a fraction of what autograd keeps
    through the same code, and the gradients are those of autograd through it."""
    f = read_gguf(family_model("qwen35"))
    model = build_model(f, ModelConfig.from_gguf(f))
    mixer = next(layer.attn for layer in model.layers if isinstance(layer.attn, GatedDeltaNet))
    for p in mixer.parameters():
        p.requires_grad_(True)
    T = 512
    x = torch.randn(1, T, mixer.qkv.in_features, generator=torch.Generator().manual_seed(0), requires_grad=True)

    kept, out = kept_bytes(lambda: mixer(x))
    # the region's inputs and its output (which ssm_out's weight gradient reads), f32
    region = T * 4 * (mixer.qkv.out_features + 2 * mixer.gate.out_features + 2 * mixer.n_v_heads)
    assert kept <= 1.1 * region, f"a DeltaNet layer kept {kept} bytes for backward, its region's ends are {region}"

    def plain() -> torch.Tensor:  # the same forward with autograd keeping everything: inside another region,
        with _region():  # the layer's checkpoint is a plain call
            return mixer(x)

    kept_plain, out_plain = kept_bytes(plain)
    assert kept_plain >= 4 * kept, (kept_plain, kept)
    torch.testing.assert_close(out, out_plain, rtol=0, atol=0)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    leaves = [x, *mixer.parameters()]
    got = torch.autograd.grad((out * weights).sum(), leaves)
    want = torch.autograd.grad((out_plain * weights).sum(), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

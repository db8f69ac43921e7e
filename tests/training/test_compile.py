"""A LoRA training step traces under torch.compile and FakeTensor on CPU: ggtorch's C loops are torch ops
(``ggtorch::*``) with fake implementations and autograd formulas, its policy a module global torch.compile guards
on, and nothing in the step reads a tensor's data into Python except the loss's check for a vanishing target
probability. The reference is the same step run eagerly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ggtorch.lora import LoraConfig, attach_lora, trainable_parameters
from ggtorch.models.loader import load_model_file
from ggtorch.ops import policy
from ggtorch.quant import native
from ggtorch.quant.modules import QuantLinear
from ggtorch.training import loss
from ggtorch.training.loss import model_cross_entropy

TOKENS = torch.randint(1, 512, (2, 33), generator=torch.Generator().manual_seed(0))


def _lora_model(path: Path) -> torch.nn.Module:
    """The file's model cut to its first two blocks (tracing costs seconds per block), with LoRA on every matrix."""
    model = load_model_file(path, keep_quantized=True).model
    model.layers = model.layers[:2]
    attach_lora(model, LoraConfig(rank=4), seed=1)
    with torch.no_grad():  # B = 0 would leave A's gradients zero
        for _, p, _ in trainable_parameters(model):
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    return model


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Forward to the normed hidden states and the fused output loss, as Trainer.step computes them (its backward
    is the compiled graphs' own, run by ``loss.backward()``)."""
    return model_cross_entropy(model, model(tokens[:, :-1], hidden_only=True), tokens[:, 1:])


def _grads(model: torch.nn.Module, loss_of) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = [p for _, p, _ in trainable_parameters(model)]
    for p in params:
        p.grad = None
    loss = loss_of(model, TOKENS)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


def test_a_compiled_lora_step_of_a_quantized_model_equals_eager(stories_q8: Path) -> None:
    """AOT autograd traces the step (FakeTensor through every ggtorch op, functionalized mutations, the registered
    backward formulas) into two graphs and their backward graphs; run, they give the eager step's loss and
    gradients."""
    import torch._dynamo

    model = _lora_model(stories_q8)
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    policy.for_device("cpu")  # chosen before the trace, as a run chooses it before its first step
    eager = _grads(model, _loss)
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(_loss)(model, TOKENS)
        torch._dynamo.reset()
        compiled = _grads(model, torch.compile(_loss, backend="aot_eager"))
    finally:
        torch._dynamo.reset()
    # the graphs end only where a chunk's probabilities are read, at the loss's check for a vanishing target
    # probability
    breaks = {(b.user_stack[-1].filename, b.user_stack[-1].line.strip()) for b in explained.break_reasons}
    assert breaks <= {(loss.__file__, "if bool(tiny.any()):")}, breaks
    ops = {str(node.target) for graph in explained.graphs for module in graph.modules()
           if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes if node.op == "call_function"}
    assert torch.equal(compiled[0], eager[0])
    for got, want in zip(compiled[1], eager[1], strict=True):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    if native.native_types():  # the C loops are in the graph as ops, not run around it
        assert {"ggtorch.lowrank_project.default", "ggtorch.rms_norm.default", "ggtorch.glu.default"} <= ops, ops


def test_the_model_runs_on_fake_tensors(stories260k: Path) -> None:
    """Shapes and dtypes without data: every op, the C loops included, has a fake implementation."""
    model = _lora_model(stories260k)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        logits = model(mode.from_tensor(TOKENS))
        hidden = model(mode.from_tensor(TOKENS[:, :-1]), hidden_only=True)
    assert logits.shape == (2, 33, model.config.n_vocab) and logits.dtype == torch.float32
    assert hidden.shape == (2, 32, model.config.n_embd)


@pytest.fixture(autouse=True)
def _no_leftover_compiles() -> None:
    yield
    import sys

    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()

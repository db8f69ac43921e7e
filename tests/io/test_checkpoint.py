"""Checkpoint files: exact round trip of nested training state, base identity, refusals."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ggtorch.errors import BadGGUF, GGTorchError
from ggtorch.io.checkpoint import load_checkpoint, save_checkpoint
from ggtorch.io.gguf import read_gguf


def _optimizer_after_steps() -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 64))
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    return p, opt


def test_state_round_trips_bit_exact(stories260k: Path, tmp_path: Path) -> None:
    base = read_gguf(stories260k)
    p, opt = _optimizer_after_steps()
    rng = random.Random(5)
    state = {
        "optimizer": opt.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "py_rng": rng.getstate(),
        "third": 1.0 / 3.0,
        "bf16": torch.randn(7, dtype=torch.bfloat16),
        "nested": {"ints": [1, 2**40], "none": None, 3: "int key"},
    }
    save_checkpoint(tmp_path / "c.gguf", base, {"training.iteration_count": 12},
                    {"blk.0.attn_q.weight.lora_a": p.detach()}, state)
    ck = load_checkpoint(tmp_path / "c.gguf")
    assert ck.iteration == 12
    assert torch.equal(ck.tensors["blk.0.attn_q.weight.lora_a"], p.detach())
    s = ck.state
    assert torch.equal(s["torch_rng"], state["torch_rng"])
    assert s["py_rng"] == state["py_rng"]
    assert s["third"] == 1.0 / 3.0
    assert torch.equal(s["bf16"], state["bf16"])
    assert s["nested"] == state["nested"]
    # The optimizer continues exactly as the original would.
    p2 = torch.nn.Parameter(p.detach().clone())
    opt2 = torch.optim.AdamW([p2], lr=1e-3, weight_decay=0.1)
    opt2.load_state_dict(s["optimizer"])
    grad = torch.randn_like(p)
    p.grad, p2.grad = grad.clone(), grad.clone()
    opt.step()
    opt2.step()
    assert torch.equal(p, p2)
    ck.check_base(base)


def test_other_base_is_refused(stories260k: Path, random_llama, tmp_path: Path) -> None:
    base = read_gguf(stories260k)
    save_checkpoint(tmp_path / "c.gguf", base, {}, {}, {})
    other = read_gguf(random_llama("F32"))
    with pytest.raises(GGTorchError, match="trained on base model 'stories260K'"):
        load_checkpoint(tmp_path / "c.gguf").check_base(other)


def test_a_model_is_not_a_checkpoint(stories260k: Path) -> None:
    with pytest.raises(BadGGUF, match="is a model, not a training checkpoint: pass it where a model goes"):
        load_checkpoint(stories260k)

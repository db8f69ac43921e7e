"""Attaching adapters to a model, initializing them as the old finetune did, and bulk queries."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from ggtorch.errors import BadFlag, Unsupported
from ggtorch.lora.config import EXPERT_KINDS, GLOBAL_ORDER, LAYER_ORDER, NORM_KINDS, TIED_KINDS, LoraConfig
from ggtorch.lora.layers import LoRAEmbedding, LoRAExperts, LoRALinear, LoRANorm, _linear_shape, _LoRA
from ggtorch.models import names
from ggtorch.rng import MT19937, libstdcpp_normal

log = logging.getLogger("ggtorch.lora")


def _is_tied(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "tied_output", False))


def _has_module(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _plan(model: nn.Module, config: LoraConfig) -> list[tuple[str, int | None, int]]:
    """(kind, bid, rank to train) for every tensor of the old order the model has; rank 0 = not adapted.

    Kinds the model's family lacks (attn_q/k/v beside a fused attn_qkv, or the reverse; phi3's
    ffn_gate) are left out, so they draw no init values and a llama model draws the old stream.
    """
    n_layer = len(model.layers)  # type: ignore[arg-type]
    tied = _is_tied(model)
    plan = []
    for kind, bid in [(k, None) for k in GLOBAL_ORDER] + [(k, i) for i in range(n_layer) for k in LAYER_ORDER]:
        if not _has_module(model, names.module_path(kind, bid)):
            continue
        rank = config.rank_of(kind)
        if tied and kind in TIED_KINDS and rank > 0:
            if config.explicit(kind):
                raise Unsupported(
                    f"the model ties its output projection to token_embd; llama.cpp cannot load an adapter for "
                    f"'{names.gguf_name(kind)}' of such a model (it aborts on token_embd, and there is no "
                    "output.weight). Drop the rank for it (--rank-tok-embd 0 / --rank-out 0)")
            rank = 0
        plan.append((kind, bid, rank))
    return plan


def attach_lora(model: nn.Module, config: LoraConfig | None = None, seed: int = 0) -> nn.Module:
    """Freeze ``model`` and wrap every adapted module of it (in place; also returned).

    After this, exactly the LoRA parameters require grad. On a tied model token_embd and output
    are skipped (see the module docstring). ``seed`` seeds the A initialization.
    """
    config = (config or LoraConfig()).for_model(getattr(getattr(model, "config", None), "n_expert", 0) or 0)
    if any(isinstance(m, _LoRA) for m in model.modules()):
        raise BadFlag("the model already has LoRA adapters attached; attach once, or merge and reload")
    plan = _plan(model, config)
    config.check_kinds({kind for kind, _, _ in plan}, getattr(getattr(model, "config", None), "arch", "given"))
    for p in model.parameters():
        p.requires_grad_(False)
    if _is_tied(model) and any(config.rank_of(k) > 0 for k in TIED_KINDS):
        log.info("tied output: no LoRA on token_embd/output (llama.cpp cannot load such an adapter)")
    wrapped: list[_LoRA] = []
    for kind, bid, rank in plan:
        if rank == 0:
            continue
        wrapped.append(wrap(model, kind, bid, rank, config.lora_alpha, config.dropout))
    _initialize(model, plan, config, seed)
    return model


def wrap(model: nn.Module, kind: str, bid: int | None, rank: int, alpha: float | None = None,
         dropout: float = 0.0) -> _LoRA:
    """Replace the module holding tensor (kind, bid) by the LoRA wrapper for its kind; return the wrapper."""
    path = names.module_path(kind, bid)
    base = model.get_submodule(path)
    module: _LoRA
    if kind in NORM_KINDS:
        module = LoRANorm(base, rank)
    elif kind == "token_embd":
        module = LoRAEmbedding(base, rank, alpha)
    elif kind in EXPERT_KINDS:
        module = LoRAExperts(base, rank, alpha, dropout)
    else:
        module = LoRALinear(base, rank, alpha, dropout)
    module.gguf_name = names.gguf_name(kind, bid)
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, module)
    if isinstance(module, LoRALinear) and hasattr(parent, "group_forward"):
        parent.group_forward = LoRALinear.forward_group  # its layers that read one input run as one node
    return module


def _initialize(model: nn.Module, plan: list[tuple[str, int | None, int]], config: LoraConfig, seed: int) -> None:
    """A tensors as randomize_lora fills them, B = 0 (already zero)."""
    # Values per tensor in the old layout order. Skipped kinds still consume their draws (norms
    # with the old default rank 1), so a default run's A values equal the old program's.
    # An expert stack draws one A per expert, expert after expert (the old program had none).
    shapes = []  # (kind, bid, rank, old ne0 = r, old ne1 = n_in, experts)
    for kind, bid, rank in plan:
        draw_rank = rank or (1 if kind in NORM_KINDS else config.rank_of(kind))
        n_in, n_expert = _old_a_width(model, kind, bid)
        shapes.append((kind, bid, rank, draw_rank, n_in, n_expert))
    counts = [r * n * e for _, _, _, r, n, e in shapes]
    if config.init == "ggml":
        values = libstdcpp_normal(MT19937(seed & 0xFFFFFFFF), sum(counts))
    else:
        gen = torch.Generator().manual_seed(seed)
        values = torch.randn(sum(counts), generator=gen).numpy()
    offset = 0
    for (kind, bid, rank, draw_rank, n_in, n_expert), count in zip(shapes, counts, strict=True):
        chunk = values[offset:offset + count]
        offset += count
        if rank == 0:
            continue
        scale = np.float32(1.0) / np.sqrt(np.float32(draw_rank) + np.float32(n_in), dtype=np.float32)
        old_a = np.clip(chunk, np.float32(-1), np.float32(1)).astype(np.float32) * scale
        module = model.get_submodule(names.module_path(kind, bid))
        with torch.no_grad():
            if kind in EXPERT_KINDS:
                module.lora_a.copy_(torch.from_numpy(old_a.reshape(n_expert, draw_rank, n_in)))
                continue
            t = torch.from_numpy(old_a.reshape(n_in, draw_rank)).to(module.lora_a.device)
            if kind == "token_embd":
                module.lora_b.copy_(t)  # new lora_b (n_embd, r) is the old A, same layout
            else:
                module.lora_a.copy_(t.T)  # new lora_a (r, n_in) is the old A transposed


def _old_a_width(model: nn.Module, kind: str, bid: int | None) -> tuple[int, int]:
    """(ne1 of the old finetune's A tensor for ``kind``, the number of A's): the base's input width
    (n_embd for token_embd and the norms), and 1 or the experts of a stack."""
    module = model.get_submodule(names.module_path(kind, bid))
    base = module.base if isinstance(module, _LoRA) else module
    if kind in NORM_KINDS:
        return int(base.weight.shape[0]), 1
    shape = _linear_shape(base)
    return (shape[-1], shape[0]) if kind in EXPERT_KINDS else (shape[1], 1)


# --- queries and bulk operations -------------------------------------------------------------


def lora_modules(model: nn.Module) -> list[tuple[str, _LoRA]]:
    """(module path, wrapper) of every attached adapter, in module order."""
    return [(path, m) for path, m in model.named_modules() if isinstance(m, _LoRA)]


def _ordered(model: nn.Module) -> list[tuple[str, _LoRA]]:
    """Wrappers in the old finetune's tensor order (token_embd, output_norm, output, layers)."""
    found = {m.gguf_name: (p, m) for p, m in lora_modules(model)}
    order = [names.gguf_name(k) for k in GLOBAL_ORDER]
    n_layer = len(model.layers) if hasattr(model, "layers") else 0  # type: ignore[arg-type]
    order += [names.gguf_name(k, i) for i in range(n_layer) for k in LAYER_ORDER]
    ordered = [found.pop(name) for name in order if name in found]
    return ordered + list(found.values())


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter, int]]:
    """(parameter name, parameter, ggml n_dims) of every LoRA tensor, in the old finetune's order.

    n_dims is what ``ggml_n_dims`` gave for the tensor in the old layout (trailing size-1 axes
    dropped): 2 for every matrix pair and norm A, 1 for a norm B ``ne=[r, 1]``, 3 for an expert stack's
    pair (which the old finetune never had): the old finetune's
    ``--adam-decay-min-ndim`` decides weight decay from it.
    """
    out = []
    for path, m in _ordered(model):
        for pname, p in m.lora_parameters():
            ndim = 1 if isinstance(m, LoRANorm) and pname == "lora_b" else p.dim()
            out.append((f"{path}.{pname}", p, ndim))
    return out


def count_trainable_parameters(model: nn.Module) -> int:
    """Number of values that require grad (all of them LoRA values after attach_lora)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the LoRA tensors, under their parameter names (``layers.0.attn.q.lora_a``)."""
    return {name: p.detach() for name, p, _ in trainable_parameters(model)}


def lora_tensors_by_gguf_name(model: nn.Module) -> dict[str, torch.Tensor]:
    """``<base gguf name>.lora_a/.lora_b`` -> tensor (GGUF LoRA orientation, norm pairs included)."""
    out: dict[str, torch.Tensor] = {}
    for _, m in _ordered(model):
        out[f"{m.gguf_name}.lora_a"] = m.lora_a.detach()
        out[f"{m.gguf_name}.lora_b"] = m.lora_b.detach()
    return out


def lora_pairs(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Base gguf name -> (lora_a, lora_b, scale) of every matrix adapter (norms left out)."""
    return {m.gguf_name: (m.lora_a.detach(), m.lora_b.detach(), m.scale)  # type: ignore[misc]
            for _, m in _ordered(model) if not isinstance(m, LoRANorm)}


def load_lora_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy tensors named as by lora_tensors_by_gguf_name into the attached adapters.

    Every adapter must be present with its exact shape; extra LoRA names are an error too.
    """
    expected = {f"{m.gguf_name}.{pname}": p for _, m in _ordered(model) for pname, p in m.lora_parameters()}
    given = {k: v for k, v in tensors.items() if k.endswith((".lora_a", ".lora_b"))}
    missing = sorted(set(expected) - set(given))
    extra = sorted(set(given) - set(expected))
    if missing or extra:
        which = f"missing '{missing[0]}'" if missing else f"unexpected '{extra[0]}'"
        raise BadFlag(f"the LoRA tensors do not fit the attached adapters ({which}); "
                      "use the same ranks and model as the run that wrote them")
    with torch.no_grad():
        for name, p in expected.items():
            t = given[name]
            if tuple(t.shape) != tuple(p.shape):
                raise BadFlag(f"LoRA tensor '{name}' has shape {tuple(t.shape)}, the adapter expects "
                              f"{tuple(p.shape)}; use the same ranks and model as the run that wrote it")
            p.copy_(t.to(p.device, p.dtype))


def merge_lora(model: nn.Module) -> None:
    """merge() every adapter (idempotent)."""
    for _, m in lora_modules(model):
        m.merge()


def unmerge_lora(model: nn.Module) -> None:
    """unmerge() every adapter (idempotent)."""
    for _, m in lora_modules(model):
        m.unmerge()

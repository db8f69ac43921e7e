"""GGUF tensor names <-> module paths of ggtorch's Llama, as plain dicts.

``{bid}`` is the layer placeholder. The GGUF side follows gguf-py's ``TENSOR_NAMES`` for
``MODEL_ARCH.LLAMA`` (checked in the tests), with the ``.weight`` suffix.
"""

from __future__ import annotations

import re

# tensor kind -> (GGUF name, module path). Kinds are the old finetune's names for them.
TENSOR_KINDS: dict[str, tuple[str, str]] = {
    "token_embd": ("token_embd.weight", "tok_embd"),
    "output_norm": ("output_norm.weight", "output_norm"),
    "output": ("output.weight", "output"),
    "attn_norm": ("blk.{bid}.attn_norm.weight", "layers.{bid}.attn_norm"),
    "attn_q": ("blk.{bid}.attn_q.weight", "layers.{bid}.attn.q"),
    "attn_k": ("blk.{bid}.attn_k.weight", "layers.{bid}.attn.k"),
    "attn_v": ("blk.{bid}.attn_v.weight", "layers.{bid}.attn.v"),
    "attn_output": ("blk.{bid}.attn_output.weight", "layers.{bid}.attn.o"),
    "ffn_norm": ("blk.{bid}.ffn_norm.weight", "layers.{bid}.ffn_norm"),
    "ffn_gate": ("blk.{bid}.ffn_gate.weight", "layers.{bid}.ffn.gate"),
    "ffn_down": ("blk.{bid}.ffn_down.weight", "layers.{bid}.ffn.down"),
    "ffn_up": ("blk.{bid}.ffn_up.weight", "layers.{bid}.ffn.up"),
}

ROPE_FREQS = "rope_freqs.weight"
"""Optional rope frequency factors (Llama 3.1+): a buffer ``rope_freqs`` of the model, not a
trainable kind, so it is not in TENSOR_KINDS."""

GGUF_TO_MODULE: dict[str, str] = {gguf: module for gguf, module in TENSOR_KINDS.values()}
MODULE_TO_GGUF: dict[str, str] = {module: gguf for gguf, module in TENSOR_KINDS.values()}

LAYER_KINDS: tuple[str, ...] = tuple(k for k, (g, _) in TENSOR_KINDS.items() if "{bid}" in g)
"""Kinds that occur once per block."""
NORM_KINDS: tuple[str, ...] = ("attn_norm", "ffn_norm", "output_norm")
"""1-D tensors: always kept in float."""
MATRIX_KINDS: tuple[str, ...] = tuple(k for k in TENSOR_KINDS if k not in NORM_KINDS)


def gguf_name(kind: str, bid: int | None = None) -> str:
    """GGUF tensor name of a kind (``bid`` for per-layer kinds): ``gguf_name("attn_q", 3)``."""
    return TENSOR_KINDS[kind][0].format(bid=bid)


def module_path(kind: str, bid: int | None = None) -> str:
    """Module path in Llama of a kind: ``module_path("attn_q", 3) == "layers.3.attn.q"``."""
    return TENSOR_KINDS[kind][1].format(bid=bid)


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(re.escape("{bid}"), r"(\d+)") + "$")


_GGUF_PATTERNS = [(kind, _pattern(g)) for kind, (g, _) in TENSOR_KINDS.items()]
_MODULE_PATTERNS = [(kind, _pattern(m)) for kind, (_, m) in TENSOR_KINDS.items()]


def parse_gguf_name(name: str) -> tuple[str, int | None] | None:
    """``"blk.3.attn_q.weight"`` -> ``("attn_q", 3)``; None for a name that is no llama tensor."""
    for kind, pattern in _GGUF_PATTERNS:
        m = pattern.match(name)
        if m:
            return kind, int(m.group(1)) if m.groups() else None
    return None


def parse_module_path(path: str) -> tuple[str, int | None] | None:
    """``"layers.3.attn.q"`` -> ``("attn_q", 3)``; None for a path that holds no GGUF tensor."""
    for kind, pattern in _MODULE_PATTERNS:
        m = pattern.match(path)
        if m:
            return kind, int(m.group(1)) if m.groups() else None
    return None


def gguf_to_module(name: str) -> str:
    """GGUF tensor name -> module path (KeyError for a name that is no llama tensor)."""
    parsed = parse_gguf_name(name)
    if parsed is None:
        raise KeyError(name)
    return module_path(*parsed)


def module_to_gguf(path: str) -> str:
    """Module path -> GGUF tensor name (KeyError for a path that holds no GGUF tensor)."""
    parsed = parse_module_path(path)
    if parsed is None:
        raise KeyError(path)
    return gguf_name(*parsed)

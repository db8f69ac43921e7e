"""LoRA attached by wrapping modules: the adapters llama.cpp's old ``finetune`` trained.

``attach_lora(model, LoraConfig(...))`` replaces each targeted module of a :class:`Llama` by a
wrapper holding the original as ``base`` (``models/`` stays untouched):

- :class:`LoRALinear` around ``nn.Linear`` or ``QuantLinear``: ``y = base(x) + s·B(A(drop(x)))``
  with ``lora_a (r, in)``, ``lora_b (out, r)`` (GGUF LoRA orientation) and ``s = alpha / r``.
- :class:`LoRAEmbedding` around ``nn.Embedding`` or ``QuantEmbedding``, laid out as llama.cpp
  lays out ``token_embd``'s pair: ``lora_a (n_vocab, r)``, ``lora_b (n_embd, r)``,
  ``emb[t] += s · lora_b @ lora_a[t]``.
- :class:`LoRANorm` around an RMSNorm gain g (off by default): ``g + lora_b @ lora_a`` with
  ``lora_a (r, n_embd)``, ``lora_b (1, r)``, trained with scale 1 as the old finetune did.
  Today's llama.cpp adapter files cannot carry norm deltas (its loader skips ``*_norm``
  tensors), so they only survive a merge into the model.

Initialization follows the old finetune (``randomize_lora``): one ``std::mt19937(seed)`` and one
``std::normal_distribution<float>`` (libstdc++) over all A tensors of the old layout in its
order, each value ``clamp(N(0,1), -1, 1) / sqrtf(ne0 + ne1)``, and B = 0, so a fresh adapter
changes nothing. ``init="torch"`` draws the same distribution from a seeded torch generator.

Tied output (no ``output.weight``): llama.cpp aborts when an adapter targets ``token_embd`` of
such a model, and an ``output.weight`` pair has no base tensor to attach to. So ggtorch skips
``token_embd`` and ``output`` on tied models by default (logged), and an explicit rank for
either raises :class:`~ggtorch.errors.Unsupported`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from .errors import BadFlag, Unsupported
from .matmul import Linear, mm, mm_t
from .models import names
from .models.llama import RMSNorm
from .mt19937 import MT19937
from .quant.autograd import compute_dtype, quant_mm, quant_mm_t
from .quant.modules import QuantEmbedding, QuantLinear, float_module

log = logging.getLogger(__name__)

MATRIX_KINDS: tuple[str, ...] = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output",
                                 "ffn_gate", "ffn_down", "ffn_up")
NORM_KINDS: tuple[str, ...] = ("attn_norm", "ffn_norm", "output_norm")
ALL_KINDS: tuple[str, ...] = MATRIX_KINDS + NORM_KINDS
TIED_KINDS: tuple[str, ...] = ("token_embd", "output")
GLOBAL_ORDER: tuple[str, ...] = ("token_embd", "output_norm", "output")
LAYER_ORDER: tuple[str, ...] = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                                "ffn_gate", "ffn_down", "ffn_up")
"""The old finetune's tensor order (randomize_lora, checkpoints): globals, then per layer."""

LINEAR_BASES = (nn.Linear, QuantLinear)
EMBEDDING_BASES = (nn.Embedding, QuantEmbedding)

# FinetuneConfig field -> tensor kind, for the old --rank-* flags.
FINETUNE_RANK_FIELDS: dict[str, str] = {
    "rank_tok_embd": "token_embd", "rank_out": "output", "rank_wq": "attn_q", "rank_wk": "attn_k",
    "rank_wv": "attn_v", "rank_wo": "attn_output", "rank_ffn_gate": "ffn_gate", "rank_ffn_down": "ffn_down",
    "rank_ffn_up": "ffn_up", "rank_att_norm": "attn_norm", "rank_ffn_norm": "ffn_norm",
    "rank_out_norm": "output_norm",
}


@dataclass
class LoraConfig:
    """Which tensors get an adapter, of which rank, and how it is scaled and initialized."""

    rank: int = 4
    """Rank of every adapted matrix without an override (llama.cpp's ``--lora-r``)."""
    alpha: float | None = None
    """Scale numerator: each adapter is scaled by alpha / its rank (default: alpha = rank)."""
    ranks: dict[str, int] = field(default_factory=dict)
    """Per-kind overrides (``{"attn_q": 8, "output": 0}``); 0 switches a kind off. Norm kinds
    (attn_norm, ffn_norm, output_norm) are trained only when given a rank here."""
    dropout: float = 0.0
    """Dropout probability on the LoRA input of linear layers (not on the embedding's ids)."""
    init: Literal["ggml", "torch"] = "ggml"
    """``ggml``: bit-exact old finetune init (libstdc++ mt19937 + normal); ``torch``: same
    distribution from ``torch.Generator``."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise BadFlag(f"LoRA rank must be at least 1, got {self.rank}")
        unknown = sorted(set(self.ranks) - set(ALL_KINDS))
        if unknown:
            raise BadFlag(f"unknown LoRA tensor kind '{unknown[0]}'; kinds are {', '.join(ALL_KINDS)}")
        for kind, r in self.ranks.items():
            if r < 0:
                raise BadFlag(f"LoRA rank of {kind} must be >= 0, got {r}")
        if self.alpha is not None and not self.alpha > 0:
            raise BadFlag(f"LoRA alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise BadFlag(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if self.init not in ("ggml", "torch"):
            raise BadFlag(f"LoRA init must be 'ggml' or 'torch', got '{self.init}'")

    @property
    def lora_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else float(self.rank)

    def rank_of(self, kind: str) -> int:
        """The rank ``kind`` is trained with (0: not adapted)."""
        if kind in self.ranks:
            return self.ranks[kind]
        return 0 if kind in NORM_KINDS else self.rank

    def explicit(self, kind: str) -> bool:
        """Whether the user asked for this kind by name (an override > 0)."""
        return self.ranks.get(kind, 0) > 0

    @classmethod
    def from_finetune(cls, c: Any) -> LoraConfig:
        """From a FinetuneConfig: ``lora_r``, ``lora_alpha``, ``lora_dropout`` and the ``rank_*`` flags."""
        ranks = {kind: getattr(c, fname) for fname, kind in FINETUNE_RANK_FIELDS.items()
                 if getattr(c, fname, None) is not None}
        return cls(rank=c.lora_r, alpha=c.lora_alpha, ranks=ranks, dropout=getattr(c, "lora_dropout", 0.0))

    def metadata(self) -> dict[str, int | float]:
        """``training.lora.rank.<kind>`` for every kind (as the old checkpoints) and ``training.lora.alpha``."""
        meta: dict[str, int | float] = {f"training.lora.rank.{k}": self.rank_of(k) for k in GLOBAL_ORDER + LAYER_ORDER}
        # rounded to f32 as GGUF stores it, so a value read back from a checkpoint compares equal
        meta["training.lora.alpha"] = float(np.float32(self.lora_alpha))
        return meta


# --- modules -------------------------------------------------------------------------------


class _LoRA(nn.Module):
    """Shared state of the wrappers: base, pair, scale, merged flag."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter

    def __init__(self, base: nn.Module, rank: int, scale: float) -> None:
        super().__init__()
        self.base = base
        self.rank = rank
        self.scale = scale
        self.merged = False
        self.gguf_name: str | None = None
        """The base tensor's GGUF name (``blk.0.attn_q.weight``), set by attach_lora."""
        self._unmerged_base: nn.Module | None = None
        self._unmerged_weight: nn.Parameter | None = None

    def delta_weight(self) -> torch.Tensor:
        """s·ΔW in the base weight's orientation, f32."""
        raise NotImplementedError

    def merge(self) -> None:
        """Fold s·ΔW into the base weight (idempotent). The merged weight is a new tensor (a
        quantized base becomes its f32 dequantization plus the delta), never an in-place edit:
        a float base can be a view of the GGUF file's mapping that other models share.
        unmerge() puts the original weight or blocks back, exactly."""
        if self.merged:
            return
        with torch.no_grad():
            if isinstance(self.base, QuantLinear | QuantEmbedding):
                self._unmerged_base = self.base
                self.base = _float_module(self.base, self.base.dequantized_weight(torch.float32) + self.delta_weight())
            else:
                w = self.base.weight
                self._unmerged_weight = w
                self.base.weight = nn.Parameter((w.float() + self.delta_weight()).to(w.dtype),
                                                requires_grad=w.requires_grad)
        self.merged = True

    def unmerge(self) -> None:
        """Undo merge() (idempotent): the original base weight (or quantized blocks) again."""
        if not self.merged:
            return
        if self._unmerged_base is not None:
            self.base, self._unmerged_base = self._unmerged_base, None
        elif self._unmerged_weight is not None:
            self.base.weight, self._unmerged_weight = self._unmerged_weight, None
        self.merged = False

    def lora_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield "lora_a", self.lora_a
        yield "lora_b", self.lora_b


def _float_module(quant: QuantLinear | QuantEmbedding, weight: torch.Tensor) -> nn.Module:
    return float_module(nn.Parameter(weight, requires_grad=False), embedding=isinstance(quant, QuantEmbedding))


def _supported(base: nn.Module, bases: tuple[type, ...], what: str) -> None:
    if not isinstance(base, bases):
        raise Unsupported(f"{what} cannot wrap a {type(base).__name__}; supported bases: "
                          f"{', '.join(b.__name__ for b in bases)}")


class LoRALinear(_LoRA):
    """``base(x) + scale · B(A(dropout(x)))`` around an nn.Linear or QuantLinear."""

    def __init__(self, base: nn.Module, rank: int, alpha: float | None = None, dropout: float = 0.0) -> None:
        _supported(base, LINEAR_BASES, "LoRALinear")
        if rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {rank}")
        super().__init__(base, rank, (alpha if alpha is not None else rank) / rank)
        n_out, n_in = _linear_shape(base)
        device = _device_of(base)
        self.lora_a = nn.Parameter(torch.zeros(rank, n_in, device=device))
        self.lora_b = nn.Parameter(torch.zeros(n_out, rank, device=device))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.base(x)
        dtype = compute_dtype(x)
        products = None if self.training and self.dropout_p > 0 else _frozen_products(self.base, dtype)
        if products is not None and (dtype == self.lora_a.dtype or torch.is_autocast_enabled(x.device.type)):
            return _LoRAProduct.apply(x, self.lora_a, self.lora_b, self.scale, products, dtype)
        y = self.base(x)
        x = self.dropout(x)
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.lora_a.dtype)  # a half-precision base still gets an f32 delta (peft does the same)
        h = F.linear(x, self.lora_a)  # (..., r); under autocast in the autocast dtype
        return y + (F.linear(h, self.lora_b.to(h.dtype)) * self.scale).to(y.dtype)

    @property
    def dropout_p(self) -> float:
        return self.dropout.p if isinstance(self.dropout, nn.Dropout) else 0.0

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_b.float() @ self.lora_a.float()) * self.scale  # (out, in)


Products = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]
"""(x -> x @ W.T, g -> g @ W) for 2-D operands in one dtype, without autograd."""


def _frozen_products(base: nn.Module, dtype: torch.dtype) -> Products | None:
    """A base layer's products in ``dtype`` when its weight takes no gradient (a bias-free float
    Linear whose weight is frozen, or a QuantLinear); None for anything else."""
    if isinstance(base, QuantLinear):
        raw, ggml_type, n_in, chunk_bytes = base.raw, base.ggml_type, base.shape[1], base.chunk_bytes
        return (lambda x: quant_mm_t(x, raw, ggml_type, n_in, chunk_bytes),
                lambda g: quant_mm(g, raw, ggml_type, n_in, chunk_bytes))
    if (isinstance(base, nn.Linear) and base.weight.dtype != dtype
            and not torch.is_autocast_enabled(base.weight.device.type)):
        return None  # a half-precision base without autocast: the plain path keeps the delta in f32
    w = frozen_float_weight(base, dtype)  # (out, in); a cast only under autocast, as F.linear's would be
    if w is None:
        return None
    return (lambda x: mm_t(x, w)), (lambda g: mm(g, w))


def frozen_float_weight(base: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """W in ``dtype`` of a bias-free ``nn.Linear`` or ggtorch ``Linear`` whose weight takes no
    gradient: its forward is ``x @ W.T``, which the one-node LoRA and the fused loss compute
    themselves. None for anything else, subclasses included (their forward may differ)."""
    if type(base) in (nn.Linear, Linear) and base.bias is None and not base.weight.requires_grad:
        return base.weight.to(dtype)
    return None


class _LoRAProduct(torch.autograd.Function):
    """``base(x) + s·(x @ A.T) @ B.T`` for a frozen base, as one autograd node.

    As two nodes, ``y + delta`` copies the base's output once more and backward sums two input
    gradients of x (the base's and the delta's): ~0.1 s, 3%, of an f32 step of a 110M model at
    1024 tokens (steps alternating in one process). Here the delta is added into the base's
    product in place and its input gradient into the base's. Computed in ``dtype`` (the autocast dtype, or x's), as
    autocast would compute the two F.linear calls; gradients come back in their tensors' dtypes.
    The rank-r products go through ggtorch.matmul too: for f32 on CPU, oneDNN ran them in 0.13 s of
    that step where torch.mm's MKL took 0.25 s.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,  # type: ignore[override]
                products: Products, dtype: torch.dtype) -> torch.Tensor:
        product, _ = products
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)  # (N, in)
            a_c, b_c = a.to(dtype), b.to(dtype)  # (r, in), (out, r)
            h = mm_t(x2, a_c)  # (N, r)
            y = product(x2).addmm_(h, b_c.T, alpha=scale)  # (N, out)
        ctx.save_for_backward(x2, h, a_c, b_c)
        ctx.products, ctx.scale, ctx.x_meta = products, scale, (x.shape, x.dtype, a.dtype, b.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # type: ignore[override]
        x2, h, a_c, b_c = ctx.saved_tensors
        x_shape, x_dtype, a_dtype, b_dtype = ctx.x_meta
        _, input_grad = ctx.products
        grad_x = grad_a = grad_b = None
        with torch.autocast(grad_y.device.type, enabled=False):
            g = grad_y.reshape(-1, grad_y.shape[-1]).to(x2.dtype)  # (N, out)
            grad_h = mm(g, b_c).mul_(ctx.scale)  # (N, r)
            if ctx.needs_input_grad[0]:
                acc = input_grad(g)  # (N, in)
                acc.addmm_(grad_h.to(acc.dtype), a_c.to(acc.dtype))
                grad_x = acc.to(x_dtype).view(x_shape)
            if ctx.needs_input_grad[1]:
                grad_a = mm(grad_h.T.contiguous(), x2).to(a_dtype)  # (r, in)
            if ctx.needs_input_grad[2]:
                # h.T @ g, then transposed: as g.T @ h MKL ran 2.5x slower (a transposed (N, out) operand)
                grad_b = mm(h.T.contiguous(), g).mul_(ctx.scale).T.contiguous().to(b_dtype)  # (out, r)
        return grad_x, grad_a, grad_b, None, None, None


class LoRAEmbedding(_LoRA):
    """``base(ids) + scale · lora_a[ids] @ lora_b.T`` around an nn.Embedding or QuantEmbedding."""

    def __init__(self, base: nn.Module, rank: int, alpha: float | None = None) -> None:
        _supported(base, EMBEDDING_BASES, "LoRAEmbedding")
        if rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {rank}")
        super().__init__(base, rank, (alpha if alpha is not None else rank) / rank)
        n_vocab, n_embd = _linear_shape(base)
        device = _device_of(base)
        self.lora_a = nn.Parameter(torch.zeros(n_vocab, rank, device=device))
        self.lora_b = nn.Parameter(torch.zeros(n_embd, rank, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.base(ids)
        if self.merged:
            return y
        h = F.embedding(ids, self.lora_a)  # (..., r)
        return y + (F.linear(h, self.lora_b) * self.scale).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_a.float() @ self.lora_b.float().T) * self.scale  # (n_vocab, n_embd)


class LoRANorm(_LoRA):
    """RMSNorm with gain ``g + scale · (lora_b @ lora_a)[0]``: the old finetune's norm adapters."""

    def __init__(self, base: nn.Module, rank: int) -> None:
        _supported(base, (RMSNorm,), "LoRANorm")
        if rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {rank}")
        super().__init__(base, rank, 1.0)
        n_embd = base.weight.shape[0]
        device = base.weight.device
        self.lora_a = nn.Parameter(torch.zeros(rank, n_embd, device=device))
        self.lora_b = nn.Parameter(torch.zeros(1, rank, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.base(x)
        gain = self.base.weight.float() + self.delta_weight()
        return functional_call(self.base, {"weight": gain}, (x,))

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_b.float() @ self.lora_a.float())[0] * self.scale  # (n_embd,)


def _linear_shape(base: nn.Module) -> tuple[int, int]:
    if isinstance(base, QuantLinear | QuantEmbedding):
        return base.shape
    return tuple(base.weight.shape)  # type: ignore[return-value]


def _device_of(base: nn.Module) -> torch.device:
    return base.raw.device if isinstance(base, QuantLinear | QuantEmbedding) else base.weight.device


# --- attaching -----------------------------------------------------------------------------


def _is_tied(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "tied_output", False))


def _plan(model: nn.Module, config: LoraConfig) -> list[tuple[str, int | None, int]]:
    """(kind, bid, rank to train) for every tensor of the old order; rank 0 = not adapted."""
    n_layer = len(model.layers)  # type: ignore[arg-type]
    tied = _is_tied(model)
    plan = []
    for kind, bid in [(k, None) for k in GLOBAL_ORDER] + [(k, i) for i in range(n_layer) for k in LAYER_ORDER]:
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
    config = config or LoraConfig()
    if any(isinstance(m, _LoRA) for m in model.modules()):
        raise BadFlag("the model already has LoRA adapters attached; attach once, or merge and reload")
    for p in model.parameters():
        p.requires_grad_(False)
    plan = _plan(model, config)
    if _is_tied(model) and any(config.rank_of(k) > 0 for k in TIED_KINDS):
        log.info("tied output: no LoRA on token_embd/output (llama.cpp cannot load such an adapter)")
    wrapped: list[_LoRA] = []
    for kind, bid, rank in plan:
        if rank == 0:
            continue
        path = names.module_path(kind, bid)
        base = model.get_submodule(path)
        if kind in NORM_KINDS:
            module: _LoRA = LoRANorm(base, rank)
        elif kind == "token_embd":
            module = LoRAEmbedding(base, rank, config.lora_alpha)
        else:
            module = LoRALinear(base, rank, config.lora_alpha, config.dropout)
        module.gguf_name = names.gguf_name(kind, bid)
        parent_path, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, attr, module)
        wrapped.append(module)
    _initialize(model, plan, config, seed)
    return model


def _initialize(model: nn.Module, plan: list[tuple[str, int | None, int]], config: LoraConfig, seed: int) -> None:
    """A tensors as randomize_lora fills them, B = 0 (already zero)."""
    # Values per tensor in the old layout order. Skipped kinds still consume their draws (norms
    # with the old default rank 1), so a default run's A values equal the old program's.
    shapes = []  # (kind, bid, old ne0 = r, old ne1 = n_in)
    for kind, bid, rank in plan:
        draw_rank = rank or (1 if kind in NORM_KINDS else config.rank_of(kind))
        n_in = _old_a_width(model, kind, bid)
        shapes.append((kind, bid, rank, draw_rank, n_in))
    counts = [r * n for _, _, _, r, n in shapes]
    if config.init == "ggml":
        values = libstdcpp_normal(MT19937(seed & 0xFFFFFFFF), sum(counts))
    else:
        gen = torch.Generator().manual_seed(seed)
        values = torch.randn(sum(counts), generator=gen).numpy()
    offset = 0
    for (kind, bid, rank, draw_rank, n_in), count in zip(shapes, counts, strict=True):
        chunk = values[offset:offset + count]
        offset += count
        if rank == 0:
            continue
        scale = np.float32(1.0) / np.sqrt(np.float32(draw_rank) + np.float32(n_in), dtype=np.float32)
        old_a = (np.clip(chunk, np.float32(-1), np.float32(1)).astype(np.float32) * scale).reshape(n_in, draw_rank)
        module = model.get_submodule(names.module_path(kind, bid))
        with torch.no_grad():
            t = torch.from_numpy(old_a).to(module.lora_a.device)
            if kind == "token_embd":
                module.lora_b.copy_(t)  # new lora_b (n_embd, r) is the old A, same layout
            else:
                module.lora_a.copy_(t.T)  # new lora_a (r, n_in) is the old A transposed


def _old_a_width(model: nn.Module, kind: str, bid: int | None) -> int:
    """ne1 of the old finetune's A tensor for ``kind``: the base's input width (n_embd for
    token_embd and the norms)."""
    module = model.get_submodule(names.module_path(kind, bid))
    base = module.base if isinstance(module, _LoRA) else module
    if kind in NORM_KINDS:
        return int(base.weight.shape[0])
    return _linear_shape(base)[1]


def libstdcpp_normal(engine: MT19937, n: int) -> np.ndarray:
    """``n`` values of libstdc++'s ``std::normal_distribution<float>(0, 1)`` driven by ``engine``.

    Marsaglia's polar method as bits/random.tcc writes it, vectorized over pairs: uniforms are
    ``generate_canonical<float>`` (one 32-bit draw, ``float(draw) / 2^32``, 1 mapped to the
    float below 1); ``x = 2u - 1`` (in double, then float), pairs with ``r2 > 1`` or ``r2 == 0``
    are rejected, ``mult = sqrt(-2 log(r2) / r2)`` in float, and each accepted pair yields
    ``y·mult`` then ``x·mult``. ``log`` is the C library's ``logf`` (glibc's is not correctly
    rounded, so numpy's log would differ in the last bit); without a C ``logf`` it is rounded
    from double. Assumes no FMA contraction of ``x*x + y*y``, as in a default x86-64 build.
    """
    out: list[np.ndarray] = []
    have = 0
    below_one = np.nextafter(np.float32(1), np.float32(0))
    while have < n:
        pairs = int((n - have + 1) // 2 * 1.28) + 64  # acceptance is pi/4
        draws = engine.draw(2 * pairs).reshape(pairs, 2)
        u = draws.astype(np.float32) / np.float32(2.0 ** 32)
        u = np.where(u >= 1, below_one, u)
        xy = (2 * u.astype(np.float64) - 1.0).astype(np.float32)
        x, y = xy[:, 0], xy[:, 1]
        r2 = x * x + y * y
        ok = (r2 <= 1) & (r2 != 0)
        x, y, r2 = x[ok], y[ok], r2[ok]
        logr2 = _logf(r2)
        mult = np.sqrt(np.float32(-2) * logr2 / r2).astype(np.float32)
        vals = np.stack([y * mult, x * mult], axis=1).reshape(-1)
        out.append(vals)
        have += vals.size
    return np.concatenate(out)[:n].astype(np.float32) + np.float32(0)


@functools.cache
def _c_logf() -> Callable[[float], float] | None:
    path = ctypes.util.find_library("m")
    try:
        fn = ctypes.CDLL(path).logf if path else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn


def _logf(r: np.ndarray) -> np.ndarray:
    """C ``logf`` elementwise (float32), as ``std::log(float)`` computes it."""
    fn = _c_logf()
    if fn is None:
        return np.log(r.astype(np.float64)).astype(np.float32)
    return np.fromiter(map(fn, r.tolist()), dtype=np.float32, count=r.size)


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
    dropped): 2 for every matrix pair and norm A, 1 for a norm B ``ne=[r, 1]``: the old finetune's
    ``--adam-decay-min-ndim`` decides weight decay from it.
    """
    out = []
    for path, m in _ordered(model):
        for pname, p in m.lora_parameters():
            ndim = 1 if isinstance(m, LoRANorm) and pname == "lora_b" else 2
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

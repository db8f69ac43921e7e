"""The LoRA wrappers: LoRALinear, LoRAEmbedding, LoRAExperts and LoRANorm around a base module.

Each holds the original module as ``base`` (``models/`` stays untouched) and ``lora_a``,
``lora_b`` in GGUF LoRA orientation; ``merge()``/``unmerge()`` fold the delta in and out.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ggtorch.errors import Unsupported
from ggtorch.lora.product import (
    Products,
    _expert_products,
    _frozen_products,
    delta_only,
    expert_lora_products,
    lora_products,
)
from ggtorch.models.model import RMSNorm
from ggtorch.ops.experts import Experts, grouped
from ggtorch.quant.autograd import compute_dtype
from ggtorch.quant.modules import QuantEmbedding, QuantExperts, QuantLinear, float_twin

LINEAR_BASES = (nn.Linear, QuantLinear)
EMBEDDING_BASES = (nn.Embedding, QuantEmbedding)
EXPERT_BASES = (Experts, QuantExperts)
QUANT_BASES = (QuantLinear, QuantEmbedding, QuantExperts)


class _LoRA(nn.Module):
    """Shared state of the wrappers: base, pair, scale, merged flag."""

    def __init__(self, base: nn.Module, rank: int, alpha: float | None, a_shape: tuple[int, ...],
                 b_shape: tuple[int, ...]) -> None:
        """A zero pair of the given shapes on the base's device, scaled by alpha / rank (default 1)."""
        if rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {rank}")
        super().__init__()
        self.base = base
        self.rank = rank
        self.scale = (alpha if alpha is not None else rank) / rank
        device = _device_of(base)
        self.lora_a = nn.Parameter(torch.zeros(*a_shape, device=device))
        self.lora_b = nn.Parameter(torch.zeros(*b_shape, device=device))
        self.merged = False
        self.enabled = True
        """False: the layer is its base alone, its pair kept but not computed (a preference run's reference
        model: ``training.preference.adapters_off``)."""
        self.gguf_name: str | None = None
        """The base tensor's GGUF name (``blk.0.attn_q.weight``), set by attach_lora."""
        self._unmerged_base: nn.Module | None = None
        self._unmerged_weight: nn.Parameter | None = None

    @property
    def passes_through(self) -> bool:
        """Whether the forward is the base's alone: merged into it, or switched off."""
        return self.merged or not self.enabled

    def delta_weight(self) -> torch.Tensor:
        """s·ΔW in the base weight's orientation, f32."""
        raise NotImplementedError

    def merge_delta(self) -> torch.Tensor:
        """What merge() adds to the base weight: s·ΔW."""
        return self.delta_weight()

    def merge(self) -> None:
        """Fold s·ΔW into the base weight (idempotent). The merged weight is a new tensor (a
        quantized base becomes its f32 dequantization plus the delta), never an in-place edit:
        a float base can be a view of the GGUF file's mapping that other models share.
        unmerge() puts the original weight or blocks back, exactly."""
        if self.merged:
            return
        with torch.no_grad():
            if isinstance(self.base, QUANT_BASES):
                self._unmerged_base = self.base
                self.base = float_twin(self.base, self.base.dequantized_weight(torch.float32) + self.merge_delta())
            else:
                w = self.base.weight
                self._unmerged_weight = w
                self.base.weight = nn.Parameter((w.float() + self.merge_delta()).to(w.dtype),
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


def _supported(base: nn.Module, bases: tuple[type, ...], what: str) -> None:
    if not isinstance(base, bases):
        raise Unsupported(f"{what} cannot wrap a {type(base).__name__}; supported bases: "
                          f"{', '.join(b.__name__ for b in bases)}")


class LoRALinear(_LoRA):
    """``base(x) + scale · B(A(dropout(x)))`` around an nn.Linear or QuantLinear."""

    def __init__(self, base: nn.Module, rank: int, alpha: float | None = None, dropout: float = 0.0) -> None:
        _supported(base, LINEAR_BASES, "LoRALinear")
        n_out, n_in = _linear_shape(base)
        super().__init__(base, rank, alpha, (rank, n_in), (n_out, rank))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.passes_through:
            return self.base(x)
        together = LoRALinear.forward_group((self,), x)
        if together is not None:
            return together[0]
        # the delta apart from the base's own forward: dropout on its input, a base that trains, or a
        # half-precision base without autocast, whose delta stays in f32 (peft does the same)
        y = self.base(x)
        dtype = compute_dtype(x) if torch.is_autocast_enabled(x.device.type) else self.lora_a.dtype
        (delta,) = lora_products(self.dropout(x), (float(self.scale),), (delta_only(*_linear_shape(self.base)),),
                                 dtype, [self.lora_a, self.lora_b])
        return y + delta.to(y.dtype)

    @staticmethod
    def forward_group(layers: tuple[LoRALinear, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The outputs of LoRALinear layers that read the same x (one layer; q, k and v; gate and up) as one node,
        the layers' rank-r products over all their A at once and the input gradient summed there
        (ggtorch.lora.product.lora_products); None when one of them does not take the one-node product (merged,
        dropout, a base whose weight trains), and each runs its own forward. The models' ``group_forward`` hook
        (attach_lora sets it on the modules whose projections it wraps)."""
        if not all(isinstance(layer, LoRALinear) for layer in layers):
            return None
        dtype = compute_dtype(x)
        products = [layer._one_node_products(x, dtype) for layer in layers]
        if any(p is None for p in products):
            return None
        pairs = [t for layer in layers for t in (layer.lora_a, layer.lora_b)]
        return lora_products(x, tuple(float(layer.scale) for layer in layers), tuple(products), dtype, pairs)

    def _one_node_products(self, x: torch.Tensor, dtype: torch.dtype) -> Products | None:
        """The frozen base's products when this layer's forward on x is the one-node product in ``dtype``; None
        when it is not: merged, dropout in training, a base that trains, or a half-precision base without
        autocast (whose delta stays in f32)."""
        if self.passes_through or (self.training and self.dropout_p > 0):
            return None
        products = _frozen_products(self.base, dtype)
        if products is None or not (dtype == self.lora_a.dtype or torch.is_autocast_enabled(x.device.type)):
            return None
        return products

    @property
    def dropout_p(self) -> float:
        return self.dropout.p if isinstance(self.dropout, nn.Dropout) else 0.0

    def linear_parts(self) -> tuple[nn.Module, nn.Parameter, nn.Parameter, float] | None:
        """``(base, lora_a, lora_b, scale)`` for code that computes ``base(x) + scale·(x @ A.T) @ B.T``
        itself (the fused output loss); None when this layer's forward is not that: merged, or with
        dropout on its input."""
        if self.passes_through or self.dropout_p > 0:
            return None
        return self.base, self.lora_a, self.lora_b, float(self.scale)

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_b.float() @ self.lora_a.float()) * self.scale  # (out, in)


class LoRAExperts(_LoRA):
    """Per-expert LoRA around a stack of expert matrices (Experts or QuantExperts): expert e computes
    ``x @ W[e].T + scale · (x @ A[e].T) @ B[e].T`` on its own rows.

    ``lora_a`` (E, r, in) and ``lora_b`` (E, out, r) are the layout llama.cpp's adapter loader takes for
    ``*_exps`` (its build_lora_mm_id multiplies them with ggml_mul_mat_id, expert by expert). Each
    expert's product is the one-node LoRA product of a LoRALinear over that expert's matrix, so only
    routed experts are computed (and, quantized, dequantized), and the gradients of A and B are
    assembled once per step, zero for experts nothing was routed to.
    """

    def __init__(self, base: nn.Module, rank: int, alpha: float | None = None, dropout: float = 0.0) -> None:
        _supported(base, EXPERT_BASES, "LoRAExperts")
        n_expert, n_out, n_in = base.shape
        super().__init__(base, rank, alpha, (n_expert, rank, n_in), (n_expert, n_out, rank))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if self.passes_through:
            return self.base(x, counts)
        dtype = compute_dtype(x)
        frozen = isinstance(self.base, QuantExperts) or not self.base.weight.requires_grad
        dropout = self.training and isinstance(self.dropout, nn.Dropout)
        unscaled = self.base.scale is None  # a scaled stack scales its own product only (llama.cpp's w_s)
        if frozen and unscaled and not dropout and (dtype == self.lora_a.dtype or
                                                    torch.is_autocast_enabled(x.device.type)):
            return expert_lora_products(x, counts, float(self.scale), lambda e: _expert_products(self.base, e, dtype),
                                        dtype, self.lora_a, self.lora_b)
        y = self.base(x, counts)
        if not torch.is_autocast_enabled(x.device.type):
            dtype = self.lora_a.dtype
        only = (delta_only(*_linear_shape(self.base)[1:]),)
        a, b = self.lora_a.unbind(0), self.lora_b.unbind(0)
        delta = grouped(self.dropout(x), counts,
                        lambda e, rows: lora_products(rows, (float(self.scale),), only, dtype, [a[e], b[e]])[0])
        return y + delta.to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        return torch.bmm(self.lora_b.float(), self.lora_a.float()) * self.scale  # (E, out, in)

    def merge_delta(self) -> torch.Tensor:
        """What merging adds to the stack: s·ΔW, divided by each expert's scale where the stack has one (its
        product is scaled, the adapter's is not)."""
        delta = self.delta_weight()
        return delta if self.base.scale is None else delta / self.base.scale.float()[:, None, None]


class LoRAEmbedding(_LoRA):
    """``base(ids) + scale · lora_a[ids] @ lora_b.T`` around an nn.Embedding or QuantEmbedding."""

    def __init__(self, base: nn.Module, rank: int, alpha: float | None = None) -> None:
        _supported(base, EMBEDDING_BASES, "LoRAEmbedding")
        n_vocab, n_embd = _linear_shape(base)
        super().__init__(base, rank, alpha, (n_vocab, rank), (n_embd, rank))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.base(ids)
        if self.passes_through:
            return y
        h = F.embedding(ids, self.lora_a)  # (..., r)
        return y + (F.linear(h, self.lora_b) * self.scale).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_a.float() @ self.lora_b.float().T) * self.scale  # (n_vocab, n_embd)


class LoRANorm(_LoRA):
    """RMSNorm with gain ``g + scale · (lora_b @ lora_a)[0]``: the old finetune's norm adapters."""

    def __init__(self, base: nn.Module, rank: int) -> None:
        _supported(base, (RMSNorm,), "LoRANorm")
        n_embd = base.weight.shape[0]
        super().__init__(base, rank, None, (rank, n_embd), (1, rank))  # scale 1, as the old finetune trained

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.passes_through:
            return self.base(x)
        gain = self.base.weight.float() + self.delta_weight()
        return functional_call(self.base, {"weight": gain}, (x,))

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_b.float() @ self.lora_a.float())[0] * self.scale  # (n_embd,)


def _linear_shape(base: nn.Module) -> tuple[int, ...]:
    if isinstance(base, QUANT_BASES):
        return base.shape
    return tuple(base.weight.shape)


def _device_of(base: nn.Module) -> torch.device:
    return base.raw.device if isinstance(base, QUANT_BASES) else base.weight.device

"""Stacks of expert matrices, and the grouped product that runs each expert on its own rows only.

A mixture-of-experts layer hands its experts the rows routed to them, grouped by expert: ``counts[e]``
rows for expert e, in expert order. :func:`grouped` multiplies each group by its expert's matrix and
nothing else, so an expert no row was routed to costs nothing (for a quantized stack, it is not even
dequantized: ggtorch.quant.modules.QuantExperts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ggtorch.ops.matmul import linear


def grouped(x: torch.Tensor, counts: list[int],
            product: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product(e, rows of expert e)`` for every expert with rows, concatenated in expert order.

    x: (N, in) grouped by expert, ``sum(counts) == N``; the result is (N, out).
    """
    parts = [product(e, rows) for e, rows in enumerate(x.split(counts)) if rows.shape[0]]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def scaled(y: torch.Tensor, scale: torch.Tensor | None, expert: int) -> torch.Tensor:
    """Expert ``expert``'s product ``y`` times its entry of a stack's ``scale`` (ggml_mul in f32; None: y)."""
    return y if scale is None else (y.float() * scale[expert].float()).to(y.dtype)


class Experts(nn.Module):
    """E float matrices ``weight`` (E, out, in): one ``ffn_*_exps`` tensor of a GGUF.

    ``forward(x, counts)`` is :func:`grouped` over ``x @ W[e].T``. The matrices are unbound into views,
    so a full finetune's gradient of ``weight`` is assembled once (zeros for experts nothing was
    routed to), not once per expert.
    """

    def __init__(self, n_expert: int, n_out: int, n_in: int, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_expert, n_out, n_in, device=device, dtype=dtype))
        self.scale: nn.Parameter | None
        self.register_parameter("scale", None)
        """Per expert, a factor on its product (E,) (gemma4's ``ffn_down_exps.scale``, llama.cpp's ``w_s`` of
        build_lora_mm_id: it scales the base product, not an adapter's; None: none)."""

    @classmethod
    def holding(cls, weight: nn.Parameter) -> Experts:
        """Experts whose ``weight`` is the given Parameter itself (built on meta: no allocation)."""
        experts = cls(*weight.shape, device="meta")
        experts.weight = weight
        return experts

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, out, in), as QuantExperts has it."""
        return tuple(self.weight.shape)  # type: ignore[return-value]

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        weights = self.weight.unbind(0)
        return grouped(x, counts, lambda e, rows: scaled(linear(rows, weights[e]), self.scale, e))

    def extra_repr(self) -> str:
        n_expert, n_out, n_in = self.shape
        return f"n_expert={n_expert}, out={n_out}, in={n_in}"

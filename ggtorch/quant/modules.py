"""Modules that keep a frozen base weight as its raw ggml blocks.

``QuantLinear`` / ``QuantEmbedding`` hold W as a registered uint8 buffer ``raw`` of shape
(n_rows, row_nbytes) plus its ggml type and torch-order shape (``QuantExperts``: a stack of E
matrices, (E, n_rows, row_nbytes)), and dequantize on the fly
(:mod:`ggtorch.quant.autograd`). The buffer moves with ``.to(device)`` (``.to(dtype)`` leaves
it alone: it is not a float tensor) and is saved in ``state_dict``; the ggml type and shape
travel as the module's extra state, so a state dict is self-describing.

Construction never copies: ``raw`` is kept as given (reshaped as a view). On CPU the loader
passes the copy-on-write view of the memory-mapped GGUF, so a CPU model *keeps the mmap view*:
pages are read from the file on first use and shared with the page cache, and the file is
never duplicated in memory. ``.to("cuda")`` makes the one copy the device needs. A tied output
projection is a QuantLinear built on the embedding's own buffer (same tensor, no copy).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from gguf import GGMLQuantizationType
from torch import nn

from ggtorch.ops.experts import Experts, grouped, scaled
from ggtorch.ops.matmul import Linear
from ggtorch.quant import dequantize, row_nbytes
from ggtorch.quant.autograd import quant_embedding, quant_linear


class _QuantWeight(nn.Module):
    """Shared part: the raw buffer, its ggml type and shape, and (de)serialization of both."""

    raw: torch.Tensor

    def __init__(self, raw: torch.Tensor, ggml_type: GGMLQuantizationType | int, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.ggml_type = GGMLQuantizationType(ggml_type)
        self.shape = tuple(int(n) for n in shape)
        self.register_buffer("raw", self._rows_view(raw))
        self.chunk_bytes: int | None = None
        """Per-module override of the policy's ``dequantize_chunk_bytes`` (None: the policy's)."""

    def _rows_view(self, raw: torch.Tensor) -> torch.Tensor:
        if raw.dtype != torch.uint8:
            raise TypeError(f"raw ggml blocks must be a uint8 tensor, got {raw.dtype}")
        nbytes = row_nbytes(self.ggml_type, self.shape[-1])
        n_rows = math.prod(self.shape[:-1])
        if raw.numel() != n_rows * nbytes:
            raise ValueError(f"{self.ggml_type.name} {self.shape} takes {n_rows * nbytes} bytes, "
                             f"the raw buffer holds {raw.numel()}")
        return raw.reshape(*self.shape[:-1], nbytes)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full float W of ``shape``: a new tensor, for merging and tests."""
        return dequantize(self.raw, self.ggml_type, self.shape, dtype)

    def get_extra_state(self) -> dict[str, Any]:
        return {"ggml_type": int(self.ggml_type), "shape": list(self.shape)}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.ggml_type = GGMLQuantizationType(state["ggml_type"])
        self.shape = tuple(int(n) for n in state["shape"])

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # A state dict may hold another ggml type (other byte count): take its buffer size.
        incoming = state_dict.get(prefix + "raw")
        if isinstance(incoming, torch.Tensor) and incoming.shape != self.raw.shape:
            self.raw = torch.empty(incoming.shape, dtype=torch.uint8, device=self.raw.device)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        return f"{self.ggml_type.name}, shape={self.shape}"


class QuantLinear(_QuantWeight):
    """``y = x @ W.T`` (no bias) with W (out, in) kept as ggml blocks; W gets no gradient."""

    def __init__(self, raw: torch.Tensor, ggml_type: GGMLQuantizationType | int, shape: tuple[int, int]) -> None:
        super().__init__(raw, ggml_type, shape)
        self.out_features, self.in_features = self.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.raw, self.ggml_type, self.shape, self.chunk_bytes)

    def weight_rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, end) of W decoded in ``dtype`` (end - start, in): a slab of an output projection."""
        return dequantize(self.raw[start:end], self.ggml_type, (end - start, self.in_features), dtype)

    def rows_at(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """W's rows at ``ids`` decoded in ``dtype``, only those (the target words' rows of an output projection)."""
        return quant_embedding(ids, self.raw, self.ggml_type, self.shape, dtype)


class QuantEmbedding(_QuantWeight):
    """Row lookup in W (n_vocab, n_embd) kept as ggml blocks; only the looked-up rows are decoded."""

    def __init__(self, raw: torch.Tensor, ggml_type: GGMLQuantizationType | int, shape: tuple[int, int]) -> None:
        super().__init__(raw, ggml_type, shape)
        self.num_embeddings, self.embedding_dim = self.shape
        self.dtype = torch.float32
        """dtype of the looked-up rows (an embedding's output is not autocast, so f32 by default)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return quant_embedding(ids, self.raw, self.ggml_type, self.shape, self.dtype)


class QuantExperts(_QuantWeight):
    """E expert matrices (E, out, in) kept as ggml blocks: one ``ffn_*_exps`` tensor.

    ``forward(x, counts)`` runs expert e on its ``counts[e]`` rows of x (grouped by expert) through
    the quantized matmul: an expert is dequantized, in forward and in backward, only when some row
    was routed to it, one expert at a time.
    """

    def __init__(self, raw: torch.Tensor, ggml_type: GGMLQuantizationType | int, shape: tuple[int, ...]) -> None:
        super().__init__(raw, ggml_type, shape)
        self.scale: nn.Parameter | None
        self.register_parameter("scale", None)
        """Per expert, a factor on its product (gemma4's ``ffn_down_exps.scale``; None: none), set by the loader."""

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        n_out, n_in = self.shape[1:]
        return grouped(x, counts, lambda e, rows: scaled(quant_linear(rows, self.raw[e], self.ggml_type, (n_out, n_in),
                                                                      self.chunk_bytes), self.scale, e))


def float_twin(quant: _QuantWeight, weight: torch.Tensor) -> nn.Module:
    """The float module that replaces ``quant`` (merged or dequantized) holding ``weight``, frozen (a
    Parameter given is used as it is, so modules given one stay tied)."""
    param = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    if isinstance(quant, QuantExperts):
        experts = Experts.holding(param)
        experts.scale = quant.scale
        return experts
    return float_module(param, embedding=isinstance(quant, QuantEmbedding))


def float_module(weight: nn.Parameter, embedding: bool) -> nn.Module:
    """A Linear (or nn.Embedding) holding ``weight`` (rows, cols) as it is: the same Parameter,
    so modules given one stay tied. Built on the meta device without the random init its
    constructor would run (the first normal_, even on a meta tensor, imports torch._dynamo: slow)."""
    n_rows, n_cols = weight.shape
    module: nn.Module
    if embedding:
        module = nn.Embedding(n_rows, n_cols, _weight=torch.empty(n_rows, n_cols, device="meta"))
    else:
        module = Linear(n_cols, n_rows, bias=False, device="meta")
    module.weight = weight
    return module


def dequantize_modules(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Replace every QuantLinear / QuantEmbedding / QuantExperts in ``model`` by a frozen float nn.Linear /
    nn.Embedding / Experts of ``dtype`` (in place; also returned). Modules that shared one raw buffer (a
    tied output) share one float Parameter afterwards. The "float base" switch, for speed when
    memory allows; results equal the quantized path up to rounding.
    """
    shared: dict[int, nn.Parameter] = {}
    for path, module in list(model.named_modules()):
        if not isinstance(module, _QuantWeight):
            continue
        key = module.raw.data_ptr()
        if key not in shared:
            shared[key] = nn.Parameter(module.dequantized_weight(dtype), requires_grad=False)
        new = float_twin(module, shared[key])
        parent_path, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, attr, new)
    return model

"""Autograd over raw ggml blocks: ``y = x @ W.T`` and embedding lookups with W never materialized.

The base weight of a LoRA finetune is frozen, so backward needs only ``grad_x = grad_y @ W``
and never a gradient for W. :class:`QuantMatmul` therefore saves just a reference to the raw
uint8 blocks (which the module holds anyway) and dequantizes again in backward. Both passes
walk W in chunks of whole rows, so the only float copy of W that ever exists is one chunk of
at most the policy's ``dequantize_chunk_bytes`` (16 MiB on every device): without chunking,
a 32000 x 4096 output matrix would need a 512 MiB f32 temporary in every forward and backward,
which is exactly the memory that
keeping the model quantized is meant to save. 16 MiB holds every matrix of a 110M-shape layer
and the attention matrices of a 2048-wide one (TinyLlama's) whole, so they run one unsplit
matmul each way (a split forward costs a copy of each partial product into the output, a
split backward a pass over the accumulated gradient per chunk); a chunk must stay below the
32 MiB from which a ggtorch run's glibc maps every allocation afresh and faults it in
(:mod:`ggtorch.ops.malloc`).

Compute dtype: the dtype of ``x``, or the autocast dtype when autocast is enabled on
``x``'s device (the matmul is computed in it, as autocast computes ``F.linear``). The
Functions switch autocast off inside and cast explicitly, on any device; ``torch.amp``'s
``custom_fwd``/``custom_bwd`` would need the device type fixed at definition time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
from gguf import GGMLQuantizationType

from ggtorch.ops import policy
from ggtorch.ops.matmul import add_mm_, mm, mm_t
from ggtorch.quant import dequantize, row_nbytes


@dataclasses.dataclass
class _Keeping:
    largest: float | None
    """Bytes of the largest matrix kept (None: the policy's ``keep_dequantized_bytes`` for its device)."""
    left: float
    """Bytes the products in the context may still keep together."""
    storage: list[torch.Tensor] | None = None
    """Memory the kept matrices are decoded into, the i-th kept into ``storage[i]``, reused by the
    next context (None: new memory every time)."""
    kept: int = 0
    """Matrices kept so far in the context."""


_keeping: _Keeping | None = None
"""The innermost :func:`keeping_dequantized`'s state, or None: a module global, which torch.compile reads as it
traces (a ContextVar it cannot)."""


@contextlib.contextmanager
def keeping_dequantized(budget: int | None = None, storage: list[torch.Tensor] | None = None) -> Iterator[None]:
    """Inside, a quantized product that takes a gradient saves W as decoded for its backward instead
    of decoding it there again: W is then decoded once per forward and backward, not twice.

    Without ``budget``, for code that runs again in backward (a checkpointed block): its first
    forward's saved tensors are dropped, and those of the recomputation live only until the block's
    backward, so one block's decoded matrices exist at a time; matrices above the policy's
    ``keep_dequantized_bytes`` are decoded again. With ``budget`` (bytes), around a whole forward
    without checkpointing: the products keep matrices in the order they run until together they
    hold ``budget`` bytes, each until its own backward; the rest are decoded again.

    ``storage``: a list that the kept matrices are decoded into and that keeps them between
    contexts (give the same list to each forward of a training loop). A forward then writes into
    the memory of the previous one instead of asking the allocator for ``budget`` fresh bytes that
    the system must zero-fill page by page; so the previous forward's backward must have run (an
    older graph's backward would raise autograd's in-place modification error, not compute wrong
    gradients).
    """
    global _keeping
    outer, _keeping = _keeping, (_Keeping(None, math.inf, storage) if budget is None
                                 else _Keeping(math.inf, budget, storage))
    try:
        yield
    finally:
        _keeping = outer


def kept_dequantized(raw: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, int],
                     dtype: torch.dtype) -> torch.Tensor | None:
    """W (out, in) decoded in ``dtype`` when a product should keep it (see :func:`keeping_dequantized`), else
    None. For products whose input takes a gradient (the caller checks: a Function's forward runs without grad)."""
    keeping, nbytes = _keeping, dequantized_nbytes(shape, dtype)
    if keeping is None:
        return None
    largest = policy.current(raw.device).keep_dequantized_bytes if keeping.largest is None else keeping.largest
    if nbytes > largest or nbytes > keeping.left:
        return None
    keeping.left -= nbytes
    out = None
    if keeping.storage is not None:
        out = _storage(keeping.storage, keeping.kept, shape, dtype, raw.device)
    keeping.kept += 1
    return dequantize(raw, ggml_type, shape, dtype, out=out)


def _storage(storage: list[torch.Tensor], i: int, shape: tuple[int, int], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """``storage[i]`` if it is a ``shape`` matrix of ``dtype`` on ``device``; else a new one put there."""
    if i < len(storage) and storage[i].shape == shape and storage[i].dtype == dtype and storage[i].device == device:
        return storage[i]
    matrix = torch.empty(shape, dtype=dtype, device=device)
    if i < len(storage):
        storage[i] = matrix
    else:
        storage.append(matrix)
    return matrix


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer computes in for input ``x``: the autocast dtype if active."""
    device_type = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def rows_per_chunk(n_cols: int, dtype: torch.dtype, chunk_bytes: int) -> int:
    """Rows of a ``n_cols``-wide matrix whose dequantized copy fits in ``chunk_bytes``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, chunk_bytes // (n_cols * itemsize))


def _row_chunks(n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device,
                chunk_bytes: int | None) -> list[tuple[int, int]]:
    """W's chunks of whole rows: ``chunk_bytes`` of decoded values each, or the policy's for ``device``."""
    budget = policy.current(device).dequantize_chunk_bytes if chunk_bytes is None else chunk_bytes
    return _chunks(n_rows, rows_per_chunk(n_cols, dtype, budget))


def _chunks(n_rows: int, step: int) -> list[tuple[int, int]]:
    return [(r0, min(r0 + step, n_rows)) for r0 in range(0, n_rows, step)]


def _dequantize_rows(raw: torch.Tensor, ggml_type: GGMLQuantizationType, r0: int, r1: int, n_cols: int,
                     dtype: torch.dtype, decoded: torch.Tensor | None = None) -> torch.Tensor:
    """Rows r0..r1 of W from the (n_rows, row_nbytes) view of its blocks, or of W ``decoded`` already."""
    if decoded is not None:
        return decoded[r0:r1]
    return dequantize(raw[r0:r1], ggml_type, (r1 - r0, n_cols), dtype)


def quant_mm_t(x2: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType, n_in: int,
               chunk_bytes: int | None = None, decoded: torch.Tensor | None = None) -> torch.Tensor:
    """``x2 @ W.T`` (N, out) for 2-D ``x2`` (N, in) in the dtype it computes in; W's blocks ``raw``
    viewed as (out, row_nbytes); no autograd. ``decoded``: W decoded already (kept_dequantized), used in
    the same chunks, so the result is the same bit for bit."""
    n_out, dtype = raw.shape[0], x2.dtype
    chunks = _row_chunks(n_out, n_in, dtype, x2.device, chunk_bytes)
    if len(chunks) == 1:
        return mm_t(x2, _dequantize_rows(raw, ggml_type, 0, n_out, n_in, dtype, decoded))  # (N, out)
    y = torch.empty(x2.shape[0], n_out, dtype=dtype, device=x2.device)  # (N, out)
    for r0, r1 in chunks:
        y[:, r0:r1] = mm_t(x2, _dequantize_rows(raw, ggml_type, r0, r1, n_in, dtype, decoded))
    return y


def quant_mm(g: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType, n_in: int,
             chunk_bytes: int | None = None, decoded: torch.Tensor | None = None) -> torch.Tensor:
    """``g @ W`` (N, in) for 2-D ``g`` (N, out), dequantizing W in g's dtype; no autograd. Summed
    over row chunks in at least f32 (bf16 partial sums would lose bits), so a split bf16 product
    comes back in f32. ``decoded``: as for :func:`quant_mm_t`."""
    n_out, dtype = raw.shape[0], g.dtype
    chunks = _row_chunks(n_out, n_in, dtype, g.device, chunk_bytes)
    if len(chunks) == 1:
        return mm(g, _dequantize_rows(raw, ggml_type, 0, n_out, n_in, dtype, decoded))  # (N, in)
    acc_dtype = torch.promote_types(dtype, torch.float32)
    acc = torch.zeros(g.shape[0], n_in, dtype=acc_dtype, device=g.device)  # (N, in)
    for r0, r1 in chunks:
        w = _dequantize_rows(raw, ggml_type, r0, r1, n_in, dtype, decoded)  # (rows, in)
        if acc_dtype == dtype:
            add_mm_(acc, g[:, r0:r1], w)
        else:
            acc += mm(g[:, r0:r1], w)
    return acc


class QuantMatmul(torch.autograd.Function):
    """``y = x @ W.T`` for W stored as raw ggml blocks; gradient for ``x`` only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType,  # type: ignore[override]
                shape: tuple[int, int], chunk_bytes: int | None = None) -> torch.Tensor:
        n_out, n_in = shape
        dtype = compute_dtype(x)
        raw = raw.reshape(n_out, row_nbytes(ggml_type, n_in))
        decoded = kept_dequantized(raw, ggml_type, (n_out, n_in), dtype) if ctx.needs_input_grad[0] else None
        ctx.save_for_backward(raw, decoded)
        ctx.meta = (ggml_type, n_in, dtype, x.dtype, chunk_bytes)
        with torch.autocast(x.device.type, enabled=False):
            y = quant_mm_t(x.reshape(-1, n_in).to(dtype), raw, ggml_type, n_in, chunk_bytes, decoded)  # (N, out)
        return y.reshape(*x.shape[:-1], n_out)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # type: ignore[override]
        raw, decoded = ctx.saved_tensors
        ggml_type, n_in, dtype, x_dtype, chunk_bytes = ctx.meta
        n_out = raw.shape[0]
        grad_x = None
        if ctx.needs_input_grad[0]:
            with torch.autocast(grad_y.device.type, enabled=False):
                g = grad_y.reshape(-1, n_out).to(dtype)  # (N, out)
                grad_x = quant_mm(g, raw, ggml_type, n_in, chunk_bytes, decoded)
                grad_x = grad_x.to(x_dtype).reshape(*grad_y.shape[:-1], n_in)
        return grad_x, None, None, None, None


def quant_linear(x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, int],
                 chunk_bytes: int | None = None) -> torch.Tensor:
    """``x @ W.T`` (..., out) for W (out, in) held as ggml blocks ``raw`` (see QuantMatmul)."""
    return QuantMatmul.apply(x, raw, GGMLQuantizationType(ggml_type), tuple(shape), chunk_bytes)


def quant_embedding(ids: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType,
                    shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``W[ids]`` (..., n_embd) of W (n_vocab, n_embd) held as ggml blocks.

    Rows are byte-contiguous in the (n_vocab, row_nbytes) view, so only the rows asked for are
    gathered (as bytes) and dequantized: the temporary is as big as the result, never as big as
    W, and nothing waits on the host (no ``unique``). No gradient flows into the frozen table,
    so no autograd Function is needed.
    """
    n_vocab, n_embd = shape
    raw = raw.reshape(n_vocab, row_nbytes(ggml_type, n_embd))
    flat = ids.reshape(-1)
    rows = dequantize(raw.index_select(0, flat), ggml_type, (flat.numel(), n_embd), dtype)  # (N, C)
    return rows.reshape(*ids.shape, n_embd)


def dequantized_nbytes(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
    """Bytes a full float copy of a tensor of ``shape`` would take (for memory reports)."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()

"""Dequantization of ggml tensors in torch, bit-exact with llama.cpp.

``dequantize(raw, ggml_type, shape)`` turns the raw bytes of a GGUF tensor into floats on
whatever device ``raw`` lives on. Each ggml type has one small decoder (in ``floats``,
``legacy``, ``kquants``, ``iquants``) that works on a ``(n_blocks, type_size)`` uint8 view
and returns ``(n_blocks, block_size)`` float32 (F16/BF16: their own dtype, whose widening to
f32 is exact); the plain dict ``DEQUANTIZERS`` maps types to decoders. The values are
computed in f32 with the operation order of llama.cpp's ``dequantize_row_*`` and only then
cast to the requested dtype. On CPU, the types most quantized bases are stored in (Q4_0, Q8_0,
Q4_K, Q5_K, Q6_K) decode through ``native``'s C loops instead, with the same values, when a C
compiler is there to build them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggtorch.errors import Unsupported
from ggtorch.io.gguf import check_raw, raw_nbytes, whole_blocks
from ggtorch.ops import policy
from ggtorch.quant import native
from ggtorch.quant.floats import dequantize_bf16, dequantize_f16, dequantize_f32
from ggtorch.quant.iquants import (
    dequantize_iq1_m,
    dequantize_iq1_s,
    dequantize_iq2_s,
    dequantize_iq2_xs,
    dequantize_iq2_xxs,
    dequantize_iq3_s,
    dequantize_iq3_xxs,
    dequantize_iq4_nl,
    dequantize_iq4_xs,
)
from ggtorch.quant.kquants import dequantize_q2_k, dequantize_q3_k, dequantize_q4_k, dequantize_q5_k, dequantize_q6_k
from ggtorch.quant.legacy import dequantize_q4_0, dequantize_q4_1, dequantize_q5_0, dequantize_q5_1, dequantize_q8_0
from ggtorch.quant.smallfloats import dequantize_mxfp4, dequantize_nvfp4, dequantize_tq1_0, dequantize_tq2_0

T = GGMLQuantizationType

DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    T.F32: dequantize_f32,
    T.F16: dequantize_f16,
    T.BF16: dequantize_bf16,
    T.Q4_0: dequantize_q4_0,
    T.Q4_1: dequantize_q4_1,
    T.Q5_0: dequantize_q5_0,
    T.Q5_1: dequantize_q5_1,
    T.Q8_0: dequantize_q8_0,
    T.Q2_K: dequantize_q2_k,
    T.Q3_K: dequantize_q3_k,
    T.Q4_K: dequantize_q4_k,
    T.Q5_K: dequantize_q5_k,
    T.Q6_K: dequantize_q6_k,
    T.IQ4_NL: dequantize_iq4_nl,
    T.IQ4_XS: dequantize_iq4_xs,
    T.IQ2_XXS: dequantize_iq2_xxs,
    T.IQ2_XS: dequantize_iq2_xs,
    T.IQ2_S: dequantize_iq2_s,
    T.IQ3_XXS: dequantize_iq3_xxs,
    T.IQ3_S: dequantize_iq3_s,
    T.IQ1_S: dequantize_iq1_s,
    T.IQ1_M: dequantize_iq1_m,
    T.TQ1_0: dequantize_tq1_0,
    T.TQ2_0: dequantize_tq2_0,
    T.MXFP4: dequantize_mxfp4,
    T.NVFP4: dequantize_nvfp4,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(DEQUANTIZERS)


def block_size(ggml_type: GGMLQuantizationType) -> int:
    """Values per block (1 for F32/F16/BF16, 32 for Q4_0, 256 for K-quants, ...)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][0]


def type_size(ggml_type: GGMLQuantizationType) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][1]


def row_nbytes(ggml_type: GGMLQuantizationType, n_cols: int) -> int:
    """Bytes of one row of ``n_cols`` values; ``n_cols`` must be a whole number of blocks."""
    qtype = GGMLQuantizationType(ggml_type)
    if not whole_blocks(qtype, (n_cols,)):
        raise ValueError(f"a row of {n_cols} values is not a whole number of "
                         f"{qtype.name} blocks of {block_size(qtype)}")
    return raw_nbytes(qtype, (n_cols,))


def _label(name: str | None) -> str:
    return f"tensor '{name}'" if name else "a tensor"


def _decoder(ggml_type: GGMLQuantizationType | int, name: str | None
             ) -> tuple[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]]:
    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise Unsupported(f"{_label(name)} has unknown ggml type {int(ggml_type)}; "
                          "the file needs a newer reader or is corrupt") from None
    fn = DEQUANTIZERS.get(qtype)
    if fn is None:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise Unsupported(f"{_label(name)} has ggml type {qtype.name}, which ggtorch cannot dequantize "
                          f"(supported: {supported}); requantize the model to one of these with llama-quantize")
    return qtype, fn


_compiled: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {}
_tables_built: set[tuple[GGMLQuantizationType, torch.device]] = set()


def compiled_decoder(ggml_type: GGMLQuantizationType, device: torch.device | str = "cpu"
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The type's decoder as one fused kernel (torch.compile) for blocks on ``device``: what
    :attr:`ggtorch.ops.policy.Policy.compiled_dequantize` devices decode with.

    Each type compiles its own function (torch.compile keeps one cache per function's code); a second block count
    recompiles it once for any count, torch's automatic dynamic shapes making the count, and only the count,
    symbolic (``dynamic=True`` would make the block's bytes symbolic too, where Inductor 2.13 misreads an f16
    field past the block's first bytes). The type's lookup tables are built on the device first, by the eager
    decoder on one block: a trace must find them made, as constants, not make them."""
    qtype = GGMLQuantizationType(ggml_type)
    where = torch.device(device)
    if (qtype, where) not in _tables_built:
        DEQUANTIZERS[qtype](torch.zeros(1, type_size(qtype), dtype=torch.uint8, device=where))
        _tables_built.add((qtype, where))
    fn = _compiled.get(qtype)
    if fn is None:
        fn = _compiled[qtype] = torch.compile(DEQUANTIZERS[qtype], fullgraph=True)
    return fn


def _native_cast(blocks: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...], step: int,
                 out: torch.Tensor) -> torch.Tensor:
    """Decode with the native library into ``out`` of a dtype it does not write (f16: ``native.OUT_DTYPES``),
    through one reused f32 chunk, so no f32 copy of a whole big tensor is ever made."""
    bs = block_size(qtype)
    rows = out.view(blocks.shape[0], bs)
    chunk = torch.empty(min(step, blocks.shape[0]), bs)
    for start in range(0, blocks.shape[0], step):
        part = blocks[start:start + step]
        rows[start:start + step] = native.decode(part, qtype, chunk[:part.shape[0]])
    return out.view(shape)


def dequantize(raw: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32, name: str | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode whole rows of ggml blocks into a ``shape`` tensor of ``dtype`` on ``raw.device``.

    ``raw`` is uint8 of any leading shape holding exactly the tensor's bytes. Values are
    computed in f32 and cast to ``dtype`` at the end. The result owns its memory (never a
    view of ``raw``, even for F32). ``out``: a contiguous tensor of ``dtype`` on that device
    with as many elements, written and returned (reshaped) instead of new memory.
    """
    qtype, fn = _decoder(ggml_type, name)
    shape = tuple(int(n) for n in shape)
    check_raw(raw, qtype, shape, name)
    bs, ts = GGML_QUANT_SIZES[qtype]
    n_values = math.prod(shape)
    if out is not None:
        if out.dtype != dtype or out.device != raw.device or out.numel() != n_values or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {dtype} tensor of {n_values} values on {raw.device}, "
                             f"not {out.dtype} {tuple(out.shape)} on {out.device}")
    if n_values == 0:
        return torch.empty(shape, dtype=dtype, device=raw.device) if out is None else out.view(shape)
    n_blocks = n_values // bs
    blocks = raw.reshape(n_blocks, ts)
    device_policy = policy.current(raw.device)
    step = max(1, device_policy.decode_step_values // bs)
    if device_policy.compiled_dequantize and bs > 1:
        fn = compiled_decoder(qtype, raw.device)
    if native.decodes(blocks, qtype):
        result = torch.empty(shape, dtype=dtype) if out is None else out
        if dtype in native.OUT_DTYPES:  # one pass straight into the result, no temporaries to bound
            return native.decode(blocks, qtype, result).view(shape)
        return _native_cast(blocks, qtype, shape, step, result)
    if out is None and bs == 1:  # float types: one conversion pass, nothing to chunk; copy=True so
        # the result never aliases raw (an in-place update must not write into a module's buffer)
        return fn(blocks).reshape(shape).to(dtype, copy=True)
    if out is None and n_blocks <= step:
        return fn(blocks).reshape(shape).to(dtype)
    if out is None:
        out = torch.empty((n_blocks, bs), dtype=dtype, device=raw.device)
    rows = out.view(n_blocks, bs)
    for start in range(0, n_blocks, step):
        rows[start:start + step] = fn(blocks[start:start + step])
    return out.view(shape)

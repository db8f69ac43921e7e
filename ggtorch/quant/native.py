"""One-pass CPU decoders (``native.c``) for Q4_0, Q8_0, Q4_K, Q5_K and Q6_K, built on first use.

A quantized base is decoded chunk by chunk in every forward and backward, right after matrix
products that have filled the caches with other data. The torch decoders take several passes over
each chunk (widen, subtract, scale: each its own kernel, each reading and writing the f32 chunk);
the C loops read a block once and write each value once, in f32 or rounded to bf16 as torch rounds
(the compute dtype of ``--dtype bf16``). They mirror ggml's scalar
``dequantize_row_*`` and give the same values bit for bit (tests/quant/test_native.py checks them
against the torch decoders and llama.cpp).

The library is built on first use and loaded by :mod:`ggtorch.ops.clib` (the system's C compiler,
this CPU, torch's own OpenMP threads). Without a compiler, or on any other device,
:func:`ggtorch.quant.dequantize` keeps the torch decoders, which give the same values.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggtorch.ops import clib, policy

log = logging.getLogger(__name__)

TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                   GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K})
"""The types ``native.c`` decodes (its TYPES table): known without building it, and checked against the
library by :func:`native_types`."""

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-ffp-contract=off")
"""Compiler flags besides those :func:`ggtorch.ops.clib.load` adds (the CPU's, OpenMP's, -fPIC): no product
and sum contracted into an FMA, so every value is computed as ggml's scalar code computes it."""


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built library, building it first when needed; None when there is no compiler or it fails."""
    return clib.load_declared(SOURCE, FLAGS)


@functools.cache
def native_types() -> frozenset[GGMLQuantizationType]:
    """The ggml types the C library decodes here (empty when it cannot be built)."""
    lib = _library()
    if lib is None:
        return frozenset()
    ids = (ctypes.c_int * 16)()
    n = lib.ggtorch_native_types(ctypes.addressof(ids), len(ids))
    built = frozenset(GGMLQuantizationType(ids[i]) for i in range(min(n, len(ids))))
    if built != TYPES:  # native.c's table and TYPES disagree: trust neither
        log.info("ggtorch: %s decodes %s, not %s; quantized matrices decode through torch", SOURCE.name,
                 sorted(t.name for t in built), sorted(t.name for t in TYPES))
        return frozenset()
    return built


_decoded: frozenset[int] | None = None


def decodes_type(ggml_type: GGMLQuantizationType) -> bool:
    """Whether the library (built here) decodes ``ggml_type``. Asked once: a module global, which torch.compile
    reads as a constant."""
    global _decoded
    if _decoded is None:
        _decoded = frozenset(int(t) for t in native_types())
    return int(ggml_type) in _decoded


def decodes(blocks: torch.Tensor, ggml_type: GGMLQuantizationType) -> bool:
    """Whether :func:`decode` takes these blocks: CPU bytes in one piece whose policy decodes in C, a type the
    library has."""
    return (blocks.device.type == "cpu" and policy.current(blocks.device).c_dequantize and blocks.dtype == torch.uint8
            and blocks.is_contiguous() and decodes_type(ggml_type))


OUT_DTYPES = (torch.float32, torch.bfloat16)
"""What the library writes: f32, or bf16 rounded from it to nearest even, as ``.to(torch.bfloat16)`` rounds."""


def decode(blocks: torch.Tensor, ggml_type: GGMLQuantizationType, out: torch.Tensor) -> torch.Tensor:
    """Decode ``blocks`` ((n_blocks, type_size) uint8, :func:`decodes` true) into ``out``, a contiguous
    f32 or bf16 CPU tensor of n_blocks × block size values, on torch's intra-op thread count; returns ``out``."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if blocks.dim() != 2 or blocks.shape[1] != type_size:
        raise ValueError(f"blocks must be (n_blocks, {type_size}) for {ggml_type.name}, not {tuple(blocks.shape)}")
    if (out.dtype not in OUT_DTYPES or out.device.type != "cpu" or not out.is_contiguous()
            or out.numel() != blocks.shape[0] * block_size):
        raise ValueError(f"out must be a contiguous float32 or bfloat16 CPU tensor of {blocks.shape[0] * block_size} "
                         "values")
    dequantize_(blocks, int(ggml_type), out)
    return out


# native.c's decoders as a torch op (what torch.compile and FakeTensor see), registered with torch.library's
# define/impl (a torch.library.custom_op would import torch._dynamo on its first call)
torch.library.define("ggtorch::dequantize_", "(Tensor blocks, int ggml_type, Tensor(a!) out) -> ()")


@torch.library.impl("ggtorch::dequantize_", "cpu")
def _dequantize_cpu(blocks: torch.Tensor, ggml_type: int, out: torch.Tensor) -> None:
    lib = _library()
    assert lib is not None
    if lib.ggtorch_dequantize(ggml_type, blocks.data_ptr(), out.data_ptr(), blocks.shape[0], torch.get_num_threads(),
                              out.dtype == torch.bfloat16) != 0:
        raise ValueError(f"the native decoders have no {GGMLQuantizationType(ggml_type).name}")
    clib.written(out)


@torch.library.register_fake("ggtorch::dequantize_")
def _(blocks: torch.Tensor, ggml_type: int, out: torch.Tensor) -> None:
    return None


dequantize_ = torch.ops.ggtorch.dequantize_.default
"""``out`` takes the values of ``blocks`` (checked by :func:`decode`)."""

"""Full models back to GGUF: a base's (or a new model's) metadata plus float tensors, each stored as
``--outtype``: f32, f16, bf16, or one of the legacy block types gguf-py's numpy quantizer writes
(q8_0, q4_0, q4_1, q5_0, q5_1). Norms stay F32 (llama.cpp keeps 1-D tensors F32), and a matrix
whose rows do not divide into blocks falls back to F16, as llama.cpp's quantizer falls back for
such rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, Keys, LlamaFileType
from gguf import quants as gguf_quants

from ggtorch.errors import BadFlag
from ggtorch.io.gguf import TensorOut, write_gguf

Q = GGMLQuantizationType
OUTTYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (Q.F32, LlamaFileType.ALL_F32),
    "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (Q.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q5_0": (Q.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "q5_1": (Q.Q5_1, LlamaFileType.MOSTLY_Q5_1),
}
"""--outtype -> (ggml type of the matrices, general.file_type)."""


def _encode(t: torch.Tensor, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """Raw GGUF bytes (or an f32/f16 array) of ``t`` as ``ggml_type``."""
    arr = t.detach().to("cpu", torch.float32).contiguous().numpy()
    if ggml_type == Q.F32:
        return arr
    if ggml_type == Q.F16:
        return arr.astype(np.float16)
    return gguf_quants.quantize(arr, ggml_type)


def tensor_type(name: str, shape: tuple[int, ...], outtype: str) -> GGMLQuantizationType:
    """Type a tensor is written as: norms F32, matrices ``outtype`` (F16 if rows do not block)."""
    wanted = OUTTYPES[outtype][0]
    if len(shape) < 2:
        return Q.F32
    block = GGML_QUANT_SIZES[wanted][0]
    return wanted if shape[-1] % block == 0 else Q.F16


def write_model(path: str | os.PathLike[str], metadata: dict[str, Any], value_types: dict[str, Any],
                tensors: dict[str, torch.Tensor], outtype: str = "f32") -> Path:
    """Write a llama GGUF llama.cpp loads: ``metadata`` (a base's or new_metadata's) + ``tensors``.

    ``general.file_type`` is set from ``outtype``; every other key is kept with its GGUF type.
    """
    if outtype not in OUTTYPES:
        raise BadFlag(f"--outtype must be one of {', '.join(OUTTYPES)}, got '{outtype}'")
    meta = dict(metadata)
    meta[Keys.General.FILE_TYPE] = int(OUTTYPES[outtype][1])
    types = {k: v for k, v in value_types.items() if k != Keys.General.FILE_TYPE}
    outs = []
    for name, t in tensors.items():
        ggml_type = tensor_type(name, tuple(t.shape), outtype)
        outs.append(TensorOut(name, ggml_type, tuple(t.shape), _encode(t, ggml_type)))
    write_gguf(path, str(metadata[Keys.General.ARCHITECTURE]), meta, outs, value_types=types)
    return Path(path)


def ggml_n_dims(shape: tuple[int, ...]) -> int:
    """``ggml_n_dims`` of a tensor of torch-order ``shape``: trailing size-1 ggml axes do not count."""
    ne = list(reversed(shape)) or [1]
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n

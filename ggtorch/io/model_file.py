"""Full models back to GGUF: a base's (or a new model's) metadata plus float tensors, each stored as
``--outtype``: f32, f16, bf16, or one of the legacy block types gguf-py's numpy quantizer writes
(q8_0, q4_0, q4_1, q5_0, q5_1). What llama.cpp's quantizer leaves F32 stays F32 (its
``tensor_allows_quantization``): 1-D tensors, tensors not named ``*.weight`` (gpt-oss's 2-D expert
biases) and MoE routers (``ffn_gate_inp``). A matrix whose rows do not divide into blocks falls back to
F16, as llama.cpp's quantizer falls back for such rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType, Keys, LlamaFileType

from ggtorch.errors import BadFlag
from ggtorch.io.encode import encode
from ggtorch.io.gguf import TensorOut, write_gguf

Q = GGMLQuantizationType
FILE_TYPES: dict[GGMLQuantizationType, LlamaFileType] = {
    Q.F32: LlamaFileType.ALL_F32,
    Q.F16: LlamaFileType.MOSTLY_F16,
    Q.BF16: LlamaFileType.MOSTLY_BF16,
    Q.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    Q.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    Q.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    Q.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    Q.Q5_1: LlamaFileType.MOSTLY_Q5_1,
}
"""Matrix type -> ``general.file_type`` of a model whose matrices are of that type, for the types
a whole model is written in (in --outtype's order)."""

OUTTYPES: dict[str, GGMLQuantizationType] = {t.name.lower(): t for t in FILE_TYPES}
"""--outtype -> ggml type of the matrices."""


def write_model(path: str | os.PathLike[str], metadata: dict[str, Any], value_types: dict[str, Any],
                tensors: dict[str, torch.Tensor], outtype: str = "f32") -> Path:
    """Write a GGUF model llama.cpp loads: ``metadata`` (a base's or new_metadata's) + ``tensors``.

    ``general.file_type`` is set from ``outtype``; every other key is kept with its GGUF type.
    """
    if outtype not in OUTTYPES:
        raise BadFlag(f"--outtype must be one of {', '.join(OUTTYPES)}, got '{outtype}'")
    meta = dict(metadata)
    meta[Keys.General.FILE_TYPE] = int(FILE_TYPES[OUTTYPES[outtype]])
    types = {k: v for k, v in value_types.items() if k != Keys.General.FILE_TYPE}
    outs = []
    for name, t in tensors.items():
        wanted = OUTTYPES[outtype] if _quantizable(name, t) else Q.F32
        ggml_type, data = encode(t, wanted, name=name, fallback=True)
        outs.append(TensorOut(name, ggml_type, tuple(t.shape), data))
    write_gguf(path, str(metadata[Keys.General.ARCHITECTURE]), meta, outs, value_types=types)
    return Path(path)


def _quantizable(name: str, t: torch.Tensor) -> bool:
    """Whether --outtype applies to a tensor, by llama.cpp's rules (see the module docstring)."""
    return t.dim() >= 2 and name.endswith(".weight") and "ffn_gate_inp." not in name


def ggml_n_dims(shape: tuple[int, ...]) -> int:
    """``ggml_n_dims`` of a tensor of torch-order ``shape``: trailing size-1 ggml axes do not count."""
    ne = list(reversed(shape)) or [1]
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n

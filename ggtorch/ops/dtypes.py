"""The float dtypes ggtorch computes and holds weights in, under the names flags and files use."""

from __future__ import annotations

from typing import Literal

import torch

DTypeName = Literal["f32", "bf16", "f16"]

DTYPES: dict[str, torch.dtype] = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
"""--dtype / --base-dtype / adapter and PEFT dtypes -> torch dtype."""


def dtype_name(dtype: torch.dtype) -> str:
    """The flag name of a torch float dtype (``torch.bfloat16`` -> ``"bf16"``)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"{dtype} is not one of ggtorch's float dtypes ({', '.join(DTYPES)})")

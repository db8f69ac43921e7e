"""Whole models written back to GGUF (``ggtorch train --model-out --outtype``): which tensors take the type."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ggtorch.io.gguf import read_gguf
from ggtorch.io.model_file import write_model
from ggtorch.quant import dequantize
from tests.llama_models import llama_cpp_logits, open_llama_cpp
from tests.models.test_families import ggtorch_logits, tokens_for
from tests.models.test_model import TOLERANCE


def test_outtype_leaves_f32_what_llama_cpps_quantizer_leaves_f32(family_model: Callable[..., Path],
                                                                 tmp_path: Path) -> None:
    """--outtype q8_0 of a gpt-oss model: matrices and expert stacks become Q8_0; its 2-D expert biases, routers,
    sinks and norms stay F32, as llama.cpp's quantizer leaves them; llama.cpp runs the file as ggtorch does."""
    base = read_gguf(family_model("gpt_oss"))
    tensors = {name: dequantize(info.raw(), info.ggml_type, info.shape) for name, info in base.tensors.items()}
    out = write_model(tmp_path / "q8.gguf", base.metadata, base.value_types, tensors, "q8_0")
    types = {name: info.ggml_type.name for name, info in read_gguf(out).tensors.items()}
    for name, ggml_type in types.items():
        quantized = name.endswith(".weight") and len(base.tensors[name].shape) >= 2 and "ffn_gate_inp" not in name
        assert ggml_type == ("Q8_0" if quantized else "F32"), name
    assert types["blk.0.ffn_up_exps.bias"] == "F32" and types["blk.0.ffn_up_exps.weight"] == "Q8_0"
    tokens = tokens_for(out)
    ours, theirs = ggtorch_logits(out, tokens), llama_cpp_logits(open_llama_cpp(out, 64), tokens)
    assert np.abs(ours - theirs).max() <= TOLERANCE["Q8_0"]

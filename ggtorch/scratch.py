"""New llama models and trained llamas back to GGUF: what ``ggtorch train`` starts from and writes.

A new model takes its vocabulary and every ``tokenizer.*`` key from a vocabulary GGUF and is
initialized as llama.cpp's old ``train-text-from-scratch`` did (``randomize_model``): one
``std::mt19937(seed)`` and one ``std::normal_distribution<float>(0, 1)`` fill every tensor,
each value clamped to [-1, 1], in the order token_embd, output_norm, output, then per layer
attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_down, ffn_up, each in
ggml memory order (= torch row-major). The norms are random too, as they were there. The
output is untied (the old program had its own ``output`` tensor).

Writing keeps a base file's metadata (or the new model's) and stores each tensor as
``--outtype``: f32, f16, bf16, or one of the legacy block types gguf-py's numpy quantizer
writes (q8_0, q4_0, q4_1, q5_0, q5_1). Norms stay F32 (llama.cpp keeps 1-D tensors F32),
and a matrix whose rows do not divide into blocks falls back to F16, as llama.cpp's
quantizer falls back for such rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, Keys, LlamaFileType
from gguf import quants as gguf_quants

from .errors import BadFlag, BadGGUF
from .gguf_io import GGUFFile, TensorOut, write_gguf
from .lora import libstdcpp_normal
from .models import names
from .models.config import ARCH, LlamaConfig
from .models.loader import expected_shapes
from .mt19937 import MT19937

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

INIT_ORDER: tuple[str, ...] = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                               "ffn_norm", "ffn_gate", "ffn_down", "ffn_up")
"""Per-layer order in which randomize_model filled the tensors."""


def new_config(vocab: GGUFFile, *, n_embd: int, n_ff: int, n_head: int, n_head_kv: int, n_layer: int,
               n_ctx: int, rms_eps: float = 1e-5, rope_freq_base: float = 10000.0,
               rope_freq_scale: float = 1.0) -> LlamaConfig:
    """The LlamaConfig of a new model over ``vocab``'s tokens (untied output, like the old program)."""
    tokens = vocab.get(Keys.Tokenizer.LIST)
    if not tokens:
        raise BadGGUF(f"{vocab.path}: no '{Keys.Tokenizer.LIST}' in it; --vocab-model needs a GGUF with a tokenizer")
    try:
        return LlamaConfig(n_vocab=len(tokens), n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                           n_head_kv=n_head_kv, n_ff=n_ff, n_ctx_train=n_ctx, rms_eps=rms_eps,
                           rope_freq_base=rope_freq_base, rope_freq_scale=rope_freq_scale)
    except (BadGGUF, ValueError) as e:
        raise BadFlag(f"the new model's shape is invalid: {e} (check --embd/--head/--head-kv/--layer/--ff)") from None


EXACT_INIT_MAX = 1 << 22
"""Up to this many values the init is libstdc++'s exact stream; the Python port of it (C logf
per value) is too slow beyond, where a seeded torch normal with the same clamp is used."""


INITS = ("ggml", "scaled")
"""--init: ``ggml`` is the old program's (reproducible with it); ``scaled`` learns far faster."""


def init_tensors(config: LlamaConfig, seed: int, init: str = "ggml") -> dict[str, torch.Tensor]:
    """GGUF name -> f32 tensor of a new model.

    ``ggml``: filled as train-text-from-scratch's randomize_model did, bit-exact with the old
    program's stream for models up to EXACT_INIT_MAX values; larger ones draw the same
    distribution (normal(0, 1) clamped to [-1, 1]) from torch. ``scaled``: GPT-2's init,
    normal(0, 0.02) matrices with the residual projections (attn_output, ffn_down) scaled by
    1/sqrt(2 n_layer) and norms at 1, which trains in a fraction of the steps.
    """
    if init == "scaled":
        return _scaled_init(config, seed)
    if init != "ggml":
        raise BadFlag(f"--init must be one of {', '.join(INITS)}, got '{init}'")
    shapes = expected_shapes(config)
    order = [names.gguf_name("token_embd"), names.gguf_name("output_norm"), names.gguf_name("output")]
    order += [names.gguf_name(kind, bid) for bid in range(config.n_layer) for kind in INIT_ORDER]
    counts = [int(np.prod(shapes[n])) for n in order]
    if sum(counts) <= EXACT_INIT_MAX:
        normal = libstdcpp_normal(MT19937(seed & 0xFFFFFFFF), sum(counts))
    else:
        normal = torch.randn(sum(counts), generator=torch.Generator().manual_seed(seed)).numpy()
    values = np.clip(normal, np.float32(-1), np.float32(1))
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, count in zip(order, counts, strict=True):
        out[name] = torch.from_numpy(values[offset:offset + count].astype(np.float32).reshape(shapes[name]))
        offset += count
    return out


def _scaled_init(config: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / (2 * config.n_layer) ** 0.5
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape)
            continue
        kind = names.parse_gguf_name(name)
        std = residual_std if kind is not None and kind[0] in ("attn_output", "ffn_down") else 0.02
        out[name] = torch.randn(shape, generator=generator) * std
    return out


def new_metadata(vocab: GGUFFile, config: LlamaConfig, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, value_types) of a new llama: its hyperparameters plus ``vocab``'s tokenizer keys."""
    def k(template: str) -> str:
        return template.format(arch=ARCH)

    meta: dict[str, Any] = {
        Keys.General.NAME: name,
        k(Keys.LLM.CONTEXT_LENGTH): config.n_ctx_train,
        k(Keys.LLM.EMBEDDING_LENGTH): config.n_embd,
        k(Keys.LLM.BLOCK_COUNT): config.n_layer,
        k(Keys.LLM.FEED_FORWARD_LENGTH): config.n_ff,
        k(Keys.Attention.HEAD_COUNT): config.n_head,
        k(Keys.Attention.HEAD_COUNT_KV): config.n_head_kv,
        k(Keys.Rope.DIMENSION_COUNT): config.n_rot,
        k(Keys.Attention.LAYERNORM_RMS_EPS): float(config.rms_eps),
        k(Keys.Rope.FREQ_BASE): float(config.rope_freq_base),
        k(Keys.LLM.VOCAB_SIZE): config.n_vocab,
    }
    if config.rope_freq_scale != 1.0:
        meta[k(Keys.Rope.SCALING_TYPE)] = "linear"
        meta[k(Keys.Rope.SCALING_FACTOR)] = 1.0 / config.rope_freq_scale
    types: dict[str, Any] = {}
    for key, value in vocab.metadata.items():
        if key.startswith("tokenizer."):
            meta[key] = value
            types[key] = vocab.value_types[key]
    return meta, types


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
    write_gguf(path, ARCH, meta, outs, value_types=types)
    return Path(path)


def write_new_model(path: str | os.PathLike[str], vocab: GGUFFile, config: LlamaConfig, seed: int,
                    name: str = "ggtorch scratch", init: str = "ggml") -> Path:
    """A freshly initialized F32 model of ``config`` over ``vocab``'s tokenizer, written to ``path``."""
    meta, types = new_metadata(vocab, config, name)
    return write_model(path, meta, types, init_tensors(config, seed, init), "f32")


def ggml_n_dims(shape: tuple[int, ...]) -> int:
    """``ggml_n_dims`` of a tensor of torch-order ``shape``: trailing size-1 ggml axes do not count."""
    ne = list(reversed(shape)) or [1]
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n


def full_trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, int]]:
    """Every float weight of a Llama made trainable: (GGUF name, parameter, ggml n_dims).

    Each weight gets its own memory first (a loaded F32 weight can be a view of the model
    file's mapping). A tied output shares token_embd's Parameter and is listed once.
    """
    out = []
    for path, p in model.named_parameters():
        if not p.is_floating_point():
            raise BadFlag(f"'{path}' is not a float weight; full training needs an F32/F16/BF16 model")
        p.data = p.data.clone()
        p.requires_grad_(True)
        out.append((names.module_to_gguf(path.removesuffix(".weight")), p, ggml_n_dims(tuple(p.shape))))
    return out

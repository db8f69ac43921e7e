"""New llama models: what ``ggtorch train`` starts from (the writer is ggtorch.io.model_file).

A new model takes its vocabulary and every ``tokenizer.*`` key from a vocabulary GGUF and is
initialized as llama.cpp's old ``train-text-from-scratch`` did (``randomize_model``): one
``std::mt19937(seed)`` and one ``std::normal_distribution<float>(0, 1)`` fill every tensor,
each value clamped to [-1, 1], in the order token_embd, output_norm, output, then per layer
attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_down, ffn_up, each in
ggml memory order (= torch row-major). The norms are random too, as they were there. The
output is untied (the old program had its own ``output`` tensor).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import Keys

from ggtorch.errors import BadFlag, BadGGUF
from ggtorch.io.gguf import GGUFFile
from ggtorch.io.model_file import write_model
from ggtorch.models import names
from ggtorch.models.config import ARCH, ModelConfig
from ggtorch.models.loader import expected_shapes
from ggtorch.rng import MT19937, libstdcpp_normal

INIT_ORDER: tuple[str, ...] = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                               "ffn_norm", "ffn_gate", "ffn_down", "ffn_up")
"""Per-layer order in which randomize_model filled the tensors."""


def new_config(vocab: GGUFFile, *, n_embd: int, n_ff: int, n_head: int, n_head_kv: int, n_layer: int,
               n_ctx: int, rms_eps: float = 1e-5, rope_freq_base: float = 10000.0,
               rope_freq_scale: float = 1.0) -> ModelConfig:
    """The ModelConfig of a new model over ``vocab``'s tokens (untied output, like the old program)."""
    tokens = vocab.get(Keys.Tokenizer.LIST)
    if not tokens:
        raise BadGGUF(f"{vocab.path}: no '{Keys.Tokenizer.LIST}' in it; --vocab-model needs a GGUF with a tokenizer")
    try:
        return ModelConfig(n_vocab=len(tokens), n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                           n_head_kv=n_head_kv, n_ff=n_ff, n_ctx_train=n_ctx, rms_eps=rms_eps,
                           rope_freq_base=rope_freq_base, rope_freq_scale=rope_freq_scale)
    except (BadGGUF, ValueError) as e:
        raise BadFlag(f"the new model's shape is invalid: {e} (check --embd/--head/--head-kv/--layer/--ff)") from None


EXACT_INIT_MAX = 1 << 22
"""Up to this many values the init is libstdc++'s exact stream; the Python port of it (C logf
per value) is too slow beyond, where a seeded torch normal with the same clamp is used."""


INITS = ("ggml", "scaled")
"""--init: ``ggml`` is the old program's (reproducible with it); ``scaled`` learns far faster."""


def init_tensors(config: ModelConfig, seed: int, init: str = "ggml") -> dict[str, torch.Tensor]:
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


def _scaled_init(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
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


def new_metadata(vocab: GGUFFile, config: ModelConfig, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, value_types) of a new llama: its hyperparameters plus ``vocab``'s tokenizer keys."""
    def k(template: str) -> str:
        return template.format(arch=ARCH)

    meta: dict[str, Any] = {
        Keys.General.ARCHITECTURE: ARCH,
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


def write_new_model(path: str | os.PathLike[str], vocab: GGUFFile, config: ModelConfig, seed: int,
                    name: str = "ggtorch scratch", init: str = "ggml") -> Path:
    """A freshly initialized F32 model of ``config`` over ``vocab``'s tokenizer, written to ``path``."""
    meta, types = new_metadata(vocab, config, name)
    return write_model(path, meta, types, init_tensors(config, seed, init), "f32")

"""GGUF tensor names <-> module paths of ggtorch's Transformer, as plain dicts.

``{bid}`` is the layer placeholder. The GGUF side follows gguf-py's ``TENSOR_NAMES`` (checked in
the tests), with the ``.weight`` or ``.bias`` suffix. One map serves every family: a family's file
holds the subset its row in models/families.py allows. A bias is a parameter next to its matrix
(``layers.{bid}.attn.q_bias``), so the matrix stays a bias-free Linear that LoRA and the quantized
products handle alike.
"""

from __future__ import annotations

import re

# tensor kind -> (GGUF name, module path). Kinds are the old finetune's names for them.
TENSOR_KINDS: dict[str, tuple[str, str]] = {
    "token_embd": ("token_embd.weight", "tok_embd"),
    "output_norm": ("output_norm.weight", "output_norm"),
    "output": ("output.weight", "output"),
    "attn_norm": ("blk.{bid}.attn_norm.weight", "layers.{bid}.attn_norm"),
    "attn_q": ("blk.{bid}.attn_q.weight", "layers.{bid}.attn.q"),
    "attn_k": ("blk.{bid}.attn_k.weight", "layers.{bid}.attn.k"),
    "attn_v": ("blk.{bid}.attn_v.weight", "layers.{bid}.attn.v"),
    "attn_output": ("blk.{bid}.attn_output.weight", "layers.{bid}.attn.o"),
    "ffn_norm": ("blk.{bid}.ffn_norm.weight", "layers.{bid}.ffn_norm"),
    "ffn_gate": ("blk.{bid}.ffn_gate.weight", "layers.{bid}.ffn.gate"),
    "ffn_down": ("blk.{bid}.ffn_down.weight", "layers.{bid}.ffn.down"),
    "ffn_up": ("blk.{bid}.ffn_up.weight", "layers.{bid}.ffn.up"),
    "attn_qkv": ("blk.{bid}.attn_qkv.weight", "layers.{bid}.attn.qkv"),
    "attn_q_norm": ("blk.{bid}.attn_q_norm.weight", "layers.{bid}.attn.q_norm"),
    "attn_k_norm": ("blk.{bid}.attn_k_norm.weight", "layers.{bid}.attn.k_norm"),
    "attn_post_norm": ("blk.{bid}.post_attention_norm.weight", "layers.{bid}.attn_post_norm"),
    "ffn_post_norm": ("blk.{bid}.post_ffw_norm.weight", "layers.{bid}.ffn_post_norm"),
    "ffn_gate_inp": ("blk.{bid}.ffn_gate_inp.weight", "layers.{bid}.ffn.router"),
    "ffn_gate_exps": ("blk.{bid}.ffn_gate_exps.weight", "layers.{bid}.ffn.gate_exps"),
    "ffn_down_exps": ("blk.{bid}.ffn_down_exps.weight", "layers.{bid}.ffn.down_exps"),
    "ffn_up_exps": ("blk.{bid}.ffn_up_exps.weight", "layers.{bid}.ffn.up_exps"),
    "ffn_gate_inp_shexp": ("blk.{bid}.ffn_gate_inp_shexp.weight", "layers.{bid}.ffn.shared_gate"),
    "ffn_gate_shexp": ("blk.{bid}.ffn_gate_shexp.weight", "layers.{bid}.ffn.shared.gate"),
    "ffn_down_shexp": ("blk.{bid}.ffn_down_shexp.weight", "layers.{bid}.ffn.shared.down"),
    "ffn_up_shexp": ("blk.{bid}.ffn_up_shexp.weight", "layers.{bid}.ffn.shared.up"),
    "output_bias": ("output.bias", "output_bias"),
    "attn_q_bias": ("blk.{bid}.attn_q.bias", "layers.{bid}.attn.q_bias"),
    "attn_k_bias": ("blk.{bid}.attn_k.bias", "layers.{bid}.attn.k_bias"),
    "attn_v_bias": ("blk.{bid}.attn_v.bias", "layers.{bid}.attn.v_bias"),
    "attn_qkv_bias": ("blk.{bid}.attn_qkv.bias", "layers.{bid}.attn.qkv_bias"),
    "attn_output_bias": ("blk.{bid}.attn_output.bias", "layers.{bid}.attn.o_bias"),
    "ffn_gate_bias": ("blk.{bid}.ffn_gate.bias", "layers.{bid}.ffn.gate_bias"),
    "ffn_up_bias": ("blk.{bid}.ffn_up.bias", "layers.{bid}.ffn.up_bias"),
    "ffn_down_bias": ("blk.{bid}.ffn_down.bias", "layers.{bid}.ffn.down_bias"),
    "ffn_gate_inp_bias": ("blk.{bid}.ffn_gate_inp.bias", "layers.{bid}.ffn.router_bias"),
    "ffn_gate_exps_bias": ("blk.{bid}.ffn_gate_exps.bias", "layers.{bid}.ffn.gate_exps_bias"),
    "ffn_up_exps_bias": ("blk.{bid}.ffn_up_exps.bias", "layers.{bid}.ffn.up_exps_bias"),
    "ffn_down_exps_bias": ("blk.{bid}.ffn_down_exps.bias", "layers.{bid}.ffn.down_exps_bias"),
    "attn_sinks": ("blk.{bid}.attn_sinks.weight", "layers.{bid}.attn.sinks"),
    # Gated DeltaNet layers (qwen35): their mixer sits where attention does; attn_qkv is its fused q/k/v
    "attn_gate": ("blk.{bid}.attn_gate.weight", "layers.{bid}.attn.gate"),
    "ssm_beta": ("blk.{bid}.ssm_beta.weight", "layers.{bid}.attn.beta"),
    "ssm_alpha": ("blk.{bid}.ssm_alpha.weight", "layers.{bid}.attn.alpha"),
    "ssm_out": ("blk.{bid}.ssm_out.weight", "layers.{bid}.attn.out"),
    "ssm_norm": ("blk.{bid}.ssm_norm.weight", "layers.{bid}.attn.norm"),
    "ssm_conv1d": ("blk.{bid}.ssm_conv1d.weight", "layers.{bid}.attn.conv"),
    "ssm_dt": ("blk.{bid}.ssm_dt.bias", "layers.{bid}.attn.dt_bias"),
    "ssm_a": ("blk.{bid}.ssm_a", "layers.{bid}.attn.a"),
    # gemma4: per-layer embeddings (E2B/E4B), the MoE layer's dense MLP beside its experts, a scale per layer
    "per_layer_token_embd": ("per_layer_token_embd.weight", "per_layer_tok_embd"),
    "per_layer_model_proj": ("per_layer_model_proj.weight", "per_layer_model_proj"),
    "per_layer_proj_norm": ("per_layer_proj_norm.weight", "per_layer_proj_norm"),
    "per_layer_inp_gate": ("blk.{bid}.inp_gate.weight", "layers.{bid}.inp_gate"),
    "per_layer_proj": ("blk.{bid}.proj.weight", "layers.{bid}.proj"),
    "per_layer_post_norm": ("blk.{bid}.post_norm.weight", "layers.{bid}.post_norm"),
    "ffn_pre_norm_2": ("blk.{bid}.pre_ffw_norm_2.weight", "layers.{bid}.ffn.pre_norm_2"),
    "ffn_post_norm_1": ("blk.{bid}.post_ffw_norm_1.weight", "layers.{bid}.ffn.post_norm_1"),
    "ffn_post_norm_2": ("blk.{bid}.post_ffw_norm_2.weight", "layers.{bid}.ffn.post_norm_2"),
    "ffn_gate_up_exps": ("blk.{bid}.ffn_gate_up_exps.weight", "layers.{bid}.ffn.gate_up_exps"),
    "ffn_gate_inp_scale": ("blk.{bid}.ffn_gate_inp.scale", "layers.{bid}.ffn.router_scale"),
    "ffn_down_exps_scale": ("blk.{bid}.ffn_down_exps.scale", "layers.{bid}.ffn.down_exps.scale"),
    "layer_output_scale": ("blk.{bid}.layer_output_scale.weight", "layers.{bid}.out_scale"),
}

ROPE_FREQS = "rope_freqs.weight"
"""Optional rope frequency factors (Llama 3.1+): a buffer ``rope_freqs`` of the model, not a
trainable kind, so it is not in TENSOR_KINDS."""
ROPE_FACTORS_LONG = "rope_factors_long.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
"""LongRoPE's divisors (phi3) for contexts above / up to the original context: buffers too."""
ROPE_BUFFERS: dict[str, str] = {ROPE_FREQS: "rope_freqs", ROPE_FACTORS_LONG: "rope_factors_long",
                                ROPE_FACTORS_SHORT: "rope_factors_short"}
"""GGUF name -> buffer of the model, for the rope tensors that are data, not weights."""

GGUF_TO_MODULE: dict[str, str] = {gguf: module for gguf, module in TENSOR_KINDS.values()}
MODULE_TO_GGUF: dict[str, str] = {module: gguf for gguf, module in TENSOR_KINDS.values()}

LAYER_KINDS: tuple[str, ...] = tuple(k for k, (g, _) in TENSOR_KINDS.items() if "{bid}" in g)
"""Kinds that occur once per block."""
NORM_KINDS: tuple[str, ...] = ("attn_norm", "ffn_norm", "output_norm", "attn_q_norm", "attn_k_norm",
                               "attn_post_norm", "ffn_post_norm", "ssm_norm", "per_layer_proj_norm",
                               "per_layer_post_norm", "ffn_pre_norm_2", "ffn_post_norm_1", "ffn_post_norm_2")
"""RMS norm gains: 1-D, always kept in float."""
BIAS_KINDS: tuple[str, ...] = tuple(k for k in TENSOR_KINDS if k.endswith("_bias"))
"""Biases: 1-D, or (n_expert, out) for an expert stack's; always kept in float;
``bias_of("attn_q") == "attn_q_bias"``."""
VECTOR_KINDS: tuple[str, ...] = BIAS_KINDS + ("ffn_gate_inp_shexp", "attn_sinks", "ssm_conv1d", "ssm_dt", "ssm_a",
                                              "ffn_gate_inp_scale", "ffn_down_exps_scale", "layer_output_scale")
"""Parameters that are no matrix product's weight and no norm gain: biases, qwen2moe's shared-expert gate (llama.cpp
multiplies it with the hidden state as a one-row matrix; it is never quantized), gpt-oss's attention sinks, and a
Gated DeltaNet's short convolution kernel, time-step bias and decay rates (llama.cpp's ssm_conv, add and mul: never
adapted), and gemma4's router input scale, per-expert output scale and per-layer output scale (ggml_mul); kept in
float."""
EMBEDDING_KINDS: tuple[str, ...] = ("token_embd", "per_layer_token_embd")
"""Tables read by row (gemma4's per-layer table too): embeddings, not products."""
EXPERT_KINDS: tuple[str, ...] = ("ffn_gate_exps", "ffn_down_exps", "ffn_up_exps", "ffn_gate_up_exps")
"""Stacks of per-expert matrices, (n_expert, out, in) in torch order (``ffn_gate_up_exps``: gate and up in one, the
gate the first half of each expert's rows)."""
MATRIX_KINDS: tuple[str, ...] = tuple(k for k in TENSOR_KINDS if k not in NORM_KINDS + VECTOR_KINDS)


def bias_of(kind: str) -> str:
    """The bias kind of a matrix kind (``attn_q`` -> ``attn_q_bias``)."""
    return f"{kind}_bias"


def gguf_name(kind: str, bid: int | None = None) -> str:
    """GGUF tensor name of a kind (``bid`` for per-layer kinds): ``gguf_name("attn_q", 3)``."""
    return TENSOR_KINDS[kind][0].format(bid=bid)


def module_path(kind: str, bid: int | None = None) -> str:
    """Module path in the Transformer of a kind: ``module_path("attn_q", 3) == "layers.3.attn.q"``."""
    return TENSOR_KINDS[kind][1].format(bid=bid)


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(re.escape("{bid}"), r"(\d+)") + "$")


_GGUF_PATTERNS = [(kind, _pattern(g)) for kind, (g, _) in TENSOR_KINDS.items()]
_MODULE_PATTERNS = [(kind, _pattern(m)) for kind, (_, m) in TENSOR_KINDS.items()]


def parse_gguf_name(name: str) -> tuple[str, int | None] | None:
    """``"blk.3.attn_q.weight"`` -> ``("attn_q", 3)``; None for a name that is no llama tensor."""
    for kind, pattern in _GGUF_PATTERNS:
        m = pattern.match(name)
        if m:
            return kind, int(m.group(1)) if m.groups() else None
    return None


def parse_module_path(path: str) -> tuple[str, int | None] | None:
    """``"layers.3.attn.q"`` -> ``("attn_q", 3)``; None for a path that holds no GGUF tensor."""
    for kind, pattern in _MODULE_PATTERNS:
        m = pattern.match(path)
        if m:
            return kind, int(m.group(1)) if m.groups() else None
    return None


def gguf_to_module(name: str) -> str:
    """GGUF tensor name -> module path (KeyError for a name that is no llama tensor)."""
    parsed = parse_gguf_name(name)
    if parsed is None:
        raise KeyError(name)
    return module_path(*parsed)


def module_to_gguf(path: str) -> str:
    """Module path -> GGUF tensor name (KeyError for a path that holds no GGUF tensor)."""
    parsed = parse_module_path(path)
    if parsed is None:
        raise KeyError(path)
    return gguf_name(*parsed)

"""Load a GGUF of any supported family into ggtorch's Transformer, checking every tensor like
nanoGPT's from_pretrained.

The model is built on the meta device (no memory), then each GGUF tensor is placed into the
module its name maps to (``ggtorch.models.names``): dequantized to a float dtype, or kept as
its raw ggml blocks in a QuantLinear/QuantEmbedding. Tensors are read one at a time from the
memory-mapped file, so peak memory is the model plus one tensor's temporaries, never two
copies of the file. Every tensor must be used exactly once and have the expected shape;
errors name the tensor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from os import PathLike

import torch
from gguf import GGMLQuantizationType, Keys
from torch import nn

from ggtorch.errors import BadGGUF, Unsupported
from ggtorch.io.gguf import GGUFFile, TensorInfo, read_gguf, release_pages
from ggtorch.models import names
from ggtorch.models.config import ModelConfig
from ggtorch.models.model import RMSNorm, Transformer
from ggtorch.models.tokenizer import Tokenizer
from ggtorch.ops.experts import Experts
from ggtorch.quant import check_raw, dequantize
from ggtorch.quant.modules import QuantEmbedding, QuantExperts, QuantLinear, float_module

FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


@dataclass
class LoadedModel:
    """What load_model_file returns: the model, its config and tokenizer, and the opened file."""

    model: Transformer
    config: ModelConfig
    tokenizer: Tokenizer
    gguf: GGUFFile


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> torch-order shape, for every tensor a file of this config holds."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {
        names.gguf_name("token_embd"): (c.n_vocab, c.n_embd),
        names.gguf_name("output_norm"): (c.n_embd,),
    }
    if not c.tied_output:
        shapes[names.gguf_name("output")] = (c.n_vocab, c.n_embd)
    for bid in range(c.n_layer):
        for kind, shape in layer_shapes(c, bid).items():
            shapes[names.gguf_name(kind, bid)] = shape
    if c.n_embd_per_layer:
        width = c.n_layer * c.n_embd_per_layer
        shapes |= {names.gguf_name("per_layer_token_embd"): (c.n_vocab, width),
                   names.gguf_name("per_layer_model_proj"): (width, c.n_embd),
                   names.gguf_name("per_layer_proj_norm"): (c.n_embd_per_layer,)}
    if "output" in c.biases:
        shapes[names.gguf_name("output_bias")] = (c.n_vocab,)
    if c.rope_freqs:
        shapes[names.ROPE_FREQS] = (c.n_rot // 2,)
    if c.rope_long_short:
        shapes[names.ROPE_FACTORS_LONG] = shapes[names.ROPE_FACTORS_SHORT] = (c.n_rot // 2,)
    return shapes


def layer_shapes(config: ModelConfig, bid: int) -> dict[str, tuple[int, ...]]:
    """Tensor kind -> torch-order shape, for every tensor of layer ``bid``."""
    c = config
    n_ff = c.n_ff_at(bid)
    per_layer: dict[str, tuple[int, ...]] = {"attn_norm": (c.n_embd,), c.family.ffn_norm: (c.n_embd,)}
    dense = not c.n_expert or c.family.dense_beside_experts
    if dense:
        per_layer |= {"ffn_up": (2 * n_ff if c.family.fused_up else n_ff, c.n_embd), "ffn_down": (c.n_embd, n_ff)}
        if not c.family.fused_up:
            per_layer["ffn_gate"] = (n_ff, c.n_embd)
    if c.n_expert:
        per_layer |= _expert_shapes(c)
    if c.family.post_norms:
        per_layer |= {"attn_post_norm": (c.n_embd,), "ffn_post_norm": (c.n_embd,)}
    if c.n_embd_per_layer:
        per_layer |= {"per_layer_inp_gate": (c.n_embd_per_layer, c.n_embd),
                      "per_layer_proj": (c.n_embd, c.n_embd_per_layer), "per_layer_post_norm": (c.n_embd,)}
    if c.layer_output_scale:
        per_layer["layer_output_scale"] = (1,)
    if c.is_recurrent(bid):
        return per_layer | _delta_net_shapes(c)
    head_dim, n_embd_q, n_embd_kv = c.head_dim_at(bid), c.n_embd_q_at(bid), c.n_embd_kv_at(bid)
    n_embd_q_proj = n_embd_q * (2 if c.family.attn_output_gate else 1)
    per_layer["attn_output"] = (c.n_embd, n_embd_q)
    if c.fused_qkv:
        per_layer["attn_qkv"] = (n_embd_q_proj + 2 * n_embd_kv, c.n_embd)
    else:
        per_layer["attn_q"] = (n_embd_q_proj, c.n_embd)
        if c.has_kv(bid):
            per_layer["attn_k"] = (n_embd_kv, c.n_embd)
            if not c.k_as_v(bid):
                per_layer["attn_v"] = (n_embd_kv, c.n_embd)
    if c.family.qk_norm:
        per_layer["attn_q_norm"] = (head_dim,)
        if c.has_kv(bid):
            per_layer["attn_k_norm"] = (head_dim,)
    if c.family.attn_sinks:
        per_layer["attn_sinks"] = (c.n_head,)
    for kind in c.biases:
        if kind != "output":
            per_layer[names.bias_of(kind)] = per_layer[kind][:-1]  # one per output row (of each expert)
    return per_layer


def _delta_net_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors (llama_model_qwen35::load_arch_tensors)."""
    return {"attn_qkv": (c.ssm_conv_channels, c.n_embd), "attn_gate": (c.ssm_inner, c.n_embd),
            "ssm_conv1d": (c.ssm_conv_channels, c.ssm_conv_kernel), "ssm_dt": (c.ssm_v_heads,),
            "ssm_a": (c.ssm_v_heads,), "ssm_beta": (c.ssm_v_heads, c.n_embd), "ssm_alpha": (c.ssm_v_heads, c.n_embd),
            "ssm_norm": (c.ssm_state,), "ssm_out": (c.n_embd, c.ssm_inner)}


def trunk_tensors(f: GGUFFile, config: ModelConfig) -> dict[str, TensorInfo]:
    """The file's tensors the model runs: all but those of next-token-prediction blocks after the trunk
    (``nextn_predict_layers``), which llama.cpp's main graph skips too."""
    if not config.n_layer_nextn:
        return f.tensors
    extra = {f"blk.{bid}." for bid in range(config.n_layer, config.n_layer + config.n_layer_nextn)}
    return {name: info for name, info in f.tensors.items() if not any(name.startswith(p) for p in extra)}


def _expert_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer shapes of a MoE FFN: the router, the three expert stacks, qwen2moe's shared expert."""
    assert c.n_ff_exp is not None
    shapes: dict[str, tuple[int, ...]] = {
        "ffn_gate_inp": (c.n_expert, c.n_embd),
        "ffn_down_exps": (c.n_expert, c.n_embd, c.n_ff_exp),
    }
    if c.fused_gate_up_exps:
        shapes["ffn_gate_up_exps"] = (c.n_expert, 2 * c.n_ff_exp, c.n_embd)
    else:
        shapes |= {"ffn_gate_exps": (c.n_expert, c.n_ff_exp, c.n_embd),
                   "ffn_up_exps": (c.n_expert, c.n_ff_exp, c.n_embd)}
    if c.expert_scales:  # after the stack: the loader sets it on the stack's module
        shapes["ffn_down_exps_scale"] = (c.n_expert,)
    if c.family.dense_beside_experts:
        shapes |= {"ffn_gate_inp_scale": (c.n_embd,), "ffn_pre_norm_2": (c.n_embd,), "ffn_post_norm_1": (c.n_embd,),
                   "ffn_post_norm_2": (c.n_embd,)}
    if c.family.shared_expert:
        assert c.n_ff_shexp is not None
        shapes |= {"ffn_gate_inp_shexp": (c.n_embd,), "ffn_gate_shexp": (c.n_ff_shexp, c.n_embd),
                   "ffn_up_shexp": (c.n_ff_shexp, c.n_embd), "ffn_down_shexp": (c.n_embd, c.n_ff_shexp)}
    return shapes


def _shape_error(f: GGUFFile, config: ModelConfig, name: str, shape: tuple[int, ...],
                 expected: tuple[int, ...]) -> BadGGUF:
    """The message for a tensor of the wrong shape; for an expert stack, the count it disagrees with."""
    kind = names.parse_gguf_name(name)
    if kind is not None and kind[0] in names.EXPERT_KINDS and len(shape) == 3 and shape[0] != expected[0]:
        key = Keys.LLM.EXPERT_COUNT.format(arch=config.arch)
        return BadGGUF(f"{f.path}: tensor '{name}' holds {shape[0]} experts, but '{key}' is {config.n_expert}; "
                       "the file is inconsistent (re-convert it)")
    return BadGGUF(f"{f.path}: tensor '{name}' has shape {shape}, expected {expected} "
                   "from the model's hyperparameters")


def _row_of(shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` holds a vector of ``expected`` as a (1, ..., n) row: the same ggml ``ne`` but for
    trailing ones, which llama.cpp's loader takes as equal (qwen35moe's converter writes its shared-expert gate so)."""
    return len(expected) == 1 and len(shape) > 1 and shape[-1] == expected[0] and all(d == 1 for d in shape[:-1])


def _check_biases(f: GGUFFile, config: ModelConfig) -> None:
    """A bias the family's graph does not read is refused by name (llama.cpp would not load it)."""
    allowed = set(config.family.layer_biases) | ({"output"} if config.family.output_bias else set())
    for kind in config.biases:
        if kind not in allowed:
            name = names.TENSOR_KINDS[names.bias_of(kind)][0].format(bid=0)
            raise Unsupported(f"{f.path}: tensor '{name}' is not part of a {config.arch} model; "
                              "ggtorch cannot use this model")


def load_model_file(path: str | PathLike[str], device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, keep_quantized: bool = False) -> LoadedModel:
    """Open a GGUF model of any supported family and build it on ``device``.

    ``keep_quantized=False``: every weight is dequantized to ``dtype``.
    ``keep_quantized=True``: quantized matrices stay as raw ggml blocks (QuantLinear /
    QuantEmbedding, dequantized on the fly); F32/F16/BF16 matrices become ``dtype`` floats
    and the 1-D norms are always f32.

    On CPU, F32 matrices loaded as f32 are views of the file's copy-on-write mapping (no copy):
    models built from one opened file share them, so edit weights by assigning new tensors
    (as LoRA merges do), not in place.
    """
    f = read_gguf(path)
    config = ModelConfig.from_gguf(f)
    tokenizer = Tokenizer.from_gguf(f)
    if tokenizer.n_vocab != config.n_vocab:
        raise BadGGUF(f"{f.path}: the tokenizer has {tokenizer.n_vocab} tokens but the model's vocabulary "
                      f"size is {config.n_vocab}")
    model = build_model(f, config, device, dtype, keep_quantized)
    return LoadedModel(model, config, tokenizer, f)


def check_tensor_names(f: GGUFFile, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Refuse a file with a tensor ``config``'s model has no place for, or without one it needs;
    returns the expected shapes (each tensor's own shape is checked as it is loaded)."""
    _check_biases(f, config)
    expected = expected_shapes(config)
    tensors = trunk_tensors(f, config)
    unexpected = sorted(set(tensors) - expected.keys())
    if unexpected:
        raise Unsupported(f"{f.path}: tensor '{unexpected[0]}' is not part of a {config.arch} model "
                          f"({len(unexpected)} unexpected tensor(s)); ggtorch cannot use this model")
    optional = {name for name in expected if name.endswith(".bias")}  # llama.cpp reads each layer's as optional
    missing = [name for name in expected if name not in tensors and name not in optional]
    if missing:
        raise BadGGUF(f"{f.path}: required tensor '{missing[0]}' is missing ({len(missing)} missing)")
    return expected


def build_model(f: GGUFFile, config: ModelConfig, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, keep_quantized: bool = False,
                embedding_dtype: torch.dtype | None = None) -> Transformer:
    """The weights of ``f`` placed into a Transformer of ``config`` (see load_model_file).

    ``embedding_dtype``: the dtype of a float token_embd (default ``dtype``). An embedding's
    rows start the residual stream, which autocast leaves in f32, so a trainer computing in
    bf16 keeps it f32 while holding the other float matrices in bf16.
    """
    device = torch.device(device)
    expected = check_tensor_names(f, config)
    with torch.device("meta"):
        model = Transformer(config, init_weights=False)
    for name, shape in expected.items():
        if name not in f.tensors:  # an absent optional bias adds nothing
            _set_module(model, names.gguf_to_module(name), nn.Parameter(torch.zeros(shape, device=device),
                                                                        requires_grad=False))
            continue
        info = f.tensors[name]
        if info.shape != shape:
            if not _row_of(info.shape, shape):
                raise _shape_error(f, config, name, info.shape, shape)
            info = dataclasses.replace(info, shape=shape)
        if name in names.ROPE_BUFFERS:
            setattr(model, names.ROPE_BUFFERS[name],
                    dequantize(info.raw().to(device), info.ggml_type, info.shape, torch.float32, name))
            continue
        kind, _ = names.parse_gguf_name(name)
        if kind in names.VECTOR_KINDS:
            bias = dequantize(info.raw().to(device), info.ggml_type, info.shape, torch.float32, name)
            _set_module(model, names.gguf_to_module(name), nn.Parameter(bias, requires_grad=False))
            release_pages(info)
            continue
        kind_dtype = embedding_dtype if kind in names.EMBEDDING_KINDS and embedding_dtype is not None else dtype
        module = _make_module(info, kind, device, kind_dtype, keep_quantized, config.rms_eps)
        if not _uses_mapping(module, info):
            release_pages(info)  # a copy was made: the file's pages need not stay resident too
        _set_module(model, names.gguf_to_module(name), module)
    if config.tied_output:
        model.output = _tied_output(model.tok_embd)
    _check_materialized(model, f)
    return model


def _make_module(info: TensorInfo, kind: str, device: torch.device, dtype: torch.dtype,
                 keep_quantized: bool, rms_eps: float) -> nn.Module:
    """The module that holds one GGUF tensor."""
    raw = info.raw().to(device)
    if kind in names.NORM_KINDS:
        norm = RMSNorm(info.shape[0], rms_eps)
        norm_dtype = torch.float32 if keep_quantized else dtype
        norm.weight = nn.Parameter(dequantize(raw, info.ggml_type, info.shape, norm_dtype, info.name),
                                   requires_grad=False)
        return norm
    if keep_quantized and info.ggml_type not in FLOAT_TYPES:
        raw = raw.reshape(*info.shape[:-1], -1)  # whole rows of blocks
        if kind in names.EMBEDDING_KINDS:
            return QuantEmbedding(raw, info.ggml_type, info.shape)
        if kind in names.EXPERT_KINDS:
            return QuantExperts(raw, info.ggml_type, info.shape)
        return QuantLinear(raw, info.ggml_type, info.shape)
    weight = nn.Parameter(_float_weight(raw, info, dtype), requires_grad=False)
    if kind in names.EXPERT_KINDS:
        return Experts.holding(weight)
    return float_module(weight, embedding=kind in names.EMBEDDING_KINDS)


def _float_weight(raw: torch.Tensor, info: TensorInfo, dtype: torch.dtype) -> torch.Tensor:
    """The float weight of a matrix. An F32 tensor wanted as f32 on CPU stays a view of the
    copy-on-write file mapping: no copy, its pages are read on first use and shared with the
    page cache (a copy would count the file twice in RSS: once mapped, once copied); writes
    (a merge) go to private pages, never to the file."""
    if info.ggml_type == GGMLQuantizationType.F32 and dtype == torch.float32 and raw.device.type == "cpu":
        check_raw(raw, info.ggml_type, info.shape, info.name)  # the checks dequantize would make
        if raw.data_ptr() % 4 == 0:
            return raw.view(torch.float32).reshape(info.shape)
    return dequantize(raw, info.ggml_type, info.shape, dtype, info.name)


def _uses_mapping(module: nn.Module, info: TensorInfo) -> bool:
    """Whether a tensor of ``module`` is a view of ``info``'s bytes in the file mapping."""
    start = info.data.ctypes.data
    end = start + info.nbytes
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(t.device.type == "cpu" and start <= t.data_ptr() < end for t in tensors)


def _tied_output(embedding: nn.Module) -> nn.Module:
    """The output projection of a tied model: the embedding's weight (or raw blocks), shared."""
    if isinstance(embedding, QuantEmbedding):
        return QuantLinear(embedding.raw, embedding.ggml_type, embedding.shape)
    return float_module(embedding.weight, embedding=False)


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, module)


def _check_materialized(model: nn.Module, f: GGUFFile) -> None:
    """Every parameter and buffer came from the file (none left on the meta device)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            raise BadGGUF(f"{f.path}: no tensor in the file provides '{name}'")

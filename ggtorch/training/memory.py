"""The peak memory a training run will need, known before its model is loaded.

A run that does not fit is killed by the kernel (or CUDA) after minutes of loading, or pushes the
machine into swap; the numbers that decide it are all known from the GGUF's header and the flags.
:func:`estimate_memory` adds what a step holds at its peak:

- the process as it runs now (Python, torch and their libraries), on CPU;
- the base weights as the run holds them: quantized bytes as stored (memory-mapped, resident once
  read), float matrices in the compute dtype, dequantized embeddings in theirs;
- the trained tensors with their gradients and two AdamW moments (f32);
- the activations backward needs for the batch and context (every layer's, or with checkpointing
  only each block's input plus one block recomputed), and one layer's again for backward's
  temporaries;
- the loss: the final hidden states, the chunked logits and, where the loss dequantizes a quantized
  output matrix, that matrix in the compute dtype.

The per-token counts follow what the modules save for backward (models/model.py, attention.py, the
LoRA products, training/loss.py); tests/training/test_memory_estimate.py checks the total against
measured peaks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ggtorch.io.gguf import GGUFFile
from ggtorch.lora.config import EXPERT_KINDS, LoraConfig
from ggtorch.models import names
from ggtorch.models.attention import products_max_tokens, saved_keys_per_query
from ggtorch.models.config import ModelConfig
from ggtorch.models.loader import FLOAT_TYPES, trunk_tensors
from ggtorch.ops import policy
from ggtorch.training.loss import head_rows, slab_chunk

GIB = float(1 << 30)

RUNTIME_GROWTH = 96 << 20
"""What torch adds to a CPU process after the estimate: the compiler stack torch.optim imports, the
kernels and thread pools of a first step."""

ADAM_COPIES = 4
"""A trained f32 tensor, its gradient and AdamW's two moments."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Expected peak bytes of a run, by part."""

    runtime: int
    """This process before loading (0 on a CUDA device: the estimate is the device's)."""
    weights: int
    """The base weights that must stay resident: decoded floats, vectors, anything copied to a device."""
    trained: int
    activations: int
    loss: int
    device: str = "cpu"
    mapped: int = 0
    """The quantized weights a CPU run reads from the memory-mapped file as it uses them: resident while the machine
    has room, paged out and read again when it has not (the run goes on, slower)."""
    trained_params: tuple[tuple[str, int], ...] = ()
    """The trained parameters by what they adapt (the routed experts' adapters apart): what to name when they are what
    does not fit."""

    @property
    def total(self) -> int:
        return self.resident + self.mapped

    @property
    def resident(self) -> int:
        """What the run needs in memory whatever it pages: all but the mapped weights."""
        return self.runtime + self.weights + self.trained + self.activations + self.loss

    def parts(self) -> str:
        """The parts, in GiB."""
        mapped = f" + {self.mapped / GIB:.2f} mapped from the file" if self.mapped else ""
        return (f"weights {self.weights / GIB:.2f}{mapped}, trained tensors + AdamW {self.trained / GIB:.2f}, "
                f"activations {self.activations / GIB:.2f}, loss {self.loss / GIB:.2f}, "
                f"runtime {self.runtime / GIB:.2f}")

    def describe(self) -> str:
        """One line: the total and its parts, in GiB."""
        where = "" if self.device == "cpu" else f" on {self.device}"
        return f"expected peak memory{where}: {self.total / GIB:.2f} GiB ({self.parts()})"


def estimate_memory(base: GGUFFile, config: ModelConfig, *, batch: int, ctx: int, checkpointing: bool,
                    compute_dtype: torch.dtype, matrix_dtype: torch.dtype, embedding_dtype: torch.dtype | None,
                    keep_quantized: bool, lora: LoraConfig | None, device: torch.device,
                    keep_dequantized: int = 0) -> MemoryEstimate:
    """The expected peak of one training process (``lora`` None: every weight is trained).
    ``keep_dequantized``: bytes of decoded matrices a forward keeps for its backward (--keep-dequantized-mib)."""
    lora = lora.for_model(config.n_expert or 0) if lora is not None else None  # the experts' default rank
    held = trunk_tensors(base, config)  # a next-token-prediction block after the trunk is never loaded
    held_bytes = {name: _held_bytes(base, name, matrix_dtype, embedding_dtype, keep_quantized) for name in held}
    mapped = sum(b for name, b in held_bytes.items() if _mapped(base, name, b, keep_quantized, device))
    weights = sum(held_bytes.values()) - mapped
    elements = [_trained_elements(base, name, lora) for name in held]
    experts = sum(n for name, n in zip(held, elements, strict=True) if _is_routed_expert(name))
    trained_params = ((("the routed experts' adapters", experts), ("the other adapters", sum(elements) - experts))
                      if lora is not None else (("the model's weights", sum(elements)),))
    trained = sum(elements) * 4 * ADAM_COPIES
    if lora is None:
        trained -= weights  # the f32 weights are the trained tensors themselves (a full run holds no quantized one)
    # AdamW's update: temporaries of two tensors at a time on CPU (torch's per-tensor loop), of the
    # whole list on CUDA (its foreach path)
    trained += 4 * (2 * max(elements, default=0) if device.type == "cpu" else sum(elements))
    tokens = batch * ctx
    e = torch.empty((), dtype=compute_dtype).element_size()
    layer = _layer_bytes_per_token(config, ctx, e, compute_dtype, device) * tokens
    block_input = 4 * config.n_embd * tokens
    region = _delta_net_region_bytes_per_token(config, device) * tokens  # one region recomputed at a time
    if checkpointing:
        activations = config.n_layer * block_input + 2 * layer
        if keep_quantized:  # the recomputed block keeps its decoded matrices for their backward
            activations += _kept_block_bytes(base, e, device)
    else:
        activations = config.n_layer * layer + layer
        if keep_quantized and keep_dequantized:
            activations += min(keep_dequantized, sum(_decoded_matrix_bytes(base, e)))
    activations += 2 * block_input + region  # the embedding rows and the residual stream's last sum
    runtime = current_rss() + RUNTIME_GROWTH if device.type == "cpu" else 0
    slabs = lora is not None and not lora.rank_of("output")  # a frozen output: the vocabulary-slab loss
    return MemoryEstimate(runtime=runtime, weights=weights, trained=trained, activations=activations,
                          loss=_loss_bytes(base, config, tokens, e, keep_quantized, slabs, device), device=str(device),
                          mapped=mapped, trained_params=tuple((what, n) for what, n in trained_params if n))


def _mapped(base: GGUFFile, name: str, held: int, keep_quantized: bool, device: torch.device) -> bool:
    """Whether a tensor held as ``held`` bytes stays pages of the mapped file: quantized blocks kept as stored on the
    CPU (float tensors are converted copies; a device gets a copy of everything)."""
    info = base.tensors[name]
    return device.type == "cpu" and keep_quantized and info.ggml_type not in FLOAT_TYPES and held == info.nbytes


def _is_routed_expert(name: str) -> bool:
    parsed = names.parse_gguf_name(name)
    return parsed is not None and parsed[0] in EXPERT_KINDS


def _held_bytes(base: GGUFFile, name: str, matrix_dtype: torch.dtype, embedding_dtype: torch.dtype | None,
                keep_quantized: bool) -> int:
    """Bytes of one GGUF tensor as build_model holds it."""
    info = base.tensors[name]
    kind = names.parse_gguf_name(name)
    if len(info.shape) == 1 or name in names.ROPE_BUFFERS or (kind and kind[0] in names.VECTOR_KINDS):
        return info.n_elements * 4
    if keep_quantized and info.ggml_type not in FLOAT_TYPES:
        return info.nbytes
    kind, _ = names.parse_gguf_name(name)
    dtype = embedding_dtype if kind == "token_embd" and embedding_dtype is not None else matrix_dtype
    return info.n_elements * torch.empty((), dtype=dtype).element_size()


def _trained_elements(base: GGUFFile, name: str, lora: LoraConfig | None) -> int:
    """Elements trained for one GGUF tensor: all of it, or its LoRA pair."""
    info = base.tensors[name]
    if lora is None:
        return info.n_elements
    if name in names.ROPE_BUFFERS:
        return 0
    kind, _ = names.parse_gguf_name(name)
    if kind in names.VECTOR_KINDS or kind in ("ffn_gate_inp",):
        return 0
    rank = lora.rank_of(kind)
    if len(info.shape) == 1:
        return rank * (info.shape[0] + 1)
    *stack, n_out, n_in = info.shape
    experts = stack[0] if stack else 1
    return rank * (n_in + n_out) * experts


def _decoded_matrix_bytes(base: GGUFFile, e: int, layer: int | None = None) -> list[int]:
    """Bytes of each quantized block matrix decoded in the compute dtype (of one ``layer``, or of every
    block): those a product may keep for its backward (quant.autograd.keeping_dequantized)."""
    sizes = []
    for name, info in base.tensors.items():
        parsed = names.parse_gguf_name(name)
        if (parsed and parsed[1] is not None and (layer is None or parsed[1] == layer)
                and len(info.shape) == 2 and info.ggml_type not in FLOAT_TYPES):
            sizes.append(info.n_elements * e)
    return sizes


def _kept_block_bytes(base: GGUFFile, e: int, device: torch.device) -> int:
    """Bytes of the quantized matrices one checkpointed block keeps decoded during its backward:
    the first block's, those within the size a product keeps (the device policy's)."""
    largest = policy.current(device).keep_dequantized_bytes
    return sum(size for size in _decoded_matrix_bytes(base, e, layer=0) if size <= largest)


def _layer_bytes_per_token(c: ModelConfig, ctx: int, e: int, compute_dtype: torch.dtype,
                           device: torch.device) -> int:
    """Bytes one block saves for backward per token: norms' inputs (f32 residual stream) and outputs,
    the mixer's (attention's or, in a hybrid's recurrent layers, Gated DeltaNet's; the larger), the FFN's
    gate, up and activation (the routed experts' per routed row, the router's probabilities)."""
    norms = 4 if c.family.post_norms else 2
    saved = norms * (8 + (e if e < 4 else 0)) * c.n_embd  # f32 input and output; autocast's copy of the output
    saved += max(_delta_net_bytes_per_token(c, e) if c.is_recurrent(layer)
                 else _attention_bytes_per_token(c, layer, ctx, e, compute_dtype, device) for layer in range(c.n_layer))
    n_ff = max(c.n_ff_at(layer) for layer in range(c.n_layer))  # the widest layer's (gemma4's vary)
    if c.n_expert:
        saved += c.n_expert_used * (c.n_embd + 3 * (c.n_ff_exp or c.n_ff)) * e + c.n_expert * 4
        saved += 3 * (c.n_ff_shexp or 0) * e
        if c.family.dense_beside_experts:  # the dense MLP and the three extra norms of gemma4's MoE layers
            saved += 3 * n_ff * e + 3 * (8 + e) * c.n_embd
    else:
        saved += 3 * n_ff * e
    if c.n_embd_per_layer:  # gemma4's per-layer input: the gate, its GELU, the product, the norm's input and output
        saved += 3 * c.n_embd_per_layer * e + 2 * (8 + e) * c.n_embd
    return saved


def _attention_bytes_per_token(c: ModelConfig, layer: int, ctx: int, e: int, compute_dtype: torch.dtype,
                               device: torch.device) -> int:
    """q/k/v after rope, the attention output (and its probabilities on the products path), qwen35's output gate;
    gemma4's V norm. Of ``layer``, whose widths may be its own (gemma4)."""
    n_embd_q, n_embd_kv = c.n_embd_q_at(layer), c.n_embd_kv_at(layer)
    saved = (2 * n_embd_q + 2 * n_embd_kv) * e
    if c.family.attn_output_gate:
        saved += n_embd_q * (e + 4)  # the gate and its sigmoid
    if c.family.qk_norm:
        saved += (n_embd_q + n_embd_kv) * 2 * e
    if c.family.v_norm:
        saved += n_embd_kv * 2 * e
    if c.attn_softcap and not policy.current(device).flex_attention:  # FlexAttention caps inside its kernel
        saved += c.n_head * ctx * (4 + 4 + e)  # the capped scores, their softmax (f32) and the probabilities
    elif ctx <= products_max_tokens(compute_dtype, device):
        saved += int(c.n_head * saved_keys_per_query(ctx)) * e
    return saved


def _delta_net_bytes_per_token(c: ModelConfig, e: int) -> int:
    """What a Gated DeltaNet layer keeps for backward (models/delta_net.py): its recomputed region's inputs (the
    fused q|k|v projection in f32, the gate z, beta and g per value head) and its gated output, f32."""
    value_heads = c.ssm_v_heads * c.ssm_state
    return c.ssm_conv_channels * 4 + value_heads * (e + 4) + 2 * c.ssm_v_heads * 4


def _delta_net_region_bytes_per_token(c: ModelConfig, device: torch.device) -> int:
    """What one DeltaNet region holds while backward recomputes it, all f32: the fused q|k|v before and after its
    convolution and SiLU, q and k per value head (normalized, scaled), per head a row of each chunk's decay,
    triangular system, its solution and scores, the outputs, their norm and gate (ops/delta_rule.py)."""
    if not any(c.is_recurrent(layer) for layer in range(c.n_layer)):
        return 0
    chunk = policy.current(device).delta_rule_chunk
    value_heads = c.ssm_v_heads * c.ssm_state
    held = c.ssm_conv_channels * 3 * 4
    held += 2 * value_heads * 3 * 4
    held += c.ssm_v_heads * chunk * 4 * 4 + value_heads * 2 * 4  # w and kc
    held += value_heads * 4 * 4
    return held


def _loss_bytes(base: GGUFFile, c: ModelConfig, tokens: int, e: int, keep_quantized: bool, slabs: bool,
                device: torch.device) -> int:
    """The fused output projection + cross-entropy: the normed hidden states and their gradient, and
    with ``slabs`` (a frozen output, training.loss._SlabCrossEntropy) a chunk of logits, its exp in the
    compute dtype and a slab of W, else a chunk of whole logit rows (and its f32 copy) and a quantized
    output matrix dequantized for the call."""
    held = 3 * tokens * c.n_embd * 4
    if slabs:
        rows, width = slab_chunk(tokens, c.n_embd, device)
        slope = 4 if c.final_softcap else 0  # a soft-capped head's d z / d logit beside the logits
        return held + rows * width * (4 + e + slope) + width * c.n_embd * e
    out = base.tensors.get(names.gguf_name("output")) or base.tensors[names.gguf_name("token_embd")]
    rows = min(tokens, head_rows(c.n_vocab, device))
    held += rows * c.n_vocab * (4 + e)
    if keep_quantized and out.ggml_type not in FLOAT_TYPES and c.n_embd * e <= 4 * tokens:
        held += out.n_elements * e
    return held


def ways_to_lower(config: Any, memory: MemoryEstimate | None = None) -> str:
    """The flags that lower a run's peak memory from where ``config`` (a RunConfig) sets it: the adapter's ranks where
    the trained tensors are most of ``memory`` (a smaller batch cannot help there), else the batch, the context and
    how the base and the activations are held."""
    if memory is not None and memory.trained > memory.activations + memory.loss and memory.trained_params:
        return _ways_to_shrink_trained(config, memory)
    fixes = "a smaller --batch or --ctx"
    if not config.use_checkpointing:
        fixes += ", --use-checkpointing"
    if getattr(config, "base_dtype", "quantized") != "quantized":  # LoRA runs only
        fixes += ", --base-dtype quantized"
    if getattr(config, "keep_dequantized_mib", 0):
        fixes += ", a smaller --keep-dequantized-mib"
    return fixes


def _ways_to_shrink_trained(config: Any, memory: MemoryEstimate) -> str:
    """'--rank-exps (now 16) or --lora-r (now 16), as the trained parameters ...': the trained tensors by part, the
    largest first, with the flags that shrink them."""
    parts = sorted(memory.trained_params, key=lambda p: -p[1])
    total = sum(n for _, n in parts)
    held = ", ".join(f"{what} hold {n / 1e6:,.1f}M parameters ({memory.trained * n / total / GIB:.2f} GiB with their "
                     "gradients and AdamW moments)" for what, n in parts)
    if not hasattr(config, "lora_r"):  # a full finetune: every weight is trained
        return f"a smaller model or a LoRA run (ggtorch finetune): {held}"
    flags = [f"--lora-r (now {config.lora_r})"]
    if parts[0][0].startswith("the routed experts"):
        flags.insert(0, "a smaller --rank-exps (0 adapts attention and any shared expert only)")
    return f"{' or '.join(flags)}, since the trained tensors are most of it: {held}"


def _proc_bytes(path: str, key: str) -> int | None:
    """The ``key:  N kB`` line of a Linux /proc file, in bytes; None where there is none."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss() -> int:
    """Resident bytes of this process now (Linux's /proc; elsewhere the peak so far)."""
    rss = _proc_bytes("/proc/self/status", "VmRSS")
    if rss is not None:
        return rss
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024


def available_bytes(device: torch.device) -> int | None:
    """Memory a run can still take: MemAvailable on CPU, the device's free memory on CUDA; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return _proc_bytes("/proc/meminfo", "MemAvailable") if device.type == "cpu" else None

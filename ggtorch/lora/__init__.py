"""LoRA attached by wrapping modules: the adapters llama.cpp's old ``finetune`` trained.

``attach_lora(model, LoraConfig(...))`` replaces each targeted module of a :class:`Transformer` by a
wrapper holding the original as ``base`` (``models/`` stays untouched). The targets are the matrices
the model's family has (attn_q/k/v or phi3's fused attn_qkv, attn_output, ffn_gate/up/down with
phi3's fused gate|up ffn_up, token_embd, output), as llama.cpp takes adapters for them; biases and
the family's extra norms (q/k norms, post norms) are not adapted.

- :class:`LoRALinear` around ``nn.Linear`` or ``QuantLinear``: ``y = base(x) + s·B(A(drop(x)))``
  with ``lora_a (r, in)``, ``lora_b (out, r)`` (GGUF LoRA orientation) and ``s = alpha / r``.
- :class:`LoRAEmbedding` around ``nn.Embedding`` or ``QuantEmbedding``, laid out as llama.cpp
  lays out ``token_embd``'s pair: ``lora_a (n_vocab, r)``, ``lora_b (n_embd, r)``,
  ``emb[t] += s · lora_b @ lora_a[t]``.
- :class:`LoRAExperts` around a stack of expert matrices (``Experts`` or ``QuantExperts``): one pair per
  expert, ``lora_a (E, r, in)``, ``lora_b (E, out, r)``, the layout llama.cpp's loader takes for
  ``*_exps``; only routed experts are computed. Routers are never adapted.
- :class:`LoRANorm` around an RMSNorm gain g (off by default): ``g + lora_b @ lora_a`` with
  ``lora_a (r, n_embd)``, ``lora_b (1, r)``, trained with scale 1 as the old finetune did.
  Today's llama.cpp adapter files cannot carry norm deltas (its loader skips ``*_norm``
  tensors), so they only survive a merge into the model.

Initialization follows the old finetune (``randomize_lora``): one ``std::mt19937(seed)`` and one
``std::normal_distribution<float>`` (libstdc++) over all A tensors of the old layout in its
order, each value ``clamp(N(0,1), -1, 1) / sqrtf(ne0 + ne1)``, and B = 0, so a fresh adapter
changes nothing. ``init="torch"`` draws the same distribution from a seeded torch generator.

Tied output (no ``output.weight``): llama.cpp aborts when an adapter targets ``token_embd`` of
such a model, and an ``output.weight`` pair has no base tensor to attach to. So ggtorch skips
``token_embd`` and ``output`` on tied models by default (logged), and an explicit rank for
either raises :class:`~ggtorch.errors.Unsupported`.
"""

from ggtorch.lora.adapter_file import (
    ADAPTER_DTYPES,
    LoraAdapter,
    LoraPair,
    adapter_from_model,
    combine_adapters,
    load_adapter_into,
    read_adapter,
    validate_against_base,
    write_adapter,
)
from ggtorch.lora.attach import (
    attach_lora,
    count_trainable_parameters,
    load_lora_tensors,
    lora_modules,
    lora_pairs,
    lora_state_dict,
    lora_tensors_by_gguf_name,
    merge_lora,
    trainable_parameters,
    unmerge_lora,
)
from ggtorch.lora.config import ALL_KINDS, LAYER_ORDER, MATRIX_KINDS, NORM_KINDS, LoraConfig
from ggtorch.lora.layers import LoRAEmbedding, LoRAExperts, LoRALinear, LoRANorm
from ggtorch.lora.product import frozen_float_weight

__all__ = [
    "ADAPTER_DTYPES", "ALL_KINDS", "LAYER_ORDER", "MATRIX_KINDS", "NORM_KINDS", "LoRAEmbedding", "LoRAExperts",
    "LoRALinear", "LoRANorm", "LoraAdapter", "LoraConfig", "LoraPair", "adapter_from_model", "attach_lora",
    "combine_adapters", "count_trainable_parameters", "frozen_float_weight", "load_adapter_into", "load_lora_tensors",
    "lora_modules", "lora_pairs", "lora_state_dict", "lora_tensors_by_gguf_name", "merge_lora", "read_adapter",
    "trainable_parameters", "unmerge_lora", "validate_against_base", "write_adapter",
]

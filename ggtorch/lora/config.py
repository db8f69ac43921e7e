"""LoraConfig: which tensors get an adapter, of which rank, scaled and initialized how.

Kinds are the old finetune's tensor names; their order (globals, then per layer) is the order
the old program drew its init values and wrote its checkpoints in. ``attn_qkv`` (one fused q|k|v
matrix, phi3) takes the place of attn_q/k/v in that order; a model has one or the other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from ggtorch.errors import BadFlag, flag

EXPERT_KINDS: tuple[str, ...] = ("ffn_gate_exps", "ffn_down_exps", "ffn_up_exps", "ffn_gate_up_exps")
"""Routed experts' stacks: each expert gets its own A and B (lora.layers.LoRAExperts)."""
SHARED_EXPERT_KINDS: tuple[str, ...] = ("ffn_gate_shexp", "ffn_down_shexp", "ffn_up_shexp")
"""qwen2moe's shared expert: a dense FFN, sized by the ffn_gate/ffn_down/ffn_up ranks."""
LINEAR_ATTENTION_KINDS: tuple[str, ...] = ("attn_gate", "ssm_beta", "ssm_alpha", "ssm_out")
"""A Gated DeltaNet layer's products besides its fused ``attn_qkv`` (qwen35): the output gate z, the write strength
beta, the decay's input alpha and the output projection, each a build_lora_mm in llama.cpp's graph."""
PER_LAYER_EMBEDDING_KINDS: tuple[str, ...] = ("per_layer_inp_gate", "per_layer_proj")
"""gemma4's per-layer embedding products in each block (E2B/E4B): the gate from the residual stream into the
layer's embedding width and the projection back, each a build_lora_mm in llama.cpp's graph (the model-wide
``per_layer_model_proj`` is a plain ggml_mul_mat there, so it is never adapted)."""
MATRIX_KINDS: tuple[str, ...] = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output",
                                 "ffn_gate", "ffn_down", "ffn_up", "attn_qkv") + EXPERT_KINDS + SHARED_EXPERT_KINDS \
    + LINEAR_ATTENTION_KINDS + PER_LAYER_EMBEDDING_KINDS
NORM_KINDS: tuple[str, ...] = ("attn_norm", "ffn_norm", "output_norm")
ALL_KINDS: tuple[str, ...] = MATRIX_KINDS + NORM_KINDS
TIED_KINDS: tuple[str, ...] = ("token_embd", "output")
GLOBAL_ORDER: tuple[str, ...] = ("token_embd", "output_norm", "output")
LAYER_ORDER: tuple[str, ...] = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output") \
    + LINEAR_ATTENTION_KINDS + ("ffn_norm", "ffn_gate", "ffn_down", "ffn_up") + EXPERT_KINDS + SHARED_EXPERT_KINDS \
    + PER_LAYER_EMBEDDING_KINDS
"""The old finetune's tensor order (randomize_lora, checkpoints): globals, then per layer. A model
lacks some kinds (attn_q/k/v or attn_qkv; phi3 has no ffn_gate; a MoE has experts in place of
ffn_gate/down/up): they are skipped, so a llama model's order is the old one. The routers
(``ffn_gate_inp``, ``ffn_gate_inp_shexp``) are never adapted: routing stays the base model's."""
OLD_KINDS: tuple[str, ...] = ("token_embd", "output_norm", "output", "attn_norm", "attn_q", "attn_k", "attn_v",
                              "attn_output", "ffn_norm", "ffn_gate", "ffn_down", "ffn_up")
"""The kinds the old finetune had: every checkpoint records their ranks."""

LoraInit = Literal["ggml", "torch"]

FINETUNE_RANK_FIELDS: dict[str, tuple[str, ...]] = {
    "rank_tok_embd": ("token_embd",), "rank_out": ("output",), "rank_wq": ("attn_q",), "rank_wk": ("attn_k",),
    "rank_wv": ("attn_v",), "rank_wo": ("attn_output",), "rank_ffn_gate": ("ffn_gate", "ffn_gate_shexp"),
    "rank_ffn_down": ("ffn_down", "ffn_down_shexp"), "rank_ffn_up": ("ffn_up", "ffn_up_shexp"),
    "rank_att_norm": ("attn_norm",), "rank_ffn_norm": ("ffn_norm",), "rank_out_norm": ("output_norm",),
    "rank_qkv": ("attn_qkv",), "rank_exps": EXPERT_KINDS, "rank_linear_attn": LINEAR_ATTENTION_KINDS,
    "rank_per_layer": PER_LAYER_EMBEDDING_KINDS,
}
"""Run option (FinetuneConfig field, the old --rank-* flag) -> the tensor kinds whose rank it sets."""

MAX_RANK = 4096
"""The largest LoRA rank: an 8B model's width. A rank at a matrix's width is no longer low-rank (a full delta with
more parameters); beyond it only the memory grows. Per-matrix widths are not checked: a Gated DeltaNet's ssm_beta
is 32 rows wide, below ranks that suit its other matrices."""

EXPERTS_AT_FULL_RANK = 8
"""The routed experts' default rank (no --rank-exps): --lora-r x 8 / the number of experts, at least 1, so that all
experts' adapters together hold about the parameters of 8 experts at --lora-r. A model's own routing sends each token
through a few of many experts (8 of 128 in Qwen3-30B-A3B), each of which sees a share of the tokens; and --lora-r on
every expert multiplies the adapter by the expert count: r16 on Qwen3-30B-A3B's 18,432 expert matrices is 830M
parameters, 13 GiB with their gradients and AdamW moments, where rank 1 is 52M (0.8 GiB)."""

OPTION_NAMES: dict[str, str] = {"rank": "lora_r", "alpha": "lora_alpha", "dropout": "lora_dropout"}
"""LoraConfig field -> the run option that sets it; messages name that option's flag."""


@dataclass
class LoraConfig:
    """Which tensors get an adapter, of which rank, and how it is scaled and initialized."""

    rank: int = 4
    """Rank of every adapted matrix without an override."""
    alpha: float | None = None
    """Scale numerator: each adapter is scaled by alpha / its rank (default: alpha = rank)."""
    ranks: dict[str, int] = field(default_factory=dict)
    """Per-kind overrides (``{"attn_q": 8, "output": 0}``); 0 switches a kind off. Norm kinds
    (attn_norm, ffn_norm, output_norm) are trained only when given a rank here."""
    dropout: float = 0.0
    """Dropout probability on the LoRA input of linear layers (not on the embedding's ids)."""
    init: LoraInit = "ggml"
    """``ggml``: bit-exact old finetune init (libstdc++ mt19937 + normal); ``torch``: same
    distribution from ``torch.Generator``."""

    def __post_init__(self) -> None:
        """The one check of the LoRA options (the CLI, config files and the API all end here)."""
        if not 1 <= self.rank <= MAX_RANK:
            raise BadFlag(f"{flag(OPTION_NAMES['rank'])} must be at least 1 and at most {MAX_RANK}, got {self.rank}")
        unknown = sorted(set(self.ranks) - set(ALL_KINDS))
        if unknown:
            raise BadFlag(f"unknown LoRA tensor kind '{unknown[0]}'; kinds are {', '.join(ALL_KINDS)}")
        for option, kinds in FINETUNE_RANK_FIELDS.items():
            for kind in kinds:
                if not 0 <= self.ranks.get(kind, 0) <= MAX_RANK:
                    raise BadFlag(f"{flag(option)} must be at least 0 and at most {MAX_RANK}, got {self.ranks[kind]} "
                                  f"(the LoRA rank of {kind})")
        if self.alpha is not None and not (math.isfinite(self.alpha) and self.alpha > 0):
            raise BadFlag(f"{flag(OPTION_NAMES['alpha'])} must be a positive number, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise BadFlag(f"{flag(OPTION_NAMES['dropout'])} must be in [0, 1), got {self.dropout}")
        if self.init not in get_args(LoraInit):
            raise BadFlag(f"LoRA init must be one of {', '.join(get_args(LoraInit))}, got '{self.init}'")

    @property
    def lora_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else float(self.rank)

    def rank_of(self, kind: str) -> int:
        """The rank ``kind`` is trained with (0: not adapted)."""
        if kind in self.ranks:
            return self.ranks[kind]
        return 0 if kind in NORM_KINDS else self.rank

    def for_model(self, n_expert: int) -> LoraConfig:
        """This config for a model of ``n_expert`` routed experts: without a rank for them, they take
        :data:`EXPERTS_AT_FULL_RANK`'s default (the same config for 8 experts or fewer, and for a dense model)."""
        if n_expert <= EXPERTS_AT_FULL_RANK or any(kind in self.ranks for kind in EXPERT_KINDS):
            return self
        rank = max(1, self.rank * EXPERTS_AT_FULL_RANK // n_expert)
        return dataclasses.replace(self, ranks={**self.ranks, **dict.fromkeys(EXPERT_KINDS, rank)})

    def explicit(self, kind: str) -> bool:
        """Whether the user asked for this kind by name (an override > 0)."""
        return self.ranks.get(kind, 0) > 0

    def check_kinds(self, present: Collection[str], arch: str) -> None:
        """Refuse a rank given for tensors the model does not have (--rank-qkv on a llama, --rank-exps on a dense
        model): it would adapt nothing, and the tensors the user meant keep the default rank."""
        for option, kinds in FINETUNE_RANK_FIELDS.items():
            rank = max(self.ranks.get(kind, 0) for kind in kinds)
            if rank > 0 and not set(kinds) & set(present):
                applying = [flag(o) for o, ks in FINETUNE_RANK_FIELDS.items() if set(ks) & set(present)]
                raise BadFlag(f"{flag(option)} {rank} sets the LoRA rank of {', '.join(kinds)}, which this {arch} "
                              f"model does not have; drop it (the ranks of its tensors: {', '.join(applying)})")

    @classmethod
    def from_finetune(cls, c: Any) -> LoraConfig:
        """From a FinetuneConfig: the options of OPTION_NAMES and FINETUNE_RANK_FIELDS (None: not given)."""
        ranks = {kind: getattr(c, option) for option, kinds in FINETUNE_RANK_FIELDS.items() for kind in kinds
                 if getattr(c, option) is not None}
        return cls(**{name: getattr(c, option) for name, option in OPTION_NAMES.items()}, ranks=ranks)

    def metadata(self) -> dict[str, int | float]:
        """``training.lora.rank.<kind>`` for every old kind (as the old checkpoints), for newer kinds
        (attn_qkv, the experts) when their rank was given, and ``training.lora.alpha``.

        Otherwise a newer kind has the default rank, which the entries of kinds without an override
        record too; leaving it out keeps a llama checkpoint's keys those of the old finetune."""
        kinds = OLD_KINDS + tuple(k for k in MATRIX_KINDS if k not in OLD_KINDS and k in self.ranks)
        meta: dict[str, int | float] = {f"training.lora.rank.{k}": self.rank_of(k) for k in kinds}
        # rounded to f32 as GGUF stores it, so a value read back from a checkpoint compares equal
        meta["training.lora.alpha"] = float(np.float32(self.lora_alpha))
        return meta

"""TrainConfig: ``ggtorch train`` (from scratch or full finetune) = FinetuneConfig + the new-model options.

It subclasses :class:`~ggtorch.finetune_config.FinetuneConfig`, so every optimizer, data,
checkpoint and run option is the finetune's (same names, same defaults, one place); only the
outputs differ (a GGUF model instead of an adapter) and the new model's shape is added, named
after the old ``train-text-from-scratch`` flags. The LoRA fields are inherited and unused.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import BadFlag
from .finetune_config import FinetuneConfig, _flag
from .scratch import INITS, OUTTYPES


@dataclass
class TrainConfig(FinetuneConfig):
    """Options of ``ggtorch train``; shape defaults are train-text-from-scratch's."""

    lora_out: str = ""
    """Unused by full training (no adapter is written)."""
    base_dtype: str = "f32"
    """Full training keeps f32 master weights."""

    vocab_model: str = ""
    """GGUF whose vocabulary and tokenizer the new model takes (from-scratch training)."""
    model_out: str = "ggml-model-ITERATION-f32.gguf"
    """Where to write the trained model as GGUF ('' disables); the pattern becomes the iteration."""
    outtype: str = "f32"
    """ggml type of the written matrices: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1."""
    only_write_model: bool = False
    """Write the model from --checkpoint-in (or the fresh init) and exit without training."""
    embd: int = 256
    """Embedding width of a new model."""
    ff: int = 768
    """Feed-forward width of a new model."""
    head: int = 8
    """Attention heads of a new model."""
    head_kv: int | None = None
    """KV heads of a new model (default: --head)."""
    layer: int = 16
    """Transformer blocks of a new model."""
    init: str = "ggml"
    """Weights of a new model: 'ggml' (train-text-from-scratch's, reproducible with it) or 'scaled'
    (GPT-2's normal(0, 0.02) with scaled residual projections: trains in far fewer steps)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.vocab_model) == bool(self.model_base):
            raise BadFlag("pass exactly one of --vocab-model (train a new model from scratch) and "
                          "--model-base (full finetune of an F32/F16/BF16 model)")
        for name in ("embd", "ff", "head", "layer"):
            if getattr(self, name) < 1:
                raise BadFlag(f"{_flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.head_kv is not None and self.head_kv < 1:
            raise BadFlag(f"--head-kv must be at least 1, got {self.head_kv}")
        if self.init not in INITS:
            raise BadFlag(f"--init must be one of {', '.join(INITS)}, got '{self.init}'")
        if self.outtype not in OUTTYPES:
            raise BadFlag(f"--outtype must be one of {', '.join(OUTTYPES)}, got '{self.outtype}'")
        if self.base_dtype != "f32":
            raise BadFlag("full training keeps f32 weights; use --dtype bf16 for bf16 compute")

    @property
    def n_head_kv(self) -> int:
        return self.head_kv if self.head_kv is not None else self.head

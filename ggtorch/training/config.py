"""FinetuneConfig: every option of a LoRA finetune, flat, named after llama.cpp's flags.

One flat dataclass keeps three views of the same options identical: the CLI (`--adam-alpha`
→ ``adam_alpha``), config files under ``configs/`` (YAML/TOML keys are field names) and the
Python API (``FinetuneConfig(adam_alpha=...)``). The sub-configs the machinery needs
(:class:`~ggtorch.training.optim.AdamConfig`, :class:`~ggtorch.lora.LoraConfig`,
:class:`~ggtorch.data.DataOptions`) are built from it by the trainer; their defaults are the
defaults here, so each default is written once.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from ggtorch.data import FORMATS, DataOptions, RecordOptions
from ggtorch.errors import BadFlag
from ggtorch.io.model_file import OUTTYPES
from ggtorch.models.init import INITS
from ggtorch.training.optim import AdamConfig

NAN_SKIP_LIMIT = 10
"""With --on-nan skip, this many non-finite steps in a row stop the run anyway."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class FinetuneConfig:
    """Options of ``ggtorch finetune``; defaults are the old llama.cpp finetune's."""

    # --- files -------------------------------------------------------------------------
    model_base: str = ""
    """Base model GGUF (any supported ggml type; quantized bases stay quantized)."""
    train_data: str = "shakespeare.txt"
    """Training text (UTF-8), or records: a .jsonl/.parquet file or a folder of them (docs/chat-data.md)."""
    checkpoint_in: str = "checkpoint.gguf"
    """Resume from this checkpoint when it exists; start fresh when it does not."""
    checkpoint_out: str = "checkpoint-ITERATION.gguf"
    """Where to save checkpoints ('' disables); the pattern becomes the iteration, and a second copy uses fn_latest."""
    lora_out: str = "ggml-lora-ITERATION-f32.gguf"
    """Where to save the adapter in today's llama.cpp GGUF LoRA format ('' disables)."""
    pattern_fn_it: str = "ITERATION"
    """Text in output file names replaced by the iteration number."""
    fn_latest: str = "LATEST"
    """Text that replaces the pattern in the second, always-current copy of each output."""
    save_every: int = 10
    """Save checkpoint and adapter every N iterations (<= 0: only at the end)."""
    only_write_lora: bool = False
    """Load the checkpoint (or a fresh adapter), write the adapter, and exit without training."""
    drop_norms: bool = False
    """Write --lora-out without the norm adapters (llama.cpp's format cannot carry them)."""
    log_file: str | None = None
    """JSON-lines training log; default: beside the checkpoint/adapter output."""

    # --- run -----------------------------------------------------------------------------
    seed: int = -1
    """RNG seed for LoRA init and data shuffling; -1 uses the current time (printed)."""
    ctx: int = 128
    """Training context length in tokens."""
    batch: int = 8
    """Sequences per micro-batch."""
    grad_acc: int = 1
    """Micro-batches accumulated per optimizer step (effective batch = batch × grad_acc)."""
    threads: int | None = None
    """torch intra-op threads (default: torch's choice)."""
    adam_iter: int = 256
    """Optimizer steps in this run (a resumed run continues the iteration count)."""
    epochs: int = -1
    """Stop after this many epochs over the samples (<= 0: no limit)."""
    use_checkpointing: bool = True
    """Gradient checkpointing per transformer block (less memory, ~30% more compute)."""
    device: str = "cpu"
    """cpu, cuda, cuda:N or mps."""
    dtype: str = "f32"
    """Compute dtype: f32, or bf16/f16 autocast."""
    base_dtype: str = "quantized"
    """How base weights are held: 'quantized' (raw ggml blocks, dequantized on the fly) or f32/bf16/f16."""
    dist_backend: str | None = None
    """torch.distributed backend under torchrun: gloo, nccl, ... (default: nccl on CUDA, gloo otherwise)."""
    val_split: float = 0.0
    """Fraction of the training text held out for a validation loss (0: none)."""
    val_data: str | None = None
    """Separate text file (or records file, for record training data) for the validation loss."""
    eval_every: int = 0
    """Compute the validation loss every N iterations (0: only at the end)."""
    on_nan: str = "stop"
    """A NaN/inf loss: 'stop' (the last saved checkpoint is kept) or 'skip' the step's update and go on
    (NAN_SKIP_LIMIT non-finite steps in a row stop the run)."""

    # --- instruction and chat records (docs/chat-data.md): meaning and defaults are RecordOptions' ---
    data_format: str = RecordOptions.data_format
    chat_template: str | None = RecordOptions.chat_template
    train_on_prompt: bool = RecordOptions.train_on_prompt
    batching: str = RecordOptions.batching
    long_records: str = RecordOptions.long_records

    # --- model overrides ----------------------------------------------------------------
    norm_rms_eps: float | None = None
    rope_freq_base: float | None = None
    rope_freq_scale: float | None = None

    # --- LoRA --------------------------------------------------------------------------
    lora_r: int = 4
    """Default rank of every adapted matrix."""
    lora_alpha: float | None = None
    """LoRA alpha; the adapter's scale is alpha / r (default: alpha = r, scale 1)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input (0: none)."""
    rank_att_norm: int = 0
    """Rank of the attn_norm adapters (0: not trained; the old finetune used 1)."""
    rank_ffn_norm: int = 0
    """Rank of the ffn_norm adapters (0: not trained)."""
    rank_out_norm: int = 0
    """Rank of the output_norm adapter (0: not trained)."""
    rank_tok_embd: int | None = None
    rank_out: int | None = None
    rank_wq: int | None = None
    rank_wk: int | None = None
    rank_wv: int | None = None
    rank_wo: int | None = None
    rank_ffn_gate: int | None = None
    rank_ffn_down: int | None = None
    rank_ffn_up: int | None = None

    # --- optimizer (ggml AdamW): meaning and defaults are AdamConfig's ----------------------
    adam_alpha: float = AdamConfig.alpha
    adam_min_alpha: float = AdamConfig.min_alpha
    adam_decay: float = AdamConfig.decay
    adam_decay_min_ndim: int = AdamConfig.decay_min_ndim
    adam_beta1: float = AdamConfig.beta1
    adam_beta2: float = AdamConfig.beta2
    adam_gclip: float = AdamConfig.gclip
    adam_epsf: float = AdamConfig.epsf
    warmup: int = AdamConfig.warmup
    cos_decay_steps: int = AdamConfig.cos_decay_steps
    cos_decay_restart: float = AdamConfig.cos_decay_restart
    cos_decay_min: float = AdamConfig.cos_decay_min
    enable_restart: bool = AdamConfig.enable_restart
    opt_past: int = AdamConfig.opt_past
    opt_delta: float = AdamConfig.opt_delta
    opt_max_no_improvement: int = AdamConfig.opt_max_no_improvement

    # --- data (old finetune sampling): meaning and defaults are DataOptions' -------------------
    sample_start: str = DataOptions.sample_start
    include_sample_start: bool = DataOptions.include_sample_start
    escape: bool = DataOptions.escape
    overlapping_samples: bool = DataOptions.overlapping_samples
    fill_with_next_samples: bool = DataOptions.fill_with_next_samples
    separate_with_eos: bool = DataOptions.separate_with_eos
    separate_with_bos: bool = DataOptions.separate_with_bos
    sample_random_offsets: bool = DataOptions.sample_random_offsets
    force_reshuffle: bool = DataOptions.force_reshuffle
    utf8_errors: str = DataOptions.utf8_errors

    def __post_init__(self) -> None:
        positive = ("ctx", "batch", "adam_iter", "lora_r")
        for name in positive:
            if getattr(self, name) < 1:
                raise BadFlag(f"{_flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.grad_acc < 1:
            self.grad_acc = 1  # the old finetune clamped --grad-acc to >= 1
        if self.threads is not None and self.threads < 1:
            raise BadFlag(f"--threads must be at least 1, got {self.threads}")
        if not 0.0 <= self.val_split < 1.0:
            raise BadFlag(f"--val-split must be in [0, 1), got {self.val_split}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise BadFlag(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_alpha is not None and not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise BadFlag(f"--lora-alpha must be a positive number, got {self.lora_alpha}")
        for f in fields(self):
            if f.name.startswith("rank_"):
                value = getattr(self, f.name)
                if value is not None and value < 0:
                    raise BadFlag(f"{_flag(f.name)} must be >= 0, got {value}")
        if self.dtype not in ("f32", "bf16", "f16"):
            raise BadFlag(f"--dtype must be f32, bf16 or f16, got '{self.dtype}'")
        if self.base_dtype not in ("quantized", "f32", "bf16", "f16"):
            raise BadFlag(f"--base-dtype must be quantized, f32, bf16 or f16, got '{self.base_dtype}'")
        if self.data_format not in FORMATS:
            raise BadFlag(f"--data-format must be one of {', '.join(FORMATS)}, got '{self.data_format}'")
        RecordOptions.from_finetune(self)  # checks --batching and --long-records
        if self.on_nan not in ("stop", "skip"):
            raise BadFlag(f"--on-nan must be stop or skip, got '{self.on_nan}'")
        if self.utf8_errors not in ("strict", "replace"):
            raise BadFlag(f"--utf8-errors must be strict or replace, got '{self.utf8_errors}'")
        if self.val_split and self.val_data:
            raise BadFlag("--val-split and --val-data exclude each other; pass one of them")

    @property
    def alpha(self) -> float:
        return float(self.lora_alpha) if self.lora_alpha is not None else float(self.lora_r)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **overrides: Any) -> FinetuneConfig:
        """Read a YAML or TOML config (keys are field names, '-' allowed); ``overrides`` win."""
        return cls(**{**read_config_file(path, cls.field_names()), **overrides})

    def replace(self, **changes: Any) -> FinetuneConfig:
        return dataclasses.replace(self, **changes)


def read_config_file(path: str | os.PathLike[str], known: set[str]) -> dict[str, Any]:
    """Options from a YAML or TOML file, keys normalized to field names and checked against ``known``."""
    path = Path(path)
    if not path.is_file():
        raise BadFlag(f"--config: no such file '{path}'")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".toml":
            raw = tomllib.loads(text)
        else:
            raw = yaml.safe_load(text) or {}
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise BadFlag(f"--config {path}: cannot parse it ({e})") from None
    if not isinstance(raw, dict):
        raise BadFlag(f"--config {path}: expected a mapping of option names to values")
    options = {str(k).replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(options) - known)
    if unknown:
        raise BadFlag(f"--config {path}: unknown option(s) {', '.join(unknown)}; "
                      "keys are the long flag names (e.g. adam-alpha or adam_alpha)")
    return options



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

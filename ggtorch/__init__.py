"""ggtorch: finetune GGUF models with PyTorch and get back files llama.cpp loads.

The names here are the public API (each documented where it is defined):

- Models: :func:`load_model` → :class:`GGUFModel` (generate, perplexity, add_lora, load_adapter,
  save_adapter, merge_lora); :class:`Transformer` (every family's model), :class:`ModelConfig`,
  :class:`Tokenizer`; ``Llama`` and ``LlamaConfig`` are their names from when llama was the one family.
- Training: :func:`finetune` (LoRA, the old llama.cpp finetune) and :func:`train` (every weight,
  from scratch or a full finetune) return a :class:`Trainer`; options are :class:`FinetuneConfig`
  / :class:`TrainConfig` fields (the CLI's long flag names); :class:`Callback`,
  :class:`StepResult`, :class:`ProgressBar`, :func:`plot_losses`.
- Files: :func:`read_gguf`, :func:`read_adapter` / :func:`write_adapter` (GGUF LoRA),
  :func:`load_checkpoint`, :func:`merge_adapters` (export-lora), :func:`new_model` (an untrained
  llama), :func:`export_peft` / :func:`import_peft`, :func:`dequantize` / :func:`quantize` (ggml
  blocks ↔ torch).
- Errors: every user-facing error is a :class:`GGTorchError` whose message names the fix.
"""

from ggtorch.api import (
    GGUFModel,
    ProgressBar,
    export_peft,
    finetune,
    import_peft,
    load_model,
    merge_adapters,
    new_model,
    plot_losses,
    train,
)
from ggtorch.errors import BadData, BadFlag, BadGGUF, GGTorchError, Unsupported
from ggtorch.io.checkpoint import Checkpoint, load_checkpoint
from ggtorch.io.encode import quantize
from ggtorch.io.gguf import GGUFFile, read_gguf
from ggtorch.lora import LoraConfig
from ggtorch.lora.adapter_file import LoraAdapter, read_adapter, write_adapter
from ggtorch.models.config import LlamaConfig, ModelConfig
from ggtorch.models.model import Llama, Transformer
from ggtorch.models.tokenizer import Tokenizer
from ggtorch.quant import dequantize
from ggtorch.training.config import FinetuneConfig, TrainConfig
from ggtorch.training.trainer import Callback, StepResult, Trainer

__version__ = "0.1.0"

__all__ = [
    "BadData", "BadFlag", "BadGGUF", "Callback", "Checkpoint", "FinetuneConfig", "GGTorchError", "GGUFFile",
    "GGUFModel", "Llama", "LlamaConfig", "LoraAdapter", "LoraConfig", "ModelConfig", "ProgressBar", "StepResult",
    "Tokenizer", "TrainConfig", "Trainer", "Transformer", "Unsupported", "dequantize", "export_peft", "finetune",
    "import_peft", "load_checkpoint", "load_model", "merge_adapters", "new_model", "plot_losses", "quantize",
    "read_adapter", "read_gguf", "train", "write_adapter",
]

"""What a run trains: LoRA adapters on a frozen base (:class:`LoraWeights`), or every weight of a
float model (:class:`FullWeights`).

The two differ in the base they start from, the dtypes the base is held in, the parameters the
optimizer gets, the tensors a checkpoint holds and how they load back, and what a save writes
besides the checkpoint (an adapter or a model GGUF). Each difference is a method here, so the run
and the loop never ask which kind they have. A class's static methods decide what happens
before the model exists; an instance is made once the model is built.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from ggtorch.errors import BadFlag, flag
from ggtorch.io.checkpoint import Checkpoint
from ggtorch.io.gguf import GGUFFile, read_gguf, release_pages, require_kind
from ggtorch.io.model_file import ggml_n_dims, write_model
from ggtorch.lora import LoraConfig, attach_lora, load_lora_tensors, lora_tensors_by_gguf_name, trainable_parameters
from ggtorch.lora.adapter_file import adapter_from_model, write_adapter
from ggtorch.models import names
from ggtorch.models.init import new_config, write_new_model
from ggtorch.models.loader import FLOAT_TYPES
from ggtorch.models.names import ROPE_BUFFERS
from ggtorch.ops.dtypes import DTYPES
from ggtorch.quant import dequantize
from ggtorch.training.config import FinetuneConfig, RunConfig, TrainConfig

Params = list[tuple[str, nn.Parameter, int]]
"""(name, parameter, ggml n_dims) of every trained tensor, in the order the optimizer keeps them."""

BaseDtypes = tuple[torch.dtype, torch.dtype | None, bool]
"""(dtype of the base's float matrices, of its token embedding (None: as the matrices), keep
quantized matrices as ggml blocks)."""


class LoraWeights:
    """LoRA adapters on a frozen (possibly quantized) base: ``ggtorch finetune``."""

    output_field: ClassVar[str] = "lora_out"
    """The config field naming the file a save writes besides the checkpoint ('' writes none)."""

    def __init__(self, config: FinetuneConfig, model: nn.Module, base: GGUFFile, seed: int,
                 device: torch.device) -> None:
        """Attach the adapters (A drawn from ``seed``) and move the model to ``device``."""
        self.config = config
        self.model = model
        self.base = base
        self.lora_config: LoraConfig | None = LoraConfig.from_finetune(config).for_model(model.config.n_expert or 0)
        attach_lora(model, self.lora_config, seed=seed)
        model.to(device)
        self.params: Params = trainable_parameters(model)

    # --- before the model exists ---------------------------------------------------------------
    @staticmethod
    def check(config: FinetuneConfig) -> None:
        """Refuse before training what would only fail at the first save: norm adapters in --lora-out."""
        norms = [flag(f) for f in ("rank_att_norm", "rank_ffn_norm", "rank_out_norm")
                 if getattr(config, f)]
        if norms and config.lora_out and not config.drop_norms:
            raise BadFlag(f"{'/'.join(norms)} train norm adapters, which llama.cpp's adapter format (--lora-out) "
                          "cannot carry; add --drop-norms to write the adapter without them (checkpoints keep them "
                          "for export-lora), or pass --lora-out ''")

    @staticmethod
    def open_base(config: FinetuneConfig, seed: int) -> tuple[GGUFFile, tempfile.TemporaryDirectory[str] | None]:
        """The base GGUF as given (any supported type); no temporary files."""
        return read_gguf(config.model_base), None

    @staticmethod
    def base_dtypes(config: FinetuneConfig) -> BaseDtypes:
        """``--base-dtype`` when given, for matrices and embedding alike.

        By default (``quantized``: as stored) float matrices are held in the compute dtype: autocast
        rounds every frozen weight to it in every step anyway, so rounding once at load gives the
        same numbers without the per-step cast, in half the memory. The embedding stays f32 (its
        rows are not autocast: they start the f32 residual stream).
        """
        if config.base_dtype != "quantized":
            return DTYPES[config.base_dtype], None, False
        return DTYPES[config.dtype], torch.float32, True

    # --- checkpoints and outputs ---------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The adapters under their GGUF LoRA names, norm pairs included."""
        return lora_tensors_by_gguf_name(self.model)

    def checkpoint_metadata(self) -> dict[str, Any]:
        assert self.lora_config is not None
        return self.lora_config.metadata()

    def load_checkpoint(self, ck: Checkpoint) -> None:
        """The adapters of a LoRA checkpoint written with the same ranks and alpha."""
        if ck.metadata.get("training.mode") == "full":
            raise BadFlag(f"--checkpoint-in {ck.path}: a full-weight training checkpoint; "
                          "resume it with `ggtorch train`")
        assert self.lora_config is not None
        ranks = {k: v for k, v in ck.metadata.items() if k.startswith("training.lora.")}
        mine = self.lora_config.metadata()
        if ranks != mine:
            diff = sorted(k for k in set(ranks) | set(mine) if ranks.get(k) != mine.get(k))
            raise BadFlag(f"--checkpoint-in {ck.path}: its LoRA layout differs from this run's flags "
                          f"({', '.join(f'{k}: checkpoint {ranks.get(k)} vs flags {mine.get(k)}' for k in diff[:3])}); "
                          "pass the same --lora-r/--rank-*/--lora-alpha as the run that wrote it")
        load_lora_tensors(self.model, ck.tensors)

    def write_outputs(self, paths: Sequence[str], training: Mapping[str, Any]) -> list[Path]:
        """The adapter in llama.cpp's GGUF LoRA format at each path; ``training`` goes into its metadata."""
        name = self.base.get("general.name", self.base.path.stem)
        metadata = {"general.name": f"{name} LoRA", "adapter.base_model": str(name), **training}
        adapter = adapter_from_model(self.model, self.base, metadata, drop_norms=self.config.drop_norms)
        return [write_adapter(path, adapter) for path in paths]

    def model_tensors(self) -> dict[str, torch.Tensor]:
        raise BadFlag("model_tensors() is for full training (ggtorch.train); a LoRA run's trained "
                      "tensors are its adapter: save() writes it")


class FullWeights:
    """Every weight of an F32/F16/BF16 model or of a new one: ``ggtorch train``."""

    output_field: ClassVar[str] = "model_out"

    def __init__(self, config: TrainConfig, model: nn.Module, base: GGUFFile, seed: int,
                 device: torch.device) -> None:
        """Move the model to ``device`` and make each of its weights trainable."""
        self.config = config
        self.model = model
        self.base = base
        self.lora_config: LoraConfig | None = None
        model.to(device)
        self.params: Params = full_trainable_parameters(model)
        for info in base.tensors.values():  # every weight is a copy now: the file's pages need not stay resident
            release_pages(info)

    # --- before the model exists ---------------------------------------------------------------
    @staticmethod
    def check(config: TrainConfig) -> None:
        """Nothing to check before the base is read."""

    @staticmethod
    def open_base(config: TrainConfig, seed: int) -> tuple[GGUFFile, tempfile.TemporaryDirectory[str] | None]:
        """--model-base (float only), or a new model over --vocab-model, with the folder holding it.

        A new model is written (initialized as train-text-from-scratch did) to a temporary file
        and read back, so both cases continue on the same path as a base GGUF.
        """
        c = config
        if c.model_base:
            base = read_gguf(c.model_base)
            quantized = [(n, t.ggml_type.name) for n, t in base.tensors.items() if t.ggml_type not in FLOAT_TYPES]
            if quantized:
                raise BadFlag(f"--model-base {c.model_base}: tensor '{quantized[0][0]}' is {quantized[0][1]}; full "
                              "training needs an F32/F16/BF16 model. Train LoRA adapters on a quantized model "
                              "with `ggtorch finetune`")
            return base, None
        vocab = require_kind(read_gguf(c.vocab_model), "model", "vocabulary", flag=flag("vocab_model"))
        new = new_config(vocab, n_embd=c.embd, n_ff=c.ff, n_head=c.head, n_head_kv=c.n_head_kv,
                         n_layer=c.layer, n_ctx=c.ctx, rms_eps=c.norm_rms_eps or 1e-5,
                         rope_freq_base=c.rope_freq_base or 10000.0, rope_freq_scale=c.rope_freq_scale or 1.0)
        scratch = tempfile.TemporaryDirectory(prefix="ggtorch-scratch-")
        path = write_new_model(Path(scratch.name) / "init.gguf", vocab, new, seed, init=c.init)
        return read_gguf(path), scratch

    @staticmethod
    def base_dtypes(config: TrainConfig) -> BaseDtypes:
        """f32 weights: they are the optimizer's master copy."""
        return torch.float32, None, False

    # --- checkpoints and outputs ---------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every weight under its GGUF name."""
        return {name: p.detach() for name, p, _ in self.params}

    def checkpoint_metadata(self) -> dict[str, Any]:
        return {"training.mode": "full"}

    def load_checkpoint(self, ck: Checkpoint) -> None:
        """Every weight of a full-training checkpoint of the same model."""
        if ck.metadata.get("training.mode") != "full":
            raise BadFlag(f"--checkpoint-in {ck.path}: a LoRA finetune checkpoint; resume it with `ggtorch finetune`")
        for name, p, _ in self.params:
            if name not in ck.tensors:
                raise BadFlag(f"--checkpoint-in {ck.path}: no weight '{name}' in it; it belongs to another model")
            with torch.no_grad():
                p.copy_(ck.tensors[name])

    def write_outputs(self, paths: Sequence[str], training: Mapping[str, Any]) -> list[Path]:
        """The model GGUF (the base's metadata, matrices as --outtype) at each distinct path."""
        tensors = self.model_tensors()
        return [write_model(path, self.base.metadata, self.base.value_types, tensors, self.config.outtype)
                for path in dict.fromkeys(paths)]

    def model_tensors(self) -> dict[str, torch.Tensor]:
        """GGUF name -> current weight, in the base file's tensor order."""
        trained = {name: p.detach() for name, p, _ in self.params}
        for name, buffer in ROPE_BUFFERS.items():  # rope divisors: data of the file, not trained
            if getattr(self.model, buffer) is not None:
                trained[name] = getattr(self.model, buffer)
        # a block the model never runs (a next-token-prediction block after the trunk) is written as the base holds it
        return {name: trained[name] if name in trained
                else dequantize(info.raw(), info.ggml_type, info.shape, torch.float32, name)
                for name, info in self.base.tensors.items()}


Weights = LoraWeights | FullWeights


def weights_kind(config: RunConfig) -> type[LoraWeights] | type[FullWeights]:
    """What a config trains: every weight for a TrainConfig, LoRA adapters otherwise."""
    return FullWeights if isinstance(config, TrainConfig) else LoraWeights


def full_trainable_parameters(model: nn.Module) -> Params:
    """Every float weight of a model made trainable: (GGUF name, parameter, ggml n_dims).

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

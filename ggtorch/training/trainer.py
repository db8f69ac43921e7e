"""The LoRA finetune: llama.cpp's old ``finetune`` semantics on torch machinery.

One :class:`Trainer` owns a run: the model (base weights quantized or float, LoRA attached),
the data order, the ggml-exact optimizer, checkpoints and outputs. The CLI and the notebook
API both drive it; callbacks see every step, evaluation and save.

Differences from the old program, on purpose (also in ``--help`` and the docs):
- one optimizer step consumes exactly ``grad_acc`` batches (the old one evaluated one extra
  batch per run and threw its gradient away), so a resumed run equals an uninterrupted one;
- the adapter is trained with scale alpha/r, as today's llama.cpp applies it (identical for
  the default alpha = r; the old program trained with scale 1);
- the first progress line shows the real loss, not 0.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.checkpoint import checkpoint

from ggtorch.data import (
    IGNORE_INDEX,
    DataOptions,
    RecordData,
    RecordOptions,
    TrainingData,
    is_record_source,
    load_records,
    read_records,
    read_text_file,
)
from ggtorch.errors import BadFlag, GGTorchError
from ggtorch.io.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from ggtorch.io.gguf import GGUFFile, read_gguf
from ggtorch.io.model_file import ggml_n_dims, write_model
from ggtorch.lora import LoraConfig, attach_lora, load_lora_tensors, lora_tensors_by_gguf_name, trainable_parameters
from ggtorch.lora.adapter_file import adapter_from_model, write_adapter
from ggtorch.models import names
from ggtorch.models.config import LlamaConfig
from ggtorch.models.init import new_config, write_new_model
from ggtorch.models.loader import FLOAT_TYPES, build_llama
from ggtorch.models.model import Block
from ggtorch.models.names import ROPE_FREQS
from ggtorch.models.tokenizer import Tokenizer
from ggtorch.training.config import NAN_SKIP_LIMIT, FinetuneConfig, TrainConfig
from ggtorch.training.distributed import RankFailed, setup
from ggtorch.training.log import TrainLog
from ggtorch.training.loss import cross_entropy, output_cross_entropy
from ggtorch.training.optim import AdamConfig, GGMLAdamW

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class NonFiniteLoss(RankFailed):
    """A step's loss was NaN or inf (on every rank alike: the loss is all-reduced first)."""


class Interrupted(GGTorchError):
    """The run was stopped with Ctrl-C after saving; the CLI exits with 130."""


@dataclass
class StepResult:
    """What one optimizer step did; passed to callbacks and written to the log."""

    iteration: int
    loss: float
    sched: float
    lr: float
    samples: int
    n_samples: int
    epoch: int
    tokens: int
    seconds: float
    tokens_per_second: float
    eta_seconds: float


class Callback(Protocol):
    """Hooks a notebook or the CLI can implement; every method is optional."""

    def on_step(self, trainer: Trainer, result: StepResult) -> None: ...
    def on_eval(self, trainer: Trainer, iteration: int, loss: float) -> None: ...
    def on_save(self, trainer: Trainer, paths: list[Path]) -> None: ...


def output_name(template: str, pattern: str, value: str) -> str:
    """The old finetune's naming: the first occurrence of ``pattern`` becomes ``value``."""
    return template.replace(pattern, value, 1) if pattern else template


def resolve_device(name: str) -> torch.device:
    """A torch device for --device, with a clear error when it is not available here."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise BadFlag(f"--device: '{name}' is not a device name (use cpu, cuda, cuda:N or mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BadFlag(f"--device {name}: this torch build or machine has no CUDA; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise BadFlag(f"--device {name}: MPS is not available here; use --device cpu")
    return device


def ggml_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the counted positions (targets != -100), in f32.

    ggml's ``cross_entropy_loss`` adds ε = 1e-9 to the softmax probabilities; in f32 that changes
    log p only where p is below ~1e-7, i.e. never for a target the model has learned anything
    about, so the exact log-softmax form is used (:func:`ggtorch.training.loss.cross_entropy`, which
    needs one vocabulary-sized gradient tensor instead of F.cross_entropy's three).
    """
    return cross_entropy(logits, targets)


def enable_block_checkpointing(model: torch.nn.Module) -> int:
    """Recompute each transformer Block in backward instead of storing its activations.

    Done per instance from the trainer, so ``models/`` knows nothing about training and module
    names (and so adapter and checkpoint names) stay unchanged.
    """
    n = 0
    for module in model.modules():
        if isinstance(module, Block) and "forward" not in module.__dict__:
            module.forward = functools.partial(checkpoint, type(module).forward.__get__(module), use_reentrant=False)
            n += 1
    return n


def disable_block_checkpointing(model: torch.nn.Module) -> int:
    """Undo :func:`enable_block_checkpointing`: each Block stores its activations again."""
    n = 0
    for module in model.modules():
        if isinstance(module, Block) and "forward" in module.__dict__:
            del module.forward
            n += 1
    return n


def full_trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, int]]:
    """Every float weight of a Llama made trainable: (GGUF name, parameter, ggml n_dims).

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


class Trainer:
    """A training run; ``train()`` runs ``adam_iter`` steps, stoppable and resumable.

    A :class:`FinetuneConfig` trains LoRA adapters on a (possibly quantized) base. A
    :class:`TrainConfig` trains every weight (``self.full``) of an F32/F16/BF16 base or of a new
    model over a vocabulary: checkpoints then hold all weights, and the output is a GGUF model.
    """

    def __init__(self, config: FinetuneConfig, callbacks: Sequence[Callback] = (), *,
                 log_records: bool = True, records: Sequence[Mapping[str, Any]] | None = None,
                 val_records: Sequence[Mapping[str, Any]] | None = None) -> None:
        """``records``/``val_records``: train (and validate) on a list of dicts instead of
        ``config.train_data``/``val_data`` (the record formats of docs/chat-data.md)."""
        self.config = c = config
        self.callbacks = list(callbacks)
        if c.threads:
            torch.set_num_threads(c.threads)
        self.dist, self.device = setup(resolve_device(c.device), c.dist_backend)
        # under torchrun every rank trains the same order: rank 0's seed (drawn from the clock for -1)
        self.seed = self.dist.broadcast_int(c.seed if c.seed >= 0 else int(time.time()) & 0xFFFFFFFF, self.device)
        torch.manual_seed(self.seed)  # dropout masks; a resumed run restores the RNG state instead
        self.records_given = records is not None
        self._given_records = (records, val_records)  # read by _build
        # an error on any rank (a bad file, an unwritable output) stops every rank here, reported once
        self.dist.agree_on_errors(self._build, self.device)
        self.dist.check_same("the options, the training data or the checkpoint they resume",
                             [self.data.hash, self.data.n_samples, len(self.val_batches), _options_hash(c),
                              self.iteration, self.data.next_sample], self.device)
        self.forward_model = self.dist.wrap(self.model, self.device)
        """What the training step calls: ``self.model`` itself, or its DDP wrapper under torchrun."""

        self.log = TrainLog(self._log_path() if log_records and self.dist.is_main else None)
        self._last_save_iteration = self.iteration
        self._stop_requested = False
        self._interrupted = False
        self._target_iteration = self.iteration + c.adam_iter  # train(n) resets it; step() alone may run first
        self.history: list[StepResult] = []
        self.skipped_steps = 0
        """Steps whose update --on-nan skip dropped, in this process."""

    def _build(self) -> None:
        """Read the base, build model, LoRA, optimizer and data, resume: everything that can fail on one rank.

        No collective runs in here, so a rank that fails early meets the others in
        :meth:`Distributed.agree_on_errors`.
        """
        c = self.config
        self.full = isinstance(c, TrainConfig)
        if self.dist.is_main:  # only rank 0 writes
            self._check_outputs_writable()
        self._check_norms_fit_the_adapter()

        self._scratch_dir: tempfile.TemporaryDirectory[str] | None = None
        self.base = self._open_full_base() if self.full else read_gguf(c.model_base)
        self.model_config = dataclasses.replace(LlamaConfig.from_gguf(self.base), **self._model_overrides())
        self.tokenizer = Tokenizer.from_gguf(self.base)
        matrix_dtype, embedding_dtype = self._base_dtypes()
        self.model = build_llama(self.base, self.model_config, self.device, dtype=matrix_dtype,
                                 keep_quantized=c.base_dtype == "quantized", embedding_dtype=embedding_dtype)
        n_ctx_train = self.model_config.n_ctx_train
        self.warnings: list[str] = []
        if c.ctx > n_ctx_train:
            self.warnings.append(f"--ctx {c.ctx} is above the model's training context {n_ctx_train}; "
                                 "quality beyond it is not what the model learned")

        self.lora_config = None if self.full else LoraConfig.from_finetune(c)
        if self.lora_config is not None:
            attach_lora(self.model, self.lora_config, seed=self.seed)
        self.model.to(self.device)
        self.params = full_trainable_parameters(self.model) if self.full else trainable_parameters(self.model)
        self.optimizer = GGMLAdamW(self.params, AdamConfig.from_finetune(c))
        records, val_records = self._given_records
        self.data = self._open_data(records)
        self.warnings += self.data.warnings
        self.val_batches = self._validation_batches(val_records)

        self.counters = {"iteration": 0, "samples": 0, "tokens": 0, "epochs": 0}
        self.resumed_from: Path | None = None
        if c.checkpoint_in and Path(c.checkpoint_in).is_file():
            self._resume(load_checkpoint(c.checkpoint_in))
        if c.use_checkpointing:
            enable_block_checkpointing(self.model)

    # --- state -------------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        return self.optimizer.iteration

    def _model_overrides(self) -> dict[str, float]:
        c = self.config
        return {k: v for k, v in (("rms_eps", c.norm_rms_eps), ("rope_freq_base", c.rope_freq_base),
                                  ("rope_freq_scale", c.rope_freq_scale)) if v is not None}

    def _base_dtypes(self) -> tuple[torch.dtype, torch.dtype | None]:
        """The dtypes the base's float (F32/F16/BF16) matrices and its token embedding are held in.

        ``--base-dtype`` when given, for both. By default (``quantized``: as stored), a LoRA
        finetune with bf16/f16 compute holds the matrices in the compute dtype: autocast rounds
        every frozen weight to it in every step anyway, so rounding once at load gives the same
        numbers without the per-step cast (about a tenth of a bf16 step on CPU), in half the
        memory. The embedding stays f32 (its rows are not autocast: they start the f32 residual
        stream). Full training keeps f32 weights: they are the optimizer's master copy.
        """
        c = self.config
        if c.base_dtype != "quantized":
            return DTYPES[c.base_dtype], None  # None: the embedding follows the matrices
        return (torch.float32 if self.full else DTYPES[c.dtype]), torch.float32

    def _open_full_base(self) -> GGUFFile:
        """The model full training starts from: --model-base (float only), or a new one over --vocab-model.

        A new model is written (initialized as train-text-from-scratch did) to a temporary file
        and read back, so both cases continue on the same path as a base GGUF.
        """
        c = self.config
        assert isinstance(c, TrainConfig)
        if c.model_base:
            base = read_gguf(c.model_base)
            quantized = [(n, t.ggml_type.name) for n, t in base.tensors.items() if t.ggml_type not in FLOAT_TYPES]
            if quantized:
                raise BadFlag(f"--model-base {c.model_base}: tensor '{quantized[0][0]}' is {quantized[0][1]}; full "
                              "training needs an F32/F16/BF16 model. Train LoRA adapters on a quantized model "
                              "with `ggtorch finetune`")
            return base
        vocab = read_gguf(c.vocab_model)
        config = new_config(vocab, n_embd=c.embd, n_ff=c.ff, n_head=c.head, n_head_kv=c.n_head_kv,
                            n_layer=c.layer, n_ctx=c.ctx, rms_eps=c.norm_rms_eps or 1e-5,
                            rope_freq_base=c.rope_freq_base or 10000.0, rope_freq_scale=c.rope_freq_scale or 1.0)
        self._scratch_dir = tempfile.TemporaryDirectory(prefix="ggtorch-scratch-")
        path = write_new_model(Path(self._scratch_dir.name) / "init.gguf", vocab, config, self.seed, init=c.init)
        return read_gguf(path)

    def _open_data(self, records: Sequence[Mapping[str, Any]] | None) -> TrainingData | RecordData:
        """Records (a list, a .jsonl/.parquet file or folder, or a forced record format) or plain text."""
        c = self.config
        if records is not None or is_record_source(c.train_data) or c.data_format in ("chat", "prompt-response"):
            source = records if records is not None else c.train_data
            flag = "records" if records is not None else "--train-data"
            return RecordData(load_records(source, flag), self.tokenizer, c.ctx, RecordOptions.from_finetune(c),
                              self.seed, self.base.get("tokenizer.chat_template"), name=flag)
        return TrainingData(read_text_file(c.train_data, "--train-data"), self.tokenizer,
                            n_ctx=c.ctx, options=DataOptions.from_finetune(c), seed=self.seed,
                            name=f"--train-data {c.train_data}")

    def model_tensors(self) -> dict[str, torch.Tensor]:
        """GGUF name -> current weight of a fully trained model, in the base file's tensor order."""
        trained = {name: p.detach() for name, p, _ in self.params}
        if self.model.rope_freqs is not None:
            trained[ROPE_FREQS] = self.model.rope_freqs
        return {name: trained[name] for name in self.base.tensors}

    def state(self) -> dict[str, Any]:
        """Everything besides the LoRA tensors that an exact resume needs."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "data": self.data.state_dict(),
            "counters": dict(self.counters),
            "torch_rng": torch.get_rng_state(),
            # dropout on CUDA draws from the device's generator
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            "seed": self.seed,
        }

    def _resume(self, ck: Checkpoint) -> None:
        ck.check_base(self.base)
        if self.full:
            self._load_full_weights(ck)
        else:
            self._load_lora(ck)
        self.optimizer.load_state_dict(ck.state["optimizer"])
        self.warnings += self.data.load_state_dict(ck.state["data"], force_reshuffle=self.config.force_reshuffle)
        self.counters = dict(ck.state["counters"])
        torch.set_rng_state(ck.state["torch_rng"])
        if self.device.type == "cuda" and ck.state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(ck.state["cuda_rng"], self.device)
        self.resumed_from = ck.path

    def _load_full_weights(self, ck: Checkpoint) -> None:
        if ck.metadata.get("training.mode") != "full":
            raise BadFlag(f"--checkpoint-in {ck.path}: a LoRA finetune checkpoint; resume it with `ggtorch finetune`")
        for name, p, _ in self.params:
            if name not in ck.tensors:
                raise BadFlag(f"--checkpoint-in {ck.path}: no weight '{name}' in it; it belongs to another model")
            with torch.no_grad():
                p.copy_(ck.tensors[name])

    def _load_lora(self, ck: Checkpoint) -> None:
        if ck.metadata.get("training.mode") == "full":
            raise BadFlag(f"--checkpoint-in {ck.path}: a full-weight training checkpoint; "
                          "resume it with `ggtorch train`")
        ranks = {k: v for k, v in ck.metadata.items() if k.startswith("training.lora.")}
        mine = self.lora_config.metadata()
        if ranks != mine:
            diff = sorted(k for k in set(ranks) | set(mine) if ranks.get(k) != mine.get(k))
            raise BadFlag(f"--checkpoint-in {ck.path}: its LoRA layout differs from this run's flags "
                          f"({', '.join(f'{k}: checkpoint {ranks.get(k)} vs flags {mine.get(k)}' for k in diff[:3])}); "
                          "pass the same --lora-r/--rank-*/--lora-alpha as the run that wrote it")
        load_lora_tensors(self.model, ck.tensors)

    # --- files -------------------------------------------------------------------------
    def _outputs(self) -> list[str]:
        c = self.config
        return [t for t in (c.checkpoint_out, c.lora_out, getattr(c, "model_out", "")) if t]

    def _log_path(self) -> Path:
        if self.config.log_file:
            return Path(self.config.log_file)
        first = self._outputs()[0] if self._outputs() else "ggtorch-train"
        stem = Path(output_name(Path(first).name, self.config.pattern_fn_it, "")).stem.strip("-_.") or "train"
        return Path(first).parent / f"{stem}-log.jsonl"

    def _check_norms_fit_the_adapter(self) -> None:
        """Refuse before training what would only fail at the first save: norm adapters in --lora-out."""
        c = self.config
        norms = [f"--{f.replace('_', '-')}" for f in ("rank_att_norm", "rank_ffn_norm", "rank_out_norm")
                 if getattr(c, f, 0)]
        if not self.full and norms and c.lora_out and not c.drop_norms:
            raise BadFlag(f"{'/'.join(norms)} train norm adapters, which llama.cpp's adapter format (--lora-out) "
                          "cannot carry; add --drop-norms to write the adapter without them (checkpoints keep them "
                          "for export-lora), or pass --lora-out ''")

    def _check_outputs_writable(self) -> None:
        """Refuse an unwritable output folder before any heavy work."""
        for template in self._outputs() + ([self.config.log_file] if self.config.log_file else []):
            folder = Path(template).parent if str(Path(template).parent) else Path(".")
            if not folder.is_dir():
                raise BadFlag(f"output folder '{folder}' (for {template}) does not exist; create it first")
            if not os.access(folder, os.W_OK):
                raise BadFlag(f"output folder '{folder}' (for {template}) is not writable; "
                              "choose another --checkpoint-out / --lora-out")

    def save(self, checkpoint: bool = True) -> list[Path]:
        """Write checkpoint and adapter (full training: model), each under its iteration and LATEST name.

        ``checkpoint=False`` writes only the adapter or model (``--only-write-lora/-model``).
        """
        written: list[Path] = []
        # only rank 0 writes; the others wait for it (none runs ahead) and stop with it if it fails
        self.dist.agree_on_errors(lambda: written.extend(self._save(checkpoint)) if self.dist.is_main else None,
                                  self.device)
        self._last_save_iteration = self.iteration
        return written

    def _save(self, checkpoint: bool) -> list[Path]:
        c = self.config
        written: list[Path] = []
        names = [str(self.iteration), c.fn_latest]
        if c.checkpoint_out and checkpoint:
            if self.lora_config is None:
                tensors = {name: p.detach() for name, p, _ in self.params}
                meta: dict[str, Any] = {"training.mode": "full", **self._counter_metadata()}
            else:
                tensors = lora_tensors_by_gguf_name(self.model)  # norm pairs included
                meta = {**self.lora_config.metadata(), **self._counter_metadata()}
            for value in dict.fromkeys(names):
                path = Path(output_name(c.checkpoint_out, c.pattern_fn_it, value))
                save_checkpoint(path, self.base, meta, tensors, self.state())
                written.append(path)
        if self.full and c.model_out:
            model_tensors = self.model_tensors()
            for path in dict.fromkeys(output_name(c.model_out, c.pattern_fn_it, value) for value in names):
                written.append(write_model(path, self.base.metadata, self.base.value_types, model_tensors, c.outtype))
        elif c.lora_out:
            adapter = adapter_from_model(self.model, self.base, self._adapter_metadata(), drop_norms=c.drop_norms)
            for value in dict.fromkeys(names):
                written.append(write_adapter(output_name(c.lora_out, c.pattern_fn_it, value), adapter))
        self._last_save_iteration = self.iteration
        if not written:
            return written
        self.log.write("save", iteration=self.iteration, files=[str(p) for p in written])
        for cb in self.callbacks:
            getattr(cb, "on_save", lambda *a: None)(self, written)
        return written

    def _counter_metadata(self) -> dict[str, int]:
        return {"training.iteration_count": self.iteration,
                "training.sample_count": self.counters["samples"],
                "training.token_count": self.counters["tokens"],
                "training.epoch_count": self.data.epoch}

    def _adapter_metadata(self) -> dict[str, Any]:
        return {"general.name": f"{self.base.get('general.name', self.base.path.stem)} LoRA",
                "adapter.base_model": str(self.base.get("general.name", self.base.path.stem)),
                "training.iteration_count": self.iteration,
                "training.token_count": self.counters["tokens"],
                "training.data": "records" if self.records_given else Path(self.config.train_data).name}

    # --- the loop ------------------------------------------------------------------------
    def _autocast(self) -> Any:
        dtype = DTYPES[self.config.dtype]
        if dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def _next_batches(self) -> tuple[list[Sequence[torch.Tensor | None]], int]:
        """This rank's ``grad_acc`` micro-batches of the step and the samples the whole step used.

        Each micro-step takes ``world_size`` consecutive batches of the shared stream and rank r
        keeps the r-th, so N ranks consume exactly what one process with ``--grad-acc`` x N does,
        and the stream position stays global (a checkpoint resumes with any number of ranks).
        """
        mine = []
        used = 0
        for _ in range(self.config.grad_acc):
            for rank in range(self.dist.world_size):
                batch = self.data.next_batch(self.config.batch)
                used += self.data.last_used
                if rank == self.dist.rank:
                    mine.append(batch)
        return mine, used

    def _forward(self, model: torch.nn.Module, batch: Sequence[torch.Tensor | None],
                 hidden_only: bool = False) -> torch.Tensor:
        """Logits of a batch: (inputs, targets) or a packed RecordBatch with positions and segments.

        ``hidden_only``: the normed hidden states instead, for ``output_cross_entropy``."""
        inputs = batch[0].to(self.device)
        if len(batch) > 2 and batch[2] is not None:
            return model(inputs, positions=batch[2].to(self.device), segments=batch[3].to(self.device),
                         hidden_only=hidden_only)
        return model(inputs, hidden_only=hidden_only)

    def step(self) -> StepResult:
        """One optimizer step over ``grad_acc`` micro-batches (on every rank under torchrun).

        The step loss is the sum of the cross-entropy over every counted position of all
        micro-batches of all ranks over their number (for plain text: the mean of the micro-batch
        means, as ggml). DDP averages gradients over ranks, so each rank's part is scaled by
        world_size / global count; only the last micro-batch's backward synchronizes.
        """
        c = self.config
        t0 = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad()
        batches, samples_used = self._next_batches()
        counts = [int((batch[1] != IGNORE_INDEX).sum()) for batch in batches]
        global_count = self.dist.reduce_sum([float(sum(counts))], self.device)[0]
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (batch, count) in enumerate(zip(batches, counts, strict=True)):
            targets = batch[1].to(self.device)
            last = i == len(batches) - 1
            with self._autocast(), (nullcontext() if last or not self.dist.enabled else self.forward_model.no_sync()):
                # the output projection runs inside the loss: the (N, n_vocab) logits never exist
                hidden = self._forward(self.forward_model, batch, hidden_only=True)
                # a micro-batch without counted positions still runs backward (DDP expects every rank's)
                loss = (output_cross_entropy(self.model.output, hidden, targets) if count
                        else self.model.output(hidden).sum() * 0.0)
                (loss * (count * self.dist.world_size / global_count)).backward()
            loss_sum += loss.detach().double() * count
        loss_total, stop = self.dist.reduce_sum([float(loss_sum), float(self._stop_requested)], self.device)
        loss_value = loss_total / global_count if global_count else float("nan")
        self._stop_agreed = bool(stop)  # Ctrl-C on any rank stops every rank after this same step
        if not math.isfinite(loss_value):
            raise NonFiniteLoss(
                f"the loss became {loss_value} at iteration {self.iteration + 1}; training stopped and the "
                "last saved checkpoint was kept. Lower --adam-alpha, or use --dtype f32 if you trained in f16")
        sched = self.optimizer.sched
        lr = self.optimizer.lr
        self.optimizer.step()
        used = c.batch * c.grad_acc * self.dist.world_size
        self.counters["samples"] += samples_used  # with fill, a row can use several samples
        self.counters["tokens"] += used * c.ctx
        seconds = time.perf_counter() - t0
        remaining = self._target_iteration - self.iteration
        result = StepResult(
            iteration=self.iteration, loss=loss_value, sched=sched, lr=lr,
            samples=min(self.data.next_sample + 1, self.data.n_samples), n_samples=self.data.n_samples,
            epoch=self.data.epoch, tokens=self.counters["tokens"], seconds=seconds,
            tokens_per_second=used * c.ctx / seconds if seconds > 0 else 0.0,
            eta_seconds=self._smoothed_seconds(seconds) * remaining)
        self.history.append(result)
        self.log.write("iter", **asdict(result))
        for cb in self.callbacks:
            getattr(cb, "on_step", lambda *a: None)(self, result)
        return result

    _smooth: float | None = None

    def _smoothed_seconds(self, seconds: float) -> float:
        """The old finetune's smoothed time per iteration (gain 0.7) for the ETA."""
        self._smooth = seconds if self._smooth is None else 0.7 * self._smooth + 0.3 * seconds
        return self._smooth

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Held-out loss: cross-entropy summed over the counted targets of all batches / their number."""
        if not self.val_batches:
            return None
        self.model.eval()
        total, count = 0.0, 0
        for batch in self.val_batches[self.dist.rank::self.dist.world_size]:  # ranks share the work
            n = int((batch[1] != IGNORE_INDEX).sum())
            if n:
                with self._autocast():
                    logits = self._forward(self.model, batch)
                total += float(ggml_cross_entropy(logits, batch[1].to(self.device))) * n
                count += n
        total, count = self.dist.reduce_sum([total, float(count)], self.device)
        loss = total / count
        self.log.write("eval", iteration=self.iteration, loss=loss)
        for cb in self.callbacks:
            getattr(cb, "on_eval", lambda *a: None)(self, self.iteration, loss)
        return loss

    def _validation_batches(self, val_records: Sequence[Mapping[str, Any]] | None) -> list[Sequence[torch.Tensor]]:
        c = self.config
        records = isinstance(self.data, RecordData)
        if val_records is not None or (c.val_data and records):
            if not records:
                raise BadFlag("validation records need record training data (a .jsonl/.parquet file, a folder "
                              "or records=[...]); pass a text file with --val-data")
            held = (load_records(val_records, "val_records") if val_records is not None
                    else read_records(c.val_data, "--val-data"))
            return self.data.eval_batches_from(held, c.batch,
                                               "val_records" if val_records is not None else "--val-data")
        if c.val_data:
            if is_record_source(c.val_data):
                raise BadFlag(f"--val-data {c.val_data} holds records but --train-data is plain text; "
                              "pass a text file (or train on records too)")
            return self.data.eval_batches_from_text(read_text_file(c.val_data, "--val-data"), c.batch)
        if c.val_split:
            return self.data.split_validation(c.val_split, c.batch)
        return []

    def request_stop(self) -> None:
        """Stop after the current step and save; ``train()`` then returns (call it again to go on).

        A callback or a notebook button calls this. Ctrl-C does too, and then ``train()`` raises
        :class:`Interrupted` after saving, so the CLI exits with 130.
        """
        self._stop_requested = True

    _stop_agreed = False

    def _stopping(self) -> bool:
        """Stop now? Under torchrun only what all ranks agreed on in the last step counts."""
        return self._stop_agreed if self.dist.enabled else self._stop_requested

    def train(self, n_iterations: int | None = None) -> list[StepResult]:
        """Run ``n_iterations`` (default ``adam_iter``) optimizer steps; save as configured."""
        c = self.config
        n = c.adam_iter if n_iterations is None else n_iterations
        self._target_iteration = self.iteration + n
        first_epoch = self.data.epoch
        self._stop_requested = self._stop_agreed = False
        self._interrupted = False
        self.log.write("start", iteration=self.iteration, seed=self.seed, config=asdict(c),
                       trainable_parameters=sum(p.numel() for _, p, _ in self.params),
                       resumed_from=str(self.resumed_from) if self.resumed_from else None)
        results = []
        with _sigint_requests_stop(self):
            while self.iteration < self._target_iteration and not self._stopping():
                try:
                    results.append(self.step())
                except NonFiniteLoss:
                    if c.on_nan != "skip":
                        raise
                    self._skip_step()
                    continue
                self._skipped_in_a_row = 0
                if c.save_every > 0 and self.iteration - self._last_save_iteration >= c.save_every:
                    self.save()
                if c.eval_every > 0 and self.iteration % c.eval_every == 0:
                    self.evaluate()
                if c.epochs > 0 and self.data.epoch - first_epoch >= c.epochs:
                    break
                if self.optimizer.should_stop(results[-1].loss):
                    break
        if self.iteration != self._last_save_iteration:
            self.save()
        self.log.write("end", iteration=self.iteration, steps=len(results),
                       loss=results[-1].loss if results else None,
                       seconds=sum(r.seconds for r in results), stopped=self._stopping(),
                       interrupted=self._interrupted)
        # Ctrl-C here, or (under torchrun) on another rank: the CLI exits 130. A stop a callback asked for returns.
        if self._interrupted or (self.dist.enabled and self._stop_agreed and not self._stop_requested):
            raise Interrupted(f"interrupted at iteration {self.iteration}; saved, resume with "
                              f"--checkpoint-in {output_name(c.checkpoint_out, c.pattern_fn_it, c.fn_latest)}")
        return results

    _skipped_in_a_row = 0

    def _skip_step(self) -> None:
        """--on-nan skip: drop this step's gradients (no update; its batches are used up) and go on."""
        self.optimizer.zero_grad()
        self._skipped_in_a_row += 1
        self.skipped_steps += 1
        self.log.write("skip", iteration=self.iteration + 1, reason="non-finite loss",
                       in_a_row=self._skipped_in_a_row)
        if self._skipped_in_a_row >= NAN_SKIP_LIMIT:
            raise NonFiniteLoss(
                f"the loss was NaN/inf in {NAN_SKIP_LIMIT} steps in a row at iteration {self.iteration + 1}; "
                "training stopped and the last saved checkpoint was kept. Lower --adam-alpha, or use --dtype f32")

    def close(self) -> None:
        self.log.close()
        self.dist.close()
        if self._scratch_dir is not None:
            self._scratch_dir.cleanup()
            self._scratch_dir = None


def _options_hash(config: FinetuneConfig) -> int:
    """A fingerprint of the options every rank must share (not the per-rank device or threads)."""
    options = {k: v for k, v in asdict(config).items() if k not in ("device", "threads")}
    return zlib.crc32(json.dumps(options, sort_keys=True, default=str).encode())


class _sigint_requests_stop:
    """First Ctrl-C: finish the step, save, stop. Second Ctrl-C: exit at once."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.previous: Callable[..., Any] | int | None = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.trainer._interrupted:
            raise KeyboardInterrupt
        self.trainer._interrupted = True
        self.trainer.request_stop()

    def __enter__(self) -> _sigint_requests_stop:
        try:
            self.previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread (e.g. some notebook runners): no handler
            self.previous = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

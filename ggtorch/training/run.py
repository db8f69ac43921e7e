"""Building a training run: device, base file, model, what is trained, optimizer, data, resume, outputs.

A :class:`Run` holds everything a :class:`~ggtorch.training.trainer.Trainer` trains, built from
a config. Everything that can fail before the first step fails here; under torchrun a failure
on any rank stops every rank, reported once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ggtorch.data import (
    Batch,
    DataOptions,
    DataStream,
    PreferenceData,
    RecordData,
    RecordOptions,
    TrainingData,
    is_record_source,
    load_records,
    read_text_file,
)
from ggtorch.data.chat import Prompt
from ggtorch.errors import BadData, BadFlag, GGTorchError, flag
from ggtorch.io.checkpoint import Checkpoint, base_identity, load_checkpoint
from ggtorch.io.gguf import GGUFFile, read_gguf
from ggtorch.io.lock import OutputLock
from ggtorch.io.paths import Input, Output, check_files
from ggtorch.lora import LoraConfig
from ggtorch.models.config import ModelConfig
from ggtorch.models.generate import llama_cpp_context
from ggtorch.models.loader import build_model, check_tensor_names
from ggtorch.models.model import Block, Transformer
from ggtorch.models.tokenizer import Tokenizer
from ggtorch.ops import policy
from ggtorch.ops.dtypes import DTYPES, cpu_matmul_speed_vs_f32
from ggtorch.ops.recompute import checkpoint
from ggtorch.ops.threads import follow_free_cores, pin_threads
from ggtorch.quant import native
from ggtorch.quant.autograd import keeping_dequantized
from ggtorch.quant.modules import QuantEmbedding, QuantExperts, QuantLinear
from ggtorch.training.config import DEFAULT_CHECKPOINT_IN, RunConfig
from ggtorch.training.distributed import setup
from ggtorch.training.generation import SamplePrompt, answer_data, answer_prompts, sample_prompts
from ggtorch.training.log import summary_writer
from ggtorch.training.memory import GIB, MemoryEstimate, available_bytes, estimate_memory, ways_to_lower
from ggtorch.training.optim import AdamConfig, GGMLAdamW
from ggtorch.training.preference import OBJECTIVE_OPTIONS, REFERENCE_OBJECTIVES, PreferenceObjective
from ggtorch.training.weights import LoraWeights, Weights, weights_kind


def output_name(template: str, pattern: str, value: str) -> str:
    """The old finetune's naming: the first occurrence of ``pattern`` becomes ``value``."""
    return template.replace(pattern, value, 1) if pattern else template


def resolve_device(name: str) -> torch.device:
    """A torch device for --device (``auto``: CUDA, else MPS, else the CPU), with a clear error when it is not
    available here."""
    if name == "auto":
        return torch.device(policy.auto_device())
    try:
        device = torch.device(name)
    except RuntimeError:
        raise BadFlag(f"--device: '{name}' is not a device name (use auto, cpu, cuda, cuda:N or mps)") from None
    if device.type not in policy.RUN_DEVICES:
        raise BadFlag(f"--device {name}: ggtorch runs models on {', '.join(policy.RUN_DEVICES)}, not on a "
                      f"{device.type} device; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BadFlag(f"--device {name}: this torch build or machine has no CUDA; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise BadFlag(f"--device {name}: MPS is not available here; use --device cpu")
    return device


SLOW_COMPUTE_DTYPE = 0.75
"""Below this share of f32's matrix-product speed, a --dtype is worth a warning (a CPU without bf16 and f16 dot
products measures about 0.3 for bf16 and 0.01 for f16)."""


F16_INITIAL_LOSS_SCALE = 2.0**16
"""f16 runs' first loss scale (torch.amp.GradScaler's default): halved at each step whose gradients overflow."""


AUTO_CHECKPOINTING_SHARE = 0.85
"""Without --use-checkpointing or --no-checkpointing, a run skips checkpointing where its estimate without it (the
mapped weights included: paging them costs more than recomputing) takes at most this share of the available memory:
the estimate is within a quarter of the measured peak, and other processes move."""


def enable_block_checkpointing(model: torch.nn.Module) -> int:
    """Recompute each transformer Block in backward instead of storing its activations; returns the blocks.

    Set through each Transformer's ``block_wrapper`` hook, so ``models/`` knows nothing about training and module
    names (and so adapter and checkpoint names) stay unchanged. The block runs inside ``keeping_dequantized``: its
    recomputation keeps each quantized matrix it decodes for that matrix's backward, so a quantized base is
    decoded twice per step instead of three times.
    """
    n = 0
    for module in model.modules():
        if isinstance(module, Transformer):
            module.block_wrapper = checkpointed_block
            n += len(module.layers)
    return n


def checkpointed_block(block: Block, *args: Any, **kwargs: Any) -> Any:
    """``block(*args, **kwargs)`` under activation checkpointing, keeping its decoded matrices for backward."""
    return checkpoint(_keeping_dequantized, block, *args, **kwargs)


def _keeping_dequantized(block: Block, *args: Any, **kwargs: Any) -> Any:
    with keeping_dequantized():
        return block(*args, **kwargs)


def disable_block_checkpointing(model: torch.nn.Module) -> int:
    """Undo :func:`enable_block_checkpointing`: each Block stores its activations again; returns the blocks."""
    n = 0
    for module in model.modules():
        if isinstance(module, Transformer) and module.block_wrapper is checkpointed_block:
            module.block_wrapper = None
            n += len(module.layers)
    return n


class Run:
    """The objects of one training run, built from its config.

    ``records``/``val_records``: train (and validate) on a list of dicts instead of
    ``config.train_data``/``val_data`` (the record formats of docs/chat-data.md).
    """

    base: GGUFFile
    model_config: ModelConfig
    tokenizer: Tokenizer
    model: torch.nn.Module
    weights: Weights
    """What is trained: LoRA adapters or every weight (parameters, checkpoint tensors, outputs)."""
    optimizer: GGMLAdamW
    data: DataStream
    val_batches: list[Batch]
    warnings: list[str]
    notes: list[str]
    """What the user should know about how the run computes (not a problem with it)."""
    counters: dict[str, int]
    """Samples, tokens and epochs trained, checkpointed with the optimizer state."""
    resumed_from: Path | None
    sample_prompts: list[SamplePrompt]
    """--sample-prompt's texts and the tokens each is continued from."""
    answer_prompts: list[Prompt]
    """--eval-generate's validation records: each one's prompt and reference answer."""
    objective: PreferenceObjective | None
    """The preference objective of --objective dpo, ipo or orpo; None for the cross-entropy."""
    reference: torch.nn.Module | None
    """--ref-model's model (frozen); None: DPO's reference is the base with the adapters off."""

    def __init__(self, config: RunConfig, records: Sequence[Mapping[str, Any]] | None = None,
                 val_records: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.config = c = config
        if c.threads:
            pin_threads(c.threads)
        follow_free_cores()  # the first reading of the other processes' CPU use: the model loads meanwhile
        self.dist, self.device = setup(resolve_device(c.device), c.dist_backend)
        self.policy = policy.current(self.device)
        """The kernels and sizes the run computes with (ggtorch.ops.policy): the device's, or the one a caller set."""
        self.auto_dtype = c.dtype == "auto"
        """Whether the compute dtype was the device policy's choice (``--dtype auto``), not the user's."""
        if self.auto_dtype:
            self.config = c = dataclasses.replace(c, dtype=self.policy.train_dtype)
        # under torchrun every rank trains the same order: rank 0's seed (drawn from the clock for -1)
        self.seed = self.dist.broadcast_int(c.seed if c.seed >= 0 else int(time.time()) & 0xFFFFFFFF, self.device)
        torch.manual_seed(self.seed)  # dropout masks; a resumed run restores the RNG state instead
        self.records_given = records is not None
        self.objective = (PreferenceObjective(c.objective, c.beta, c.label_smoothing, c.orpo_lambda)
                          if getattr(c, "preference", False) else None)
        self.reference = None
        self._scratch_dir: tempfile.TemporaryDirectory[str] | None = None
        # an error on any rank (a bad file, an unwritable output) stops every rank here, reported once
        self.dist.agree_on_errors(lambda: self._build(records, val_records), self.device)
        self.dist.check_same("the options, the training data or the checkpoint they resume",
                             [self.data.hash, self.data.n_samples, len(self.val_batches), _options_hash(c),
                              self.optimizer.iteration, self.data.next_sample], self.device)

    def _build(self, records: Sequence[Mapping[str, Any]] | None,
               val_records: Sequence[Mapping[str, Any]] | None) -> None:
        """Everything that can fail on one rank. No collective runs in here, so a rank that fails
        early meets the others in :meth:`Distributed.agree_on_errors`."""
        c = self.config
        if c.tensorboard and self.dist.is_main:
            summary_writer()  # tensorboard is installed: else refused before any file or model
        kind = weights_kind(c)
        inputs, outputs = self._files(kind.output_field, records is not None)
        writes = outputs if self.dist.is_main else []  # only rank 0 writes
        check_files(inputs, writes)
        if c.checkpoint_in:  # the checkpoint a run continues may be replaced by its own next checkpoint, not else
            check_files([Input(flag("checkpoint_in"), c.checkpoint_in, missing=f"pass {flag('checkpoint_in')} '' "
                               "(or leave it out) to start a new run")], writes[1:])
        resume = self._resume_path()
        if self.dist.is_main:
            if resume is None and not c.overwrite:
                self._refuse_to_replace_another_run(outputs[:2])
            self._lock = OutputLock(outputs).acquire()
        try:
            self._build_from(kind, records, val_records, resume)
        except BaseException:
            self._release_lock()
            raise

    def _build_from(self, kind: type[Weights], records: Sequence[Mapping[str, Any]] | None,
                    val_records: Sequence[Mapping[str, Any]] | None, resume: Path | None) -> None:
        """The run's objects, once its files are checked and its outputs locked."""
        c = self.config
        kind.check(c)
        self.base, self._scratch_dir = kind.open_base(c, self.seed)
        self.model_config = dataclasses.replace(ModelConfig.from_gguf(self.base), **self._model_overrides())
        self.tokenizer = Tokenizer.from_gguf(self.base)
        self.warnings = []
        self.data = self._open_data(records)  # before the model: the estimate below sees the tokenized data
        self.warnings += self.data.warnings
        self.val_batches = self._validation_batches(val_records)
        if c.given("eval_every") and not self.val_batches:  # said, not refused: what is trained does not change
            self.warnings.append(f"{flag('eval_every')} {c.eval_every} has no validation data to evaluate, so it "
                                 f"does nothing; give {flag('val_data')} or {flag('val_split')}")
        self._generations()
        matrix_dtype, embedding_dtype, keep_quantized = kind.base_dtypes(c)
        check_tensor_names(self.base, self.model_config)  # the estimate reads them: a bad file fails here, named
        rows = 2 * c.batch if self.objective is not None else c.batch  # a pair is two sequences

        def estimate(checkpointing: bool) -> MemoryEstimate:
            return estimate_memory(
                self.base, self.model_config, batch=rows, ctx=c.ctx, checkpointing=checkpointing,
                compute_dtype=DTYPES[c.dtype], matrix_dtype=matrix_dtype, embedding_dtype=embedding_dtype,
                keep_quantized=keep_quantized, lora=LoraConfig.from_finetune(c) if kind is LoraWeights else None,
                device=self.device, keep_dequantized=getattr(c, "keep_dequantized_mib", 0) << 20)

        self.auto_checkpointing = c.use_checkpointing is None
        """Whether the run chose its activation checkpointing from the memory estimate (the default)."""
        if self.auto_checkpointing:
            without = estimate(checkpointing=False)
            keeping = getattr(c, "keep_dequantized_mib", 0)  # keeps decoded matrices for a backward without recompute
            self.config = c = dataclasses.replace(c, use_checkpointing=not keeping and not self._fits(without))
        self.memory = estimate(checkpointing=c.use_checkpointing)
        self._check_memory()
        self._check_compute_dtype()
        self.model = build_model(self.base, self.model_config, self.device, dtype=matrix_dtype,
                                 keep_quantized=keep_quantized, embedding_dtype=embedding_dtype)
        self.model.n_ctx = llama_cpp_context(c.ctx)  # LongRoPE's factors: those llama.cpp uses at this context
        n_ctx_train = self.model_config.n_ctx_train
        if c.ctx > n_ctx_train:
            self.warnings.append(f"--ctx {c.ctx} is above the model's training context {n_ctx_train}; "
                                 "quality beyond it is not what the model learned")
        if getattr(c, "ref_model", None):
            self.reference = self._reference_model(matrix_dtype, embedding_dtype, keep_quantized)
        self.notes = self._compute_notes()
        self.weights = kind(c, self.model, self.base, self.seed, self.device)
        self.optimizer = GGMLAdamW(self.weights.params, AdamConfig.from_finetune(c))
        self.scaler = (torch.amp.GradScaler(self.device.type, init_scale=F16_INITIAL_LOSS_SCALE) if c.dtype == "f16"
                       else None)
        """f16 compute's loss scaler: f16 gradients underflow to zero below 6e-8 and overflow above 65504, so the
        loss is multiplied by a scale that grows while the gradients stay finite and halves (skipping that step's
        update) when they do not; ``None`` in f32 and bf16, whose exponents are f32's."""
        self.counters = {"iteration": 0, "samples": 0, "tokens": 0, "epochs": 0}
        self.resumed_from = None
        if resume is not None:
            self._resume(load_checkpoint(resume))
        if c.use_checkpointing:
            enable_block_checkpointing(self.model)

    def _generations(self) -> None:
        """--sample-prompt's prompts (refused here when one does not fit the model's context) and --eval-generate's
        prompts of validation records with their answers."""
        c = self.config
        self.sample_prompts = sample_prompts(c.sample_prompt, c.sample_tokens, self.data, self.tokenizer,
                                             self.model_config)
        self.answer_data = answer_data(self.data) if self.val_batches and self.objective is None else None
        """The records whose validation answers an evaluation scores (chat or prompt/response); None: no score."""
        self.answer_prompts = answer_prompts(self.data, c.eval_generate, self.model_config) if self.answer_data else []
        if c.eval_generate and not self.answer_prompts:  # said, not refused, as --eval-every's
            self.warnings.append(f"{flag('eval_generate')} {c.eval_generate} has no validation records of chat or "
                                 "prompt/response kind whose answers fit the model's context, so it does nothing; "
                                 f"give {flag('val_data')} or {flag('val_split')} with such records")

    def _reference_model(self, matrix_dtype: torch.dtype, embedding_dtype: torch.dtype | None,
                         keep_quantized: bool) -> torch.nn.Module:
        """--ref-model, held as the base is held, frozen; its vocabulary must be the base's (the log-probabilities
        of the same token ids are compared)."""
        c = self.config
        self._reference_file = ref = read_gguf(c.ref_model)
        config = ModelConfig.from_gguf(ref)
        check_tensor_names(ref, config)
        if Tokenizer.from_gguf(ref).tokens != self.tokenizer.tokens:
            raise BadFlag(f"{flag('ref_model')} {c.ref_model}: its vocabulary is not the base's "
                          f"({config.n_vocab:,} tokens against {self.model_config.n_vocab:,}, or other texts); a "
                          "reference model must tokenize as the base does")
        model = build_model(ref, config, self.device, dtype=matrix_dtype, keep_quantized=keep_quantized,
                            embedding_dtype=embedding_dtype)
        model.n_ctx = llama_cpp_context(c.ctx)
        return model.requires_grad_(False).eval()

    def _compute_notes(self) -> list[str]:
        """A quantized base whose blocks the C decoders would take, when they could not be built here."""
        held = {m.ggml_type for m in self.model.modules() if isinstance(m, (QuantLinear, QuantEmbedding, QuantExperts))}
        held &= native.TYPES
        if not held or not policy.current(self.device).c_dequantize or native.native_types():
            return []
        names = ", ".join(sorted(t.name for t in held))
        return [f"no C compiler (cc) found, so the {names} blocks decode through torch, more slowly; install one "
                "(Debian/Ubuntu: apt install gcc) and the next run builds the faster decoders"]

    def _check_compute_dtype(self) -> None:
        """Warn when --dtype bf16/f16 is slower than f32 on this CPU: autocast exists to make the products faster,
        and a CPU without bf16/f16 dot products makes them several times slower instead."""
        c = self.config
        if c.dtype == "f32" or self.device.type != "cpu" or self.auto_dtype:
            return
        speed = cpu_matmul_speed_vs_f32(DTYPES[c.dtype])
        if speed < SLOW_COMPUTE_DTYPE:
            self.warnings.append(f"--dtype {c.dtype}: this CPU multiplies {c.dtype} matrices at {speed:.2f}x its f32 "
                                 f"speed (it has no {c.dtype} dot products): --dtype f32 trains faster here")

    def _model_overrides(self) -> dict[str, float]:
        c = self.config
        return {k: v for k, v in (("rms_eps", c.norm_rms_eps), ("rope_freq_base", c.rope_freq_base),
                                  ("rope_freq_scale", c.rope_freq_scale)) if v is not None}

    def _fits(self, memory: MemoryEstimate) -> bool:
        """Whether a run of this estimate leaves the machine (or the device) room: its resident part and its mapped
        weights within :data:`AUTO_CHECKPOINTING_SHARE` of what is available (unknown: no)."""
        available = available_bytes(self.device)
        share = 1 if self.device.type == "cuda" else max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        need = share * (memory.resident - memory.runtime) + memory.mapped
        return available is not None and need <= AUTO_CHECKPOINTING_SHARE * available

    def _check_memory(self) -> None:
        """Refuse a run whose expected peak exceeds what is available, before loading anything (unless --force), and
        say when the mapped quantized weights will page.

        Processes of one machine (torchrun's local ranks) share its memory: each needs its own."""
        available = available_bytes(self.device)
        if available is None:
            return
        share = 1 if self.device.type == "cuda" else max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        need = share * (self.memory.resident - self.memory.runtime)  # the ranks share the mapped file's pages
        if need <= available:
            if need + self.memory.mapped > available:
                self.warnings.append(
                    f"the base's {self.memory.mapped / GIB:.2f} GiB of quantized weights, read from the mapped file "
                    f"as each step uses them, do not all fit beside the run's {need / GIB:.2f} GiB in the "
                    f"{available / GIB:.2f} GiB available: the kernel will page them, reading some from disk again "
                    "each step (the run goes on, slower)")
            return
        if self.config.force:
            return
        where = f"{self.device}'s free memory" if self.device.type == "cuda" else "the memory available (MemAvailable)"
        ranks = f" for its {share} processes on this machine" if share > 1 else ""
        raise BadFlag(f"this run needs about {need / GIB:.2f} GiB{ranks} more than is loaded now "
                      f"({self.memory.parts()} GiB), and {where} is {available / GIB:.2f} GiB; "
                      f"lower it with {ways_to_lower(self.config, self.memory)}, or pass --force to start anyway")

    # --- data ----------------------------------------------------------------------------------
    def _open_data(self, records: Sequence[Mapping[str, Any]] | None) -> DataStream:
        """Records (a list, a .jsonl/.parquet file or folder, or a forced record format) or plain text."""
        c = self.config
        if self.objective is not None and records is None and not is_record_source(c.train_data):
            raise BadData(f"--objective {c.objective} trains on preference records ({{prompt, chosen, rejected}}) "
                          f"in a .jsonl or .parquet file (or a folder of them); --train-data {c.train_data} is "
                          "plain text")
        if (self.objective is not None or records is not None or is_record_source(c.train_data)
                or c.data_format in ("chat", "prompt-response")):
            source = records if records is not None else c.train_data
            flag = "records" if records is not None else "--train-data"
            stream = PreferenceData if self.objective is not None else RecordData
            return stream(load_records(source, flag), self.tokenizer, c.ctx, RecordOptions.from_finetune(c),
                          self.seed, self.base.get("tokenizer.chat_template"), name=flag)
        return TrainingData(read_text_file(c.train_data, "--train-data"), self.tokenizer,
                            n_ctx=c.ctx, options=DataOptions.from_finetune(c), seed=self.seed,
                            name=f"--train-data {c.train_data}")

    def _validation_batches(self, val_records: Sequence[Mapping[str, Any]] | None) -> list[Batch]:
        c = self.config
        if val_records is not None:
            return self.data.held_out_batches(val_records, c.batch, "val_records")
        if c.val_data:
            return self.data.held_out_batches(c.val_data, c.batch, "--val-data")
        if c.val_split:
            return self.data.split_validation(c.val_split, c.batch)
        return []

    # --- resume --------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything besides the trained tensors that an exact resume needs."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "data": self.data.state_dict(),
            "counters": dict(self.counters),
            "torch_rng": torch.get_rng_state(),
            # dropout on CUDA draws from the device's generator
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            "seed": self.seed,
            "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "objective": self._objective_record(),
        }

    def _objective_record(self) -> dict[str, Any]:
        """What the run's loss is: --objective, the options its loss reads, and the reference model's identity (the
        base's when DPO's reference is the base with the adapter off), so that a resume can tell a change."""
        c = self.config
        objective = getattr(c, "objective", "sft")  # ggtorch train has only the cross-entropy
        record: dict[str, Any] = {"objective": objective}
        record |= {name: getattr(c, name) for name in OBJECTIVE_OPTIONS.get(objective, ())}
        if objective in REFERENCE_OBJECTIVES:
            record["ref_model"] = c.ref_model or ""
            record["reference"] = base_identity(self._reference_file if self.reference is not None else self.base)
        return record

    def _check_objective(self, ck: Checkpoint) -> None:
        """Refuse to continue a checkpoint under another objective or reference model (its adapter and moments
        were trained for that loss); say once when a loss weight changed (--beta and the like may be a deliberate
        schedule, as --adam-alpha may); note that a checkpoint without the record cannot be checked."""
        if not hasattr(self.config, "objective"):  # ggtorch train: one loss, nothing to tell apart
            return
        now = self._objective_record()
        was = ck.state.get("objective")
        if not isinstance(was, dict):  # written before checkpoints recorded it: its objective is unknown
            self.notes.append(f"{ck.path} was written before checkpoints recorded their objective, so resuming it "
                              f"with --objective {now['objective']} is not checked; it must have trained with that")
            return
        if was.get("objective") != now["objective"]:
            old, new = was.get("objective"), now["objective"]
            fix = ("; or, to preference-train after supervised finetuning, merge its adapter into the base first "
                   "(ggtorch export-lora) and start a new run on the merged model (docs/preference.md)"
                   if old == "sft" else f", or start a new run with {flag('checkpoint_in')} ''")
            raise BadFlag(f"{ck.path} was trained with --objective {old}, and this run asks for --objective {new}: "
                          f"pass --objective {old} to continue it{fix}")
        if was.get("reference") != now.get("reference"):
            raise BadFlag(f"{ck.path} was trained against {_reference(was)} as its reference model, and this run's "
                          f"is {_reference(now)}, another model: the rewards would be measured from another start; "
                          f"pass the reference it trained with, or start a new run with {flag('checkpoint_in')} ''")
        changed = [f"{flag(name)} {now[name]} (it trained with {was[name]})"
                   for name in OBJECTIVE_OPTIONS.get(now["objective"], ()) if name in was and was[name] != now[name]]
        if changed:
            self.notes.append(f"{ck.path} resumes with {', '.join(changed)}: the loss changes scale from here; pass "
                              "its values to continue it as it trained")

    def _resume(self, ck: Checkpoint) -> None:
        ck.check_base(self.base)
        self.weights.load_checkpoint(ck)  # a checkpoint of the other command is refused first, naming it
        self._check_objective(ck)
        self.optimizer.load_state_dict(ck.state["optimizer"])
        self.warnings += self.data.load_state_dict(ck.state["data"], force_reshuffle=self.config.force_reshuffle)
        self.counters = dict(ck.state["counters"])
        torch.set_rng_state(ck.state["torch_rng"])
        if self.device.type == "cuda" and ck.state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(ck.state["cuda_rng"], self.device)
        if self.scaler is not None and ck.state.get("grad_scaler"):
            self.scaler.load_state_dict(ck.state["grad_scaler"])  # a run resumed in f16 goes on at its loss scale
        self.resumed_from = ck.path

    # --- files ---------------------------------------------------------------------------------
    def _files(self, output_field: str, records_given: bool) -> tuple[list[Input], list[Output]]:
        """What the run reads (but the checkpoint it resumes) and writes, named by their flags: checked, and the
        outputs locked, before any work. The outputs come in this order: checkpoint, adapter or model, log, then
        --tensorboard's folder when given."""
        c = self.config
        base_flags = ("model_base", "vocab_model")
        inputs = [Input(flag(name), getattr(c, name)) for name in base_flags if getattr(c, name, "")]
        if not records_given:
            inputs.append(Input(flag("train_data"), c.train_data, folder=None))
        inputs += [Input(flag("val_data"), c.val_data, folder=None)] if c.val_data else []
        inputs += [Input(flag("chat_template"), c.chat_template)] if c.chat_template else []
        inputs += [Input(flag("ref_model"), c.ref_model)] if getattr(c, "ref_model", None) else []
        templated = {"pattern": c.pattern_fn_it, "latest": c.fn_latest}
        outputs = [Output(flag("checkpoint_out"), c.checkpoint_out, **templated),
                   Output(flag(output_field), getattr(c, output_field), **templated),
                   Output(flag("log_file"), self.log_path(output_field))]
        outputs += [Output(flag("tensorboard"), c.tensorboard, folder=True)] if c.tensorboard else []
        return inputs, outputs

    def _resume_path(self) -> Path | None:
        """The checkpoint this run continues: --checkpoint-in (checked to exist), or without it the old default
        name when that file is there; None starts a new run."""
        c = self.config
        if c.checkpoint_in is None:
            default = Path(DEFAULT_CHECKPOINT_IN)
            return default if default.is_file() else None
        return Path(c.checkpoint_in) if c.checkpoint_in else None

    def _refuse_to_replace_another_run(self, outputs: Sequence[Output]) -> None:
        """A new run whose saves would replace another run's checkpoint or output refuses to start, saying how to
        resume that run instead or to start over on purpose (--overwrite)."""
        checkpoints = outputs[0].existing()
        for out in outputs:
            found = out.existing()
            if not found:
                continue
            what = _describe_existing(found[0])
            resume = (f"resume it with {flag('checkpoint_in')} {checkpoints[0]}" if checkpoints
                      else f"resume it with {flag('checkpoint_in')} and its checkpoint")
            raise BadFlag(f"{found[0]} is there from another run{what}, and this new run's saves "
                          f"({out.flag} {out.path}) would replace it: {resume}, or pass {flag('overwrite')} to start a "
                          f"new run over it, or give this run other output names")

    def log_path(self, output_field: str | None = None) -> Path:
        """--log-file, or ``<first output's stem>-log.jsonl`` beside the first output."""
        c = self.config
        if c.log_file:
            return Path(c.log_file)
        field = output_field or weights_kind(c).output_field
        outputs = [t for t in (c.checkpoint_out, getattr(c, field)) if t]
        first = outputs[0] if outputs else "ggtorch-train"
        stem = Path(output_name(Path(first).name, c.pattern_fn_it, "")).stem.strip("-_.") or "train"
        return Path(first).parent / f"{stem}-log.jsonl"

    def hold_outputs(self) -> None:
        """Lock the run's output names again (a Trainer trained again after :meth:`release_outputs`); BadFlag when
        another process took them meanwhile."""
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.acquire()

    def release_outputs(self) -> None:
        """Let other runs write these output names (the run is not writing now; :meth:`hold_outputs` takes them
        back)."""
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()

    def _release_lock(self) -> None:
        self.release_outputs()
        self._lock = None

    def close(self) -> None:
        """Leave the process group, let go of the outputs and remove a new model's temporary file."""
        self.dist.close()
        self._release_lock()
        if self._scratch_dir is not None:
            self._scratch_dir.cleanup()
            self._scratch_dir = None


def _describe_existing(path: Path) -> str:
    """`` (a checkpoint at iteration N)`` for a file a run wrote (an adapter, a model: what and its iteration), else
    nothing (a file that cannot be read as GGUF)."""
    try:
        f = read_gguf(path)
    except GGTorchError:
        return ""
    iteration = f.get("training.iteration_count")
    what = {"training checkpoint": "a checkpoint", "LoRA adapter": "an adapter"}.get(f.kind, f"a {f.kind}")
    return f" ({what} at iteration {iteration})" if iteration is not None else f" ({what})"


def _reference(record: Mapping[str, Any]) -> str:
    """How a run named its reference model, for a message."""
    return f"{flag('ref_model')} {record['ref_model']}" if record.get("ref_model") else "the base, adapter off"


def _options_hash(config: RunConfig) -> int:
    """A fingerprint of the options every rank must share (not the per-rank device, threads or checkpointing, which
    each rank chooses from its machine's memory by default)."""
    options = {k: v for k, v in dataclasses.asdict(config).items()
               if k not in ("device", "threads", "use_checkpointing")}  # a rank's own; recomputing changes no number
    return zlib.crc32(json.dumps(options, sort_keys=True, default=str).encode())

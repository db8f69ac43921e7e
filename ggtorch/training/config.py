"""The options of a training run: one dataclass per command, each field the single source of one option.

:class:`RunConfig` holds what ``ggtorch finetune`` and ``ggtorch train`` share (files, the run,
records, the optimizer, the old sample options); :class:`FinetuneConfig` adds the base model,
LoRA and the adapter output, :class:`TrainConfig` a new model's shape and the model output.

A field's name is the config-file key (``configs/``, '-' or '_') and the API keyword; its long
flag is the name with dashes; :func:`option` puts the other spellings, the help and the
``--help`` group in its metadata; its ``Literal`` annotation (or ``choices``, for a table kept
elsewhere) gives the allowed values. The CLI's click options (:mod:`ggtorch.cli.options`) and
every message below are generated from the fields.

Options that configure a part of the machinery take their defaults from that part
(:class:`~ggtorch.training.optim.AdamConfig`, :class:`~ggtorch.lora.LoraConfig`,
:class:`~ggtorch.data.DataOptions`, :class:`~ggtorch.data.RecordOptions`), which also holds the
part's own rules; each part is built from a run config by its ``from_finetune``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import tomllib
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, Union, get_args, get_origin, get_type_hints

import yaml

from ggtorch.data import FORMATS, DataOptions, RecordOptions
from ggtorch.data.packing import Batching, LongRecords
from ggtorch.data.samples import UTF8Errors
from ggtorch.errors import BadFlag, flag
from ggtorch.io.model_file import OUTTYPES
from ggtorch.io.paths import check_latest_name
from ggtorch.lora import LoraConfig
from ggtorch.lora.config import MAX_RANK
from ggtorch.models.init import INITS
from ggtorch.ops.dtypes import F32_MAX, DTypeChoice, DTypeName, finite_in_f32
from ggtorch.training.distributed import BACKENDS
from ggtorch.training.optim import AdamConfig
from ggtorch.training.preference import OBJECTIVE_OPTIONS, OBJECTIVES, REFERENCE_OBJECTIVES

DEFAULT_CHECKPOINT_IN = "checkpoint.gguf"
"""What a run resumes from when --checkpoint-in is not given, if that file exists (the old finetune's default)."""

NAN_SKIP_LIMIT = 10
"""With --on-nan skip, this many non-finite steps in a row stop the run anyway."""

SEED_MAX = 2**32 - 1
"""The largest --seed: the LoRA init and the old sample shuffle seed ``std::mt19937`` with 32 bits, so larger seeds
would repeat smaller ones."""

MAX_THREADS = os.cpu_count() or 1
"""The largest --threads: this machine's logical CPUs. A torch thread team larger than the CPUs waits at every
parallel region for members without a core (ggtorch.ops.threads): steps run hundreds of times slower, never
faster."""

PREFERENCE_WEIGHT_MAX = 100.0
"""The largest --beta and --orpo-lambda, 1000 times their default (TRL's): beyond it DPO's sigmoid saturates once a
margin passes a tenth of a nat, and ORPO's odds-ratio term outweighs the answers' likelihood a thousandfold. --beta
1e30 trained a loss of 1.5e25 and wrote the adapter."""

# --help groups; each command orders them (ggtorch.cli.finetune, ggtorch.cli.train)
FILES = "Model and data"
RECORDS = "Instruction and chat records (docs/chat-data.md)"
OUTPUTS = "Outputs and checkpoints"
TRAINING = "Training"
SHAPE = "New model shape (with --vocab-model)"
LORA = "LoRA"
OPTIMIZER = "Optimizer (ggml AdamW)"
SAMPLES = "Samples (as the old finetune built them)"
OVERRIDES = "Model overrides"
PREFERENCE = "Preference training (docs/preference.md)"
GENERATIONS = "Generated samples and answer metrics (docs/chat-data.md)"

SAMPLE_TOKENS = 48
"""--sample-tokens' default: a sentence or two of each sample."""


@dataclass(frozen=True)
class OptionInfo:
    """What a field's metadata says about its option."""

    help: str
    group: str
    flags: tuple[str, ...] = ()
    """Spellings besides the long flag: short names and old aliases."""
    off: str | None = None
    """A switch's 'off' spelling (``--no-checkpointing``); without one a switch can only be turned on."""
    minimum: float | None = None
    """The smallest value allowed."""
    maximum: float | None = None
    """The largest value allowed."""
    above: float | None = None
    """A bound the value must exceed (``--beta`` above 0): for floats, whose smallest allowed value has no name."""
    below: float | None = None
    """A bound the value must stay under (``--val-split`` below 1)."""
    choices: tuple[str, ...] | None = None
    """Allowed values kept in a table elsewhere; otherwise the field's Literal annotation gives them."""
    default_text: str | None = None
    """What a None default means, for --help (other defaults are shown as they are)."""

    def __post_init__(self) -> None:
        assert self.minimum is None or self.above is None, "one lower bound"
        assert self.maximum is None or self.below is None, "one upper bound"

    def in_range(self, value: float) -> bool:
        return ((self.minimum is None or value >= self.minimum) and (self.maximum is None or value <= self.maximum)
                and (self.above is None or value > self.above) and (self.below is None or value < self.below))

    def range_text(self) -> str | None:
        """The range as messages and --help say it ("at least 1", "in [0, 1)"); None: any value of the type.

        A range with an open end is written as an interval; a closed one (every whole-number option's) in words."""
        low, high = self.minimum if self.minimum is not None else self.above, \
            self.maximum if self.maximum is not None else self.below
        if low is not None and high is not None and (self.above is not None or self.below is not None):
            return (f"in {'(' if self.above is not None else '['}{_number(low)}, "
                    f"{_number(high)}{')' if self.below is not None else ']'}")
        words = [f"{'above' if self.above is not None else 'at least'} {_number(low)}" if low is not None else "",
                 f"{'below' if self.below is not None else 'at most'} {_number(high)}" if high is not None else ""]
        return " and ".join(w for w in words if w) or None


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def option(default: Any, help: str, group: str, *, flags: Sequence[str] = (), off: str | None = None,
           minimum: float | None = None, maximum: float | None = None, above: float | None = None,
           below: float | None = None, choices: Iterable[str] | None = None, default_text: str | None = None) -> Any:
    """A dataclass field for one option: its default, and its flag spellings, help and checks as metadata."""
    info = OptionInfo(help, group, tuple(flags), off, minimum, maximum, above, below,
                      tuple(choices) if choices is not None else None, default_text)
    return dataclasses.field(default=default, metadata={"option": info})


def option_info(f: dataclasses.Field[Any]) -> OptionInfo:
    return f.metadata["option"]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _literal_values(tp: Any) -> tuple[str, ...]:
    """The values of a Literal annotation, through unions (``Literal[...] | None``, ``Literal[...] | Alias``)."""
    if get_origin(tp) is Literal:
        return get_args(tp)
    if get_origin(tp) in (Union, types.UnionType):
        return tuple(v for arg in get_args(tp) for v in _literal_values(arg))
    return ()


def choices(cls: type, f: dataclasses.Field[Any]) -> tuple[str, ...] | None:
    """The values option ``f`` of ``cls`` allows (None: any of its type)."""
    return option_info(f).choices or _literal_values(_hints(cls)[f.name]) or None


def value_type(cls: type, f: dataclasses.Field[Any]) -> type:
    """The type of option ``f``'s values, without None (bool, int, float or str)."""
    tp = _hints(cls)[f.name]
    if get_origin(tp) in (Union, types.UnionType):
        tp = next(arg for arg in get_args(tp) if arg is not type(None))
    return str if get_origin(tp) is Literal else tuple if get_origin(tp) is tuple else tp


EXPECTED = {bool: "true or false", int: "a whole number", float: "a number", str: "text",
            tuple: "a list of texts"}
"""How a message names the values of each option type."""


def _takes_none(cls: type, f: dataclasses.Field[Any]) -> bool:
    tp = _hints(cls)[f.name]
    return get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp)


def describe_value(value: Any) -> str:
    """A value as a message shows it: its type where the type is what is wrong."""
    if isinstance(value, str):
        return f"the text {value!r}"
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return repr(value)
    if value is None:
        return "nothing (null)"
    return f"a {type(value).__name__} ({str(value)[:40]})"


def check_value(cls: type, f: dataclasses.Field[Any], value: Any) -> None:
    """Refuse a value of option ``f`` of ``cls`` that is not of its type, not one of its choices or out of its range:
    the one check of a flag, a config-file key and an API keyword."""
    expected = value_problem(cls, f, value)
    if expected is not None:
        raise BadFlag(f"{flag(f.name)} must be {expected}, got {describe_value(value)}")
    if value is None:
        return
    allowed = choices(cls, f)
    if allowed is not None and value not in allowed:
        raise BadFlag(f"{flag(f.name)} must be one of {', '.join(allowed)}, got '{value}'")
    info = option_info(f)
    if not isinstance(value, bool) and isinstance(value, (int, float)) and not info.in_range(value):
        fix = f"; leave it out to use {info.default_text}" if f.default is None and info.default_text else ""
        raise BadFlag(f"{flag(f.name)} must be {info.range_text()}, got {value}{fix}")


def value_problem(cls: type, f: dataclasses.Field[Any], value: Any) -> str | None:
    """What option ``f`` of ``cls`` expects, when ``value`` is not of its type (or, for a number, not finite in
    f32, where it will be used); None when it is. A flag, a config file and an API keyword are held to the same."""
    kind = value_type(cls, f)
    if value is None:
        return None if _takes_none(cls, f) else EXPECTED[kind]
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return EXPECTED[float]
        ok = finite_in_f32(value)  # every float option ends up in f32 (optimizer state, LoRA scales, rope, norms)
        if not ok:
            return f"a finite number within f32's range (±{F32_MAX:.4g})"
    elif kind is tuple:  # a repeatable option's texts (--sample-prompt)
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
    else:
        ok = isinstance(value, str)
    return None if ok else EXPECTED[kind]


@dataclass
class RunConfig:
    """The options ``ggtorch finetune`` and ``ggtorch train`` share; defaults are the old llama.cpp programs'."""

    command: ClassVar[str] = ""
    """The ``ggtorch`` command these options configure (in messages)."""

    # --- data ----------------------------------------------------------------------------------
    train_data: str = option(
        "shakespeare.txt", "Training text (UTF-8), or records: a .jsonl/.parquet file or a folder of them.", FILES)
    val_data: str | None = option(None, "Separate text (or records) for a held-out validation loss.", FILES)
    val_split: float = option(0.0, "Fraction of the training text held out for validation (0: none).", FILES,
                              minimum=0.0, below=1.0)
    eval_every: int = option(0, "Validation loss every N iterations (0: only at the end).", FILES, minimum=0)
    utf8_errors: UTF8Errors = option(
        DataOptions.utf8_errors, "Invalid UTF-8 in text: stop with the byte offset, or replace it with U+FFFD.",
        FILES)

    # --- instruction and chat records (docs/chat-data.md) ----------------------------------------
    data_format: str = option(
        RecordOptions.data_format, "Record format: messages (chat), prompt/response or instruction/output, text; "
        "auto: from the first record's keys.", RECORDS, choices=FORMATS)
    chat_template: str | None = option(RecordOptions.chat_template, "Jinja chat template file for chat records.",
                                       RECORDS, default_text="the model's tokenizer.chat_template")
    train_on_prompt: bool = option(RecordOptions.train_on_prompt, "Loss on every token, not only on the answers.",
                                   RECORDS)
    batching: Batching = option(
        RecordOptions.batching, "pack: several records per context, attention kept within each; pad: one per row.",
        RECORDS)
    long_records: LongRecords = option(
        RecordOptions.long_records, "Records longer than --ctx: keep the start, or split them into pieces.", RECORDS)

    # --- outputs and checkpoints --------------------------------------------------------------------
    checkpoint_in: str | None = option(
        None, "Resume from this checkpoint (it must exist; '' starts a new run).", OUTPUTS,
        default_text=f"{DEFAULT_CHECKPOINT_IN} when it exists, as the old finetune")
    checkpoint_out: str = option("checkpoint-ITERATION.gguf", "Checkpoint file ('' disables).", OUTPUTS)
    pattern_fn_it: str = option("ITERATION", "Text in output names replaced by the iteration.", OUTPUTS)
    fn_latest: str = option("LATEST", "Replacement for the pattern in the always-current copy of each output.",
                            OUTPUTS)
    save_every: int = option(10, "Save every N iterations (<= 0: only at the end).", OUTPUTS)
    log_file: str | None = option(None, "JSON-lines training log.", OUTPUTS, default_text="beside the outputs")
    tensorboard: str | None = option(
        None, "Also write the log's numbers (training loss, learning rate, tokens/s, validation loss, ...) per "
        "iteration as TensorBoard event files into this folder; needs pip install 'ggtorch[tensorboard]'.", OUTPUTS,
        default_text="none")
    overwrite: bool = option(False, "Start a new run where another run's checkpoints or outputs are (they are "
                             "replaced as this run saves); without it such a run refuses to start.", OUTPUTS)

    # --- the run ----------------------------------------------------------------------------------
    ctx: int = option(128, "Context length used for training.", TRAINING, flags=("-c",), minimum=1)
    batch: int = option(8, "Sequences per micro-batch.", TRAINING, flags=("-b",), minimum=1)
    grad_acc: int = option(1, "Micro-batches accumulated per optimizer step (below 1: 1).", TRAINING)
    adam_iter: int = option(256, "Optimizer steps in this run (a resumed run continues the count).", TRAINING,
                            flags=("-n",), minimum=1)
    epochs: int = option(-1, "Stop after N epochs over the samples (<= 0: no limit).", TRAINING)
    seed: int = option(-1, "Seed of the initial weights (LoRA or a new model) and the shuffling; -1 uses the time.",
                       TRAINING, flags=("-s",), minimum=-1, maximum=SEED_MAX)
    threads: int | None = option(None, "torch CPU threads, kept as given (as is OMP_NUM_THREADS).", TRAINING,
                                 flags=("-t",), minimum=1, maximum=MAX_THREADS,
                                 default_text="the cores other processes leave free, checked as it runs")
    use_checkpointing: bool | None = option(
        None, "Gradient checkpointing per transformer block: each block's activations are recomputed in backward "
        "(less memory; every product of the forward runs twice, a third of a step's work).", TRAINING,
        off="--no-checkpointing",
        default_text="auto: off where the memory estimate has room for every block's activations, else on")
    device: str = option("auto", "auto (CUDA, else MPS, else the CPU), cpu, cuda, cuda:N or mps.", TRAINING)
    dtype: DTypeChoice = option("auto", "Compute dtype (bf16/f16: autocast, f16 with a gradient scaler); auto: bf16 "
                                "where the device multiplies it natively and faster than f32 (CUDA from Ampere; "
                                "CPUs with AMX or AVX512-BF16), else f32.", TRAINING)
    dist_backend: str | None = option(None, "torch.distributed backend under torchrun.", TRAINING, choices=BACKENDS,
                                      default_text="nccl on CUDA, else gloo")
    force: bool = option(False, "Start even when the expected peak memory exceeds the memory available.",
                         TRAINING)
    on_nan: Literal["stop", "skip"] = option(
        "stop", "A NaN/inf loss: stop (keeping the last saved checkpoint), or skip that step's update (stops after "
        f"{NAN_SKIP_LIMIT} in a row).", TRAINING)

    # --- optimizer (ggml AdamW) ----------------------------------------------------------------------
    adam_alpha: float = option(AdamConfig.alpha, "Learning rate.", OPTIMIZER)
    adam_min_alpha: float = option(AdamConfig.min_alpha, "Learning-rate floor, warmup included.", OPTIMIZER)
    adam_decay: float = option(AdamConfig.decay, "Decoupled weight decay (AdamW).", OPTIMIZER)
    adam_decay_min_ndim: int = option(AdamConfig.decay_min_ndim, "Decay only tensors with >= N dims.", OPTIMIZER)
    adam_beta1: float = option(AdamConfig.beta1, "First-moment decay.", OPTIMIZER)
    adam_beta2: float = option(AdamConfig.beta2, "Second-moment decay.", OPTIMIZER)
    adam_gclip: float = option(AdamConfig.gclip, "Global gradient-norm clip; 0 disables.", OPTIMIZER)
    adam_epsf: float = option(AdamConfig.epsf, "Relative loss change that stops training; 0 disables.", OPTIMIZER)
    warmup: int = option(AdamConfig.warmup, "Warmup steps.", OPTIMIZER)
    cos_decay_steps: int = option(AdamConfig.cos_decay_steps, "Cosine decay steps.", OPTIMIZER)
    cos_decay_restart: float = option(AdamConfig.cos_decay_restart, "Decay-steps multiplier after a restart.",
                                      OPTIMIZER)
    cos_decay_min: float = option(AdamConfig.cos_decay_min, "Cosine decay minimum.", OPTIMIZER)
    enable_restart: bool = option(AdamConfig.enable_restart, "Cosine decay restarts.", OPTIMIZER,
                                  off="--disable-restart")
    opt_past: int = option(AdamConfig.opt_past, "Iterations for the delta convergence test; 0 disables.", OPTIMIZER)
    opt_delta: float = option(AdamConfig.opt_delta, "Max relative delta for that test.", OPTIMIZER)
    opt_max_no_improvement: int = option(AdamConfig.opt_max_no_improvement,
                                         "Stop after N steps without a new best loss; 0 disables.", OPTIMIZER)

    # --- samples (the old finetune's) --------------------------------------------------------------------
    sample_start: str = option(DataOptions.sample_start,
                               "Samples start after each occurrence of STR ('' = every token).", SAMPLES)
    include_sample_start: bool = option(DataOptions.include_sample_start, "Keep the sample-start text in samples.",
                                        SAMPLES)
    escape: bool = option(DataOptions.escape, "Process \\n, \\t, \\xHH ... escapes in --sample-start.", SAMPLES)
    overlapping_samples: bool = option(DataOptions.overlapping_samples, "Samples run past the next sample start.",
                                       SAMPLES)
    fill_with_next_samples: bool = option(DataOptions.fill_with_next_samples,
                                          "Fill short samples with the following ones.", SAMPLES)
    separate_with_eos: bool = option(DataOptions.separate_with_eos, "EOS between filled samples.", SAMPLES,
                                     off="--no-separate-with-eos")
    separate_with_bos: bool = option(DataOptions.separate_with_bos, "BOS between filled samples.", SAMPLES,
                                     off="--no-separate-with-bos")
    sample_random_offsets: bool = option(DataOptions.sample_random_offsets, "Start samples at random offsets.",
                                         SAMPLES)
    force_reshuffle: bool = option(DataOptions.force_reshuffle, "Reshuffle at start instead of resuming the order.",
                                   SAMPLES)

    # --- generated samples and answer metrics (docs/chat-data.md) ---------------------------------------
    sample_prompt: tuple[str, ...] = option(
        (), "Log the model's greedy continuation of TEXT as it trains (repeatable): for chat records TEXT is a user "
        "message, rendered with the chat template and its generation prompt; for prompt/response records the "
        "instruction; otherwise text continued after BOS. A finetune's first sample also shows the base's (the "
        "adapter off).", GENERATIONS)
    sample_every: int | None = option(None, "Sample every N iterations and at the end of the run (0: never).",
                                      GENERATIONS, minimum=0,
                                      default_text="with --sample-prompt, every --save-every iterations (<= 0: at "
                                      "the end)")
    sample_tokens: int = option(SAMPLE_TOKENS, "New tokens per sample, at most (it stops at an end-of-generation "
                                "token).", GENERATIONS, minimum=1)
    eval_generate: int = option(0, "Each evaluation of chat or prompt/response records also generates the answers "
                                "of the first N validation records greedily and logs the share equal to the "
                                "reference (exact match; 0: off). The answer-token accuracy is always logged.",
                                GENERATIONS, minimum=0)

    # --- model overrides ---------------------------------------------------------------------------------
    norm_rms_eps: float | None = option(None, "RMSNorm epsilon.", OVERRIDES, above=0.0,
                                        default_text="the model's value")
    rope_freq_base: float | None = option(None, "RoPE frequency base.", OVERRIDES, above=0.0,
                                          default_text="the model's value")
    rope_freq_scale: float | None = option(None, "RoPE frequency scale.", OVERRIDES, above=0.0,
                                           default_text="the model's value")

    def __post_init__(self) -> None:
        self._check_fields()
        if self.grad_acc < 1:
            self.grad_acc = 1  # the old finetune clamped --grad-acc to >= 1
        if self.val_split and self.val_data:
            raise BadFlag(f"{flag('val_split')} and {flag('val_data')} exclude each other; pass one of them")
        AdamConfig.from_finetune(self)  # the optimizer's own rules
        check_latest_name(self.pattern_fn_it, self.fn_latest, self.checkpoint_out)  # names that collide
        self._check_samples()

    def _check_samples(self) -> None:
        """--sample-every and --sample-tokens configure --sample-prompt's samples: without one they would change
        nothing, so they are refused rather than silently ignored."""
        for name in ("sample_every", "sample_tokens"):
            if self.given(name) and not self.sample_prompt:
                raise BadFlag(f"{flag(name)} applies to the samples of {flag('sample_prompt')}, and none is given; "
                              f"add {flag('sample_prompt')} TEXT or drop it")

    def _check_fields(self) -> None:
        """The rules every option may declare: its type, its choices and its range."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, os.PathLike) and value_type(type(self), f) is str:  # a notebook's Path: a file name
                value = os.fspath(value)
                setattr(self, f.name, value)
            if isinstance(value, str | list) and value_type(type(self), f) is tuple:  # a lone text is one of them
                value = (value,) if isinstance(value, str) else tuple(value)
                setattr(self, f.name, value)
            check_value(type(self), f, value)

    def given(self, name: str) -> bool:
        """Whether option ``name`` was set to other than its default: how a rule knows a flag was passed, the same
        for a flag, a config file and an API keyword (each passes only what the user set; setting the default is
        setting nothing)."""
        f = next(f for f in fields(self) if f.name == name)
        return getattr(self, name) != f.default

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def check_names(cls, names: Iterable[str], where: str) -> None:
        """Refuse options ``cls`` does not have, naming close matches and the command that has them."""
        unknown = sorted(set(names) - cls.field_names())
        if not unknown:
            return
        described = []
        for name in unknown:
            close = difflib.get_close_matches(name, cls.field_names(), n=1)
            owners = [c.command for c in RunConfig.__subclasses__() if name in c.field_names()]
            described.append(name + (f" (an option of ggtorch {owners[0]})" if owners
                                     else f" (did you mean {close[0]}?)" if close else ""))
        raise BadFlag(f"{where}: unknown option(s) {', '.join(described)}; the options of ggtorch {cls.command} "
                      "are its long flag names, '_' or '-' (adam_alpha or adam-alpha)")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **overrides: Any) -> Self:
        """Read a YAML or TOML config (keys are field names, '-' allowed); ``overrides`` win."""
        options = {**read_config_file(path, cls), **overrides}
        cls.check_names(options, f"--config {path}")
        return cls(**options)

    def replace(self, **changes: Any) -> Self:
        type(self).check_names(changes, "replace()")
        return dataclasses.replace(self, **changes)


@dataclass
class FinetuneConfig(RunConfig):
    """Options of ``ggtorch finetune``: LoRA on a (possibly quantized) base; defaults are the old finetune's."""

    command: ClassVar[str] = "finetune"

    model_base: str = option("", "Base model GGUF (F32/F16/BF16 or any supported quantization, kept quantized).",
                             FILES)
    lora_out: str = option("ggml-lora-ITERATION-f32.gguf",
                           "Adapter in today's llama.cpp GGUF LoRA format ('' disables).", OUTPUTS)
    only_write_lora: bool = option(False, "Write the adapter from --checkpoint-in (or a fresh one) and exit without "
                                   "training.", OUTPUTS)
    drop_norms: bool = option(False, "Write --lora-out without the norm adapters (llama.cpp's format cannot carry "
                              "them).", OUTPUTS)
    base_dtype: Literal["quantized"] | DTypeName = option(
        "quantized", "Hold base weights as raw ggml blocks (quantized) or as floats (faster, more memory).", FILES)
    keep_dequantized_mib: int = option(
        0, "MiB of decoded quantized base matrices a forward may keep for its backward: those are decoded once "
        "per step instead of twice (faster, that much more memory; with --no-checkpointing).", TRAINING, minimum=0)

    # --- LoRA: LoraConfig holds the rules (lora.config.OPTION_NAMES, FINETUNE_RANK_FIELDS) -----------
    lora_r: int = option(LoraConfig.rank, f"Default rank of every adapted matrix (each rank at most {MAX_RANK}).", LORA)
    lora_alpha: float | None = option(LoraConfig.alpha, "Alpha; the adapter scale is alpha/r.", LORA,
                                      default_text="--lora-r: scale 1")
    lora_dropout: float = option(LoraConfig.dropout, "Dropout on the LoRA input (0: none).", LORA)
    rank_att_norm: int = option(0, "Rank of the attn_norm adapters; 0 = off (they only survive merges).", LORA)
    rank_ffn_norm: int = option(0, "Rank of the ffn_norm adapters; 0 = off (they only survive merges).", LORA)
    rank_out_norm: int = option(0, "Rank of the output_norm adapter; 0 = off (it only survives merges).", LORA)
    rank_tok_embd: int | None = option(None, "Rank for token_embd (0 = off).", LORA, default_text="--lora-r")
    rank_out: int | None = option(None, "Rank for output (0 = off).", LORA, default_text="--lora-r")
    rank_wq: int | None = option(None, "Rank for attn_q.", LORA, default_text="--lora-r")
    rank_wk: int | None = option(None, "Rank for attn_k.", LORA, default_text="--lora-r")
    rank_wv: int | None = option(None, "Rank for attn_v.", LORA, default_text="--lora-r")
    rank_qkv: int | None = option(None, "Rank for attn_qkv, the fused q|k|v matrix of models that have one "
                                  "(phi3) in place of attn_q/attn_k/attn_v.", LORA, default_text="--lora-r")
    rank_wo: int | None = option(None, "Rank for attn_output.", LORA, default_text="--lora-r")
    rank_ffn_gate: int | None = option(None, "Rank for ffn_gate (and a shared expert's ffn_gate_shexp).", LORA,
                                       flags=("--rank-ffn_gate",), default_text="--lora-r")
    rank_ffn_down: int | None = option(None, "Rank for ffn_down (and ffn_down_shexp).", LORA,
                                       flags=("--rank-ffn_down",), default_text="--lora-r")
    rank_ffn_up: int | None = option(None, "Rank for ffn_up (and ffn_up_shexp).", LORA, flags=("--rank-ffn_up",),
                                     default_text="--lora-r")
    rank_exps: int | None = option(None, "Rank for the routed experts of a MoE model (ffn_gate_exps, ffn_up_exps, "
                                   "ffn_down_exps; each expert its own pair, so E times the parameters of one "
                                   "matrix). 0 adapts attention and any shared expert only. Routers stay frozen. "
                                   "The default keeps all experts' adapters near the size of 8 experts' at --lora-r: "
                                   "r16 on each of Qwen3-30B-A3B's 18,432 expert matrices would be 830M parameters "
                                   "(13 GiB with AdamW), rank 1 is 52M.", LORA,
                                   default_text="--lora-r x 8 / the number of experts, at least 1")
    rank_linear_attn: int | None = option(None, "Rank for a Gated DeltaNet layer's attn_gate, ssm_beta, ssm_alpha and "
                                          "ssm_out (qwen35; its fused q|k|v takes --rank-qkv). The short "
                                          "convolution and the decay rates are never adapted.", LORA,
                                          default_text="--lora-r")
    rank_per_layer: int | None = option(None, "Rank for gemma4's per-layer embedding products in each block "
                                        "(inp_gate and proj; E2B/E4B). The model-wide per_layer_model_proj is never "
                                        "adapted.", LORA, default_text="--lora-r")

    # --- preference training (docs/preference.md) ------------------------------------------------
    objective: str = option("sft", "sft: the answers' (or the text's) cross-entropy; dpo, ipo or orpo: preference "
                            "pairs ({prompt, chosen, rejected} records) with that objective.", PREFERENCE,
                            choices=OBJECTIVES)
    beta: float = option(0.1, "DPO and IPO: how far the trained model may move from the reference (TRL's beta; "
                         "smaller moves further).", PREFERENCE, above=0.0, maximum=PREFERENCE_WEIGHT_MAX)
    label_smoothing: float = option(0.0, "DPO: the share of pairs assumed mislabelled (conservative DPO), 0 to "
                                    "below 0.5.", PREFERENCE, minimum=0.0, below=0.5)
    orpo_lambda: float = option(0.1, "ORPO: the weight of the odds-ratio term beside the chosen answers' NLL "
                                "(TRL's ORPOConfig.beta).", PREFERENCE, minimum=0.0, maximum=PREFERENCE_WEIGHT_MAX)
    ref_model: str | None = option(None, "DPO and IPO: a reference GGUF with the base's vocabulary, instead of the "
                                   "base with the adapter switched off.", PREFERENCE,
                                   default_text="the base, adapter off")

    def __post_init__(self) -> None:
        super().__post_init__()
        LoraConfig.from_finetune(self)  # the LoRA rules: ranks, alpha, dropout
        self._check_preference()
        if self.keep_dequantized_mib and self.use_checkpointing:
            raise BadFlag(f"{flag('keep_dequantized_mib')} needs --no-checkpointing (checkpointed blocks already "
                          "keep the matrices they decode for their backward)")
        if self.keep_dequantized_mib and self.base_dtype != "quantized":
            raise BadFlag(f"{flag('keep_dequantized_mib')} applies to a base held quantized; with --base-dtype "
                          f"{self.base_dtype} nothing is decoded, drop it")

    def _check_preference(self) -> None:
        """Options of other objectives than the run's are refused: a flag that changes nothing must not look as if
        it did (a TRL user's --beta for ORPO would leave ORPO's weight at its default)."""
        readers = {name: tuple(o for o, names in OBJECTIVE_OPTIONS.items() if name in names)  # option -> objectives
                   for names in OBJECTIVE_OPTIONS.values() for name in names} | {"ref_model": REFERENCE_OBJECTIVES}
        for name, objectives in readers.items():
            if self.given(name) and self.objective not in objectives:
                orpo = (name, self.objective) == ("beta", "orpo")
                trl = " (TRL's ORPOConfig.beta is --orpo-lambda here)" if orpo else ""
                raise BadFlag(f"{flag(name)} applies to --objective {' or '.join(objectives)}, not "
                              f"{self.objective}{trl}; drop it")
        if self.objective == "sft":
            return
        if self.objective == "ipo" and not finite_in_f32((0.5 / self.beta) ** 2):  # not a learning-rate problem
            raise BadFlag(f"{flag('beta')} {self.beta:g} with --objective ipo: IPO's loss aims at a margin of "
                          f"1/(2 beta) = {0.5 / self.beta:.3g}, whose square overflows f32, so every loss would be "
                          "inf; raise --beta (TRL's default is 0.1)")
        if self.train_on_prompt:
            raise BadFlag(f"{flag('train_on_prompt')} does not apply to --objective {self.objective}: preference "
                          "losses compare the answers")
        if self.given("data_format"):
            raise BadFlag(f"{flag('data_format')} does not apply to --objective {self.objective}: preference records "
                          "are {prompt, chosen, rejected} whatever their texts hold; drop it")

    @property
    def preference(self) -> bool:
        """Whether the run trains on preference pairs (--objective dpo, ipo or orpo)."""
        return self.objective != "sft"

    @property
    def alpha(self) -> float:
        return LoraConfig.from_finetune(self).lora_alpha


@dataclass
class TrainConfig(RunConfig):
    """Options of ``ggtorch train``: every weight of a new or a float model; shape defaults are
    train-text-from-scratch's."""

    command: ClassVar[str] = "train"

    vocab_model: str = option("", "Train a NEW model from scratch with this GGUF's vocabulary and tokenizer.", FILES)
    model_base: str = option("", "Or: full finetune of every weight of this F32/F16/BF16 model (quantized: use "
                             "`ggtorch finetune`).", FILES)
    model_out: str = option("ggml-model-ITERATION-f32.gguf", "Trained model as GGUF ('' disables).", OUTPUTS)
    outtype: str = option("f32", "ggml type of the written matrices.", OUTPUTS, choices=OUTTYPES)
    only_write_model: bool = option(False, "Write the model from --checkpoint-in (or the fresh init) and exit "
                                    "without training.", OUTPUTS)
    embd: int = option(256, "Embedding width.", SHAPE, minimum=1)
    ff: int = option(768, "Feed-forward width.", SHAPE, minimum=1)
    head: int = option(8, "Attention heads.", SHAPE, minimum=1)
    head_kv: int | None = option(None, "KV heads (grouped-query attention).", SHAPE, minimum=1,
                                 default_text="--head")
    layer: int = option(16, "Transformer blocks.", SHAPE, minimum=1)
    init: str = option("ggml", "Initial weights: ggml (train-text-from-scratch's, reproducible with it) or scaled "
                       "(GPT-2's; trains in far fewer steps).", SHAPE, choices=INITS)

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.vocab_model) == bool(self.model_base):
            raise BadFlag(f"pass exactly one of {flag('vocab_model')} (train a new model from scratch) and "
                          f"{flag('model_base')} (full finetune of an F32/F16/BF16 model)")

    @property
    def n_head_kv(self) -> int:
        return self.head_kv if self.head_kv is not None else self.head


def read_config_file(path: str | os.PathLike[str], config_cls: type[RunConfig]) -> dict[str, Any]:
    """The options of ``config_cls`` in a YAML or TOML file, keys normalized to field names.

    A file may hold the options of either command (a preset serves both); each takes its own.
    Keys no command knows are refused.
    """
    path = Path(path)
    if not path.is_file():
        raise BadFlag(f"--config: no such file '{path}'")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadFlag(f"--config {path}: not a text file; a config is YAML or TOML text (configs/ has "
                      "examples)") from None
    except OSError as e:
        raise BadFlag(f"--config {path}: cannot be read ({e.strerror or e})") from None
    try:
        if path.suffix.lower() == ".toml":
            raw = tomllib.loads(text)
        else:
            raw = yaml.safe_load(text) or {}
    except (yaml.YAMLError, tomllib.TOMLDecodeError, ValueError) as e:
        where = " ".join(str(e).split())
        raise BadFlag(f"--config {path}: cannot parse it as {'TOML' if path.suffix.lower() == '.toml' else 'YAML'} "
                      f"({where})") from None
    if not isinstance(raw, dict):
        raise BadFlag(f"--config {path}: expected a mapping of option names to values, got {describe_value(raw)}")
    options = {str(k).replace("-", "_"): v for k, v in raw.items()}
    any_command = set().union(*(c.field_names() for c in RunConfig.__subclasses__()))
    config_cls.check_names(set(options) - (any_command - config_cls.field_names()), f"--config {path}")
    own = {f.name: f for f in fields(config_cls)}
    for name, value in options.items():
        if name in own and (expected := value_problem(config_cls, own[name], value)) is not None:
            raise BadFlag(f"--config {path}: {name.replace('_', '-')} must be {expected}, got "
                          f"{describe_value(value)}")
    return {k: v for k, v in options.items() if k in own}

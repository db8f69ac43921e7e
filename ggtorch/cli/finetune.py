"""``ggtorch finetune``: the old llama.cpp ``finetune`` command line on ggtorch's trainer.

Every flag of the old program is accepted under its old spelling (single- and double-dash
where it had both; ``--rank-ffn_gate`` and ``--rank-ffn-gate`` alike). Flags that only made
sense for ggml's memory management are accepted and ignored with a note. Values come from,
in increasing priority: the old defaults, ``--config FILE``, and the command line.
"""

from __future__ import annotations

import time
from typing import Any

import click
from click.core import ParameterSource

from ggtorch.cli import allocator
from ggtorch.data import RecordData
from ggtorch.errors import BadFlag
from ggtorch.training.config import NAN_SKIP_LIMIT, FinetuneConfig, read_config_file
from ggtorch.training.distributed import BACKENDS, env_rank
from ggtorch.training.trainer import Interrupted, StepResult, Trainer

# (group title, [(flags..., field or None, type or "flag"/"pair", help)])
# field None: accepted for compatibility and ignored (with a note).
Option = tuple[tuple[str, ...], str | None, Any, str]
GROUPS: list[tuple[str, list[Option]]] = [
    ("Model and data", [
        (("--model-base",), "model_base", str, "Base model GGUF (F32/F16/BF16 or any supported quantization)."),
        (("--train-data",), "train_data", str,
         "Training text (UTF-8), or records: .jsonl/.parquet file or folder. [default: shakespeare.txt]"),
        (("--val-data",), "val_data", str, "Separate text (or records) for a held-out validation loss."),
        (("--val-split",), "val_split", float, "Fraction of the training text held out for validation. [0]"),
        (("--eval-every",), "eval_every", int, "Validation loss every N iterations (0: at the end). [0]"),
        (("--utf8-errors",), "utf8_errors", click.Choice(["strict", "replace"]),
         "Invalid UTF-8 in text: stop with the byte offset, or replace it with U+FFFD. [strict]"),
        (("--config",), None, str, "YAML/TOML file of options (keys = long flag names); flags override it."),
    ]),
    ("Instruction and chat records (docs/chat-data.md)", [
        (("--data-format",), "data_format", click.Choice(["auto", "text", "chat", "prompt-response"]),
         "Record format: messages (chat), prompt/response or instruction/output, text. [auto]"),
        (("--chat-template",), "chat_template", str,
         "Jinja chat template file for chat records. [the model's tokenizer.chat_template]"),
        (("--train-on-prompt",), "train_on_prompt", "flag", "Loss on every token, not only on the answers."),
        (("--batching",), "batching", click.Choice(["pack", "pad"]),
         "pack: several records per context, attention kept within each; pad: one per row. [pack]"),
        (("--long-records",), "long_records", click.Choice(["truncate", "split"]),
         "Records longer than --ctx: keep the start, or split into pieces. [truncate]"),
    ]),
    ("Outputs and checkpoints", [
        (("--checkpoint-in",), "checkpoint_in", str,
         "Resume from this checkpoint if it exists, else start fresh. [checkpoint.gguf]"),
        (("--checkpoint-out",), "checkpoint_out", str,
         "Checkpoint file ('' disables). [checkpoint-ITERATION.gguf]"),
        (("--lora-out",), "lora_out", str,
         "Adapter in today's llama.cpp GGUF LoRA format ('' disables). [ggml-lora-ITERATION-f32.gguf]"),
        (("--pattern-fn-it",), "pattern_fn_it", str, "Text in output names replaced by the iteration. [ITERATION]"),
        (("--fn-latest",), "fn_latest", str, "Replacement for the pattern in the always-current copy. [LATEST]"),
        (("--save-every",), "save_every", int, "Save every N iterations; <= 0 saves only at the end. [10]"),
        (("--only-write-lora",), "only_write_lora", "flag",
         "Write the adapter from --checkpoint-in (or a fresh one) and exit without training."),
        (("--log-file",), "log_file", str, "JSON-lines training log. [beside the outputs]"),
    ]),
    ("Training", [
        (("-c", "--ctx"), "ctx", int, "Context length used for training. [128]"),
        (("-b", "--batch"), "batch", int, "Sequences per batch. [8]"),
        (("--grad-acc",), "grad_acc", int, "Batches accumulated per optimizer step. [1]"),
        (("-n", "--adam-iter"), "adam_iter", int, "Optimizer steps in this run. [256]"),
        (("--epochs",), "epochs", int, "Stop after N epochs over the samples (<= 0: no limit). [-1]"),
        (("-s", "--seed"), "seed", int, "Seed for LoRA init and shuffling; -1 uses the time. [-1]"),
        (("-t", "--threads"), "threads", int, "torch CPU threads. [torch's default]"),
        (("--use-checkpointing/--no-checkpointing",), "use_checkpointing", "pair",
         "Gradient checkpointing per transformer block. [on]"),
        (("--device",), "device", str, "cpu, cuda, cuda:N or mps. [cpu]"),
        (("--on-nan",), "on_nan", click.Choice(["stop", "skip"]),
         "A NaN/inf loss: stop (keeping the last checkpoint), or skip that step's update "
         f"(stops after {NAN_SKIP_LIMIT} in a row). [stop]"),
        (("--dtype",), "dtype", click.Choice(["f32", "bf16", "f16"]), "Compute dtype (bf16/f16 = autocast). [f32]"),
        (("--base-dtype",), "base_dtype", click.Choice(["quantized", "f32", "bf16", "f16"]),
         "Hold base weights as raw ggml blocks (quantized) or as floats (faster, more memory). [quantized]"),
        (("--dist-backend",), "dist_backend", click.Choice(list(BACKENDS)),
         "torch.distributed backend under torchrun. [nccl on CUDA, else gloo]"),
    ]),
    ("LoRA", [
        (("--lora-r",), "lora_r", int, "Default rank of every adapted matrix. [4]"),
        (("--lora-alpha",), "lora_alpha", float, "Alpha; the adapter scale is alpha/r. [= lora-r]"),
        (("--lora-dropout",), "lora_dropout", float, "Dropout on the LoRA input. [0]"),
        (("--rank-att-norm",), "rank_att_norm", int, "Rank of attn_norm adapters; 0 = off (merge-only). [0]"),
        (("--rank-ffn-norm",), "rank_ffn_norm", int, "Rank of ffn_norm adapters; 0 = off (merge-only). [0]"),
        (("--rank-out-norm",), "rank_out_norm", int, "Rank of the output_norm adapter; 0 = off (merge-only). [0]"),
        (("--rank-tok-embd",), "rank_tok_embd", int, "Rank for token_embd (0 = off). [lora-r]"),
        (("--rank-out",), "rank_out", int, "Rank for output (0 = off). [lora-r]"),
        (("--rank-wq",), "rank_wq", int, "Rank for attn_q. [lora-r]"),
        (("--rank-wk",), "rank_wk", int, "Rank for attn_k. [lora-r]"),
        (("--rank-wv",), "rank_wv", int, "Rank for attn_v. [lora-r]"),
        (("--rank-wo",), "rank_wo", int, "Rank for attn_output. [lora-r]"),
        (("--rank-ffn-gate", "--rank-ffn_gate"), "rank_ffn_gate", int, "Rank for ffn_gate. [lora-r]"),
        (("--rank-ffn-down", "--rank-ffn_down"), "rank_ffn_down", int, "Rank for ffn_down. [lora-r]"),
        (("--rank-ffn-up", "--rank-ffn_up"), "rank_ffn_up", int, "Rank for ffn_up. [lora-r]"),
    ]),
    ("Optimizer (ggml AdamW)", [
        (("--adam-alpha",), "adam_alpha", float, "Learning rate. [0.001]"),
        (("--adam-min-alpha",), "adam_min_alpha", float, "Learning-rate floor, warmup included. [0]"),
        (("--adam-decay",), "adam_decay", float, "Decoupled weight decay (AdamW). [0.1]"),
        (("--adam-decay-min-ndim",), "adam_decay_min_ndim", int, "Decay only tensors with >= N dims. [2]"),
        (("--adam-beta1",), "adam_beta1", float, "First-moment decay. [0.9]"),
        (("--adam-beta2",), "adam_beta2", float, "Second-moment decay. [0.999]"),
        (("--adam-gclip",), "adam_gclip", float, "Global gradient-norm clip; 0 disables. [1.0]"),
        (("--adam-epsf",), "adam_epsf", float, "Relative loss change that stops training; 0 disables. [0]"),
        (("--warmup",), "warmup", int, "Warmup steps. [100]"),
        (("--cos-decay-steps",), "cos_decay_steps", int, "Cosine decay steps. [1000]"),
        (("--cos-decay-restart",), "cos_decay_restart", float, "Decay-steps multiplier after a restart. [1.1]"),
        (("--cos-decay-min",), "cos_decay_min", float, "Cosine decay minimum. [0.1]"),
        (("--enable-restart/--disable-restart",), "enable_restart", "pair", "Cosine decay restarts. [off]"),
        (("--opt-past",), "opt_past", int, "Iterations for the delta convergence test; 0 disables. [0]"),
        (("--opt-delta",), "opt_delta", float, "Max relative delta for that test. [1e-5]"),
        (("--opt-max-no-improvement",), "opt_max_no_improvement", int,
         "Stop after N steps without a new best loss; 0 disables. [0]"),
    ]),
    ("Samples (as the old finetune built them)", [
        (("--sample-start",), "sample_start", str, "Samples start after each occurrence of STR ('' = every token)."),
        (("--include-sample-start",), "include_sample_start", "flag", "Keep the sample-start text in samples."),
        (("--escape",), "escape", "flag", "Process \\n, \\t, \\xHH ... escapes in --sample-start."),
        (("--overlapping-samples",), "overlapping_samples", "flag", "Samples run past the next sample start."),
        (("--fill-with-next-samples",), "fill_with_next_samples", "flag",
         "Fill short samples with the following ones."),
        (("--separate-with-eos/--no-separate-with-eos",), "separate_with_eos", "pair",
         "EOS between filled samples. [off]"),
        (("--separate-with-bos/--no-separate-with-bos",), "separate_with_bos", "pair",
         "BOS between filled samples. [on]"),
        (("--sample-random-offsets",), "sample_random_offsets", "flag", "Start samples at random offsets."),
        (("--force-reshuffle",), "force_reshuffle", "flag", "Reshuffle at start instead of resuming the order."),
    ]),
    ("Model overrides", [
        (("--norm-rms-eps",), "norm_rms_eps", float, "RMSNorm epsilon. [from the model]"),
        (("--rope-freq-base",), "rope_freq_base", float, "RoPE frequency base. [from the model]"),
        (("--rope-freq-scale",), "rope_freq_scale", float, "RoPE frequency scale. [from the model]"),
    ]),
    ("Accepted for compatibility, ignored", [
        (("--use-flash/--no-flash",), None, "pair", "ggml flash attention (torch picks its own kernel)."),
        (("-ngl", "--n-gpu-layers"), None, int, "ggml GPU offload; use --device cuda instead."),
        (("--use-alloc/--no-alloc",), None, "pair", "ggml allocator (torch manages memory)."),
        (("--mem-model",), None, float, "ggml memory buffer size (not needed)."),
        (("--mem-lora",), None, float, "ggml memory buffer size (not needed)."),
        (("--mem-compute",), None, float, "ggml memory buffer size (not needed)."),
        (("--mem-compute0",), None, float, "ggml memory buffer size (not needed)."),
        (("--mem-compute1",), None, float, "ggml memory buffer size (not needed)."),
    ]),
]


def _param_name(decls: tuple[str, ...], field: str | None) -> str:
    if field:
        return field
    return "ignored_" + decls[-1].split("/")[0].lstrip("-").replace("-", "_")


IGNORED_FLAGS = {_param_name(decls, None): " / ".join(decls[-1].split("/")) if "/" in decls[-1] else decls[-1]
                 for _, options in GROUPS for decls, field, _, _ in options if field is None}
"""Parameter name -> how --help spells an ignored flag, for the note."""


class GroupedCommand(click.Command):
    """A command whose --help lists options under the old program's headings (``groups``)."""

    groups: list[tuple[str, list[Option]]] = GROUPS

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        by_name = {p.name: p for p in self.get_params(ctx)}
        for title, options in self.groups:
            rows = [by_name[_param_name(decls, field)].get_help_record(ctx) for decls, field, _, _ in options]
            with formatter.section(title):
                formatter.write_dl([r for r in rows if r])
        help_option = self.get_help_option(ctx)
        if help_option is not None:
            with formatter.section("Other"):
                formatter.write_dl([help_option.get_help_record(ctx)])


def _options(fn: Any, groups: list[tuple[str, list[Option]]] = GROUPS) -> Any:
    for _, options in reversed(groups):
        for decls, field, kind, help_text in reversed(options):
            name = _param_name(decls, field)
            if kind == "flag":
                fn = click.option(*decls, name, is_flag=True, default=None, help=help_text)(fn)
            elif kind == "pair":
                fn = click.option(*decls, name, default=None, help=help_text)(fn)
            else:
                fn = click.option(*decls, name, type=kind, default=None, help=help_text)(fn)
    return fn


def config_from_cli(ctx: click.Context, values: dict[str, Any],
                    config_cls: type[FinetuneConfig] = FinetuneConfig) -> tuple[FinetuneConfig, list[str]]:
    """Old defaults < --config file < flags given on the command line; notes for ignored flags.

    ``config_cls`` is FinetuneConfig or a subclass (``ggtorch train``'s TrainConfig, which checks
    its own required inputs).
    """
    notes = []
    options: dict[str, Any] = {}
    if values.get("ignored_config"):
        options.update(read_config_file(values["ignored_config"], config_cls.field_names()))
    for name, value in values.items():
        if ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE or value is None:
            continue
        if name.startswith("ignored_"):
            if name != "ignored_config":
                flag = IGNORED_FLAGS[name]
                notes.append(f"note: {flag} is a ggml memory/offload setting; ggtorch ignores it"
                             + (" (use --device cuda)" if "gpu" in name else ""))
            continue
        options[name] = value
    if config_cls is FinetuneConfig and not options.get("model_base"):
        raise BadFlag("--model-base is required: the GGUF model to finetune")
    return config_cls(**options), notes


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressPrinter:
    """One line per iteration, in the old train_opt_callback's shape plus throughput and ETA."""

    def __init__(self) -> None:
        self.first_loss: float | None = None

    def on_step(self, trainer: Trainer, r: StepResult) -> None:
        if self.first_loss is None:
            self.first_loss = r.loss
        bar = "-" * min(40, max(0, int(1 + 10 * (self.first_loss - r.loss) + 0.5))) + ">"  # capped: from scratch
        click.echo(f"iter={r.iteration:6d} sample={r.samples}/{r.n_samples} epoch={r.epoch} sched={r.sched:.6f} "
                   f"loss={r.loss:.6f} dt={r.seconds * 1000:.0f}ms {r.tokens_per_second:.0f} tok/s "
                   f"eta={_hms(r.eta_seconds)} |{bar}")

    def on_eval(self, trainer: Trainer, iteration: int, loss: float) -> None:
        click.echo(f"eval: iter={iteration} validation loss={loss:.6f}")

    def on_save(self, trainer: Trainer, paths: list[Any]) -> None:
        click.echo("saved: " + ", ".join(str(p) for p in paths))


@click.command(cls=GroupedCommand, context_settings={"help_option_names": ["-h", "--help"]})
@_options
def finetune(**values: Any) -> None:
    """LoRA-finetune a GGUF model, as llama.cpp's finetune did (same flags and semantics).

    \b
    Differences from the old program, on purpose:
    - each optimizer step uses exactly --grad-acc batches (the old one used one extra batch
      per run), so resuming from a checkpoint continues exactly like an uninterrupted run;
    - the adapter trains with scale alpha/r, as today's llama.cpp applies it (the same for
      the default alpha = r) and --lora-out writes today's GGUF LoRA format (not ggla);
    - norm adapters (--rank-*-norm) are off by default: llama.cpp adapter files cannot
      carry them, only export-lora merges can;
    - the first progress line shows the real loss.
    """
    ctx = click.get_current_context()  # not a parameter: 'ctx' is the --ctx flag here
    config, notes = config_from_cli(ctx, values)
    trainer = start_trainer(config, notes)
    n_trainable = sum(p.numel() for _, p, _ in trainer.params)
    echo = _echo(trainer)
    echo(f"model: {config.model_base} ({trainer.model_config.n_layer} layers, n_embd "
         f"{trainer.model_config.n_embd}), base weights {config.base_dtype}, compute {config.dtype}, "
         f"device {trainer.device}, malloc {allocator.current()}")
    echo(f"LoRA: {n_trainable:,} trainable parameters; seed {trainer.seed}")
    run_trainer(ctx, trainer, "--only-write-lora", "--lora-out", config.only_write_lora, config.lora_out)


def _echo(trainer: Trainer) -> Any:
    """click.echo on rank 0; silence on the other torchrun ranks (they compute the same numbers)."""
    return click.echo if trainer.dist.is_main else (lambda *args, **kwargs: None)


def start_trainer(config: FinetuneConfig, notes: list[str]) -> Trainer:
    """A Trainer with the CLI's progress printer; notes and warnings go to stderr (rank 0 only)."""
    main_rank = env_rank() == 0
    for note in notes if main_rank else ():
        click.echo(note, err=True)
    trainer = Trainer(config, [ProgressPrinter()] if main_rank else [])
    for warning in trainer.warnings if trainer.dist.is_main else ():
        click.echo(f"warning: {warning}", err=True)
    return trainer


def run_trainer(ctx: click.Context, trainer: Trainer, only_write_flag: str, output_flag: str, only_write: bool,
                output: str) -> None:
    """Train (or with ``only_write`` just write the output), handle Ctrl-C, print the summary.

    Shared by ``finetune`` and ``train``: exit 130 after an interrupted-but-saved run, at once
    on a second Ctrl-C.
    """
    config = trainer.config
    echo = _echo(trainer)
    world = trainer.dist.world_size
    data = trainer.data
    described = (data.summary() if isinstance(data, RecordData)
                 else f"{data.n_tokens:,} tokens, {data.n_samples:,} samples of ctx {config.ctx}")
    echo(f"data: {described}" + (f"; resumed from {trainer.resumed_from} at iteration {trainer.iteration}"
                                  if trainer.resumed_from else ""))
    ranks = f" per rank x {world} ranks (torch.distributed {trainer.dist.backend})" if world > 1 else ""
    echo(f"batch: {config.batch} x grad-acc {config.grad_acc}{ranks} = {config.batch * config.grad_acc * world} "
         "sequences per optimizer step")
    start = time.perf_counter()
    results: list[StepResult] = []
    val = None
    try:
        if only_write:
            if not output:
                raise BadFlag(f"{only_write_flag} needs a {output_flag} file name")
            trainer.save(checkpoint=False)
            return
        results = trainer.train()
        val = trainer.evaluate()
    except Interrupted as e:
        echo(f"interrupted: {e}", err=True)
        ctx.exit(130)
    except KeyboardInterrupt:
        echo("interrupted twice: stopped at once; the last saved checkpoint is kept", err=True)
        ctx.exit(130)
    finally:
        trainer.close()
    elapsed = time.perf_counter() - start
    if results:
        tokens = len(results) * config.batch * config.grad_acc * world * config.ctx
        echo(f"done: {len(results)} iterations in {_hms(elapsed)}, loss {results[0].loss:.4f} -> "
             f"{results[-1].loss:.4f}, {tokens / elapsed:.0f} tokens/s"
             + (f", validation loss {val:.4f}" if val is not None else "")
             + (f"; {trainer.skipped_steps} step(s) skipped (NaN/inf loss)" if trainer.skipped_steps else ""))


@click.command(name="plot")
@click.argument("log_path", metavar="LOG.jsonl")
@click.option("-o", "--output", "png_path", default=None, help="PNG to write. [LOG with .png]")
def plot(log_path: str, png_path: str | None) -> None:
    """Draw the loss curve of a training log (written beside the finetune outputs) to a PNG."""
    from ggtorch.training.log import plot_loss

    click.echo(f"wrote {plot_loss(log_path, png_path)}")

"""``ggtorch finetune``: the old llama.cpp ``finetune`` command line on ggtorch's trainer.

Every flag of the old program is accepted under its old spelling (single- and double-dash
where it had both; ``--rank-ffn_gate`` and ``--rank-ffn-gate`` alike); the options are the
fields of :class:`~ggtorch.training.config.FinetuneConfig` (:mod:`ggtorch.cli.options`). Flags
that only made sense for ggml's memory management are accepted and ignored with a note.
The run itself is :func:`ggtorch.api.finetune`; this module prints it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ggtorch import api
from ggtorch.cli.options import config_command, config_from_cli
from ggtorch.errors import BadFlag
from ggtorch.training.config import (
    FILES,
    GENERATIONS,
    LORA,
    OPTIMIZER,
    OUTPUTS,
    OVERRIDES,
    PREFERENCE,
    RECORDS,
    SAMPLES,
    TRAINING,
    FinetuneConfig,
    RunConfig,
    flag,
)
from ggtorch.training.distributed import env_rank
from ggtorch.training.trainer import Callback, Interrupted, Sample, StepResult, Trainer

GROUPS = (FILES, RECORDS, PREFERENCE, OUTPUTS, TRAINING, LORA, OPTIMIZER, SAMPLES, GENERATIONS, OVERRIDES)
"""``finetune --help``'s headings, in order."""


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressPrinter(Callback):
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
        click.echo(f"eval: iter={iteration} validation loss={loss:.6f}{answer_scores(trainer.last_eval_metrics)}")

    def on_sample(self, trainer: Trainer, samples: list[Sample]) -> None:
        for sample in samples:
            for line in sample.lines():
                click.echo(line)


def answer_scores(metrics: dict[str, float] | None) -> str:
    """An evaluation's answer scores as its progress line ends with them (nothing when it has none)."""
    if not metrics or "answer_accuracy" not in metrics:
        return ""
    exact = (f" exact match={metrics['exact_match']:.4f} ({metrics['exact_match_records']} records)"
             if "exact_match" in metrics else "")
    return f" answer accuracy={metrics['answer_accuracy']:.4f}{exact}"

    def on_save(self, trainer: Trainer, paths: list[Any]) -> None:
        click.echo("saved: " + ", ".join(str(p) for p in paths))


@config_command(FinetuneConfig, GROUPS)
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
    config, notes = config_from_cli(ctx, values, FinetuneConfig)
    trainer = start_trainer(api.finetune, config, notes)
    n_trainable = sum(p.numel() for _, p, _ in trainer.params)
    echo = _echo(trainer)
    echo(f"model: {config.model_base} ({trainer.model_config.n_layer} layers, n_embd "
         f"{trainer.model_config.n_embd}), base weights {_held_as(trainer, config.base_dtype)}, compute "
         f"{compute_dtype(trainer)}, device {trainer.device}, malloc {trainer.allocator}")
    echo(f"LoRA: {n_trainable:,} trainable parameters; seed {trainer.seed}")
    for note in trainer.notes:
        echo(f"note: {note}")
    run_trainer(ctx, trainer, "only_write_lora", "lora_out")


def _held_as(trainer: Trainer, base_dtype: str) -> str:
    """How the run holds the base's matrices: decoded to a dtype, or as the file stores them (its matrices' types,
    the commonest first: "as stored (Q4_K, Q6_K)", or "as stored (F32)" for a float file)."""
    if base_dtype != "quantized":
        return base_dtype
    types = Counter(t.ggml_type.name for t in trainer.base.tensors.values() if len(t.shape) >= 2)
    return f"as stored ({', '.join(name for name, _ in types.most_common())})"


def compute_dtype(trainer: Trainer) -> str:
    """The compute dtype, and who chose it: --dtype auto trains in bf16 on a CPU that multiplies bf16 natively,
    which its user may not know it does."""
    dtype = trainer.config.dtype
    if not trainer.run.auto_dtype:
        return dtype
    if dtype == "bf16":
        return "bf16 (--dtype auto: this device multiplies bf16 natively, faster than f32; --dtype f32 to change)"
    return f"{dtype} (--dtype auto)"


def checkpointing(trainer: Trainer) -> str:
    """Whether the blocks recompute their activations in backward, and why when the run chose."""
    on = trainer.config.use_checkpointing
    if not trainer.run.auto_checkpointing:
        return f"activation checkpointing {'on' if on else 'off'}"
    if on:
        return ("activation checkpointing on (auto: without it the estimate leaves too little memory; "
                "--no-checkpointing)")
    return "activation checkpointing off (auto: the estimate has room; --use-checkpointing to save memory)"


def _echo(trainer: Trainer) -> Any:
    """click.echo on rank 0; silence on the other torchrun ranks (they compute the same numbers)."""
    return click.echo if trainer.dist.is_main else (lambda *args, **kwargs: None)


def start_trainer(start: Callable[..., Trainer], config: RunConfig, notes: list[str]) -> Trainer:
    """``start`` (api.finetune or api.train) with the CLI's progress printer, not yet trained;
    notes and warnings go to stderr (rank 0 only)."""
    main_rank = env_rank() == 0
    for note in notes if main_rank else ():
        click.echo(note, err=True)
    trainer = start(config, callbacks=[ProgressPrinter()] if main_rank else [], progress=False, run=False,
                    manage_process=True)  # the command tunes its own process (malloc, threads)
    for warning in trainer.warnings if trainer.dist.is_main else ():
        click.echo(f"warning: {warning}", err=True)
    return trainer


def run_trainer(ctx: click.Context, trainer: Trainer, only_write: str, output: str) -> None:
    """Train (or with the option ``only_write`` set, just write ``output``), handle Ctrl-C, print the summary.

    Shared by ``finetune`` and ``train``: exit 130 after an interrupted-but-saved run, at once
    on a second Ctrl-C.
    """
    config = trainer.config
    echo = _echo(trainer)
    world = trainer.dist.world_size
    resumed = f"; resumed from {trainer.resumed_from} at iteration {trainer.iteration}" if trainer.resumed_from else ""
    echo(f"data: {trainer.data.summary()}{resumed}")
    ranks = f" per rank x {world} ranks (torch.distributed {trainer.dist.backend})" if world > 1 else ""
    echo(trainer.run.memory.describe() + "; " + checkpointing(trainer))
    echo(f"batch: {config.batch} x grad-acc {config.grad_acc}{ranks} = {config.batch * config.grad_acc * world} "
         "sequences per optimizer step")
    start = time.perf_counter()
    results: list[StepResult] = []
    val = None
    try:
        if getattr(config, only_write):
            if not getattr(config, output):
                raise BadFlag(f"{flag(only_write)} needs a {flag(output)} file name")
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
    """Draw the loss curves of a training log (written beside the finetune outputs) to a PNG, each run labelled."""
    from ggtorch.io.lock import writing
    from ggtorch.io.paths import Input, Output
    from ggtorch.training.log import plot_loss

    out = png_path or str(Path(log_path).with_suffix(".png"))
    with writing([Input("LOG.jsonl", log_path)], [Output("-o", out)]):
        written = plot_loss(log_path, out)
    click.echo(f"wrote {written}")

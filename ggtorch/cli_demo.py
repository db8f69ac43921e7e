"""``ggtorch demo``: the README's first command; everything it does lives in :mod:`ggtorch.demo`."""

from __future__ import annotations

from pathlib import Path

import click

from .demo import LORA_PROMPT, DemoSettings, next_steps, run_demo


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-o", "--out", "out_dir", default="ggtorch-demo", show_default=True,
              help="Folder for every file the demo writes (created; files in it are overwritten).")
@click.option("--base-iterations", type=click.IntRange(min=1), default=DemoSettings.base_iterations,
              show_default=True, help="Training steps of the base model from scratch.")
@click.option("--lora-iterations", type=click.IntRange(min=1), default=DemoSettings.lora_iterations,
              show_default=True, help="LoRA finetune steps.")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None, help="torch threads. [torch's choice]")
@click.option("-s", "--seed", type=int, default=DemoSettings.seed, show_default=True, help="Seed of every random draw.")
def demo(out_dir: str, base_iterations: int, lora_iterations: int, threads: int | None, seed: int) -> None:
    """Offline demo (about a minute): train a small GGUF model, quantize it, LoRA-finetune it, compare.

    \b
    Uses only text every Python carries: a base model is trained from scratch on Python's own
    documentation, written as GGUF and quantized to Q8_0; LoRA adapters are trained on the
    quantized model with The Zen of Python and written in llama.cpp's adapter format; then the
    model continues the same prompt without and with the adapter.
    """
    settings = DemoSettings(out_dir=Path(out_dir), base_iterations=base_iterations, lora_iterations=lora_iterations,
                            threads=threads, seed=seed)
    result = run_demo(settings, say=click.echo)
    for title, text in (("without the adapter", result.without_adapter), ("with the adapter", result.with_adapter)):
        click.echo(f"\n{title}:")
        for line in (LORA_PROMPT + text).rstrip().splitlines():
            click.echo(f"  {line}")
    click.echo(f"\ndone in {result.seconds:.0f} s. Files in {result.out_dir.resolve()}:")
    for label, path in result.files.items():
        click.echo(f"  {path.name:<22} {label}")
    click.echo("\nnext:")
    for line in next_steps(result):
        click.echo(f"  {line}")

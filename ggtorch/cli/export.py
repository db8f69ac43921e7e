"""``ggtorch export-lora`` (merge adapters into a GGUF model) and ``ggtorch convert-old-lora``.

export-lora takes llama.cpp's flag spellings, current and old: ``--lora F`` (comma lists too),
``--lora-scaled F:S`` (comma lists too), ``--lora-scaled F S`` and ``-s F S`` (old export-lora),
``-l F``, ``--model-base``/``--model-out``. Adapters are applied in command-line order.
"""

from __future__ import annotations

import time

import click

from ggtorch.api import merge_adapters
from ggtorch.cli.options import LoraArgsCommand, file_scale, threads_option
from ggtorch.errors import BadFlag
from ggtorch.export.merge import OUTTYPES
from ggtorch.export.old_formats import convert_old
from ggtorch.io.gguf import read_gguf
from ggtorch.io.lock import writing
from ggtorch.io.paths import Input, Output
from ggtorch.lora.adapter_file import ADAPTER_DTYPES, validate_against_base, write_adapter
from ggtorch.ops.threads import pin_threads


@click.command(name="export-lora", cls=LoraArgsCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-m", "--model", "--model-base", "model_path", required=True, help="Base GGUF model.")
@click.option("-o", "--output", "--model-out", "out_path", required=True, help="Merged GGUF model to write.")
@click.option("--lora", "-l", multiple=True, metavar="FILE[,FILE...]", expose_value=False,  # as --lora-scaled F:1
              help="Adapter to merge with scale 1: GGUF LoRA, ggtorch checkpoint, or old lora-*.bin/checkpoint.")
@click.option("--lora-scaled", "-s", "lora_scaled", multiple=True, metavar="FILE:SCALE",
              help="Adapter with a user scale (also FILE SCALE, as the old export-lora took it).")
@click.option("--outtype", type=click.Choice(sorted(OUTTYPES)), default="same", show_default=True,
              help="Type of the merged tensors; untouched tensors are copied as they are. 'same' keeps each base "
                   "type where ggtorch quantizes it exactly like llama.cpp, else Q8_0 (K-quants, IQ types).")
@threads_option
def export_lora(model_path: str, out_path: str, lora_scaled: tuple[str, ...],
                outtype: str, threads: int | None) -> None:
    """Merge LoRA adapters into a GGUF model: W + Σ scale·(alpha/r)·B·A (llama.cpp's export-lora)."""
    if threads:
        pin_threads(threads)
    specs = [file_scale(s) for s in lora_scaled]
    if not specs:
        raise BadFlag("no adapter given; pass --lora FILE or --lora-scaled FILE:SCALE")
    start = time.perf_counter()
    plan = merge_adapters(model_path, specs, out_path, outtype)
    for (before, after), n in sorted(plan.fallbacks().items()):
        click.echo(f"note: {n} merged {before.name} tensor(s) written as {after.name}"
                   + (" (ggtorch has no llama.cpp-exact quantizer for that type)" if outtype == "same" else ""),
                   err=True)
    click.echo(f"merged {len(specs)} adapter(s) into {len(plan.merged)} tensors -> {out_path} "
               f"[{time.perf_counter() - start:.1f} s]")


@click.command(name="convert-old-lora", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("old_path", metavar="OLD.bin|OLD-checkpoint.gguf")
@click.option("-o", "--output", "out_path", required=True, help="GGUF LoRA adapter to write.")
@click.option("--drop-norms", is_flag=True, help="Leave out norm-gain adapters (today's format cannot hold them).")
@click.option("--outtype", type=click.Choice(sorted(ADAPTER_DTYPES)), default="f32", show_default=True,
              help="Type of the adapter tensors.")
@click.option("-m", "--model-base", "model_path", default=None, help="Base GGUF model to check the adapter against.")
def convert_old_lora(old_path: str, out_path: str, drop_norms: bool, outtype: str, model_path: str | None) -> None:
    """Convert an old llama.cpp finetune adapter (ggla lora-*.bin) or checkpoint to today's GGUF LoRA."""
    with writing([Input("OLD", old_path), *([Input("-m", model_path)] if model_path else [])],
                 [Output("-o", out_path)]):
        adapter = convert_old(old_path, drop_norms=drop_norms)
        if model_path:
            validate_against_base(adapter, read_gguf(model_path), old_path)
        write_adapter(out_path, adapter, outtype)
    click.echo(f"wrote {len(adapter.pairs)} LoRA pairs -> {out_path}")


"""``ggtorch convert-lora`` / ``ggtorch export-peft``: PEFT LoRA folders to GGUF LoRA and back.

``convert-lora`` takes llama.cpp's convert_lora_to_gguf.py flags (``--outfile``,
``--outtype``, ``--base``), except that ``--base`` is the GGUF model the adapter will run on:
no Hugging Face model folder is needed.
"""

from __future__ import annotations

import click

from ggtorch.export.peft import PEFT_FILES, export_peft, import_peft
from ggtorch.io.gguf import read_gguf
from ggtorch.io.lock import writing
from ggtorch.io.paths import Input, Output
from ggtorch.lora.adapter_file import ADAPTER_DTYPES, read_adapter, write_adapter
from ggtorch.ops.dtypes import DTYPES


@click.command(name="convert-lora")
@click.argument("peft_dir", type=click.Path())
@click.option("--base", "-m", "base_path", required=True, help="GGUF base model the adapter was trained on.")
@click.option("--outfile", "-o", required=True, help="GGUF LoRA adapter to write.")
@click.option("--outtype", type=click.Choice(list(ADAPTER_DTYPES)), default="f32", show_default=True,
              help="Type of the adapter tensors (q8_0 falls back to f16 for rows not a multiple of 32).")
def convert_lora(peft_dir: str, base_path: str, outfile: str, outtype: str) -> None:
    """Convert a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) to a GGUF LoRA."""
    with writing([Input("PEFT_DIR", peft_dir, folder=True), Input("--base", base_path)],
                 [Output("--outfile", outfile)]):
        adapter = import_peft(peft_dir, read_gguf(base_path))
        path = write_adapter(outfile, adapter, outtype)
    ranks = sorted({p.rank for p in adapter.pairs.values()})
    click.echo(f"[{len(adapter.pairs)} tensors, rank {'/'.join(map(str, ranks))}, alpha {adapter.alpha:g}, "
               f"{outtype}]", err=True)
    click.echo(str(path))


@click.command(name="export-peft")
@click.argument("adapter_path", type=click.Path())
@click.option("--base", "-m", "base_path", required=True, help="GGUF base model the adapter belongs to.")
@click.option("--outdir", "-o", required=True, help="Folder to write adapter_config.json and the weights into.")
@click.option("--base-model-id", default=None,
              help="base_model_name_or_path for the config (default: taken from the base GGUF).")
@click.option("--outtype", type=click.Choice(list(DTYPES)), default="f32", show_default=True,
              help="Type of the safetensors weights.")
def export_peft_cmd(adapter_path: str, base_path: str, outdir: str, base_model_id: str | None, outtype: str) -> None:
    """Write a GGUF LoRA adapter as a PEFT folder with Hugging Face llama module names."""
    with writing([Input("ADAPTER", adapter_path), Input("--base", base_path)],
                 [Output("--outdir", outdir, folder=True, inside=PEFT_FILES)]):
        adapter = read_adapter(adapter_path)
        out = export_peft(adapter, read_gguf(base_path), outdir, base_model_id, DTYPES[outtype])
    click.echo(f"[{len(adapter.pairs)} tensors, alpha {adapter.alpha:g}, {outtype}]", err=True)
    click.echo(str(out))

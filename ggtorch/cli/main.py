"""The ``ggtorch`` command line: a thin click layer over the library.

Each command parses flags (llama.cpp's spellings where one exists), calls the library and
prints. Every GGTorchError becomes one ``error: ...`` line on stderr and exit status 1,
never a traceback; anything else is a bug and keeps its traceback. New commands (finetune,
export-lora, ...) are one more ``@main.command()`` function each.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any

import click

from ggtorch.cli.allocator import relaunch_on_jemalloc
from ggtorch.cli.chat import chat
from ggtorch.cli.demo import demo
from ggtorch.cli.export import convert_old_lora, export_lora
from ggtorch.cli.finetune import finetune, plot
from ggtorch.cli.options import (
    RunLoraArgsCommand,
    load_with_adapters,
    model_options,
    run_lora_options,
    sampling_options,
    sampling_params,
)
from ggtorch.cli.peft import convert_lora, export_peft_cmd
from ggtorch.cli.train import train
from ggtorch.errors import BadData, GGTorchError
from ggtorch.io.gguf import read_gguf
from ggtorch.io.paths import Input, check_input
from ggtorch.models.config import ModelConfig
from ggtorch.models.generate import check_fits, check_n_tokens, iter_tokens
from ggtorch.ops.threads import follow_free_cores, pin_threads, start_following
from ggtorch.training.distributed import env_rank, env_world_size


class _Group(click.Group):
    """A click group that turns ggtorch's errors into one line and a non-zero exit."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GGTorchError as e:
            rank, world = env_rank(), env_world_size()
            quiet = getattr(e, "quiet", False)  # another rank failed and says why
            if not quiet and (rank == 0 or not getattr(e, "on_every_rank", False)):  # all saw it: rank 0 says it
                message = " ".join(str(e).split())
                click.echo(f"error: {message}" if world == 1 else f"error (rank {rank} of {world}): {message}",
                           err=True)
            ctx.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ggtorch", prog_name="ggtorch")
def main() -> None:
    """Run, evaluate and finetune GGUF models (llama, Qwen, Gemma, Phi-3, Mistral 3, SmolLM3, MoE; quantized or not)."""


RELAUNCHED_COMMANDS = frozenset({"finetune", "train", "demo", "export-lora", "perplexity"})
"""The long-running commands, which move onto jemalloc first (ggtorch.cli.allocator); a few seconds
of a second start do not matter to them, and the rest start once."""


def entry() -> None:
    """The ``ggtorch`` command and ``python -m ggtorch``."""
    if sys.argv[1:2] and sys.argv[1] in RELAUNCHED_COMMANDS:
        try:
            relaunch_on_jemalloc()
        except GGTorchError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
    start_following()  # the command sizes its thread team to the cores other processes leave free
    follow_free_cores()  # the first reading of the other processes' CPU use: the command starts meanwhile
    main()


@main.command()
@click.argument("model_path", metavar="MODEL.gguf")
def info(model_path: str) -> None:
    """Architecture, hyperparameters and tensors of a GGUF file."""
    f = read_gguf(model_path)
    size = f.path.stat().st_size
    click.echo(f"file:          {f.path} ({size / 2**20:.2f} MiB)")
    click.echo(f"architecture:  {f.architecture}")
    if "general.name" in f.metadata:
        click.echo(f"name:          {f.metadata['general.name']}")
    tok_model = f.get("tokenizer.ggml.model")
    if tok_model is not None:
        click.echo(f"tokenizer:     {tok_model}, {len(f.get('tokenizer.ggml.tokens', []))} tokens")
    if f.kind == "LoRA adapter":
        click.echo(f"kind:          LoRA adapter ({f.get('adapter.type')}, alpha {f.get('adapter.lora.alpha', 0):g})")
    elif f.kind == "training checkpoint":
        click.echo(f"kind:          training checkpoint ({f.get('training.type')}, "
                   f"iteration {f.get('training.iteration_count', 0)})")
    elif f.kind == "vocabulary":
        click.echo("kind:          vocabulary (a tokenizer without weights: `ggtorch train --vocab-model` builds a "
                   "model over it)")
    else:
        click.echo("hyperparameters:")
        for field, value in ModelConfig.from_gguf(f).describe().items():
            click.echo(f"  {field:<16} {value:g}" if isinstance(value, float) else f"  {field:<16} {value}")
    counts = Counter(t.ggml_type.name for t in f.tensors.values())
    nbytes = Counter()
    for t in f.tensors.values():
        nbytes[t.ggml_type.name] += t.nbytes
    n_params = sum(t.n_elements for t in f.tensors.values())
    click.echo(f"tensors:       {len(f.tensors)}, {n_params:,} parameters, {sum(nbytes.values()) / 2**20:.2f} MiB")
    for name, count in sorted(counts.items(), key=lambda kv: -nbytes[kv[0]]):
        click.echo(f"  {name:<8} {count:>5} tensors  {nbytes[name] / 2**20:10.2f} MiB")


@main.command(cls=RunLoraArgsCommand)
@model_options
@click.option("-p", "--prompt", default="", show_default=True, help="Text to continue (BOS is added).")
@click.option("-n", "--n-predict", "n_predict", type=int, default=64, show_default=True,
              help="Number of tokens to generate.")
@sampling_options
@click.option("--ignore-eos", is_flag=True, help="Keep generating after an end-of-generation token (EOS, EOT).")
@run_lora_options
def generate(model_path: str, device: str, dtype: str, keep_quantized: bool, threads: int | None, prompt: str,
             n_predict: int, temp: float, top_k: int, top_p: float, seed: int, ignore_eos: bool,
             lora_scaled: tuple[str, ...]) -> None:
    """Continue a prompt, printing the text as it is generated."""
    if threads:
        pin_threads(threads)
    params = sampling_params(temp, top_k, top_p, seed)  # the API's checks, before the load
    check_n_tokens(n_predict)
    loaded = load_with_adapters(model_path, device, dtype, keep_quantized, lora_scaled)
    tok = loaded.tokenizer
    prompt_tokens = tok.encode(prompt, add_special=True)
    if not prompt_tokens:
        raise BadData("the prompt is empty and the vocabulary adds no BOS token; give a prompt with -p")
    check_fits(loaded.model, len(prompt_tokens), n_predict)  # before the prompt is echoed
    stop = frozenset() if ignore_eos else tok.eog_ids
    click.echo(prompt, nl=False)
    new: list[int] = []
    shown = ""
    start = time.perf_counter()
    for token in iter_tokens(loaded.model, prompt_tokens, n_predict, params, stop):
        if token in stop:
            break
        new.append(token)
        text = tok.decode(new, prev_ids=prompt_tokens)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            click.echo(text[len(shown):], nl=False)
            shown = text
    click.echo(tok.decode(new, prev_ids=prompt_tokens)[len(shown):])
    elapsed = time.perf_counter() - start
    click.echo(f"[{len(new)} tokens in {elapsed:.2f} s, {len(new) / max(elapsed, 1e-9):.1f} tokens/s]", err=True)


@main.command(name="perplexity", cls=RunLoraArgsCommand)
@model_options
@click.option("-f", "--file", "text_file", required=True, help="Text file to evaluate.")
@click.option("-c", "--ctx", "--ctx-size", "n_ctx", type=click.IntRange(min=4), default=512, show_default=True,
              help="Tokens per chunk (llama-perplexity's -c); the second half of each chunk is scored.")
@click.option("-b", "--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Chunks evaluated per forward.")
@run_lora_options
def perplexity_cmd(model_path: str, device: str, dtype: str, keep_quantized: bool, threads: int | None, text_file: str,
                   n_ctx: int, batch_size: int, lora_scaled: tuple[str, ...]) -> None:
    """Perplexity of a text, as llama.cpp's llama-perplexity computes it."""
    if threads:
        pin_threads(threads)
    text = _read_text(text_file)
    loaded = load_with_adapters(model_path, device, dtype, keep_quantized, lora_scaled)
    n_tokens = len(loaded.tokenizer.encode(text, add_special=True))
    start = time.perf_counter()
    result = loaded.perplexity(text, n_ctx, batch_size)
    click.echo(f"[{n_tokens} tokens, {result.n_chunks} chunks of {n_ctx}, {result.n_scored} scored, "
               f"{time.perf_counter() - start:.2f} s]", err=True)
    click.echo(f"perplexity: {result.perplexity:.4f}")


def _read_text(path: str) -> str:
    p = check_input(Input("-f", path))
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadData(f"{p}: not UTF-8 text ({e}); convert it to UTF-8") from None



# Commands defined in their own modules (one job each), registered on the group here.
main.add_command(chat)
main.add_command(demo)
main.add_command(finetune)
main.add_command(plot)
main.add_command(train)
main.add_command(export_lora)
main.add_command(convert_old_lora)
main.add_command(convert_lora)
main.add_command(export_peft_cmd)

"""``ggtorch train``: llama.cpp's old ``train-text-from-scratch`` and a full finetune, on the finetune's trainer.

The option table is the finetune's (:mod:`ggtorch.cli.finetune`) with the LoRA group and the
adapter outputs taken out and the new model's shape and the model output put in, under the
old program's flag names (``--vocab-model``, ``--embd``, ``--ff``, ``--head``, ``--head-kv``,
``--layer``, ``--model-out``).
"""

from __future__ import annotations

from typing import Any

import click

from ggtorch.cli import allocator
from ggtorch.cli.finetune import (
    GROUPS,
    GroupedCommand,
    Option,
    _echo,
    _options,
    config_from_cli,
    run_trainer,
    start_trainer,
)
from ggtorch.io.model_file import OUTTYPES
from ggtorch.models.init import INITS
from ggtorch.training.config import TrainConfig

_DROPPED = {"model_base", "lora_out", "only_write_lora", "base_dtype"}
_REPLACED_GROUPS = ("Model and data", "Outputs and checkpoints", "LoRA")


def _kept(title: str) -> list[Option]:
    return [o for o in dict(GROUPS)[title] if o[1] not in _DROPPED]


TRAIN_GROUPS: list[tuple[str, list[Option]]] = [
    ("Model and data", [
        (("--vocab-model",), "vocab_model", str,
         "Train a NEW model from scratch with this GGUF's vocabulary and tokenizer."),
        (("--model-base",), "model_base", str,
         "Or: full finetune of every weight of this F32/F16/BF16 model (quantized: use `ggtorch finetune`)."),
        *_kept("Model and data"),
    ]),
    ("New model shape (with --vocab-model)", [
        (("--embd",), "embd", int, "Embedding width. [256]"),
        (("--ff",), "ff", int, "Feed-forward width. [768]"),
        (("--head",), "head", int, "Attention heads. [8]"),
        (("--head-kv",), "head_kv", int, "KV heads (grouped-query attention). [= --head]"),
        (("--layer",), "layer", int, "Transformer blocks. [16]"),
        (("--init",), "init", click.Choice(list(INITS)),
         "Initial weights: ggml (train-text-from-scratch's) or scaled (GPT-2's; trains faster). [ggml]"),
    ]),
    ("Outputs and checkpoints", [
        (("--model-out",), "model_out", str,
         "Trained model as GGUF ('' disables). [ggml-model-ITERATION-f32.gguf]"),
        (("--outtype",), "outtype", click.Choice(list(OUTTYPES)), "ggml type of the written matrices. [f32]"),
        (("--only-write-model",), "only_write_model", "flag",
         "Write the model from --checkpoint-in (or the fresh init) and exit without training."),
        *_kept("Outputs and checkpoints"),
    ]),
    *[(title, _kept(title)) for title, _ in GROUPS if title not in _REPLACED_GROUPS],
]


class TrainCommand(GroupedCommand):
    groups = TRAIN_GROUPS


def _train_options(fn: Any) -> Any:
    return _options(fn, TRAIN_GROUPS)


@click.command(cls=TrainCommand, context_settings={"help_option_names": ["-h", "--help"]})
@_train_options
def train(**values: Any) -> None:
    """Train every weight of a llama: a new one (--vocab-model) or a float GGUF (--model-base).

    \b
    As llama.cpp's old train-text-from-scratch (new models are initialized as it did) and
    today's full llama-finetune, on the machinery of `ggtorch finetune`: the same optimizer,
    data and checkpoint flags, exact resume from --checkpoint-in, and a GGUF model out
    (--model-out, --outtype f32/f16/bf16/q8_0/q4_0/q4_1/q5_0/q5_1) that llama.cpp loads.
    """
    ctx = click.get_current_context()  # not a parameter: 'ctx' is the --ctx flag here
    config, notes = config_from_cli(ctx, values, TrainConfig)
    assert isinstance(config, TrainConfig)
    trainer = start_trainer(config, notes)
    mc = trainer.model_config
    source = f"full finetune of {config.model_base}" if config.model_base else f"new model over {config.vocab_model}"
    _echo(trainer)(f"model: {source}: {mc.n_layer} layers, n_embd {mc.n_embd}, n_ff {mc.n_ff}, heads "
                   f"{mc.n_head}/{mc.n_head_kv}, vocab {mc.n_vocab}; {sum(p.numel() for _, p, _ in trainer.params):,} "
                   f"trainable parameters; compute {config.dtype}, device {trainer.device}, "
                   f"malloc {allocator.current()}, seed {trainer.seed}")
    run_trainer(ctx, trainer, "--only-write-model", "--model-out", config.only_write_model, config.model_out)

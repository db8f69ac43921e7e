"""``ggtorch train``: llama.cpp's old ``train-text-from-scratch`` and a full finetune, on the finetune's trainer.

The options are the fields of :class:`~ggtorch.training.config.TrainConfig`: the finetune's
shared ones (data, run, optimizer, samples) and, instead of LoRA and the adapter output, the
new model's shape and the model output, under the old program's flag names (``--vocab-model``,
``--embd``, ``--ff``, ``--head``, ``--head-kv``, ``--layer``, ``--model-out``).
"""

from __future__ import annotations

from typing import Any

import click

from ggtorch import api
from ggtorch.cli.finetune import _echo, compute_dtype, run_trainer, start_trainer
from ggtorch.cli.options import config_command, config_from_cli
from ggtorch.training.config import (
    FILES,
    GENERATIONS,
    OPTIMIZER,
    OUTPUTS,
    OVERRIDES,
    RECORDS,
    SAMPLES,
    SHAPE,
    TRAINING,
    TrainConfig,
)

GROUPS = (FILES, SHAPE, OUTPUTS, RECORDS, TRAINING, OPTIMIZER, SAMPLES, GENERATIONS, OVERRIDES)
"""``train --help``'s headings, in order."""


@config_command(TrainConfig, GROUPS)
def train(**values: Any) -> None:
    """Train every weight: a new llama (--vocab-model) or a float GGUF of any family (--model-base).

    \b
    As llama.cpp's old train-text-from-scratch (new models are initialized as it did) and
    today's full llama-finetune, on the machinery of `ggtorch finetune`: the same optimizer,
    data and checkpoint flags, exact resume from --checkpoint-in, and a GGUF model out
    (--model-out, of --outtype) that llama.cpp loads.
    """
    ctx = click.get_current_context()  # not a parameter: 'ctx' is the --ctx flag here
    config, notes = config_from_cli(ctx, values, TrainConfig)
    trainer = start_trainer(api.train, config, notes)
    mc = trainer.model_config
    source = f"full finetune of {config.model_base}" if config.model_base else f"new model over {config.vocab_model}"
    _echo(trainer)(f"model: {source}: {mc.n_layer} layers, n_embd {mc.n_embd}, n_ff {mc.n_ff}, heads "
                   f"{mc.n_head}/{mc.n_head_kv}, vocab {mc.n_vocab}; {sum(p.numel() for _, p, _ in trainer.params):,} "
                   f"trainable parameters; compute {compute_dtype(trainer)}, device {trainer.device}, "
                   f"malloc {trainer.allocator}, seed {trainer.seed}")
    run_trainer(ctx, trainer, "only_write_model", "model_out")
